"""A record's images read and checked: each a path (relative to the source file's folder, or absolute),
raw encoded bytes, or the ``{"bytes", "path"}`` dict of ``datasets``' ``Image`` feature.

An image is kept as the bytes the source holds (stored so, never as pixels), and checked here, once, so
that a shard never holds one the loader cannot decode: its header is read and its size refused above
:data:`packer.contract.vision.MAX_PIXELS` before anything is decoded (a decompression bomb costs its
header), then it is decoded whole once (a truncated file fails here, not mid-epoch) and let go. A bad
image is the record's ``RecordError``, naming the image (``--on-error skip`` counts it by reason).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract.vision import MAX_PIXELS, open_image, oriented_size
from ..errors import RecordError


@dataclass(frozen=True, slots=True)
class Image:
    data: bytes  # encoded, as the source holds it
    height: int  # after its EXIF orientation
    width: int


def _bytes_of(value: Any, base: Path | None, which: str) -> bytes:
    if isinstance(value, dict):  # datasets' Image feature: bytes when embedded, else a path
        if value.get("bytes") is not None:
            return _bytes_of(value["bytes"], base, which)
        if value.get("path") is not None:
            return _bytes_of(value["path"], base, which)
        raise RecordError(f"{which} is a dict with neither 'bytes' nor 'path'", "image_missing")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if hasattr(value, "getexif") and hasattr(value, "save"):  # a PIL image (`datasets` decodes its Image feature)
        name = getattr(value, "filename", "")
        if name and Path(name).is_file():
            return Path(name).read_bytes()  # the file it was read from: its own bytes
        out = io.BytesIO()  # made in memory: encoded once, in its own format (PNG where it has none)
        value.save(out, format=value.format or "PNG")
        return out.getvalue()
    if isinstance(value, str):
        path = _path_of(value, base)
        try:
            return path.read_bytes()
        except OSError as e:
            raise RecordError(f"{which} {value!r}: cannot be read ({e.strerror or e}); check the path (relative "
                              "paths are from the source file's folder)", "image_missing") from None
    raise RecordError(f"{which} is {type(value).__name__}; give a path, encoded bytes or a {{'bytes', 'path'}} dict",
                      "wrong_type")


def _path_of(value: str, base: Path | None) -> Path:
    path = Path(value).expanduser()
    return base / path if not path.is_absolute() and base is not None else path


def image_file(value: Any, base: Path | None) -> Path | None:
    """The file an image value is read from, as :func:`read_image` reads it (None: its bytes are the record's
    own, or it is no image value and fails there): what the token store re-hashes before it serves the value's
    tokens (:mod:`packer.building.image_entry`), since the source's sha256 covers only the record."""
    if isinstance(value, dict):
        inner = value.get("bytes") if value.get("bytes") is not None else value.get("path")
        return None if inner is None else image_file(inner, base)
    if isinstance(value, str):
        return _path_of(value, base)
    # a PIL image is read from the file it came from where that is there (else encoded from its pixels): named
    # either way, so that the file appearing or changing later is seen
    name = getattr(value, "filename", "") if hasattr(value, "getexif") and hasattr(value, "save") else ""
    return Path(name) if name else None


def read_image(value: Any, base: Path | None, which: str) -> Image:
    """One image of a record, read and checked (``which`` names it in an error: "image 2")."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    data = _bytes_of(value, base, which)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            image = open_image(data)
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise RecordError(f"{which} is {width:,} x {height:,} pixels, over the {MAX_PIXELS:,} packer decodes "
                                  "(a decompression bomb, or a scan far larger than any processor's input); resize "
                                  "it", "image_too_large")
            height, width = oriented_size(image)
            image.load()  # decoded whole once (no converted copy), then dropped: a truncated or corrupt file fails here
            del image
    except RecordError:
        raise
    except PILImage.DecompressionBombError:  # PIL's own guard, past twice its MAX_IMAGE_PIXELS, at the header
        raise RecordError(f"{which} has more pixels than PIL opens (a decompression bomb?); resize it",
                          "image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise RecordError(f"{which} cannot be decoded ({first}); replace the file", "image_undecodable") from None
    if height < 1 or width < 1:
        raise RecordError(f"{which} has no pixels ({width} x {height})", "image_undecodable")
    return Image(data, height, width)
