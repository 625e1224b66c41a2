"""Gemma 3's packed mask: causal within each example, both ways inside each of its images, nothing across.

Gemma 3's image tokens attend to each other both ways (``token_type_ids`` 1, one block a run of them), so
its text model needs a mask, not only boundaries: packer_varlen (causal kernels) cannot compute it, and the
one transformers 5.24 builds from a packed row's ``position_ids`` is wrong from the second example on in
its sliding layers (the image blocks are looked up by the position inside the example there, not by the
place in the row: 0.3-0.5 off on the sweep's tiny model). So ``install`` puts a pre-hook on the model
that takes ``token_type_ids`` (``Gemma3Model``) which, on a packed row, hands it the mask per layer type,
built here from the row's boundaries and blocks (textbook, judged by the probe against each example
alone through the model's own eager mask), as the precomputed mask dict the model accepts (the one
``generate`` passes)::

    full:     same example  and (key <= query  or  same image)
    sliding:  the above     and  key > query - sliding_window

A bool mask for sdpa, an additive one for eager; other implementations read no mask (refused at the
probe). Cost: one ``[T, T]`` mask per layer type a row.
"""

from __future__ import annotations

from typing import Any

import torch

from . import attention

__all__ = ["FAMILIES", "install", "packed_masks"]

# Model types whose image tokens attend both ways, read from token_type_ids by their base model
FAMILIES = ("gemma3",)


def packed_masks(config: Any, token_type_ids: torch.Tensor | None, cu: torch.Tensor, dtype: torch.dtype,
                 implementation: str) -> dict:  # fmt: skip
    """{layer type: [1, 1, T, T] mask} for one packed row with boundaries ``cu``."""
    t = int(cu[-1])
    device = cu.device if token_type_ids is None else token_type_ids.device
    idx = torch.arange(t, device=device)
    segment = torch.bucketize(idx, cu[1:].to(device), right=True)
    allowed = (segment[:, None] == segment[None, :]) & (idx[None, :] <= idx[:, None])
    if token_type_ids is not None:
        image = token_type_ids.reshape(-1) == 1
        start = image & ~torch.nn.functional.pad(image, (1, 0))[:-1]
        block = torch.where(image, torch.cumsum(start.to(torch.int64), 0), -1)
        allowed = allowed | ((block[:, None] == block[None, :]) & (block[:, None] >= 0))
    masks = {"full_attention": allowed}
    window = getattr(config, "sliding_window", None)
    if window:
        masks["sliding_attention"] = allowed & (idx[None, :] > idx[:, None] - window)
    if implementation != "sdpa":  # eager adds its mask to the scores
        low = torch.finfo(dtype).min
        masks = {k: torch.zeros((), dtype=dtype, device=device).masked_fill(~m, low) for k, m in masks.items()}
    return {k: m[None, None] for k, m in masks.items()}


def _hook(module, args, kwargs):
    if kwargs.get("attention_mask") is not None:
        return None  # the guard refuses a caller's mask on a packed row
    cu = kwargs.get("cu_seq_lens_q")
    pos = kwargs.get("position_ids")
    if cu is None and pos is not None and pos.dim() == 2 and pos.shape[0] == 1 and bool((pos[0, 1:] == 0).any()):
        cu = attention.segments_from_position_ids(pos)[0]
    if cu is None or cu.numel() <= 2:
        return None  # one sequence (generation): the model's own mask
    text = module.config.get_text_config()
    embeds = module.get_input_embeddings().weight
    masks = packed_masks(text, kwargs.get("token_type_ids"), cu.to(embeds.device), embeds.dtype,
                         text._attn_implementation)  # fmt: skip
    return args, {**kwargs, "attention_mask": masks}


_hook.packer_guard = True  # the probe's copy gets its own


def install(model: Any) -> list:
    """The mask hook on the base model of a family in ``FAMILIES`` (after the guard's hooks); handles."""
    if getattr(model.config, "model_type", None) not in FAMILIES:
        return []
    return [m.register_forward_pre_hook(_hook, with_kwargs=True) for m in model.modules()
            if type(m).__name__.endswith("Model") and hasattr(m, "set_attn_implementation")
            and m.config is model.config and "token_type_ids" in _params(m)]  # fmt: skip


def _params(module: Any) -> tuple:
    import inspect

    return tuple(inspect.signature(type(module).forward).parameters)
