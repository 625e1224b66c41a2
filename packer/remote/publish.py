"""``packer push DIR URL``: a finished local build uploaded to object storage so that a reader never sees
half of it.

The order is the promise: the shards first, then the ``datasets`` files, the manifest last, so a reader
that finds the manifest finds every shard it lists. When the URL holds another build, its manifest is
removed first: during the upload a reader finds no build (one clear error), never the old manifest over
new shards of the same names. Shards the old manifest listed and the new one does not are removed after
the new manifest is in place; nothing else at the URL is touched (it is not packer's).

A rerun uploads only what is missing or differs: a shard is skipped when the URL holds a file of its
size that the manifest there, or this machine's record of what it pushed to that URL (in the cache,
``.pushed/``), says has its sha256. Each file is written whole or not at all: object stores make an
object visible when its upload completes; a local or ``file://`` target is written under a temporary
name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import cache
from ..errors import RemoteError
from .fetch import Policy, filesystem, redact

__all__ = ["Pushed", "check_target", "push"]


@dataclass(slots=True)
class Pushed:
    """What a push did: files uploaded, files already there, bytes uploaded, stale shards removed."""

    url: str
    uploaded: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes: int = 0
    removed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _record_path(url: str, cache_dir: str | os.PathLike | None) -> Path:
    folder = cache.root(cache_dir) / ".pushed"  # hidden: a record, not a cache entry eviction may take
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (hashlib.sha256(redact(url).encode()).hexdigest()[:40] + ".json")


def _read_json(fs, path: str) -> dict | None:
    try:
        data = json.loads(fs.cat_file(path))
        return data if isinstance(data, dict) else None
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return None  # a damaged manifest there records nothing we can trust


def _upload(fs, local_target: Path | None, src: Path, dest: str) -> None:
    if local_target is not None:  # a local folder: whole or absent, by a rename
        target = local_target / src.name
        tmp = target.with_name(f".{src.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fs.put_file(str(src), str(tmp))
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        fs.put_file(str(src), dest)  # an object appears whole when its upload completes


def _refuse_http(url: str) -> None:
    if url.split("://", 1)[0].lower() in ("http", "https"):
        raise RemoteError(f"{redact(url)}: HTTP is read-only here; push to object storage (s3://, gs://, ...) or a "
                          "folder, and serve that over HTTP")


def check_target(url: str) -> None:
    """What ``push`` asks of ``url`` first (its filesystem, a listing of what is there), asked before a build
    whose end is that push (``build --out URL``), so that missing credentials or a missing bucket cost one line
    and no build. Only reads."""
    url = str(url).rstrip("/")
    _refuse_http(url)
    fs, root = filesystem(url, Policy.from_env().timeout)
    try:
        there = fs.exists(root)
        local = getattr(fs, "protocol", None) in ("file", "local", ("file", "local"))
        bucket = root.split("/", 1)[0]
        if not there and not local and "/" in root and not fs.exists(bucket):
            raise RemoteError(f"{redact(url)}: its bucket {bucket} does not exist, or these credentials cannot see it; "
                              "create it (or fix the URL) and rerun: nothing was built")
    except RemoteError:
        raise
    except Exception as e:  # every transport's errors, as one line without credentials
        raise RemoteError(f"{redact(url)}: cannot be reached ({type(e).__name__}: "
                          f"{redact(str(e)).splitlines()[0] if str(e) else ''}); check its credentials and endpoint "
                          "and rerun: nothing was built") from e


def push(directory: str | os.PathLike, url: str, shards: list[tuple[str, int, str]], others: list[str],
         manifest_name: str, owned: Callable[[dict | None], frozenset[str] | None], *,
         cache_dir: str | os.PathLike | None = None) -> Pushed:
    """Upload the build at ``directory`` to ``url``: ``shards`` as (file, bytes, sha256) from its manifest,
    ``others`` the other files packer wrote there (the ``datasets`` files), ``manifest_name`` last."""
    start = time.monotonic()
    directory = Path(directory)
    url = str(url).rstrip("/")
    shown = redact(url)
    _refuse_http(url)
    fs, root = filesystem(url, Policy.from_env().timeout)
    local_target = Path(root) if getattr(fs, "protocol", None) in ("file", "local", ("file", "local")) else None
    done = Pushed(shown)
    try:
        if local_target is not None:
            local_target.mkdir(parents=True, exist_ok=True)
        fs.invalidate_cache()
        there = {}
        for info in fs.ls(root, detail=True) if fs.exists(root) else []:
            there[str(info["name"]).rstrip("/").rsplit("/", 1)[-1]] = info.get("size")
        record_file = _record_path(url, cache_dir)
        record = json.loads(record_file.read_text()) if record_file.is_file() else {}
        old = _read_json(fs, f"{root}/{manifest_name}") if manifest_name in there else None
        # what packer may overwrite or remove there: the files a manifest there proves packer wrote (``owned``:
        # the contract's rule, as for a local --out), and the shards an earlier push of ours recorded
        ours = owned(old) or frozenset()
        foreign = sorted(name for name in [*(name for name, _, _ in shards), *others, manifest_name]
                         if name in there and name not in ours and name not in record)
        if foreign:
            raise RemoteError(f"{shown}: holds {foreign[0]}" + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
                              + ", which packer cannot prove it wrote (no packer manifest there lists it); push to an "
                              "empty folder, or remove it yourself")
        old_shards = ({e.get("file"): e.get("sha256") for e in old.get("shards", []) if isinstance(e, dict)}
                      if ours else {})
        new_manifest = (directory / manifest_name).read_bytes()
        if manifest_name in there and fs.cat_file(f"{root}/{manifest_name}") != new_manifest:
            fs.rm_file(f"{root}/{manifest_name}")  # another build's: no reader may pair it with our shards
        for name, size, sha in shards:
            if there.get(name) == size and sha in (old_shards.get(name), record.get(name)):
                done.kept.append(name)
                continue
            _upload(fs, local_target, directory / name, f"{root}/{name}")
            record[name] = sha
            record_file.write_text(json.dumps(record))
            done.uploaded.append(name)
            done.bytes += size
        for name in [*others, manifest_name]:  # the manifest last: then the build is there, whole
            data = (directory / name).read_bytes()
            if there.get(name) == len(data) and fs.cat_file(f"{root}/{name}") == data:
                done.kept.append(name)
                continue
            _upload(fs, local_target, directory / name, f"{root}/{name}")
            record[name] = hashlib.sha256(data).hexdigest()  # ours from now on, though a push stops before the manifest
            record_file.write_text(json.dumps(record))
            done.uploaded.append(name)
            done.bytes += len(data)
        listed = {name for name, _, _ in shards}
        for name in sorted(set(old_shards) - listed):
            if isinstance(name, str) and name in ours and name in there:
                fs.rm_file(f"{root}/{name}")  # the old build's, which this manifest no longer lists
                done.removed.append(name)
        fs.invalidate_cache()
    except RemoteError:
        raise
    except Exception as e:  # every transport's errors, as one line without credentials
        raise RemoteError(f"push to {shown}: {type(e).__name__}: {redact(str(e)).splitlines()[0] if str(e) else ''}; "
                          "rerun `packer push` to upload the rest (what is there is kept)") from e
    done.seconds = time.monotonic() - start
    return done
