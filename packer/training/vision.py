"""An image build's rows as the model takes them: the vision inputs of a row's images and the positions
the model computes, added to the text row's batch (the loader calls :class:`VisionRows` per row, in
whichever process reads the row, so DataLoader workers decode and preprocess images in parallel).

- The vision inputs: each segment's images decoded (:func:`packer.contract.vision.decode`) and put through
  the processor's image processor alone, one call per example, as ``processor.apply_chat_template`` does
  for that example; each output key concatenated along its first axis over the row's examples, in token
  order, under the processor's own names (``pixel_values``, ``image_grid_thw``, ...). A row without an
  image gets no vision key.
- ``mm_token_type_ids`` (1 on image placeholders), as the processor returns it.
- ``position_ids``: for the mRoPE families, each example's positions as the model's own
  ``get_rope_index`` computes them for that example alone (``[3, 1, len]``), concatenated along T, with the
  text row's 1-D positions first where the model's forward takes a text-position row (``[4, 1, T]``).
  Positions are recomputed here rather than stored: the function is the model's, its inputs (ids and
  the image grids) are what the row holds, and a build then stores a third of the bytes and imports no
  modeling code (docs/images.md).

Each image's placeholder span must hold the tokens its grid gives; a row where it does not is refused
(``ShardFormatError``), never trained on.
"""

from __future__ import annotations

import types
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..contract.vision import IMAGE_TOKENS, IMAGES, PROCESSOR_KEY, decode, family_of, load_processor
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

    def row(self, arrow, j: int, out: dict[str, Any], where: str) -> dict[str, Any]:
        """``out`` (the text batch of row ``j`` of record batch ``arrow``) with the row's vision inputs."""
        blobs = arrow.column(IMAGES)[j].as_py()
        counts = arrow.column(IMAGE_TOKENS)[j].values.to_numpy()
        ids = out["input_ids"][0].numpy()
        cu = out["cu_seq_lens_q"].numpy()
        image_id = int(self.processor.image_token_id)
        is_image = ids == image_id
        # each image's span: a run of placeholders; the runs of each segment are its example's images
        edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
        starts, ends = edges[0::2], edges[1::2]
        if len(starts) != len(blobs) or not np.array_equal(ends - starts, counts):
            raise ShardFormatError(f"{where}: its image spans ({(ends - starts).tolist()}) are not its {len(blobs)} "
                                   f"images' token counts ({counts.tolist()}); the shard is damaged, rebuild the folder")
        per_segment = np.searchsorted(starts, cu, side="left")
        outputs: list[dict] = []
        grids: list[Any] = []
        for s in range(len(cu) - 1):
            mine = blobs[per_segment[s]:per_segment[s + 1]]
            if not mine:
                grids.append(None)
                continue
            done = dict(self.processor.image_processor([decode(b) for b in mine]))  # numpy: one copy at the concatenation
            outputs.append(done)
            grid = done.get("image_grid_thw")
            grids.append(None if grid is None else torch.from_numpy(np.asarray(grid)))
        if outputs:
            for key in outputs[0]:
                values = [np.asarray(o[key]) for o in outputs]
                out[key] = torch.from_numpy(values[0] if len(values) == 1 else np.concatenate(values))
            self._check_grids(out, counts, where)
        out["mm_token_type_ids"] = torch.from_numpy(is_image.astype(np.int64))[None]
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
        types_ = out["mm_token_type_ids"]
        parts = []
        for s in range(len(cu) - 1):
            lo, hi = int(cu[s]), int(cu[s + 1])
            pos, _ = self._rope(ids[:, lo:hi], mm_token_type_ids=types_[:, lo:hi], image_grid_thw=grids[s])
            parts.append(pos)
        positions = torch.cat(parts, dim=2)
        if self.family.text_row:
            positions = torch.cat([out["position_ids"][None], positions], dim=0)
        return positions


def check_view(manifest, view) -> None:
    """An image build's rows are whole rows: a context-parallel share or a fixed shape is refused."""
    if PROCESSOR_KEY in manifest.tokenizer and view is not None:
        raise ConfigError("an image build's rows cannot be split for context parallelism or padded to a fixed "
                          "shape yet (their images are per example); use cp_size=1 and static_shapes=False")
