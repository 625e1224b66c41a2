"""The lifecycle of an output folder: lock, check, prepare, commit, or discard.

A build holds ``LOCK`` (an exclusive ``flock``) from start to end. It refuses a folder holding anything
packer does not own (:func:`packer.schema.is_owned`) or another build, reuses one holding this exact
build intact (:func:`damage` re-checks it: a damaged one is rebuilt), and otherwise clears what a previous build left (the manifest first, so the folder stops
looking complete at once). Shards are written into ``STAGING``; :func:`commit` fsyncs and moves them
into place, writes what ``datasets.load_from_disk`` reads, and writes the manifest last (temporary
name, fsync, rename): a folder without ``manifest.json`` is never a finished build. A failed write is
:func:`discard`\\ ed: no manifest, no shards, no staging files remain.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from . import schema
from .errors import OutputError, ShardFormatError
from .schema import LOCK, MANIFEST_NAME, MANIFEST_TMP, STAGING, TOKENS_DIR

_HELD: set[int] = set()  # descriptors of the locks this process holds


def _close_held_in_child() -> None:
    # A forked worker would keep the lock's open file (and so the flock) alive after its parent died.
    for fd in _HELD:
        with suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


@contextmanager
def lock(out: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``out/LOCK`` (creating ``out`` if needed); refuse if held.

    The lock file is removed on release (and ``out`` too if this call created it and it is empty);
    one left by a killed build is harmless: the kernel released its lock, and the next build takes it.
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file, not a folder; choose another --out")
    created = not out.exists()
    path = out / LOCK
    for _ in range(10):  # retry if the holder removed the file between our open and our flock
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"--out {out}: cannot write there ({_reason(e)}); choose a writable folder") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(
                f"--out {out}: another packer build is writing there now ({LOCK} is locked); wait for it to "
                "finish or choose another --out"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:  # pragma: no cover - only under a storm of concurrent builds
        raise OutputError(f"--out {out}: could not take {LOCK}; another build keeps replacing it, retry")
    _HELD.add(fd)
    try:
        _drop_stale_staging(out)
        yield
    finally:
        with suppress(OSError):
            path.unlink()
        _HELD.discard(fd)
        os.close(fd)
        if created:
            with suppress(OSError):
                out.rmdir()  # only if empty: a failed first build leaves no folder behind


def _drop_stale_staging(out: Path) -> None:
    """Under the lock, a folder with a manifest holds a finished build: a staging folder or temporary
    manifest beside it is what a build killed between its commit point (the manifest's rename) and
    its last step left; remove them, or the folder never verifies."""
    if (out / MANIFEST_NAME).is_file():
        with suppress(FileNotFoundError):
            shutil.rmtree(out / STAGING)
        with suppress(FileNotFoundError):
            (out / MANIFEST_TMP).unlink()


def tidy(directory) -> None:
    """What ``verify`` and ``inspect`` run first: drop a finished build's stale staging (see
    :func:`_drop_stale_staging`) if no build holds the folder now. A no-op for URLs, folders without
    leftovers, and folders this process cannot write (the check then reports the leftover)."""
    out = Path(directory)
    if "://" in str(directory) or not (out / MANIFEST_NAME).is_file():
        return
    if not ((out / STAGING).exists() or (out / MANIFEST_TMP).exists()):
        return
    with suppress(OutputError, OSError), lock(out):
        pass


def refuse_inside(out: Path, source: str) -> None:
    """Refuse an ``out`` inside the SOURCE folder: the next build would read its shards as input."""
    folder = Path(source).expanduser()
    with suppress(OSError):
        if folder.is_dir() and out.resolve().is_relative_to(folder.resolve()):
            raise OutputError(
                f"--out {out}: is inside the SOURCE folder {source}, so a rerun would read its shards as input; "
                "choose an --out outside it"
            )


def check(out: Path, identity: dict[str, Any], overwrite: bool) -> schema.Manifest | None:
    """Refuse a folder that holds something else; return its manifest if it holds this exact build."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file, not a folder; choose another --out")
    if not out.exists():
        return None
    foreign = sorted(p.name for p in out.iterdir() if not schema.is_owned(p.name))
    if overwrite:
        if foreign:
            raise OutputError(
                f"--out {out}: holds files packer did not write ({', '.join(foreign[:3])}); "
                "refusing to delete them even with --overwrite; choose an empty or new folder"
            )
        return None
    if foreign:
        raise OutputError(
            f"--out {out}: is not empty and not a packer build ({', '.join(foreign[:3])} ...); "
            "choose an empty or new folder"
        )
    path = out / MANIFEST_NAME
    if path.is_file():
        try:
            data = schema.load_json(path.read_bytes(), str(path))
        except (OSError, ShardFormatError):
            data = None
        if not isinstance(data, dict) or any(data.get(k) != v for k, v in identity.items()):
            raise OutputError(
                f"--out {out}: holds another build (different config, source or tokenizer) or an unreadable "
                "manifest; pass --overwrite to replace it or choose another --out"
            )
        if damage(out, data) is None:
            return schema.Manifest.from_json(data, str(path))
    return None  # an interrupted or damaged build of ours: it is redone


def damage(out: Path, data: dict[str, Any]) -> str | None:
    """What is wrong with a finished build of ours that a rerun would reuse (None: nothing), checked
    before the rerun says "nothing to do": the manifest's content hash, every listed shard's size and
    sha256, the ``datasets`` files, and no shard the manifest does not list. Hashing the shards reads
    them once: 0.3% of the build on the bundled sample (``benchmarks/bench_reuse.py``), so always."""
    try:
        manifest = schema.Manifest.from_json(data)
    except ShardFormatError as e:
        return str(e)
    listed = {entry.file for entry in manifest.shards}
    extra = sorted(p.name for p in out.iterdir() if schema.is_shard_name(p.name) and p.name not in listed)
    if extra:
        return f"{extra[0]}: not listed in the manifest"
    for entry in manifest.shards:
        problems = schema.shard_file_problems(out, entry)
        if problems:
            return f"{entry.file}: {problems[0]}"
    for name, problem in schema.datasets_file_problems(out, manifest):
        return f"{name}: {problem}"
    return None


def prepare(out: Path) -> Path:
    """Clear what a previous build left (keeping a token spill, which checks its own identity and is
    resumed) and return the empty staging folder."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        clear(out, keep=(TOKENS_DIR,))
        (out / STAGING).mkdir(exist_ok=True)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot write there ({e.strerror}); choose a writable folder") from e
    return out / STAGING


def clear(out: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove a previous build: the manifest first, so the folder stops looking complete at once.

    ``keep`` names entries of the staging folder to leave there."""
    manifest = out / MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
        _fsync_dir(out)
    for path in out.iterdir():
        if path.name == LOCK or not schema.is_owned(path.name):
            continue
        if path.name == STAGING and path.is_dir() and keep:
            for inner in path.iterdir():
                if inner.name not in keep:
                    shutil.rmtree(inner) if inner.is_dir() else inner.unlink()
        else:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def commit(out: Path, manifest: schema.Manifest) -> None:
    """Move the staged shards into place, write what ``datasets.load_from_disk`` reads beside them
    (``schema.DATASETS_FILES``), then the manifest last (the commit point)."""
    staging = out / STAGING
    manifest_bytes = manifest.dumps()  # first: a manifest that cannot be written must not leave shards in place
    for entry in manifest.shards:
        _fsync(staging / entry.file)
        os.replace(staging / entry.file, out / entry.file)
    for name, data in schema.datasets_files(manifest).items():
        (staging / name).write_bytes(data)
        _fsync(staging / name)
        os.replace(staging / name, out / name)
    tmp = out / MANIFEST_TMP
    tmp.write_bytes(manifest_bytes)
    _fsync(tmp)
    os.replace(tmp, out / MANIFEST_NAME)
    _fsync_dir(out)
    shutil.rmtree(staging, ignore_errors=True)


def discard(out: Path) -> None:
    """After a failed write: remove whatever of an unfinished build is there (never a finished one)."""
    if not out.is_dir() or (out / MANIFEST_NAME).exists():
        return
    with suppress(OSError):
        clear(out)
    for name in (STAGING, MANIFEST_TMP):
        with suppress(OSError):
            (out / name).unlink() if (out / name).is_file() else shutil.rmtree(out / name)


def write_failure(e: OSError, out: Path) -> OutputError | None:
    """The OutputError an OSError escaping a build becomes when it is a failure to write ``out``
    (disk full, a file size limit, a read-only or vanished folder); None for any other OSError."""
    if not _is_output_failure(e, out):
        return None
    return OutputError(
        f"--out {out}: writing failed ({_reason(e)}); the partial build was removed; free space or "
        "fix the folder's permissions and rerun, or choose another --out"
    )


_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT}


def _is_output_failure(e: OSError, out: Path) -> bool:
    for name in (e.filename, e.filename2):
        if name is not None:
            try:
                return Path(name).resolve().is_relative_to(out.resolve())
            except (OSError, ValueError):
                return False
    # pyarrow's write errors carry neither filename nor errno; the text says what failed
    text = str(e).lower()
    return e.errno in _DISK_ERRNOS or any(w in text for w in ("no space", "file too large", "quota", "read-only"))


def _reason(e: OSError) -> str:
    if e.errno == errno.EFBIG or "file too large" in str(e).lower():
        return "file too large: a file size limit (ulimit -f) was reached"
    if e.errno in (errno.ENOSPC, errno.EDQUOT) or "no space" in str(e).lower():
        return "no space left on the device"
    return e.strerror or str(e).splitlines()[0][:200]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):  # some filesystems cannot fsync a directory; the rename is still atomic
        _fsync(path)
