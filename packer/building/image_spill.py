"""The images of an image build's token spill: appended beside the tokens, resumable with them, read back
by the writer.

Three more files in the spill folder (:mod:`packer.building.spill`), in source order::

    images.bin          bytes             every kept example's images, encoded, concatenated
    image_index.bin     int64[images, 7]  per image: byte offset, bytes, height, width, first image token,
                                          tokens to its last image token, image tokens
    example_images.bin  int32[examples]   images per example

``progress.json`` counts what of them its marker covers (``images``, ``image_bytes``), and a rerun
truncates them there, as it does the token files. A text build never makes them. The token store's re-draws and
splits of a spill carry each example's images with it (:func:`gather`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATA, INDEX, PER_EXAMPLE = "images.bin", "image_index.bin", "example_images.bin"
INDEX_WIDTH = 7  # offset, bytes, height, width, first image token, extent, image tokens


def complete(folder: Path, progress: dict[str, Any]) -> bool:
    """Whether the image files hold at least what ``progress`` commits (a marker without its images: the
    spill starts over, as for the token files)."""
    images = progress.get("images", 0)
    if not images and not (folder / PER_EXAMPLE).is_file():
        return True  # a text build's spill, or an image build's before its first image
    need = ((DATA, progress.get("image_bytes", 0)), (INDEX, images * INDEX_WIDTH * 8), (PER_EXAMPLE, progress["examples"] * 4))
    return all((folder / name).is_file() and (folder / name).stat().st_size >= size for name, size in need)


class Appender:
    """Appends each chunk's images (a chunk without them: nothing), counting them in ``progress``."""

    def __init__(self, folder: Path, progress: dict[str, Any]):
        self.folder = folder
        self.files: dict[str, Any] = {}
        if (folder / PER_EXAMPLE).is_file():  # drop what was written after the last marker
            self._open()
            for name, size in ((DATA, progress.get("image_bytes", 0)), (INDEX, progress.get("images", 0) * INDEX_WIDTH * 8),
                               (PER_EXAMPLE, progress["examples"] * 4)):
                self.files[name].truncate(size)

    def _open(self) -> None:
        self.files = {name: open(self.folder / name, "ab") for name in (DATA, INDEX, PER_EXAMPLE)}  # noqa: SIM115

    def append(self, chunk, progress: dict[str, Any]) -> None:
        images = getattr(chunk, "images", None)
        if images is None:
            return
        if not self.files:
            self._open()
        offset = progress.get("image_bytes", 0)
        rows = []
        for example_images, spans in zip(images, chunk.spans, strict=True):
            for image, (first, extent, tokens) in zip(example_images, spans, strict=True):
                self.files[DATA].write(image.data)
                rows.append((offset, len(image.data), image.height, image.width, first, extent, tokens))
                offset += len(image.data)
        self.files[INDEX].write(np.asarray(rows, np.int64).reshape(-1, INDEX_WIDTH).tobytes())
        self.files[PER_EXAMPLE].write(np.asarray([len(i) for i in images], np.int32).tobytes())
        progress["image_bytes"] = offset
        progress["images"] = progress.get("images", 0) + len(rows)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


@dataclass(frozen=True, slots=True)
class ImageStore:
    """A finished spill's images: example k's are index rows first[k]:first[k+1]."""

    data_path: Path
    index: np.ndarray  # int64[images, INDEX_WIDTH]
    first: np.ndarray  # int64[examples + 1]

    def read(self, rows: np.ndarray) -> list[bytes]:
        with open(self.data_path, "rb") as f:
            out = []
            for offset, size in self.index[rows, :2].tolist():
                f.seek(offset)
                out.append(f.read(size))
            return out


def open_images(folder: Path, examples: int) -> ImageStore | None:
    """The images of the finished spill in ``folder`` (None: a text build's)."""
    if not (folder / PER_EXAMPLE).is_file():
        return None
    counts = np.fromfile(folder / PER_EXAMPLE, np.int32, count=examples)
    first = np.zeros(examples + 1, np.int64)
    np.cumsum(counts, out=first[1:])
    index = np.fromfile(folder / INDEX, np.int64, count=int(first[-1]) * INDEX_WIDTH).reshape(-1, INDEX_WIDTH)
    return ImageStore(folder / DATA, index, first)


def gather(sources: list[Path], which: np.ndarray, local: np.ndarray, into: Path) -> None:
    """Write the image files of a spill in ``into`` whose example j is example ``local[j]`` of the finished spill
    in ``sources[which[j]]`` (a mix's spill re-drawn from its parts', or a part's split out of a mix's): each
    example's images in order, their bytes copied and the index's offsets made the new file's. Nothing when the
    sources hold no images (a text build's)."""
    if not all((source / PER_EXAMPLE).is_file() for source in sources):
        return
    which, local = np.asarray(which, np.int64), np.asarray(local, np.int64)
    firsts, indexes = [], []
    for source in sources:
        counts = np.fromfile(source / PER_EXAMPLE, np.int32)
        firsts.append(np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]))
        indexes.append(np.fromfile(source / INDEX, np.int64).reshape(-1, INDEX_WIDTH))
    starts, counts = np.zeros(which.size, np.int64), np.zeros(which.size, np.int64)
    for k, first in enumerate(firsts):
        mine = which == k
        starts[mine], counts[mine] = first[local[mine]], first[local[mine] + 1] - first[local[mine]]
    out_first = np.concatenate([[0], np.cumsum(counts)])
    rows = np.repeat(starts - out_first[:-1], counts) + np.arange(int(out_first[-1]))  # each image's row in its source
    row_source = np.repeat(which, counts)
    index = np.zeros((rows.size, INDEX_WIDTH), np.int64)
    for k, source_index in enumerate(indexes):
        index[row_source == k] = source_index[rows[row_source == k]]
    files = [open(source / DATA, "rb") for source in sources]  # noqa: SIM115 - closed below
    try:
        with open(into / DATA, "wb") as data:
            for k, (offset, size) in zip(row_source.tolist(), index[:, :2].tolist(), strict=True):
                files[k].seek(offset)
                data.write(files[k].read(size))
    finally:
        for f in files:
            f.close()
    index[:, 0] = np.concatenate([[0], np.cumsum(index[:, 1])[:-1]]) if rows.size else index[:, 0]
    index.tofile(into / INDEX)
    counts.astype(np.int32).tofile(into / PER_EXAMPLE)
