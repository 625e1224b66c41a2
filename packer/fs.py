"""Where a folder lives: a local path or an fsspec URL (``s3://``, ``gs://``, ``file://``, ``memory://``, ...).

Local paths and ``file://`` URLs are read with the OS (and memory-mapped by the readers, zero copy);
other filesystems go through fsspec (a dependency of `datasets`; the remote protocols need their own
package, e.g. ``s3fs``) and are read whole into memory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import PackerError, ShardFormatError

PathLike = str | os.PathLike


def is_url(path: PathLike) -> bool:
    """True for an fsspec URL (``proto://...``); a local path otherwise."""
    return isinstance(path, str) and "://" in path


def expand_user(path: PathLike, what: str, error: type[PackerError]) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded, as the shell expands it. A ``~user`` of no user on
    this machine is ``error`` in one line: ``Path.expanduser`` raises a bare RuntimeError, ``os.path``
    leaves the ``~`` in place, which would name a folder called ``~user`` here."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text.startswith("~"):
        return Path(path)
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        user = text[1:].split(os.sep, 1)[0]
        home = f"~{user}" if user else "~"
        raise error(f"{what} {text}: {f'there is no user {user!r} on this machine, so' if user else 'no home folder is set (HOME), so'}"
                    f" {home} names no folder; give the path in full")
    return Path(expanded)


def local_path(path: PathLike) -> Path | None:
    """The local path of a plain path or a ``file://`` URL; None for any other filesystem."""
    if not is_url(path):
        return Path(path)
    if str(path).startswith(("file://", "local://")):
        return Path(str(path).split("://", 1)[1])
    return None


def filesystem(url: str):
    """``(fs, path)`` of an fsspec URL; a ShardFormatError when its filesystem cannot be opened."""
    try:
        from fsspec.core import url_to_fs  # fsspec comes with datasets, but only URLs need it
    except ImportError as e:  # pragma: no cover - datasets depends on fsspec
        raise ShardFormatError(f"{url}: reading an fsspec URL needs fsspec (pip install fsspec)") from e
    try:
        return url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ShardFormatError(f"{url}: cannot open this filesystem ({e}); install its fsspec package (s3fs, gcsfs, ...)") from e


def join(directory: PathLike, name: str) -> PathLike:
    """``directory / name`` for a local path, ``directory + "/" + name`` for a URL."""
    if is_url(directory):
        return str(directory).rstrip("/") + "/" + name
    return Path(directory) / name


def file_size(path: PathLike) -> int | None:
    """Size in bytes of a file, or None when there is no such file."""
    local = local_path(path)
    if local is not None:
        return local.stat().st_size if local.is_file() else None
    fs, p = filesystem(str(path))
    try:
        return int(fs.size(p)) if fs.isfile(p) else None
    except FileNotFoundError:
        return None


def is_dir(path: PathLike) -> bool:
    local = local_path(path)
    if local is not None:
        return local.is_dir()
    fs, p = filesystem(str(path))
    return bool(fs.isdir(p))


def list_names(directory: PathLike) -> list[str]:
    """Names of the entries of a folder (files and subfolders), sorted."""
    local = local_path(directory)
    if local is not None:
        return sorted(p.name for p in local.iterdir())
    fs, p = filesystem(str(directory))
    return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False))


def read_bytes(path: PathLike) -> bytes:
    local = local_path(path)
    if local is not None:
        return local.read_bytes()
    fs, p = filesystem(str(path))
    return fs.cat_file(p)


def file_sha256(path: PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    local = local_path(path)
    if local is not None:
        opened = open(local, "rb")  # noqa: SIM115 - closed by the `with` below, whichever filesystem opened it
    else:
        fs, p = filesystem(str(path))
        opened = fs.open(p, "rb")
    with opened as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
