"""Fetching ahead: the shards a reader needs next, fetched into the cache by a background thread while it
reads the current one.

The reader gives the order in which it will need shards and says, as it goes, which one it reads now
(``reached``); the thread fetches, in that order, at most ``ahead`` shards past it, so a cache limit is
not flooded by shards needed much later. A shard the thread could not fetch is left to the reader, whose
own fetch then retries it and reports it in one line: the thread never raises into the reader.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

PREFETCH_SHARDS = 2  # shards fetched ahead of the one being read

__all__ = ["PREFETCH_SHARDS", "Prefetcher"]


class Prefetcher:
    """Calls ``fetch(shard)`` for the shards of ``order`` in a daemon thread, ``ahead`` past the reader."""

    def __init__(self, fetch: Callable[[int], None], order: list[int], ahead: int = PREFETCH_SHARDS) -> None:
        self._fetch, self._order, self._ahead = fetch, list(order), ahead
        self._where = {s: i for i, s in enumerate(self._order)}
        self._front = 0  # the position in order of the shard the reader reads now
        self._stop = False
        self._wake = threading.Condition()
        self.fetched: list[int] = []  # what the thread fetched (or found cached), in order
        self._thread = threading.Thread(target=self._run, name="packer-prefetch", daemon=True)
        self._thread.start()

    def reached(self, shard: int) -> None:
        """The reader reads ``shard`` now: the thread may fetch up to ``ahead`` shards past it."""
        i = self._where.get(shard, 0)
        if i > self._front:
            with self._wake:
                self._front = i
                self._wake.notify()

    def _run(self) -> None:
        for i, shard in enumerate(self._order):
            with self._wake:
                while not self._stop and i > self._front + self._ahead:
                    self._wake.wait()
                if self._stop:
                    return
            try:
                self._fetch(shard)
            except Exception:  # the reader's own fetch of it retries and reports
                return
            self.fetched.append(shard)

    def close(self, timeout: float = 0.0) -> None:
        """Stop fetching more (a fetch under way finishes in the background: it leaves a whole entry or none)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if timeout:
            self._thread.join(timeout)
