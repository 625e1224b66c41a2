"""A remote build as the contract reads it: its typed manifest, fetched once, and each listed shard through
the local cache (packer.remote.cached), so the loader, inspect and verify read a remote build from local,
memory-mapped files like a local one (docs/loader.md, "Remote builds").

Local paths and ``file://`` URLs are not remote: they are read in place, as ever.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .. import cache, fs
from ..errors import RemoteError, ShardFormatError
from ..remote.cached import RemoteBuild
from ..remote.fetch import fetch_bytes, redact
from ..remote.publish import Pushed, check_target, push
from . import schema

__all__ = ["Remote", "check_target", "is_remote", "local_view", "publish", "remote_build", "staging_folder"]


class Remote:
    """The build at ``url`` read through the cache: ``manifest`` and ``fingerprint`` (sha256 of its bytes)
    from one fetch, ``shard(entry)`` a cached, checked copy of a listed shard."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None) -> None:
        self.build = RemoteBuild(url, cache_dir, cache_limit)
        self.url = self.build.url
        self.shown = redact(self.url)  # the URL as messages name it: no credentials
        where = f"{redact(self.url)}/{schema.MANIFEST_NAME}"
        try:
            data = self.build.manifest_bytes()
        except FileNotFoundError:
            raise ShardFormatError(f"{redact(self.url)}: no {schema.MANIFEST_NAME}, so this is not a finished packer "
                                   f"build (or not yet published: `packer push DIR {redact(self.url)}`)") from None
        self.manifest = schema.Manifest.from_json(schema.load_json(data, where), where)
        self.fingerprint = hashlib.sha256(data).hexdigest()

    def cached(self, entry: schema.ShardEntry) -> bool:
        """Whether the cache holds ``entry``'s shard (of its size): opening it then fetches nothing."""
        return cache.file_problem(self.build.shards.path(entry.sha256), entry.bytes) is None

    def shard(self, entry: schema.ShardEntry, *, full: bool = False) -> cache.Entry:
        """``entry``'s shard, open in the cache (fetched now unless cached); close it when done reading."""
        return self.build.shard(entry.file, entry.bytes, entry.sha256, full=full)


def is_remote(directory: fs.PathLike) -> bool:
    """True for a URL of a filesystem other than the local one (``file://`` is read in place)."""
    return fs.is_url(directory) and fs.local_path(directory) is None


def remote_build(directory: fs.PathLike, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None) -> Remote | None:
    """The build at ``directory`` read through the cache when it is remote; None when it is local."""
    return Remote(str(directory), cache_dir, cache_limit) if is_remote(directory) else None


@contextlib.contextmanager
def local_view(url: str, cache_dir: str | os.PathLike | None = None,
               cache_limit: int | str | None = None) -> Iterator[tuple[Path, dict[str, str]]]:
    """The build at ``url`` as a local folder, for inspect and verify: every name the remote folder holds,
    its listed shards linked to their cached copies (fetched once, checked on arrival, held open while
    the folder exists), its other files fetched whole. Yields ``(folder, failed)``: ``failed`` maps each
    shard that could not be fetched (missing, changed on the server) to its one-line reason; it is absent
    from the folder. A manifest that cannot be read is copied as it is, for verify to report."""
    build = RemoteBuild(url, cache_dir, cache_limit)
    try:
        data = build.manifest_bytes()
    except FileNotFoundError:
        data = None
    shards: dict[str, schema.ShardEntry] = {}
    if data is not None:
        with contextlib.suppress(ShardFormatError, ValueError):  # verify reads the copy and says what is wrong
            shards = {e.file: e for e in schema.Manifest.from_json(json.loads(data)).shards}
    try:
        names = fs.list_names(build.url)
    except Exception:  # a server without listings (plain HTTP): what the manifest implies
        names = sorted({*shards, schema.MANIFEST_NAME, *schema.DATASETS_FILES})
    views = build.shards.root / ".views"
    views.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="view-", dir=views))
    held: list[cache.Entry] = []
    failed: dict[str, str] = {}
    try:
        for name in names:
            if name in shards:
                entry = shards[name]
                try:
                    held.append(build.shard(name, entry.bytes, entry.sha256))
                except RemoteError as e:
                    failed[name] = str(e)
                    continue
                (folder / name).symlink_to(held[-1].path)
            elif name == schema.MANIFEST_NAME and data is not None:
                (folder / name).write_bytes(data)
            else:
                try:
                    (folder / name).write_bytes(fetch_bytes(build.file_url(name), what=name, policy=build.policy))
                except FileNotFoundError:
                    continue  # a name the manifest implies that is not there: verify says so
                except (IsADirectoryError, RemoteError):
                    (folder / name).mkdir()  # a subfolder (or an unreadable name): there, for verify to judge
        yield folder, failed
    finally:
        for entry in held:
            entry.close()
        shutil.rmtree(folder, ignore_errors=True)


def publish(directory: fs.PathLike, url: str, cache_dir: str | os.PathLike | None = None) -> Pushed:
    """``packer push``: the finished build at ``directory`` (its manifest read and its shards' sizes
    checked first: a damaged build is not published) uploaded to ``url``, the manifest last."""
    local = fs.local_path(directory)
    if local is None:
        raise ShardFormatError(f"{directory}: push a local build folder (packer build ... --out DIR)")
    manifest = schema.read_manifest(local)
    for entry in manifest.shards:
        problems = schema.shard_file_problems(local, entry, sha256=False)
        if problems:
            raise ShardFormatError(f"{fs.join(local, entry.file)}: {problems[0]}; rebuild the folder before pushing it")
    others = [name for name in schema.DATASETS_FILES if (Path(local) / name).is_file()]
    return push(local, url, [(e.file, e.bytes, e.sha256) for e in manifest.shards], others, schema.MANIFEST_NAME,
                schema.listed_files, cache_dir=cache_dir)


def staging_folder(url: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``packer build --out URL`` builds before it uploads: a folder of the cache root named for the
    URL, so a rerun resumes and reuses there as a local build does. Under ``.builds``: a hidden folder of
    the root is no cache kind, so eviction never takes a build (mid-build or after)."""
    return cache.root(cache_dir) / ".builds" / hashlib.sha256(redact(str(url).rstrip("/")).encode()).hexdigest()[:24]
