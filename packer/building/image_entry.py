"""An image build's entry in the token store (:mod:`packer.building.token_store`): its image files, and the
image files its records read.

An image build's spill holds three files beside the token files (:mod:`packer.building.image_spill`); its entry
keeps them too, listed in ``meta.json`` with their sizes and sha256s as the token files are, and checked alike
(sizes on every lookup, sha256s on the build's own links). What the source's sha256 does not cover is an image
given by path: a file beside the source, which may be rewritten, replaced or removed after the entry was made.
So the entry lists every such file its records read (``image_files``), each with the size and sha256 of the very
bytes the build stored (taken from ``images.bin``, not read again: a file changed during the build cannot slip
in), and a build re-hashes those files before it re-plans from the entry: one that differs, or is gone, and the
entry is not used (it is removed and the source tokenized again, which fails or skips as a ``--no-cache`` build
would).

What an image part's tokens depend on beyond a text part's (:func:`identity`): the processor (its fingerprint is
in the manifest's tokenizer record, which the identity holds), the images field, the folder relative paths are
read from, ``--max-len`` where the encoder drops an example whose cut would fall in an image (``--overlong
truncate`` only), and Pillow's version (it reads each image's size and decides what decodes).

An image entry is used as a text entry is: taken whole, re-drawn into a mix or its first records taken
(:func:`packer.building.image_spill.gather` carries each example's images wherever
:mod:`packer.building.redraw` puts its tokens), split out of a mix's spill, or extended by the records a build
draws beyond it (their images appended, :func:`append`). A part is kept when its records were all kept or
dropped because a ``--max-len`` cut would fall in an image (:func:`read_files` pins the images that decided
each drop); one with records skipped for another reason is not (what decided a skip is in no stored byte).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .. import cache
from ..errors import PackerError
from . import image_spill
from .image_encoder import CUT_IMAGE, ImageEncoder, image_values
from .images import image_file

FILES = (image_spill.DATA, image_spill.INDEX, image_spill.PER_EXAMPLE)
KEY = "images"  # an image part's identity holds this (what identity() returns); a text part's never does
LISTED = "image_files"  # in an image entry's meta.json: the image files its records read


def identity(encoder) -> dict[str, Any] | None:
    """What an image part's tokens depend on beyond what a text part's identity holds (None: a text encoder)."""
    if not isinstance(encoder, ImageEncoder):
        return None
    import PIL  # the module's own version: a fork installed under another name (pillow-simd) has it too

    base = encoder.formatter.base
    pillow = getattr(PIL, "__version__", None)
    return {"field": encoder.formatter.images_field, "base": None if base is None else str(Path(base).absolute()),
            "max_len": encoder.max_len, "pillow": pillow,  # and the processor's tokenizer's image token
            "image_token": [encoder.image_token, encoder.image_token_id, encoder.model_token]}


def files(ident: dict[str, Any], token_files: tuple[str, ...]) -> tuple[str, ...]:
    """The files an entry of identity ``ident`` holds: the token files, and an image part's image files."""
    return token_files + FILES if KEY in ident else token_files


def size_problem(path: Path, meta: dict[str, Any]) -> str | None:
    """What is wrong with an image entry's image files (in ``path``) or its list of read files, as ``meta`` and
    the files' sizes show (None: nothing)."""
    listed = meta.get(LISTED)
    if not isinstance(listed, list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("bytes"), int)
            and isinstance(f.get("sha256"), str) for f in listed):
        return "its meta.json does not list the image files its records read"
    sizes = {name: meta["files"][name]["bytes"] for name in FILES}
    if (sizes[image_spill.PER_EXAMPLE] != 4 * meta["counts"]["examples"]
            or sizes[image_spill.INDEX] % (8 * image_spill.INDEX_WIDTH)):
        return "its meta.json's counts do not match its image files"
    for name, size in sizes.items():
        try:
            found = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if found != size:
            return f"{name} holds {found:,} bytes, not the {size:,} it was written with"
    return None


def held(folder: Path) -> tuple[str, ...]:
    """The image files in ``folder``, an entry's or a spill's (none: a text part's)."""
    return FILES if (folder / image_spill.PER_EXAMPLE).is_file() else ()


def progress(folder: Path) -> dict[str, int]:
    """What a finished spill's marker counts of the images in ``folder`` (image_spill's ``images``, ``image_bytes``:
    its files are truncated to them when the spill is opened, and here they are an entry's own, linked); {} for
    a text spill."""
    if not held(folder):
        return {}
    return {"images": (folder / image_spill.INDEX).stat().st_size // (8 * image_spill.INDEX_WIDTH),
            "image_bytes": (folder / image_spill.DATA).stat().st_size}


def examples_bytes(folder: Path, mine: np.ndarray) -> int:
    """The bytes the image files of the examples ``mine`` selects (a mask) of the spill in ``folder`` take (0: a
    text spill's)."""
    if not held(folder):
        return 0
    counts = np.fromfile(folder / image_spill.PER_EXAMPLE, np.int32, count=mine.size)
    sizes = np.fromfile(folder / image_spill.INDEX, np.int64).reshape(-1, image_spill.INDEX_WIDTH)[:, 1]
    selected = np.repeat(mine, counts)
    return int(sizes[:selected.size][selected].sum()) + 8 * image_spill.INDEX_WIDTH * int(selected.sum()) + 4 * int(mine.sum())


def append(where: Path, rest: Path) -> None:
    """An image entry's image files in ``where`` (linked: never written) replaced by copies of them followed by
    those of the records read beyond it (its part's spill of them in ``rest``), the index's byte offsets moved
    past the entry's images; nothing for a text entry."""
    if not held(where):
        return
    shift = (where / image_spill.DATA).stat().st_size
    for name in FILES:
        with open(where / f"{name}.tmp", "wb") as out:
            with open(where / name, "rb") as old:
                shutil.copyfileobj(old, out, 1 << 20)
            if name == image_spill.INDEX and (rest / name).is_file():
                index = np.fromfile(rest / name, np.int64).reshape(-1, image_spill.INDEX_WIDTH)
                index[:, 0] += shift
                out.write(index.tobytes())
            elif (rest / name).is_file():
                with open(rest / name, "rb") as new:
                    shutil.copyfileobj(new, out, 1 << 20)
        os.replace(where / f"{name}.tmp", where / name)
    if (where / image_spill.PER_EXAMPLE).stat().st_size != (where / "lengths.bin").stat().st_size:
        raise ValueError(f"{where}: the images of {(where / image_spill.PER_EXAMPLE).stat().st_size // 4:,} examples "
                         f"for {(where / 'lengths.bin').stat().st_size // 4:,} examples")  # never: a bug, said


def changed(meta: dict[str, Any]) -> str | None:
    """Which image file the entry's records read differs now from the bytes the entry holds (None: none)."""
    for f in meta[LISTED]:
        try:
            problem = cache.file_problem(f["path"], f["bytes"], f["sha256"])
        except OSError as e:  # not a file now, unreadable, a symlink loop: changed all the same; tokenizing says how
            problem = f"cannot be read ({e.strerror or e})"
        if problem is not None:
            return f"image file {f['path']}: {problem}"
    return None


class Unpinned(Exception):
    """The image files a part's records read cannot be pinned: the part keeps no entry (no warning: nothing failed)."""


def read_files(folder: Path, stream, encoder: ImageEncoder, records: int, example_ids: np.ndarray
               ) -> list[dict[str, Any]]:
    """The image files the first ``records`` records of ``stream`` (one part's) read, each once, with the size
    and sha256 of the bytes whose tokens the entry holds: a kept record's, the bytes its spill in ``folder``
    holds (not read again: a file changed since cannot slip in); a record dropped because a ``--max-len`` cut
    would fall in one of its images, the bytes an encode of it alone reads now, which drop it again (the drop is
    what those bytes give). The source's records are read again for their images field. Raises
    :class:`Unpinned` for a record skipped for another reason (what decided its skip is in no stored byte) or
    a path relative to the working folder (the source is no local file); ``cache.CacheError`` (the store is
    skipped, with its warning) for a file that gave two contents in one build."""
    ids = np.asarray(example_ids, np.int64)
    if ids.size and (np.any(np.diff(ids) <= 0) or ids[-1] >= records):
        raise Unpinned("an image part's spill holds other than one example a record")
    example_of = np.full(records, -1, np.int64)
    example_of[ids] = np.arange(ids.size)
    counts = np.fromfile(folder / image_spill.PER_EXAMPLE, np.int32, count=ids.size)
    first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    index = np.fromfile(folder / image_spill.INDEX, np.int64).reshape(-1, image_spill.INDEX_WIDTH)
    field, base = encoder.formatter.images_field, encoder.formatter.base
    found: dict[str, dict[str, Any]] = {}
    with open(folder / image_spill.DATA, "rb") as data:

        def row_bytes(row: int) -> bytes:
            data.seek(int(index[row, 0]))
            return data.read(int(index[row, 1]))

        for at, batch in stream.chunks(0, 1000):
            n = len(next(iter(batch.values()), []))
            column = batch.get(field) or [None] * n
            for r in range(at, min(at + n, records)):
                values, k = image_values(column[r - at]), int(example_of[r])
                if k < 0:  # dropped: its images as an encode of it alone reads them
                    dropped = _dropped(encoder, {c: v[r - at:r - at + 1] for c, v in batch.items()}, r)
                    held = [lambda image=image: image.data for image in dropped]
                else:
                    held = [lambda row=row: row_bytes(row) for row in range(int(first[k]), int(first[k + 1]))]
                if len(values) != len(held):
                    raise cache.CacheError(f"record {r + 1}'s images read again are not those its spill holds")
                for value, got in zip(values, held, strict=True):
                    _list(found, image_file(value, base), base, value, got)
            if at + n >= records:
                break
    return sorted(found.values(), key=lambda f: f["path"])


def _dropped(encoder: ImageEncoder, record: dict[str, list], r: int) -> list:
    """The images of record ``r`` (``record``: it alone, as columns), encoded alone again: dropped because a
    ``--max-len`` cut would fall in an image, as in the build (else :class:`Unpinned`)."""
    try:
        encoded = encoder.encode(record, r)
    except PackerError as e:
        raise Unpinned(f"record {r + 1} was skipped ({e})") from None
    reasons = list(encoded.skipped)
    if reasons != [CUT_IMAGE]:
        raise Unpinned(f"record {r + 1} was skipped ({', '.join(reasons) or 'and now is not'})")
    return encoder.formatter.last_images


def _list(found: dict[str, dict[str, Any]], path: Path | None, base: Path | None, value: Any, held) -> None:
    """Image file ``path`` (None: the image's bytes are the record's own) listed in ``found`` with the size and
    sha256 of ``held()``, the bytes the entry's tokens were made from."""
    if path is None:
        return
    # a relative path is pinned only where it is read from the source's folder (the key holds it), never from
    # the working folder (no source folder, or a PIL image's own file name)
    if not path.is_absolute() and (base is None or not isinstance(value, (str, dict))):
        raise Unpinned(f"image {value!r} is read relative to the working folder, which no key holds")
    got = held()
    listed = {"path": str(path.absolute()), "bytes": len(got), "sha256": hashlib.sha256(got).hexdigest()}
    if found.setdefault(listed["path"], listed) != listed:
        raise cache.CacheError(f"image file {listed['path']} changed during the build")
