"""The one local cache of packer: remote shards, token stores (/work/shared/DESIGN.md, "Caches").

Where it is: ``cache_dir=`` where an API takes one, else ``$PACKER_CACHE``, else
``$XDG_CACHE_HOME/packer``, else ``~/.cache/packer`` (:func:`root`). How big it may grow:
``cache_limit=`` else ``$PACKER_CACHE_LIMIT``, in bytes or with a unit (``10GB``, ``512MiB``;
:func:`parse_limit`); no limit when neither is set.

An entry is a file or a folder at ``ROOT/KIND/KEY``, keyed by what it depends on (a shard's sha256, a
token store's identity); a folder of the root whose name starts with ``.`` is no kind, and eviction
never looks in it (a place for what must stay, such as ``packer build --out URL``'s local build). The
rules every entry follows, so that any number of processes (ranks,
DataLoader workers, machines sharing a folder) can share one root:

- **Made once.** :meth:`Cache.open` makes a missing entry under its making lock, so of the processes
  that ask for a missing entry together one makes it and the others wait, then use it.
- **Never torn.** An entry is made under a temporary name in its kind's folder, checked, flushed to
  disk and renamed into place: a reader sees a whole entry or none. A crash leaves a temporary file,
  removed by the next maker of that key.
- **Checked.** The maker's ``check`` runs on what it made before it is placed, and on a placed entry
  when it is opened (cheap checks there: size; a hash with ``full``): a damaged or partial entry is
  removed and made again, never used.
- **Evicted least recently used, never while open.** An opened entry holds a shared lock until it is
  closed (``Entry.close`` or the end of the process); each open touches its mtime. Past the limit,
  making an entry first removes the least recently used entries whose lock nobody holds. What is open
  is never removed, so a limit smaller than what is open at once is exceeded rather than breaking a
  reader.

Locks are ``flock`` on two files per entry, ``KIND/.locks/KEY`` (shared by its readers, taken
exclusively by eviction, without waiting) and ``KIND/.making/KEY`` (its maker's): held by an open file
description, so they work between threads (each ``open`` opens its own), processes and forked children
alike, and vanish with the process that held them (no stale lock after a crash). A reader may hold an
entry while another process replaces a damaged copy of it: the copy is renamed away, and the reader's
open file or memory map keeps its bytes. Lock files are never deleted (deleting one that another process
has open would split the lock in two); they are empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, PackerError
from .fs import expand_user

ENV_ROOT = "PACKER_CACHE"
ENV_LIMIT = "PACKER_CACHE_LIMIT"
TMP_PREFIX = ".tmp-"
LOCKS = ".locks"
MAKING = ".making"

# The making locks this process holds now. A process forked while one of its threads makes an entry would
# inherit that lock's open file, and with it the lock, past the maker's own release: closed in the child.
_MAKING: set[int] = set()


def _close_inherited_making() -> None:
    for fd in list(_MAKING):
        with contextlib.suppress(OSError):
            os.close(fd)
    _MAKING.clear()


os.register_at_fork(after_in_child=_close_inherited_making)

__all__ = ["Cache", "CacheError", "Entry", "file_problem", "parse_limit", "root", "limit"]


class CacheError(PackerError):
    """A cache folder that cannot be used (not writable, not a folder), or an entry its maker could not make."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$PACKER_CACHE``, else ``$XDG_CACHE_HOME/packer`` (an absolute
    ``XDG_CACHE_HOME`` only, as the XDG spec says), else ``~/.cache/packer``. Not created here."""
    if cache_dir is not None and os.fspath(cache_dir) != "":
        return expand_user(cache_dir, "cache_dir", ConfigError).absolute()
    env = os.environ.get(ENV_ROOT)
    if env:
        return expand_user(env, f"${ENV_ROOT}", ConfigError).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "packer"
    return expand_user("~/.cache/packer", "the cache folder (set $PACKER_CACHE)", ConfigError)


def parse_limit(value: int | str | None, what: str = "cache_limit") -> int | None:
    """A cache limit in bytes: an int, or a string of a number and an optional unit (``10GB`` = 10**10,
    ``512MiB`` = 512 * 2**20, ``1.5 GB``; ``B``, ``KB``/``K``, ``MB``, ``GB``, ``TB`` and ``KiB`` ... ``TiB``,
    any case). None or ``""``: no limit. Anything else is a ConfigError naming ``what``."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{what} {value!r}: need a size in bytes (an int) or a string such as '10GB' or '512MiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what} {value}: need a size >= 0 bytes")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"{what} {value!r}: need a size in bytes or with a unit, such as 10GB, 512MiB or 1000000")


def limit(cache_limit: int | str | None = None) -> int | None:
    """The cache limit in bytes: ``cache_limit``, else ``$PACKER_CACHE_LIMIT``, else None (no limit)."""
    if cache_limit is not None:
        return parse_limit(cache_limit)
    return parse_limit(os.environ.get(ENV_LIMIT), f"${ENV_LIMIT}")


def file_problem(path: str | os.PathLike, size: int, sha256: str | None = None) -> str | None:
    """What is wrong with a file against its expected ``size`` and (when given) ``sha256``, or None:
    missing, another size (partial), other bytes (damaged). The check an entry made of one file uses."""
    try:
        found = os.stat(path).st_size
    except FileNotFoundError:
        return "missing"
    if found != size:
        return f"{found:,} bytes, expected {size:,} (partial or from elsewhere)"
    if sha256 is not None:
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != sha256:
                return "sha256 differs from the expected one (damaged)"
    return None


@dataclass(eq=False)
class Entry:
    """An open cache entry: ``path`` is safe to read (and to memory-map) until :meth:`close`, which
    releases the shared lock that keeps it from eviction. A context manager; closing twice is fine."""

    path: Path
    key: str
    _fd: int | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the description releases its flock
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> Entry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # an entry dropped without close still lets go of its lock
        self.close()


def _size(path: Path) -> int:
    """Bytes an entry takes: a file's size, or a folder's files' sizes summed."""
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
        return path.lstat().st_size
    except FileNotFoundError:
        return 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_tree(path: Path) -> None:
    """Flush what a maker wrote to disk before it is renamed into place (a crash then leaves a whole
    entry or a temporary file, never a torn entry under its final name)."""
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class _NotMade(Exception):
    """What :meth:`Cache.find`'s maker raises: a lookup never makes an entry."""


class Cache:
    """The entries of one ``kind`` (a folder name: ``shards``, ``tokens``) under a cache root, with the
    root's limit. Cheap to make; holds no state but its paths (every process makes its own)."""

    def __init__(self, kind: str, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None) -> None:
        if not _KEY.fullmatch(kind) or kind.startswith("."):
            raise ConfigError(f"cache kind {kind!r}: need a plain folder name")
        self.root = root(cache_dir)
        self.kind = kind
        self.folder = self.root / kind
        self.limit = limit(cache_limit)
        try:
            (self.folder / LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cache folder {self.folder}: cannot be made ({e.strerror or e}); set $PACKER_CACHE "
                             "or cache_dir= to a writable folder") from e

    # -- paths --------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        """Where entry ``key`` lives once made (it may not exist)."""
        if not _KEY.fullmatch(key):
            raise ConfigError(f"cache key {key!r}: need letters, digits, '.', '_' or '-' (at most 200)")
        return self.folder / key

    def _lock_file(self, key: str) -> int:
        return os.open(self.folder / LOCKS / key, os.O_RDWR | os.O_CREAT, 0o644)

    # -- the one way in -----------------------------------------------------------------------
    def open(self, key: str, make: Callable[[Path], None], check: Callable[[Path, bool], str | None] | None = None,
             *, full: bool = False, size_hint: int = 0) -> Entry:
        """Entry ``key``, made by ``make(tmp)`` when it is missing or damaged; open (kept from eviction)
        until the returned Entry is closed.

        ``make(tmp)`` writes the entry at ``tmp`` (a file or a folder; the path does not exist yet) or
        raises, which leaves nothing behind. ``check(path, full)`` says what is wrong with an entry (None:
        nothing); it runs with ``full=True`` on what ``make`` wrote, and with ``full`` (this call's) on an
        entry already in place, so a cheap check (size) guards every open and a thorough one (hash)
        arrivals. ``size_hint``: bytes the entry will take, room made for it before ``make`` runs.

        Raises CacheError when what ``make`` wrote fails ``check`` (and whatever ``make`` raises)."""
        path = self.path(key)
        fd = self._lock_file(key)
        try:
            for _ in range(8):  # another process may evict between our checks; each round re-checks
                fcntl.flock(fd, fcntl.LOCK_SH)  # ours from here on: no eviction takes it while we read it
                if path.exists() and (check is None or check(path, full) is None):
                    return self._opened(path, key, fd)
                with self._making(key):  # one maker at a time; the others wait here, then find it made
                    if not path.exists() or (check is not None and check(path, full) is not None):
                        self._make(key, path, make, check, size_hint)  # a damaged entry is replaced, never used
                if path.exists():
                    return self._opened(path, key, fd)
                fcntl.flock(fd, fcntl.LOCK_UN)
            raise CacheError(f"cache entry {path}: removed by other processes as soon as it was made, 8 times; the "
                             "cache limit is too small for what is open at once, raise it")
        except BaseException:
            os.close(fd)
            raise

    def find(self, key: str, check: Callable[[Path, bool], str | None] | None = None) -> Entry | None:
        """Entry ``key`` opened as :meth:`open` opens it (kept from eviction until closed) if it is there and passes
        ``check``; None otherwise, and nothing is made: a lookup, for entries only a later step makes."""
        if not self.path(key).exists():
            return None

        def declined(_tmp: Path) -> None:
            raise _NotMade

        try:
            return self.open(key, declined, check)
        except _NotMade:
            return None

    @contextlib.contextmanager
    def _making(self, key: str) -> Iterator[None]:
        """The lock of making entry ``key``: apart from the lock readers share (a reader may hold an entry
        open while another process replaces a damaged copy of it: its memory map keeps the old file)."""
        (self.folder / MAKING).mkdir(exist_ok=True)
        fd = os.open(self.folder / MAKING / key, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _MAKING.add(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _MAKING.discard(fd)
            os.close(fd)

    def _opened(self, path: Path, key: str, fd: int) -> Entry:
        with contextlib.suppress(OSError):  # a read-only cache still reads
            os.utime(path)  # the recency eviction orders by
        return Entry(path, key, fd)

    def _make(self, key: str, path: Path, make: Callable[[Path], None],
              check: Callable[[Path, bool], str | None] | None, size_hint: int) -> None:
        """Under the entry's exclusive lock: clear a crashed maker's leftovers, make it under a temporary
        name, check it, make room, rename it into place."""
        for stale in self.folder.glob(f"{TMP_PREFIX}{key}.*"):
            _remove(stale)  # only a maker of this key writes these, and we hold its lock
        tmp = self.folder / f"{TMP_PREFIX}{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            if size_hint:
                self.make_room(size_hint, keep=key)
            make(tmp)
            if not tmp.exists():
                raise CacheError(f"cache entry {path}: its maker wrote nothing")
            problem = None if check is None else check(tmp, True)
            if problem is not None:
                raise CacheError(f"cache entry {path}: what was made is {problem}")
            _fsync_tree(tmp)
            self.make_room(_size(tmp), keep=key)
            if path.exists():  # a damaged copy: renamed away (its readers keep their open files), then removed
                gone = self.folder / f"{TMP_PREFIX}{key}.damaged.{uuid.uuid4().hex[:8]}"
                os.replace(path, gone)
                _remove(gone)
            os.replace(tmp, path)  # atomic on one filesystem: whole or absent
        finally:
            if tmp.exists():
                _remove(tmp)

    # -- eviction -----------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, Path]]:
        """Every entry under the root, of every kind: (mtime, bytes, path), least recently used first."""
        found = []
        if not self.root.is_dir():
            return found
        for kind in self.root.iterdir():
            if not kind.is_dir() or kind.name.startswith("."):
                continue
            for p in kind.iterdir():
                if p.name.startswith("."):
                    continue
                try:
                    found.append((p.lstat().st_mtime, _size(p), p))
                except FileNotFoundError:
                    continue
        return sorted(found, key=lambda e: (e[0], str(e[2])))

    def size(self) -> int:
        """Bytes the root's entries take, of every kind."""
        return sum(e[1] for e in self.entries())

    def make_room(self, incoming: int, keep: str | None = None) -> int:
        """Remove least recently used entries that no process has open until ``incoming`` more bytes fit
        under the limit (or nothing more can go); returns the bytes removed. Entries of every kind count
        against the one limit. ``keep``: a key of this kind never removed (the one being made)."""
        if self.limit is None:
            return 0
        entries = self.entries()
        total = sum(e[1] for e in entries)
        freed = 0
        for _, size, p in entries:
            if total + incoming <= self.limit:
                break
            if p.parent == self.folder and p.name == keep:
                continue
            if self._evict(p):
                total -= size
                freed += size
        return freed

    def _evict(self, p: Path) -> bool:
        """Remove entry ``p`` if nobody has it open (its lock is free); True when removed."""
        try:
            fd = os.open(p.parent / LOCKS / p.name, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # open in some process (or being made): never removed under a reader
            if not p.exists():
                return False
            # renamed away first: a reader that finds the name finds a whole entry, never a half-deleted folder
            gone = p.parent / f"{TMP_PREFIX}{p.name}.evicted.{uuid.uuid4().hex[:8]}"
            os.replace(p, gone)
            _remove(gone)
            return True
        finally:
            os.close(fd)
