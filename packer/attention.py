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
rows; for padded batches (e.g. generation) switch the model back with ``set_attn_implementation``.

``prepare(model)`` switches a model to ``packer_varlen`` and refuses (``ConfigError``) a model on
which packed rows would leak across examples: one whose attention does not go through transformers'
``AttentionInterface`` (its own attention code would ignore the boundaries), one that is not a causal
decoder, or one that fails a probe: two short examples packed in one row must give the second one the
logits it gets alone.

Model families tried (tests/test_attention.py, tiny random configs, fp32, CPU): Llama, Qwen2,
Mistral (with a sliding window shorter than the examples). Refused: Mamba (no attention layers, its
recurrent state runs across the whole row) and a model whose attention ignores the interface.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from .errors import ConfigError

ATTN_IMPLEMENTATION = "packer_varlen"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "packed_attention",
    "register",
    "prepare",
    "backend_for",
    "segments_from_position_ids",
]

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
_calls = 0  # how many times packed_attention ran: prepare's probe checks the model routes through it


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


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
    return torch.cat(outs, dim=1).transpose(0, 1)


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
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise ConfigError(
            f"{type(module).__name__}: attention logit soft-capping / sinks are not supported by packer_varlen; "
            "use the model's flash_attention_2 implementation with the loader's cu_seq_lens kwargs instead"
        )
    if getattr(module, "is_causal", True) is False:
        raise ConfigError(f"{type(module).__name__}: non-causal attention cannot be packed by packer_varlen")
    bsz, _, t_q, _ = query.shape
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
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k),
            dropout_p=dropout, softmax_scale=scaling, causal=True,
            window_size=(window - 1, 0) if window else (-1, -1),
        )  # fmt: skip
    elif backend == "varlen_attn":
        out = _varlen_attn()(
            q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k),
            scale=scaling, window_size=(window - 1, 0) if window else (-1, 0),
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
    else:
        out = _sdpa_segments(query[0], key[0], value[0], cu_q, cu_k, scaling, dropout, window)
    return out.unsqueeze(0), None


def _gqa(query, key, value):
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return key, value


def register() -> None:
    """Register ``packed_attention`` with transformers as ``"packer_varlen"`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)


def _refuse(model: Any, why: str) -> ConfigError:
    name = type(model).__name__
    return ConfigError(
        f"{name}: packed rows would let examples attend to each other ({why}); "
        "use a decoder whose attention goes through transformers' AttentionInterface (Llama, Qwen2, Mistral, ...) "
        "or train it on padded batches"
    )


def prepare(model: Any, *, implementation: str = ATTN_IMPLEMENTATION, probe: bool = True) -> Any:
    """Switch a transformers causal LM to ``implementation`` and check it keeps packed examples apart.

    ``implementation`` is ``"packer_varlen"`` (default) or any transformers one to vet instead (e.g.
    ``"flash_attention_2"``, which takes the loader's ``cu_seq_lens`` kwargs, or ``"sdpa"``, which
    builds a packed mask from ``position_ids`` only when no cache is used: ``config.use_cache=False``).

    Raises ``ConfigError`` (and leaves the model's attention setting as it was) when the model does not
    route its attention through transformers' ``AttentionInterface``, is not a causal decoder, or, with
    ``probe``, when a probe row of two examples, called as the loader's batches are, gives the second
    one other logits than it gets alone. Returns the model.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise _refuse(model, "not a transformers PreTrainedModel, its attention cannot be replaced")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_causal", True) is False:
        raise _refuse(model, "not a causal decoder")
    if not getattr(model, "_supports_attention_backend", False):
        raise _refuse(
            model, "its attention does not go through AttentionInterface, so it ignores cu_seq_lens"
        )
    register()
    previous = config._attn_implementation
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, KeyError, ImportError) as e:
        raise _refuse(model, f"transformers would not set attn_implementation={implementation!r}: {e}") from e
    if config._attn_implementation != implementation:
        raise _refuse(model, f"transformers would not set attn_implementation={implementation!r}")
    if probe:
        try:
            _probe(model, check_calls=implementation == ATTN_IMPLEMENTATION)
        except ConfigError:
            model.set_attn_implementation(previous)
            raise
    return model


@torch.no_grad()
def _probe(model: Any, check_calls: bool) -> None:
    """Two examples in one row must give the second the logits it has alone; the function must run."""
    device = next(model.parameters()).device
    vocab = (
        model.config.get_text_config().vocab_size
        if hasattr(model.config, "get_text_config")
        else model.config.vocab_size
    )
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab, (1, 6), generator=gen)
    b = torch.randint(0, vocab, (1, 5), generator=gen)
    row = torch.cat([a, b], dim=1).to(device)
    pos = torch.cat([torch.arange(6), torch.arange(5)]).view(1, -1).to(device)
    cu = torch.tensor([0, 6, 11], dtype=torch.int32, device=device)
    was_training = model.training
    model.eval()
    try:
        before = _calls
        packed = model(
            input_ids=row,
            position_ids=pos,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=6,
            max_length_k=6,
        ).logits[0, 6:]
        if check_calls and _calls == before:
            raise _refuse(model, "its forward never called the registered attention function")
        alone = model(input_ids=b.to(device), use_cache=False).logits[0]
    finally:
        model.train(was_training)
    diff = (packed.float() - alone.float()).abs().max().item()
    scale = alone.float().abs().max().item() + 1.0
    tol = 1e-4 if packed.dtype == torch.float32 else 2e-2
    if not diff <= tol * scale:
        hint = (
            " (with use_cache=True transformers builds no packed mask)"
            if getattr(model.config, "use_cache", False)
            else ""
        )
        raise _refuse(
            model,
            f"probe: an example's logits change by {diff:.3g} when packed after another one with "
            f"attn_implementation={model.config._attn_implementation!r}{hint}",
        )
