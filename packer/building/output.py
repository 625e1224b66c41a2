"""The lifecycle of an output folder (lock, check, prepare, commit; a failed build leaves nothing),
and what in it is packer's.

Ownership is proven, never guessed from a name. packer owns the files that a manifest it wrote lists
(:func:`packer.contract.schema.listed_files`: checked by the manifest's content hash), and its staging folder
``STAGING``, proven by the lock file in it (``STAGING/LOCK`` holding ``LOCK_BYTES``). Everything else
is someone else's: a build refuses a folder holding it, and with ``--overwrite`` builds beside it,
deleting only the previous build's files; a foreign file with a name a build writes is refused even
then. No source file may lie inside the folder (:func:`refuse_sources_inside`).

A build holds an exclusive ``flock`` on ``STAGING/LOCK`` from start to end (:func:`lock`). A build found
in the folder stays whole until the new one's commit: the new shards are written in ``STAGING``, and
:func:`commit` swaps the builds with renames, recording each move before it happens so that whatever a
kill or a failure leaves can be undone or proven packer's. It stages the new manifest
(``STAGING/PENDING``), moves the old manifest to ``STAGING/PREVIOUS`` (the folder stops looking complete),
moves the old build's files into ``STAGING/REPLACING``, renames that folder ``STAGING/REPLACED`` (every
old file is out), moves the new files in, and renames the staged manifest to ``manifest.json``: the
commit point. A commit stopped before it is rolled back (:func:`_roll_back`), when the lock is released
and when the next build takes it: the folder holds the build it held, byte for byte. A folder without
``manifest.json`` is never a finished build. When the lock is released, a build that failed for a
reason it reports leaves nothing new (its staging removed; a folder it created too), an interrupted
one keeps its token spill for the rerun when no build is there to keep, and otherwise the staging
folder goes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import fs
from ..contract import schema
from ..contract.schema import LOCK, LOCK_BYTES, MANIFEST_NAME, PENDING, PREVIOUS, STAGING, TOKENS_DIR
from ..errors import OutputError, PackerError, ShardFormatError, SourceError

# inside STAGING, during a commit: the old build's files being moved out of the folder, then all of them
REPLACING, REPLACED = "replacing", "replaced"

_HELD: set[int] = set()  # descriptors of the locks this process holds


def _close_held_in_child() -> None:
    # A forked worker would keep the lock's open file (and so the flock) alive after its parent died.
    for fd in _HELD:
        with suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def local_folder(out: str) -> Path:
    """``--out`` as a local folder (a path or a ``file://`` URL); any other filesystem is refused: the
    commit protocol needs a local folder's atomic renames, fsync and flock."""
    local = fs.local_path(out)
    if local is None:
        raise OutputError(
            f"--out {out}: packer writes to a local folder only; build into a local folder, then copy it there "
            "(the loader, inspect and verify read fsspec URLs)"
        )
    return fs.expand_user(local, "--out", OutputError)


# -- what is packer's -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Contents:
    """An output folder's entries, sorted by proof of ownership."""

    finished: dict[str, Any] | None  # the manifest of the finished build there (parsed JSON), if packer's
    foreign: tuple[str, ...]  # the entries packer cannot prove it wrote


def _json(path: Path) -> Any:
    try:
        if path.is_symlink() or not path.is_file():
            return None
        return schema.load_json(path.read_bytes(), str(path))
    except (OSError, ShardFormatError):
        return None


def _staging_is_ours(staging: Path) -> bool:
    """Whether ``staging`` is packer's: its lock file holds packer's bytes, or it is what a build
    killed while creating it leaves (an empty folder, or one holding only a torn lock file)."""
    if staging.is_symlink() or not staging.is_dir():
        return False
    try:
        entries = os.listdir(staging)
        if not entries:
            return True
        lock_file = staging / LOCK
        if lock_file.is_symlink() or not lock_file.is_file():
            return False
        data = lock_file.read_bytes()
    except OSError:
        return False
    return data == LOCK_BYTES or (entries == [LOCK] and LOCK_BYTES.startswith(data))


def _proven(out: Path, data: Any) -> frozenset[str]:
    """The files of ``out`` that the manifest ``data`` proves packer's: listed by it (its content hash
    checked), and as it records them (a shard of the size it lists, a ``datasets`` file of the bytes
    it implies), so a file of someone else's put under a listed name is not taken for packer's."""
    listed = schema.listed_files(data)
    if listed is None:
        return frozenset()
    sizes = {e["file"]: e.get("bytes") for e in data["shards"] if isinstance(e, dict) and "file" in e}
    try:
        derived = schema.datasets_files(schema.Manifest.from_json(data))
    except ShardFormatError:  # a version this packer cannot read: its listing alone
        derived = {}

    def as_recorded(name: str) -> bool:
        path = out / name
        if path.is_symlink() or not path.is_file():
            return False
        if name in sizes:
            return path.stat().st_size == sizes[name]
        if name in derived:
            return path.read_bytes() == derived[name]
        return True

    return frozenset(n for n in listed if as_recorded(n))


def _staged_files(out: Path, staging: Path) -> frozenset[str]:
    """The files of ``out`` that the manifests in ``staging`` prove packer's (a build being committed,
    one being cleared); never ``manifest.json``, which is only ever moved into staging."""
    return frozenset().union(*(_proven(out, _json(staging / n)) for n in (PENDING, PREVIOUS))) - {MANIFEST_NAME}


def survey(out: Path) -> Contents:
    """What of ``out`` is packer's (read only)."""
    if not out.is_dir():
        return Contents(None, ())
    try:
        names = sorted(p.name for p in out.iterdir())
    except OSError as e:
        raise OutputError(f"--out {out}: cannot read it ({_reason(e)}); choose a folder you can read and write") from e
    finished = _json(out / MANIFEST_NAME)
    if schema.listed_files(finished) is None:
        finished = None
    ours = set(_proven(out, finished))
    staging = out / STAGING
    if _staging_is_ours(staging):
        ours |= {STAGING, *_staged_files(out, staging)}
    return Contents(finished, tuple(n for n in names if n not in ours))


def writes(name: str) -> bool:
    """Whether a build writes an entry of this name (so a foreign one there cannot stay beside it)."""
    return schema.is_shard_name(name) or name in (MANIFEST_NAME, STAGING, *schema.DATASETS_FILES)


def refuse_foreign(out: Path, overwrite: bool) -> Contents:
    """Refuse a folder holding entries packer did not write (without ``--overwrite``), or holding one
    under a name a build writes (even with it); return the survey."""
    contents = survey(out)
    foreign = contents.foreign
    clash = [n for n in foreign if writes(n)]
    if MANIFEST_NAME in clash:
        raise OutputError(
            f"--out {out}: its {MANIFEST_NAME} is not a manifest packer wrote (another tool's, or edited or damaged: "
            "its content_sha256 does not match), so packer cannot tell its files from others'; move the folder's "
            "files away or choose another --out"
        )
    if STAGING in clash:
        raise _foreign_staging(out)
    if clash:
        raise OutputError(
            f"--out {out}: holds {_names(clash)}, under names a build writes, which packer cannot prove it wrote "
            "(no packer manifest lists them as they are); move them away or choose another --out"
        )
    if foreign and not overwrite:
        raise OutputError(
            f"--out {out}: holds files packer did not write ({_names(foreign)}); choose an empty or new folder, or "
            "pass --overwrite to build beside them (they stay untouched)"
        )
    return contents


def _foreign_staging(out: Path) -> OutputError:
    return OutputError(
        f"--out {out}: holds {STAGING}, which packer did not create (it holds no lock file of packer's); move it "
        "away or choose another --out"
    )


def _names(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def refuse_inside(out: Path, source: str) -> None:
    """Refuse an ``out`` inside the SOURCE folder: the next build would read its shards as input."""
    folder = fs.expand_user(source, "source", SourceError)
    with suppress(OSError):
        if folder.is_dir() and out.resolve().is_relative_to(folder.resolve()):
            raise OutputError(
                f"--out {out}: is inside the SOURCE folder {source}, so a rerun would read its shards as input; "
                "choose an --out outside it"
            )


def refuse_sources_inside(out: Path, name: str, paths: Iterable[str]) -> None:
    """Refuse a source path (the file, folder or glob SOURCE names, or a file it resolved to) inside
    ``out``, before anything there is touched: a build must never write where it reads."""
    try:
        root = fs.expand_user(out, "--out", OutputError).resolve()
    except OSError:
        return
    for path in paths:
        with suppress(OSError, ValueError):
            if fs.expand_user(path, "source", SourceError).resolve().is_relative_to(root):
                where = name if path == name else f"{name} ({path})"
                raise OutputError(
                    f"--out {out}: holds the source {where}; a build must not write where it reads, so choose an "
                    "--out outside the source's folder"
                )


# -- the lock -------------------------------------------------------------------------------------


@contextmanager
def lock(out: Path) -> Iterator[Path]:
    """Hold an exclusive ``flock`` on ``out/STAGING/LOCK`` (creating ``out`` and the staging folder if
    needed) and yield the staging folder; refuse if another build holds it or the staging folder is
    not packer's. On release: see the module docstring (what a failed, interrupted or finished build leaves).
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file, not a folder; choose another --out")
    created = [p for p in (out, *out.parents) if not p.exists()]  # what a failed build removes again
    staging = out / STAGING
    try:
        fd = _lock(out, staging)
    except BaseException:
        _remove_empty(created)
        raise
    _HELD.add(fd)
    try:
        _recover(out, staging)  # a commit a kill stopped: the folder gets back the build it held
    except BaseException as e:
        _HELD.discard(fd)
        os.close(fd)
        if isinstance(e, OSError):
            raise OutputError(f"--out {out}: cannot write there ({_reason(e)}); choose a writable folder") from e
        raise
    # A build that failed for a reason it reports (a PackerError) leaves nothing; one stopped from
    # outside (Ctrl-C) or by the unforeseen keeps its spill, for the rerun to resume.
    keep_spill = True
    try:
        yield staging
        keep_spill = False
    except PackerError:
        keep_spill = False
        raise
    finally:
        try:
            with suppress(OSError):  # a folder gone read-only: the next build tidies what is left
                _release(out, staging, keep_spill=keep_spill)
        finally:
            _HELD.discard(fd)
            os.close(fd)
            _remove_empty(created)  # a failed first build leaves no folder behind


def _lock(out: Path, staging: Path) -> int:
    for _ in range(10):  # retry if the holder removed the file between our open and our flock
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = _take(out, staging)
        except OSError as e:
            raise OutputError(f"--out {out}: cannot write there ({_reason(e)}); choose a writable folder") from e
        try:
            same = os.fstat(fd).st_ino == os.stat(staging / LOCK).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise OutputError(  # pragma: no cover - only under a storm of concurrent builds
        f"--out {out}: could not take {STAGING}/{LOCK}; another build keeps replacing it, retry")


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders this build created, innermost first, each only if it is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _take(out: Path, staging: Path) -> int:
    """Create or adopt the staging folder and flock its lock file; the descriptor."""
    with suppress(FileExistsError):
        staging.mkdir()
    if not _staging_is_ours(staging):
        raise _foreign_staging(out)
    path = staging / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        new = True
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY)
        new = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputError(
            f"--out {out}: another packer build is writing there now ({STAGING}/{LOCK} is locked); wait for it to "
            "finish or choose another --out"
        ) from None
    try:
        if new:
            os.write(fd, LOCK_BYTES)
        elif path.read_bytes() != LOCK_BYTES:  # torn by a build killed while writing it (see _staging_is_ours)
            if not _staging_is_ours(staging):
                raise OutputError(f"--out {out}: {STAGING} changed while packer took it; rerun")
            path.write_bytes(LOCK_BYTES)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _release(out: Path, staging: Path, *, keep_spill: bool) -> None:
    """End a build's hold on ``out``: roll back a commit that did not reach its commit point, then keep
    the spill of an interrupted build when no finished build is there (the rerun resumes it), else
    remove the staging folder."""
    _recover(out, staging)
    finished = schema.listed_files(_json(out / MANIFEST_NAME)) is not None
    if keep_spill and not finished and set(os.listdir(staging)) - {LOCK}:
        return
    for entry in staging.iterdir():
        if entry.name != LOCK:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    (staging / LOCK).unlink()
    staging.rmdir()


def _recover(out: Path, staging: Path) -> None:
    """Put back the build a stopped commit was replacing (:func:`_roll_back`); clear what a packer of
    before this protocol left when killed while clearing a build (its manifest in ``PREVIOUS``, its files
    being deleted: there is nothing left to put back)."""
    if (staging / PENDING).exists():
        _roll_back(out, staging)
    elif (staging / PREVIOUS).exists() and not (out / MANIFEST_NAME).exists():
        _remove_listed(out, staging)


def _roll_back(out: Path, staging: Path) -> None:
    """Undo a commit stopped before its commit point (``PENDING`` still staged), so that the folder
    holds the build it held before, byte for byte. Each step is safe to repeat after a kill: which
    files in ``out`` are new is known from the folder the old ones are in (see the module docstring)."""
    pending, replacing, replaced = staging / PENDING, staging / REPLACING, staging / REPLACED
    previous = staging / PREVIOUS
    if replaced.is_dir():  # every old file is out of the folder: what of the new build's is there goes
        for name in sorted(_proven(out, _json(pending)) - {MANIFEST_NAME}):
            with suppress(FileNotFoundError):
                (out / name).unlink()
        _fsync_dir(out)
        os.replace(replaced, replacing)  # and from here on, nothing of the new build is in the folder
        _fsync_dir(staging)
    elif not replacing.is_dir():
        # No old file moved yet, so none of the new build's is in the folder, unless a packer of before
        # this protocol was committing (it deleted the old files first, then moved the new ones in).
        kept = _proven(out, _json(previous if previous.exists() else out / MANIFEST_NAME))
        for name in sorted(_proven(out, _json(pending)) - kept - {MANIFEST_NAME}):
            with suppress(FileNotFoundError):
                (out / name).unlink()
    if replacing.is_dir():
        for entry in sorted(replacing.iterdir()):
            os.replace(entry, out / entry.name)
        replacing.rmdir()
    if previous.exists():
        os.replace(previous, out / MANIFEST_NAME)
    _fsync_dir(out)
    pending.unlink()


def remove_stale_staging(out: Path) -> None:
    """Remove the staging folder beside a finished build (what a build stopped between its commit point
    and its release leaves), unless a build holds it now: taking and releasing the lock does it."""
    with suppress(OutputError, OSError), lock(out):
        pass


def staging_left(local: Path) -> str | None:
    """What a staging folder of packer's in ``local`` is, and what removes it; None when there is none
    (a foreign one is not packer's to remove: a build refuses it)."""
    if not _staging_is_ours(local / STAGING):
        return None
    return f"a build is writing there now, or one was stopped; the next `packer build` into {local} resumes or removes it"


def staging_note(directory) -> str | None:
    """For the read-only commands: a line about a staging folder in ``directory``, which they leave alone."""
    local = fs.local_path(directory)
    left = None if local is None else staging_left(local)
    return None if left is None else f"{local / STAGING}: {left}"


# -- the build's steps ----------------------------------------------------------------------------


def check(out: Path, identity: dict[str, Any], overwrite: bool) -> schema.Manifest | None:
    """Refuse a folder that holds something else; return its manifest if it holds this exact build."""
    finished = refuse_foreign(out, overwrite).finished
    if finished is None or overwrite:
        return None
    if any(finished.get(k) != v for k, v in identity.items()):
        raise OutputError(f"--out {out}: holds another build ({_differs(finished, identity)}); pass --overwrite to "
                          "replace it or choose another --out")
    if damage(out, finished) is None:
        return schema.Manifest.from_json(finished, str(out / MANIFEST_NAME))
    return None  # a damaged build of ours: it is redone


def _differs(finished: dict[str, Any], identity: dict[str, Any]) -> str:
    """What differs between a finished build's manifest and this build: the config keys by value,
    else which of source and tokenizer. A build of another format version of the same config says what
    the new format changes."""
    keys = [k for k in identity if finished.get(k) != identity[k]]
    if keys != ["config"] or not isinstance(finished.get("config"), dict):
        return f"different {' and '.join(keys)}"
    old, new = finished["config"], identity["config"]
    changed = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    was, now = old.get("format_version", 1), new.get("format_version", 1)
    shown = ", ".join(f"{k} {old.get(k)!r} → {new.get(k)!r}" for k in changed if k != "format_version")
    if was == now:
        return f"different config: {shown}"
    change = (f"format {was} → {now}: "
              + ("ids and positions in the narrowest type, the loss as a bit mask instead of int32 labels, about a "
                 "third of the bytes; the loader yields the same batches" if now == 2 else
                 "int32 ids, positions and labels, about three times the bytes") + f" (give --format {was} to keep "
              f"format {was})")
    return change + (f"; and config: {shown}" if shown else "")


def damage(out: Path, data: dict[str, Any]) -> str | None:
    """What is wrong with a finished build of ours that a rerun would reuse (None: nothing), checked
    before the rerun says "nothing to do": the manifest's content hash, every listed shard's size and
    sha256 and the ``datasets`` files. Hashing the shards reads them once: 0.3% of the build on the
    bundled sample (``benchmarks/bench_reuse.py``), so always."""
    try:
        manifest = schema.Manifest.from_json(data)
    except ShardFormatError as e:
        return str(e)
    for entry in manifest.shards:
        problems = schema.shard_file_problems(out, entry)
        if problems:
            return f"{entry.file}: {problems[0]}"
    for name, problem in schema.datasets_file_problems(out, manifest):
        return f"{name}: {problem}"
    return None


def prepare(out: Path, staging: Path) -> None:
    """Clear the staging folder for this build, keeping a token spill (it checks its own identity and is
    resumed). A build in the folder stays untouched until :func:`commit` replaces it."""
    try:
        for entry in staging.iterdir():
            if entry.name not in (LOCK, TOKENS_DIR):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    except OSError as e:
        raise OutputError(f"--out {out}: cannot write there ({e.strerror}); choose a writable folder") from e


def _remove_listed(out: Path, staging: Path) -> None:
    """Delete from ``out`` the files the staged manifests list (what a packer of before the current commit
    protocol left, killed while clearing a build or committing one), then those manifests. ``manifest.json`` itself is only ever moved into staging, never deleted here."""
    for name in sorted(_staged_files(out, staging)):
        with suppress(FileNotFoundError):
            (out / name).unlink()
    for name in (PENDING, PREVIOUS):
        with suppress(FileNotFoundError):
            (staging / name).unlink()


def commit(out: Path, staging: Path, manifest: schema.Manifest) -> None:
    """Replace the build in ``out`` (if any) with the one staged: everything is written and fsynced in
    the staging folder first, then the builds are swapped by renames (module docstring), the manifest
    last (the commit point). Until then the staged manifest proves the moved files packer's, and a
    stop anywhere is rolled back to the build that was there."""
    for entry in manifest.shards:
        _fsync(staging / entry.file)
    datasets = schema.datasets_files(manifest)
    for name, data in datasets.items():
        (staging / name).write_bytes(data)
        _fsync(staging / name)
    pending = staging / PENDING
    pending.write_bytes(manifest.dumps())
    _fsync(pending)
    _fsync_dir(staging)
    found = _json(out / MANIFEST_NAME)
    old: list[str] = []
    if schema.listed_files(found) is not None:
        old = sorted(_proven(out, found) - {MANIFEST_NAME})
        os.replace(out / MANIFEST_NAME, staging / PREVIOUS)  # first: the folder stops looking complete
        _fsync_dir(out)
    replacing = staging / REPLACING
    replacing.mkdir()
    for name in old:
        os.replace(out / name, replacing / name)
    _fsync_dir(out)
    _fsync_dir(replacing)
    os.replace(replacing, staging / REPLACED)  # every old file is out: the new ones may come in
    _fsync_dir(staging)
    for name in (*(e.file for e in manifest.shards), *datasets):
        os.replace(staging / name, out / name)
    os.replace(pending, out / MANIFEST_NAME)
    _fsync_dir(out)


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
            except (OSError, ValueError, RuntimeError):  # RuntimeError: a symlink loop (Python before 3.13)
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
