"""The records a build's draws take beyond what its parts' token store entries hold: read from where each
entry ends and tokenized, nothing else (:mod:`packer.building.token_store` then extends the entries and
re-draws the build from them, :mod:`packer.building.redraw`).

A mix draws each position's part, the k-th draw of a part taking its k-th record
(:func:`packer.building.mix.draws`), so of the positions whose part's entry holds ``held[k]`` records, a
position is *new* when it is a draw of a record at index ``held[k]`` or later. :class:`Rest` is the stream
of the new positions' records in mix order, read as :class:`packer.building.mix.MixStream` reads the mix:
each part's stream from the record its entry ends at (a complete entry's part has none left), chunks of
``size`` new records, a weighted mix ending at the first draw of a part with no record left and a mix by
records counts refusing a part that ends early, exactly where a cold build would. Its chunks are encoded by
the build's own :class:`packer.building.mix.MixEncoder` through the build's engine into a spill of their own
(:func:`packer.building.spill.tokenize`: resumable, in any number of processes), with each example's id its
position in the mix and each record's index in its part as a cold build gives them. :func:`end` says, from
the new records that spill holds, where the mix ended and which part ran out.

Cost: the draws walked in numpy (O(positions)); each extended part's stream read from its first record
(records before the entry's end are passed over, unparsed where the format allows: :func:`packer.building.readers.records`),
the new records tokenized.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import mix, redraw
from .mix import MixChunk


def _new(parts: list[dict[str, Any]], seed: int, limit: int | None, held: list[int]
         ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Per block of draws: the new positions in it (int64, in order), their parts, and the block's end."""
    have = np.asarray(held, np.int64)
    taken = np.zeros(len(parts), np.int64)
    lo = 0
    for block in mix.draws(parts, seed, limit):
        index = taken[block] + redraw.rank(block, len(parts))  # each draw's record index in its part
        new = np.flatnonzero(index >= have[block])
        taken += np.bincount(block, minlength=len(parts))
        yield lo + new, block[new], lo + block.size
        lo += block.size


def end(parts: list[dict[str, Any]], seed: int, limit: int | None, held: list[int], records: int
        ) -> tuple[int, int | None]:
    """Where a mix whose parts' entries hold ``held`` records ended once :class:`Rest` gave ``records`` new
    records: (the mix's records, the part that ran out or None). A Rest ends at the limit or at the first new
    position whose part has no record left, the ``records + 1``-th; a weighted mix draws every part of
    positive weight without end, so each one's new positions come and this walk ends."""
    seen, drawn = 0, 0
    for positions, block_parts, block_end in _new(parts, seed, limit, held):
        if seen + positions.size > records:
            return int(positions[records - seen]), int(block_parts[records - seen])
        seen += positions.size
        drawn = block_end
    return drawn, None


class _From:
    """A part's stream from record ``offset`` on, as a stream from 0 (what ``mix``'s reader reads)."""

    def __init__(self, stream, offset: int):
        self.stream, self.offset = stream, offset

    def chunks(self, start: int, size: int):
        return ((first - self.offset, batch) for first, batch in self.stream.chunks(self.offset + start, size))


class _Nothing:
    """A part whose entry holds all its records: nothing is left to read (its stream is not opened)."""

    def chunks(self, start: int, size: int):
        return iter(())


@dataclass(frozen=True, slots=True)
class Rest:
    """The records of ``stream`` (the build's mix) at its new positions, in mix order, a chunk at a time: what
    a :class:`packer.building.mix.MixStream` gives :func:`packer.building.spill.tokenize`, here only the
    records no entry holds (``held[k]``: part k's entry's records, ``complete[k]``: all the part has)."""

    stream: mix.MixStream
    held: tuple[int, ...]
    complete: tuple[bool, ...]

    @property
    def parts(self) -> tuple[dict[str, Any], ...]:
        return self.stream.parts

    @property
    def name(self) -> str:
        return self.stream.name

    def total(self) -> int | None:
        """Not known before the parts are read (where a weighted mix ends): a bar of counts only."""
        return None

    def chunks(self, start: int = 0, size: int = 1000) -> Iterator[tuple[int, MixChunk]]:
        """``(first new record, chunk)`` of ``size`` new records each, from new record ``start`` (a chunk
        boundary: an interrupted spill commits whole chunks), the chunks before it passed over unread."""
        parts = list(self.stream.parts)
        n = len(parts)
        mix._room_for_files(n)
        nexts = list(self.held)  # each part's next record index
        readers: list[Any] = [None] * n
        blocks = ((positions, block) for positions, block, _ in _new(parts, self.stream.seed, self.stream.limit,
                                                                      list(self.held)))
        lo = 0
        for positions, chunk in mix.in_runs(blocks, size):
            if lo < start:  # tokenized by an interrupted run: its records passed over, not read
                nexts = [a + int(b) for a, b in zip(nexts, np.bincount(chunk, minlength=n), strict=True)]
                lo += int(chunk.size)
                continue
            cut, got = chunk.size, []
            for k in range(n):
                want = int((chunk == k).sum())
                if want and readers[k] is None:  # opened at its first new record
                    stream = _Nothing() if self.complete[k] else _From(self.stream.streams[k], nexts[k])
                    readers[k] = mix._Reader(stream, size)
                records = readers[k].take(want) if want else {}
                m = len(next(iter(records.values()))) if records else 0
                got.append(records)
                if m < want:  # this part ran out at its (m+1)-th new record in the chunk
                    if "records" in parts[k]:
                        raise mix.short(parts[k], nexts[k] + m)
                    cut = min(cut, int(np.flatnonzero(chunk == k)[m]))
            pieces = []
            for k, records in enumerate(got):
                mine = np.flatnonzero(chunk[:cut] == k)
                if mine.size:
                    pieces.append((k, nexts[k], {c: v[:mine.size] for c, v in records.items()}, positions[mine]))
                    nexts[k] += int(mine.size)
            if cut:
                yield lo, MixChunk(tuple(pieces), int(cut))
            lo += int(cut)
            if cut < chunk.size:  # a part ran out: the mix ends here
                return
