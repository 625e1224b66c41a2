"""The vision-language side of ``prepare``: only the text model is switched, the vision tower keeps its
own attention and never sees the row's boundaries, and a packed row's images are checked at the forward.

A vision-language model (a config with a ``vision_config``) is a text decoder fed image features in place
of its placeholder tokens. Packing concerns the text decoder only: a vision tower attends within each image
(Qwen's own ``cu_seqlens`` per image, a SigLIP/CLIP per image of the batch), so ``prepare`` leaves its
attention implementation as it is (``implementation_for``), and ``install`` strips the row's keys
(``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``) from every call into a sub-model that is not the text
model: LLaVA and Qwen pass their forward's kwargs on to the tower, where a flash implementation would
read the *text* row's boundaries, and Qwen's would receive them twice.

At every packed forward of the prepared model (``row_refusal``), in one line: image placeholders without
the row's vision inputs (the model would read the placeholders as text), vision inputs without
placeholders, one example's placeholders not a whole number of the images given in order (the Qwen
families, where each image's count is known from ``image_grid_thw``), Gemma 3's images without the
``token_type_ids`` that mark their blocks, and 3-D (mRoPE) positions without the row's ``cu_seq_lens``
(they carry no boundary the attention can read).

Where the text model's mask comes from its outer model (Gemma 3 builds it there: image blocks
bidirectional), the inner language model receives it as a dict; ``outer_mask`` tells the guard that this
mask was built for the row by the prepared model itself, not passed by the caller.

The probe with images is ``vision_probe``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import mixers, vision_masks

__all__ = ["is_vision_language", "implementation_for", "install", "row_refusal", "outer_mask", "image_token_id"]

# The placeholder id's name in the configs of the families (image_token_id; LLaVA's image_token_index)
IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")
# Inputs that carry a row's images (one of them present: the row has its vision inputs)
PIXEL_KEYS = ("pixel_values", "mm_encoder_outputs", "image_embeds", "pixel_values_images")


def is_vision_language(model: Any) -> bool:
    """A composite model with a vision sub-config (image placeholders in the text, a vision tower)."""
    config = getattr(model, "config", None)
    return config is not None and "vision_config" in (getattr(config, "sub_configs", None) or {}) and getattr(
        config, "vision_config", None) is not None  # fmt: skip


def _text_key(config: Any) -> str | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((k for k in getattr(config, "sub_configs", {}) if getattr(config, k, None) is text), None)


def implementation_for(model: Any, implementation: str) -> str | dict:
    """What to hand ``set_attn_implementation``: on a vision-language model the top and text configs only
    (the other sub-configs, the vision tower's, keep theirs); otherwise ``implementation`` itself."""
    if not is_vision_language(model):
        return implementation
    key = _text_key(model.config)
    return {"": implementation, key: implementation} if key else {"": implementation}


def image_token_id(config: Any) -> int | None:
    for name in IMAGE_TOKEN_KEYS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _strip_row(module, args, kwargs):
    """A vision tower's pre-hook: the text row's boundaries are not its own."""
    if any(k in kwargs for k in mixers.ROW_KEYS):
        return args, {k: v for k, v in kwargs.items() if k not in mixers.ROW_KEYS}
    return None


_strip_row.packer_guard = True  # removed from the probe's copy with the guard's hooks


def _sub_models(model: Any) -> list[torch.nn.Module]:
    """The PreTrainedModels inside ``model`` whose config is neither the model's nor its text config's."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [m for m in model.modules()
            if m is not model and hasattr(m, "set_attn_implementation") and m.config is not config
            and m.config is not text]  # fmt: skip


def install(model: Any) -> list:
    """On a vision-language model: the vision towers' row-stripping pre-hooks (run first), the inner
    models marked (their mask may come from the outer model), Gemma 3's mask (``vision_masks``).
    Returns the hook handles."""
    if not is_vision_language(model):
        return []
    handles = [m.register_forward_pre_hook(_strip_row, with_kwargs=True, prepend=True) for m in _sub_models(model)]
    for m in model.modules():
        if m is not model and hasattr(m, "set_attn_implementation"):
            m._packer_inner = True
    return handles + vision_masks.install(model)


def outer_mask(module: Any, mask: Any) -> bool:
    """A mask dict handed to an inner model of a prepared vision-language model: built by its outer model
    for this row (from the row's positions and image blocks), not passed by the caller."""
    return isinstance(mask, dict) and getattr(module, "_packer_inner", False)


def _spans(ids: torch.Tensor, token: int, bounds: list[int]) -> list[int]:
    """How many placeholders each segment of the row holds."""
    hits = (ids.reshape(-1) == token).to(torch.int64).cumsum(0)
    at = [0] + [int(hits[b - 1]) if b > 0 else 0 for b in bounds[1:]]
    return [b - a for a, b in zip(at[:-1], at[1:], strict=True)]


def _per_image(model: Any, kwargs: dict) -> list[int] | None:
    """Each image's placeholder count where the row's inputs say it (``image_grid_thw`` of the Qwen
    families, over the tower's spatial merge); None elsewhere."""
    grid = kwargs.get("image_grid_thw")
    if grid is None:
        return None
    vision = getattr(model.config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    if not isinstance(merge, int):
        return None
    return [int(x) for x in (grid.prod(-1) // merge**2).tolist()]


def packed_3d(kwargs: dict) -> bool:
    """3-D (mRoPE) position_ids of one row that restart at 0 inside it, without cu_seq_lens (a host sync)."""
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 3 or kwargs.get("cu_seq_lens_q") is not None or pos.shape[-1] < 2:
        return False
    return pos.shape[1] == 1 and bool((pos[0, 0, 1:] == 0).any())


def row_refusal(model: Any, kwargs: dict) -> str | None:
    """Why a packed row's vision inputs do not match its placeholders (None: they do, or not a VLM's row).

    A host sync or two (the placeholders' count, the boundaries): paid on a vision-language model only."""
    if packed_3d(kwargs):
        return ("its 3-D (mRoPE) position_ids restart inside the row but no cu_seq_lens come with them (the "
                "attention reads no boundary from 3-D positions): pass the loader's batch as it is")
    ids = kwargs.get("input_ids")
    cu = kwargs.get("cu_seq_lens_q")
    bounds = None if cu is None else [int(x) for x in cu.tolist()]
    token = image_token_id(model.config)
    if ids is None or token is None:
        return None
    placed = int((ids == token).sum())
    given = any(kwargs.get(k) is not None for k in PIXEL_KEYS)
    if placed and not given:
        return (f"it holds {placed} image placeholder tokens but no pixel_values (the model would read them as "
                "text): pass the row's vision inputs with it (the loader's batch as it is)")
    if given and not placed and kwargs.get("pixel_values") is not None:
        return "pixel_values come with it but it holds no image placeholder token: pass each row's own vision inputs"
    family = getattr(model.config, "model_type", None)
    if placed and family in vision_masks.FAMILIES and kwargs.get("token_type_ids") is None:
        return ("its images come without token_type_ids, which mark the image blocks that attend both ways "
                f"({family}): pass the row's token_type_ids (the loader's batch as it is)")
    counts = _per_image(model, kwargs)
    if counts is None or bounds is None or not placed:
        return None
    if sum(counts) != placed:
        return (f"its image_grid_thw gives {sum(counts)} placeholder tokens for {len(counts)} images but the row "
                f"holds {placed}: pass each row's own vision inputs")
    images = iter(enumerate(counts))
    for seg, n in enumerate(_spans(ids, token, bounds)):
        while n > 0:
            i, c = next(images)
            if c > n:
                return (f"example {seg}'s placeholders end inside image {i} ({c} tokens): its images are not whole; "
                        "pass each row's vision inputs in token order")
            n -= c
    return None
