"""A remote build read through the local cache (packer.cache): its manifest once per process, each of its
shards fetched once per cache folder, checked on arrival, then read from local disk (memory-mapped).

Shards are cache entries of kind ``shards`` keyed by their sha256: the manifest names each shard's bytes
exactly, so an entry is the same whichever build, URL or mirror it came from, and a shard that changed on
the server is another key (never a stale hit). Ranks and DataLoader workers that share the cache folder
fetch a shard once between them (the entry's lock); the others wait for it and map the same file.

The manifest is fetched whole once per ``RemoteBuild`` (a process makes one per dataset) and kept beside
the shards (in the root's ``.manifests/``, keyed by the URL: a note's record, never an entry whose
placement could evict shards): ``changed`` says when the build at the URL is no
longer the one this cache saw last, which is worth a note; its shards are then other keys anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path

from .. import cache
from ..errors import RemoteError
from .fetch import Policy, fetch_bytes, fetch_file, redact

MANIFEST_NAME = "manifest.json"  # packer.contract.schema's; the shared layer cannot import the contract

__all__ = ["RemoteBuild"]


class RemoteBuild:
    """The build at ``url`` (an fsspec URL), read through the cache at ``cache_dir`` (packer.cache.root)."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 policy: Policy | None = None) -> None:
        self.url = str(url).rstrip("/")
        self.shards = cache.Cache("shards", cache_dir, cache_limit)
        self.manifests = self.shards.root / ".manifests"
        self.policy = policy or Policy.from_env()
        self._manifest: bytes | None = None
        self.changed = False  # the manifest differs from the copy this cache kept of the same URL
        self.fetched = 0  # bytes this process fetched (shards and manifest)

    def file_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def manifest_bytes(self) -> bytes:
        """The build's manifest, fetched once per RemoteBuild; FileNotFoundError when the URL has none."""
        if self._manifest is None:
            data = fetch_bytes(self.file_url(MANIFEST_NAME), what=MANIFEST_NAME, policy=self.policy)
            self.fetched += len(data)
            self._remember(data)
            self._manifest = data
        return self._manifest

    def _remember(self, data: bytes) -> None:
        """Keep the manifest beside the shards, and note when it is not the copy kept last time."""
        previous = self.manifests / hashlib.sha256(redact(self.url).encode()).hexdigest()[:40]
        with contextlib.suppress(OSError):  # only a note depends on this copy
            self.changed = previous.is_file() and previous.read_bytes() != data
            if not previous.is_file() or self.changed:
                self.manifests.mkdir(exist_ok=True)
                tmp = previous.with_name(f"{previous.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, previous)  # whole or absent

    def shard(self, name: str, size: int, sha256: str, *, full: bool = False) -> cache.Entry:
        """Shard ``name`` of ``size`` bytes and ``sha256`` (the manifest's), open in the cache: fetched now
        unless this cache holds it. ``full``: hash a cached copy again before using it (verify=True); a
        cached copy of another size is always fetched again. Close the entry when the shard is unmapped."""
        url = self.file_url(name)
        arrived: set[Path] = set()

        def make(tmp: Path) -> None:
            fetch_file(url, tmp, size, sha256, what=name, policy=self.policy, on_bytes=self._count)
            arrived.add(tmp)  # hashed as it arrived: no second read of it

        def check(path: Path, thorough: bool) -> str | None:
            return cache.file_problem(path, size, sha256 if thorough and path not in arrived else None)

        try:
            return self.shards.open(sha256, make, check, full=full, size_hint=size)
        except cache.CacheError as e:
            raise RemoteError(f"{name} at {redact(url)}: {e}") from e

    def _count(self, n: int) -> None:
        self.fetched += n
