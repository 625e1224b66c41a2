"""Attention that respects the example boundaries of a packed row, registered with transformers.

A packed row is ``[1, T]`` holding several examples; attention is correct only if every token sees
the earlier tokens of *its own* example and nothing else (block-diagonal causal)::

    row   a a a b b c c c c         allowed (q ↓, k →):   a: ■□□    b: ■□    c: ■□□□
                                                             ■■□       ■■       ■■□□
                                                             ■■■                ■■■□ ...

``packer_varlen`` (registered by ``register()``, selected by ``prepare(model)``) takes the boundaries
from the ``cu_seq_lens_q/k`` and ``max_length_q/k`` kwargs the loader yields (or, without them, from
``position_ids``: a segment starts where the position is 0) and computes, in order of preference:

1. ``flash_attn.flash_attn_varlen_func``: CUDA, flash-attn installed, fp16/bf16;
2. ``torch.nn.attention.varlen.varlen_attn``: CUDA, torch ≥ 2.9, fp16/bf16, no dropout;
3. one ``scaled_dot_product_attention(is_causal=True)`` call per segment: any device and dtype (the
   CPU path). Cost: one kernel call per segment and layer, no T×T mask.

Sliding windows (Mistral/Qwen2 ``sliding_window``) are honoured by every backend. The function does
not see 2-D padding masks (transformers builds none for custom implementations): it is for packed
rows and unpadded sequences. Generation's cached decode (queries that are the last of longer keys) is
causal attention aligned with the keys' end, one SDPA call, on an unpacked forward only (a packed row
with a cache is refused); for padded batches switch the model back with ``set_attn_implementation``.

``packer.prepare(model)`` (``packer.training.guard``, which imports this module; this one imports nothing of
packer's but its errors) switches a model to ``packer_varlen`` only if packed rows are exact on it,
judged against the model's own eager attention, and keeps a guard on it.

Refused inside the function (``ConfigError``), rather than computed wrongly: attention logit
soft-capping and attention sinks (``s_aux``), non-causal modules, keys that do not cover exactly a packed
row's tokens (a cache or prefix, e.g. PEFT prefix tuning: ``cu_seq_lens_k`` indexes the row only), and a
cached decode of several sequences (their padding mask is not seen). The
kernel call paths (1, 2) are tested on CPU against reference implementations of the kernels' documented
semantics (tests/test_varlen_kernels.py), and against the real kernels where CUDA is present.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError

ATTN_IMPLEMENTATION = "packer_varlen"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "packed_attention",
    "register",
    "calls",
    "backend_for",
    "segments_from_position_ids",
    "current_row",
    "enter_row",
    "leave_row",
]

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
_calls = 0  # how many times packed_attention ran: prepare's probe checks the model routes through it
# The boundaries (cu_seqlens) of the row the outermost prepared model is running, for the layers that
# receive no kwargs: Mamba1 mixers, GraniteMoeHybrid's position-free attention. A stack per thread:
# a prepared model inside another (a composite's language model) inherits the outer row's.
_rows = threading.local()


def enter_row(owner: object, cu: torch.Tensor | None) -> None:
    """Push the row ``owner``'s forward runs (``cu``: its cu_seqlens, empty: unpacked; None: inherit)."""
    stack = _rows.__dict__.setdefault("stack", [])
    stack.append((id(owner), cu if cu is not None or not stack else stack[-1][1]))


def leave_row(owner: object) -> None:
    """Pop ``owner``'s row (only its own: a forward refused before its push pops nothing)."""
    stack = _rows.__dict__.get("stack")
    if stack and stack[-1][0] == id(owner):
        stack.pop()


def current_row() -> torch.Tensor | None:
    """cu_seqlens of the row being run by a prepared model's forward (None: outside one; empty: unpacked)."""
    stack = _rows.__dict__.get("stack")
    return stack[-1][1] if stack else None


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _flash_attn_varlen_func():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def backend_for(query: torch.Tensor, dropout: float = 0.0) -> str:
    """The backend ``packed_attention`` uses for a query tensor: 'flash_attn', 'varlen_attn' or 'sdpa'."""
    half = query.dtype in (torch.float16, torch.bfloat16)
    if query.is_cuda and half and _HAS_FLASH_ATTN:
        return "flash_attn"
    if query.is_cuda and half and dropout == 0.0 and _varlen_attn() is not None:
        return "varlen_attn"
    return "sdpa"


def segments_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32) and the longest segment of a ``[1, T]`` row, from where positions restart at 0.

    A host sync on CUDA; the loader's ``cu_seq_lens_*``/``max_length_*`` kwargs avoid it."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError(
            "position_ids of a packed row must start at 0 (a segment starts where the position is 0)"
        )
    total = torch.tensor([pos.numel()], device=pos.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _sdpa_segments(q, k, v, cu_q, cu_k, scaling, dropout, window):
    """q/k/v: [H, T, D]; one causal SDPA call per segment. Returns [T, H, D]."""
    bounds_q = cu_q.tolist()
    bounds_k = cu_k.tolist()
    if bounds_q[0] != 0 or bounds_q[-1] != q.shape[1] or bounds_k[0] != 0 or bounds_k[-1] != k.shape[1]:
        raise ValueError(
            f"cu_seq_lens_q {bounds_q} / cu_seq_lens_k {bounds_k} do not span the row's {q.shape[1]} queries "
            f"and {k.shape[1]} keys"
        )
    if k.shape[0] != q.shape[0]:  # grouped-query attention
        rep = q.shape[0] // k.shape[0]
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
    outs = []
    for (q0, q1), (k0, k1) in zip(
        zip(bounds_q[:-1], bounds_q[1:], strict=True),
        zip(bounds_k[:-1], bounds_k[1:], strict=True),
        strict=True,
    ):
        qs, ks, vs = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1]
        if window is not None and k1 - k0 > window:
            i = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
            j = torch.arange(k1 - k0, device=q.device)[None, :]
            mask = (j <= i) & (j > i - window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout, scale=scaling)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, dropout_p=dropout, scale=scaling)
        outs.append(o)
    return torch.cat(outs, dim=1).transpose(0, 1).contiguous()


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query/key/value ``[1, H, T, D]`` → output ``[1, T, H, D]``.

    Boundaries from ``cu_seq_lens_q/k`` (+ ``max_length_q/k``), else from ``position_ids``; a batch of
    several rows without either is treated as unpadded causal sequences."""
    global _calls
    _calls += 1
    _refuse_unsupported(module, softcap, kwargs)
    bsz, _, t_q, _ = query.shape
    if key.shape[2] != t_q:  # shapes only: no host sync on a row
        return _cached_attention(module, query, key, value, dropout, scaling, sliding_window,
                                 cu_seq_lens_q, position_ids), None  # fmt: skip
    if cu_seq_lens_q is None and bsz == 1 and position_ids is None:
        cu_seq_lens_q, max_length_q = _from_row(module, t_q)
    if cu_seq_lens_q is None:
        if position_ids is not None and bsz == 1 and position_ids.shape[-1] == t_q:
            cu_seq_lens_q, max_length_q = segments_from_position_ids(position_ids)
        else:  # plain causal rows, no packing information
            cu_seq_lens_q = torch.tensor([0, t_q], dtype=torch.int32, device=query.device)
            max_length_q = t_q
            if bsz > 1:
                out = F.scaled_dot_product_attention(
                    query, *_gqa(query, key, value), is_causal=True, dropout_p=dropout, scale=scaling
                )
                return out.transpose(1, 2).contiguous(), None
        cu_seq_lens_k, max_length_k = cu_seq_lens_q, max_length_q
    if cu_seq_lens_k is None:
        cu_seq_lens_k, max_length_k = cu_seq_lens_q, max_length_q
    if bsz != 1:
        raise ValueError(f"packed rows have batch size 1 (one row is the batch), got {bsz}")
    cu_q = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    cu_k = cu_seq_lens_k.to(device=query.device, dtype=torch.int32)
    dropout = dropout if module.training else 0.0
    window = sliding_window if sliding_window and sliding_window > 0 else None
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
    backend = backend_for(query, dropout)
    if backend == "flash_attn":
        # window_size=(left, right): keys i-left .. i+right; transformers' sliding_window W lets a token
        # see itself and the W-1 before it, so left = W-1; causal=True makes right 0.
        out = _flash_attn_varlen_func()(
            q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k),
            dropout_p=dropout, softmax_scale=scaling, causal=True,
            window_size=(window - 1, 0) if window else (-1, -1),
        )  # fmt: skip
    elif backend == "varlen_attn":
        # no causal flag here: causal is window_size (-1, 0), a sliding window (W-1, 0)
        out = _varlen_attn()(
            q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k),
            scale=scaling, window_size=(window - 1, 0) if window else (-1, 0),
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
    else:
        out = _sdpa_segments(query[0], key[0], value[0], cu_q, cu_k, scaling, dropout, window)
    # contiguous: some models (JetMoe, AFMoE, Dory) `.view` the output, which a transposed tensor refuses
    return out.unsqueeze(0).contiguous(), None


def _cached_attention(module, query, key, value, dropout, scaling, sliding_window, cu_seq_lens_q, position_ids):
    """Queries that are the last of longer keys (a cache: generation's decode steps): causal attention of
    each sequence of the batch, the queries aligned with the keys' end. Refused on a packed row, whose keys
    would cover a prefix no example has (PEFT prefix tuning)."""
    t_q, t_k = query.shape[2], key.shape[2]
    # a decode step (one query) cannot be a packed row; longer queries are judged by their positions
    packed = cu_seq_lens_q is not None or _row_is_packed()
    if not packed and t_q > 1 and position_ids is not None and position_ids.shape[-1] == t_q:
        packed = bool((position_ids.reshape(-1, t_q)[:, 1:] == 0).any())
    if packed or t_k < t_q:
        raise ConfigError(
            f"{type(module).__name__}: packer_varlen attends within the row only, but the keys cover {t_k} "
            f"positions and the queries {t_q} (a past_key_values cache or prefix, e.g. PEFT prefix tuning); "
            "pass no cache with packed rows (use_cache=False)"
        )
    if query.shape[0] != 1:  # transformers builds no mask for a custom implementation: padding would be attended
        raise ConfigError(
            f"{type(module).__name__}: packer_varlen generates one sequence at a time; it does not see the "
            f"attention_mask of a batch of {query.shape[0]} (a padded prompt would attend to its padding): for "
            "batched generation call model.set_attn_implementation('sdpa'), and packer.prepare(model) again to train"
        )
    # query i sits at key position t_k - t_q + i: it sees the keys up to it (and, with a window, the W-1 before)
    i = torch.arange(t_q, device=query.device)[:, None] + (t_k - t_q)
    j = torch.arange(t_k, device=query.device)[None, :]
    mask = j <= i
    if sliding_window is not None and sliding_window > 0:
        mask = mask & (j > i - sliding_window)
    key, value = _gqa(query, key, value)
    dropout = dropout if module.training else 0.0
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


def _row_is_packed() -> bool:
    row = current_row()
    return row is not None and row.numel() > 2


def _refuse_unsupported(module: torch.nn.Module, softcap: float | None, kwargs: dict) -> None:
    """What packer_varlen does not compute: soft-capping, sinks, an additive position bias, non-causal."""
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise ConfigError(
            f"{type(module).__name__}: attention logit soft-capping / sinks are not supported by packer_varlen; "
            "use the model's flash_attention_2 implementation with the loader's cu_seq_lens kwargs instead"
        )
    if kwargs.get("position_bias") is not None:
        raise ConfigError(
            f"{type(module).__name__}: an additive position bias (Inkling's relative logits, computed from the row's "
            "offsets) is not supported by packer_varlen"
        )
    if getattr(module, "is_causal", True) is False:
        raise ConfigError(f"{type(module).__name__}: non-causal attention cannot be packed by packer_varlen")


def _from_row(module: torch.nn.Module, t_q: int) -> tuple[torch.Tensor | None, int | None]:
    """The boundaries of the row a prepared model runs, for a layer that gets no boundary kwargs and no
    positions (GraniteMoeHybrid's attention); (None, None) outside one or on an unpacked row."""
    row = current_row()
    if row is None or row.numel() <= 2:
        return None, None
    if int(row[-1]) != t_q:
        raise ConfigError(
            f"{type(module).__name__}: the row's cu_seq_lens cover {int(row[-1])} tokens, the attention {t_q}; "
            "pass the loader's batch as it is"
        )
    return row, int((row[1:] - row[:-1]).max())


def _gqa(query, key, value):
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return key, value


def register() -> None:
    """Register ``packed_attention`` with transformers as ``"packer_varlen"`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)


def calls() -> int:
    """How many times ``packed_attention`` ran (prepare's probe checks the model routes through it)."""
    return _calls

