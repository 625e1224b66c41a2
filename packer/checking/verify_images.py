"""``packer verify``'s image step, for an image build: every row's image columns against its tokens and the
processor (docs/images.md).

Per row: as many images, token counts and (height, width) pairs; the image tokens of each segment are the
counts of the images the row gives it, in order (a segment's images are those its tokens hold); every image
decodes, at its recorded size after its EXIF orientation; and, for the families whose placeholder count is
a function of the size (the "count" rule), each count is the processor's own count for that size (the
"replace" families' counts are re-derived by ``--source``). ``checked`` gains the images and their sha256
over all rows (``images_sha256``: equal builds give equal digests). With ``--source``, each segment's images
against its source record's, as the build's own reader gives them (by sha256). Cost: one decode of every
image; ``--source``: one more encoding pass over the source.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ..building.pipeline import open_source
from ..building.spill import CHUNK
from ..contract import schema
from ..contract.vision import (
    IMAGE_SIZES,
    IMAGE_TOKENS,
    IMAGES,
    PROCESSOR_KEY,
    decode,
    family_of,
    image_token_id,
    load_processor,
    open_image,
    oriented_size,
)
from ..errors import PackerError
from .report import Report


def check_images(directory: Path, manifest: schema.Manifest, entries: list[schema.ShardEntry], report: Report,
                 source: str | None = None, tokenizer=None) -> None:
    name = manifest.tokenizer.get(PROCESSOR_KEY, {}).get("name_or_path")
    try:
        processor = load_processor(name)
    except (PackerError, TypeError) as e:
        report.add("images", f"tokenizer.{PROCESSOR_KEY}", f"the processor {name!r} cannot be loaded ({e}); the image "
                   "checks need it")
        return
    token, counted = image_token_id(processor), family_of(processor).rule == "count"
    wanted = None if source is None else _source_images(manifest, source, tokenizer, report)
    differ = 0
    digest, images, row_base = hashlib.sha256(), 0, 0
    for entry in entries:
        try:
            table = schema.open_shard(directory / entry.file, manifest.row_format)
        except PackerError:
            continue  # the rows step reports it
        columns = ["input_ids", "seq_lens", "example_ids", IMAGES, IMAGE_TOKENS, IMAGE_SIZES]
        for j, row in enumerate(table.select(columns).to_pylist()):
            where = f"{entry.file} row {row_base + j}"
            blobs, counts, sizes = row[IMAGES], row[IMAGE_TOKENS], row[IMAGE_SIZES]
            if not (len(blobs) == len(counts) == len(sizes) // 2 and len(sizes) % 2 == 0):
                report.add("images", where, f"{len(blobs)} images, {len(counts)} token counts and {len(sizes)} size "
                           "values (two an image)")
                continue
            ids = np.asarray(row["input_ids"]) == token
            bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
            per_segment = [int(ids[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
            ends = np.concatenate([[0], np.cumsum(counts)])
            if sum(per_segment) != ends[-1] or not set(np.cumsum(per_segment).tolist()) <= set(ends.tolist()):
                report.add("images", where, f"its segments hold {per_segment} image tokens, its images {counts}: the "
                           "spans are not the images'")
            elif wanted is not None:  # each segment's images are its source example's, byte for byte
                cuts = np.searchsorted(ends, np.concatenate([[0], np.cumsum(per_segment)]))
                for s, example in enumerate(row["example_ids"]):
                    stored = [hashlib.sha256(b).digest() for b in blobs[cuts[s]:cuts[s + 1]]]
                    differ += stored != wanted.get(example, [])
            for k, blob in enumerate(blobs):
                digest.update(hashlib.sha256(blob).digest())
                try:
                    size = oriented_size(open_image(blob))
                    decode(blob)
                except Exception as e:  # whatever PIL raises for broken bytes
                    report.add("images", f"{where} image {k + 1}", f"does not decode ({type(e).__name__}: {e})")
                    continue
                if list(size) != sizes[2 * k:2 * k + 2]:
                    report.add("images", f"{where} image {k + 1}", f"is {size[0]} x {size[1]} (height x width), the row "
                               f"records {sizes[2 * k]} x {sizes[2 * k + 1]}")
            if counted and blobs:
                expected = processor._get_num_multimodal_tokens(
                    image_sizes=[sizes[2 * k:2 * k + 2] for k in range(len(blobs))])["num_image_tokens"]
                if [int(n) for n in expected] != counts:
                    report.add("images", where, f"its images' token counts are {counts}, the processor gives "
                               f"{[int(n) for n in expected]} for their sizes")
            images += len(blobs)
        row_base += table.num_rows
    report.checked["images"] = images
    report.checked["images_sha256"] = digest.hexdigest()
    if differ:
        report.add("source", f"--source {source}", f"{differ:,} segments hold other images than their source "
                   "records' (bytes compared by sha256)")


def _source_images(manifest: schema.Manifest, source: str, tokenizer, report: Report) -> dict[int, list[bytes]] | None:
    """Each kept example's images (their sha256s) as the build's own reading and encoder give them."""
    if manifest.config.mix is not None:
        report.notes.append("the images of a mix build are checked against their rows, not re-read from --source")
        return None
    config = manifest.config.replace(source=source, out=os.devnull)
    opened = open_source(config, tokenizer, skip_errors=True)
    out: dict[int, list[bytes]] = {}
    for _, chunk in opened.stream.chunks(0, CHUNK):
        encoded = opened.encoder.encode(chunk)
        for example, images in zip(encoded.example_ids.tolist(), getattr(encoded, "images", []), strict=False):
            out[example] = [hashlib.sha256(image.data).digest() for image in images]
    return out
