"""An image build's rows as the model takes them: the vision inputs of a row's images and the positions
the model computes, added to the text row's batch (the loader calls :class:`VisionRows` per row, in
whichever process reads the row, so DataLoader workers decode and preprocess images in parallel).

- The vision inputs: each segment's images decoded (:func:`packer.contract.vision.decode`) and put through
  the processor's image processor alone, one call per example with the processor's image arguments, as
  ``processor.apply_chat_template`` does for that example; each output the model takes concatenated over
  the row's examples, in token order, under the processor's own names (``pixel_values``,
  ``image_grid_thw``, ...): along axis 0, or for a family whose outputs have a per-example batch axis
  (Idefics3/SmolVLM) along axis 1, the row one batch of one. A row without an image gets no vision key.
- The processor's 0/1 image-token mask, under its name, for the families whose processor returns one.
- ``position_ids``: for the mRoPE families, each example's positions as the model's own
  ``get_rope_index`` computes them for that example alone (``[3, 1, len]``), concatenated along T, with the
  text row's 1-D positions first where the model's forward takes a text-position row (``[4, 1, T]``).
  Positions are recomputed here rather than stored: the function is the model's, its inputs (ids and
  the image grids) are what the row holds, and a build then stores a third of the bytes and imports no
  modeling code (docs/images.md).

A segment's image tokens must be its images' counts, and (Qwen) each count the tokens its grid gives; a
row where they are not is refused (``ShardFormatError``), never trained on."""

from __future__ import annotations

import types
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..contract.vision import (
    IMAGE_TOKENS,
    IMAGES,
    PROCESSOR_KEY,
    decode,
    family_of,
    image_token_id,
    images_kwargs,
    load_processor,
)
from ..errors import ConfigError, ShardFormatError


class VisionRows:
    """What a row of an image build adds to the text batch (see the module's docstring)."""

    def __init__(self, manifest) -> None:
        record = manifest.tokenizer.get(PROCESSOR_KEY) or {}
        self.name = record.get("name_or_path")
        if not isinstance(self.name, str):
            raise ShardFormatError("the manifest's tokenizer.processor names no processor folder; rebuild the folder")

    def __getstate__(self) -> dict[str, Any]:  # a worker loads the processor itself
        return {"name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name = state["name"]

    @cached_property
    def processor(self):
        return load_processor(self.name)

    @cached_property
    def family(self):
        return family_of(self.processor)

    @cached_property
    def _rope(self):
        """The model class's own ``get_rope_index``, bound to an object holding what it reads: the family's
        config (its class defaults) with the processor's merge size."""
        import transformers

        if self.family.rope_model is None:
            return None
        model = getattr(transformers, self.family.rope_model)
        config = model.config_class()
        config.vision_config.spatial_merge_size = self.processor.image_processor.merge_size
        holder = types.SimpleNamespace(config=config)
        holder.get_vision_position_ids = types.MethodType(model.get_vision_position_ids, holder)
        return types.MethodType(model.get_rope_index, holder)

    @cached_property
    def _token(self) -> int:
        return image_token_id(self.processor)

    @cached_property
    def _kwargs(self) -> dict[str, Any]:
        return images_kwargs(self.processor)

    @cached_property
    def _keys(self) -> set[str]:
        """The image processor's outputs the model takes (the processor's own drops, e.g. Gemma 3's num_crops)."""
        return set(self.processor.image_processor.model_input_names) - set(self.processor.unused_input_names)

    def row(self, arrow, j: int, out: dict[str, Any], where: str) -> dict[str, Any]:
        """``out`` (the text batch of row ``j`` of record batch ``arrow``) with the row's vision inputs."""
        blobs = arrow.column(IMAGES)[j].as_py()
        counts = arrow.column(IMAGE_TOKENS)[j].values.to_numpy().astype(np.int64)
        ids = out["input_ids"][0].numpy()
        cu = out["cu_seq_lens_q"].numpy()
        is_image = ids == self._token
        # a segment's images are those whose image tokens its tokens hold, in order
        per_segment = np.add.reduceat(is_image, cu[:-1]) if len(ids) else np.zeros(len(cu) - 1, np.int64)
        bounds = np.searchsorted(np.concatenate([[0], np.cumsum(counts)]), np.concatenate([[0], np.cumsum(per_segment)]))
        if len(counts) != len(blobs) or is_image.sum() != counts.sum() or not np.array_equal(
                np.concatenate([[0], np.cumsum(counts)])[bounds], np.concatenate([[0], np.cumsum(per_segment)])):
            raise ShardFormatError(f"{where}: its image tokens per segment ({per_segment.tolist()}) are not its "
                                   f"{len(blobs)} images' ({counts.tolist()}); the shard is damaged, rebuild the folder")
        outputs: list[dict] = []
        grids: list[Any] = []
        for s in range(len(cu) - 1):
            mine = blobs[bounds[s]:bounds[s + 1]]
            if not mine:
                grids.append(None)
                continue
            # one call per example, its images nested as processor.__call__ gets them; numpy, one copy at the end
            done = self.processor.image_processor([[decode(b) for b in mine]], **self._kwargs)
            outputs.append({k: np.asarray(v) for k, v in done.items() if k in self._keys})
            grid = outputs[-1].get("image_grid_thw")
            grids.append(None if grid is None else torch.from_numpy(grid))
        if outputs:
            axis = 1 if self.family.batched else 0  # Idefics3: a batch of one holding the row's images
            for key in outputs[0]:
                values = [o[key] for o in outputs]
                out[key] = torch.from_numpy(values[0] if len(values) == 1 else _concatenate(values, axis))
            self._check_grids(out, counts, where)
        if self.family.type_ids is not None:
            out[self.family.type_ids] = torch.from_numpy(is_image.astype(np.int64))[None]
        if self._rope is not None:
            out["position_ids"] = self._positions(out, cu, grids)
        return out

    def _check_grids(self, out: dict[str, Any], counts: np.ndarray, where: str) -> None:
        grid = out.get("image_grid_thw")
        if grid is None:
            return
        tokens = (grid.prod(-1) // self.processor.image_processor.merge_size ** 2).numpy()
        if not np.array_equal(tokens, counts):
            raise ShardFormatError(f"{where}: the processor gives its images {tokens.tolist()} tokens, the row holds "
                                   f"{counts.tolist()}; the build's processor is not this one, rebuild the folder")

    def _positions(self, out: dict[str, Any], cu: np.ndarray, grids: list) -> torch.Tensor:
        ids = out["input_ids"]
        types_ = (ids == self._token).long()
        parts = []
        for s in range(len(cu) - 1):
            lo, hi = int(cu[s]), int(cu[s + 1])
            pos, _ = self._rope(ids[:, lo:hi], mm_token_type_ids=types_[:, lo:hi], image_grid_thw=grids[s])
            parts.append(pos)
        positions = torch.cat(parts, dim=2)
        if self.family.text_row:
            positions = torch.cat([out["position_ids"][None], positions], dim=0)
        return positions


def _concatenate(values: list[np.ndarray], axis: int) -> np.ndarray:
    """Along ``axis``; a batched family's per-example arrays padded to the largest on the axes after it
    (Idefics3 pads its images to the batch's largest, its pixel_attention_mask marking what is real)."""
    if axis == 0 or all(v.shape[2:] == values[0].shape[2:] for v in values):
        return np.concatenate(values, axis=axis)
    shape = [max(v.shape[d] for v in values) for d in range(values[0].ndim)]
    padded = []
    for v in values:
        p = np.zeros((v.shape[0], v.shape[1], *shape[2:]), v.dtype)
        p[(slice(None), slice(None), *(slice(0, n) for n in v.shape[2:]))] = v
        padded.append(p)
    return np.concatenate(padded, axis=axis)


def check_view(manifest, view) -> None:
    """An image build's rows are whole rows: a context-parallel share or a fixed shape is refused."""
    if PROCESSOR_KEY in manifest.tokenizer and view is not None:
        raise ConfigError("an image build's rows cannot be split for context parallelism or padded to a fixed "
                          "shape yet (their images are per example); use cp_size=1 and static_shapes=False")
