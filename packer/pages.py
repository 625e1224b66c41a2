"""Keeping the resident set flat while reading a memory-mapped input.

`datasets` memory-maps its Arrow cache, and every page a read touches stays resident while mapped, so
a process reading the whole input would show an RSS that grows with it. The readers (the source
check, the tokenize loop, the pool's workers) call :func:`drop_mapped_pages` after each piece.
"""

from __future__ import annotations

import ctypes
import mmap
import os


def mapped_files(dataset) -> frozenset[str]:
    """The Arrow cache files ``dataset`` memory-maps (none for an in-memory dataset)."""
    try:
        return frozenset(os.path.realpath(f["filename"]) for f in getattr(dataset, "cache_files", ()) or ())
    except (TypeError, KeyError):
        return frozenset()


def drop_mapped_pages(paths: frozenset[str]) -> None:
    """Drop this process's read-only mapped pages of ``paths`` from its resident set.

    `datasets` memory-maps its Arrow cache; every page a chunk read touched stays resident (and
    counted in RSS) while mapped, so RSS would grow with the input although the kernel may reclaim
    those pages. MADV_DONTNEED on a mapping that cannot have been written (no ``w`` in its
    permissions) only unmaps the pages: they stay in the page cache and a later read refaults them.
    Only whole mappings of exactly these files are touched, found in /proc/self/maps."""
    if not paths or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return
    libc = _libc()
    if libc is None:
        return
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or "w" in parts[1] or parts[5].rstrip("\n") not in paths:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0]
