"""What ``packer inspect --row`` shows of an image build's row: each segment's images (their token spans and
sizes), and each image's run of placeholder tokens drawn as one marker instead of hundreds of tokens."""

from __future__ import annotations

import numpy as np

from ..contract import schema
from ..contract.vision import IMAGE_SIZES, IMAGE_TOKENS, IMAGES, PROCESSOR_KEY, image_token_id, load_processor
from ..fs import join


def image_token(manifest) -> int | None:
    """The image token id of an image build's processor (None: a text build)."""
    record = manifest.tokenizer.get(PROCESSOR_KEY)
    return None if record is None else image_token_id(load_processor(record["name_or_path"]))


def totals(directory, manifest) -> tuple[int, int, str] | None:
    """An image build's images in its rows, their bytes, and its processor's class (None: a text build);
    from the columns' offsets, no image read."""
    record = manifest.tokenizer.get(PROCESSOR_KEY)
    if record is None:
        return None
    import pyarrow.compute as pc  # here: every command imports this module, and pyarrow.compute takes ~0.1 s

    count = size = 0
    for entry in manifest.shards:
        column = schema.open_shard(join(directory, entry.file), manifest.row_format).column(IMAGES)
        for chunk in column.chunks:
            count += len(chunk.values)
            size += int(pc.sum(pc.binary_length(chunk.values)).as_py() or 0)
    return count, size, str(record.get("class"))


def segment_images(record: dict, bounds: np.ndarray, token: int) -> list[tuple[dict, ...]]:
    """Per segment, its images: where each image's tokens start in the row, how many, its height and width."""
    ids = np.asarray(record["input_ids"]) == token
    counts, sizes = record[IMAGE_TOKENS], record[IMAGE_SIZES]
    at = np.flatnonzero(ids)
    firsts = at[np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)] if counts else np.zeros(0, np.int64)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out.append(tuple({"image": k, "offset": int(f), "tokens": int(counts[k]), "height": sizes[2 * k],
                          "width": sizes[2 * k + 1]} for k, f in enumerate(firsts.tolist()) if lo <= f < hi))
    return out


class Marking:
    """A tokenizer whose ``decode`` draws each run of the image token as one marker."""

    def __init__(self, tokenizer, token: int):
        self.tokenizer, self.token = tokenizer, token

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        out, k = [], 0
        while k < len(ids):
            j = k
            if ids[k] == self.token:
                while j < len(ids) and ids[j] == self.token:
                    j += 1
                out.append(f"⟦image: {j - k:,} tokens⟧")
            else:
                while j < len(ids) and ids[j] != self.token:
                    j += 1
                out.append(self.tokenizer.decode(ids[k:j], skip_special_tokens=skip_special_tokens))
            k = j
        return "".join(out)
