"""The per-segment path: the non-attention mixers of hybrid models run once per example of a packed row.

A linear-attention, state-space or convolution mixer (GatedDeltaNet, Mamba1/2, a short convolution,
lightning attention, KDA) carries a state along the row: in a packed row each example would start from
the previous example's state. transformers' torch fallbacks ignore the boundaries, and the kernels
receive only some of them (transformers #46093). So ``install(model)`` replaces the ``forward`` of
every mixer packer knows (by class name, ``MIXERS``) with one that, on a packed row, calls the
module's own forward once per segment on the slices of its inputs and concatenates the outputs::

    row     a a a b b c c c c      forward(a a a) | forward(b b) | forward(c c c c)  →  concatenated

The model's code runs unchanged (no copy of it); whatever kernel it uses sees one example at a time, so
the result is exact whether fla, causal-conv1d or mamba-ssm are installed or not (the kernel path, where
the kernels take ``cu_seqlens``/``seq_idx`` themselves, is not taken: it cannot be checked on CPU;
``benchmarks/gpu_mixers_check.py`` compares it where the kernels are). Cost: one call of the mixer per
segment and layer instead of one per row (``benchmarks/bench_mixers.py``).

The boundaries come from the call's own ``cu_seq_lens_q`` when the decoder layer passes its kwargs on,
else from the row the prepared model is running (``attention.current_row``, pushed by ``install``'s
pre-hook on every ``PreTrainedModel``): Mamba1 mixers are called with no kwargs. A call with a cache
(generation) or with one segment runs as it is; a packed row with a cache is refused. A mixer class
packer does not know, in a layer that is not attention, is refused by ``refusals`` naming its class.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
from typing import Any

import torch

from ..errors import ConfigError
from . import attention

# class name -> whether its decoder layer passes the forward's kwargs on (then cu_seq_lens reach it
# again when gradient checkpointing recomputes it in the backward pass; the row context does not).
MIXERS = {
    # GatedDeltaNet (linear attention, a short convolution in front)
    "Qwen3NextGatedDeltaNet": True, "Qwen3_5GatedDeltaNet": True, "Qwen3_5MoeGatedDeltaNet": True,
    "OlmoHybridGatedDeltaNet": True, "LaraMiniGatedDeltaNet": True,
    # Kimi delta attention (Bailing hybrid)
    "BailingHybridDeltaAttention": True, "KimiLinearDeltaAttention": True,
    # short convolutions
    "Lfm2ShortConv": True, "Lfm3ShortConv": True, "Lfm2MoeShortConv": True, "InklingShortConvolution": False,
    # Mamba2
    "GraniteMoeHybridMambaLayer": True, "BambaMixer": True, "NemotronHMamba2Mixer": True, "FalconH1Mixer": True,
    "Zamba2MambaMixer": True, "Mamba2Mixer": True,
    # Mamba1: called with no kwargs
    "MambaMixer": False, "FalconMambaMixer": False, "JambaMambaMixer": False, "ZambaMambaMixer": False,
    # lightning attention (MiniMax)
    "MiniMaxLightningAttention": True,
}  # fmt: skip
# Mixers returning (output, state): the state of the row's last block, which their decoder layer drops
# (``hidden_states, _ = self.self_attn(...)``); a packed call returns None in its place.
STATE_DROPPED = {"MiniMaxLightningAttention"}
# A module in a decoder layer whose class name says it mixes tokens outside attention; refused unless in MIXERS.
LOOKS_LIKE_A_MIXER = re.compile(r"Mamba|Mixer|ShortConv|Convolution|DeltaNet|DeltaAttention|Lightning|Recurrent|Rglru"
                                r"|Lstm|Rwkv|Compressor", re.IGNORECASE)  # fmt: skip
# Layer types that mix tokens by attention only; any other (conv, mamba, linear_attention, ...) needs a mixer here
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
# Indexed / compressed attention: keys chosen or pooled by the model from its mask (deepseek_v32, glm_moe_dsa)
INDEXED_LAYER_TYPES = {"indexed_attention"}
COMPRESSED_LAYER_TYPES = {"compressed_sparse_attention", "heavily_compressed_attention"}
# kwargs that describe the whole row: not passed to a segment's call (each segment is alone)
ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Attribute names of a mixer past whose value its computation changes (chunks, blocks, a window).
THRESHOLD_ATTRS = ("chunk_size", "block_size", "conv_kernel_size", "L_cache", "conv_kernel", "d_conv")

__all__ = ["MIXERS", "install", "installed", "refusals", "thresholds", "mixer_modules", "attention_free"]


def _layers(model: Any, num_layers: int | None) -> list[torch.nn.Module]:
    """The text decoder's layers: the ModuleList of ``num_hidden_layers`` modules (not a vision tower's)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for root in (base, model):
        for m in root.modules():
            if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers:
                return list(m)
    return []


def mixer_modules(model: Any) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, module) of every known mixer in the model."""
    found = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None and type(child).__name__ in MIXERS:
                found.append((parent, name, child))
    return found


def refusals(model: Any, text_config: Any, implementation: str) -> list[str]:
    """Why the per-segment path cannot make this model's packed rows exact (empty: it can)."""
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    n = getattr(text_config, "num_hidden_layers", None)
    why = []
    indexed = sorted(set(layer_types) & INDEXED_LAYER_TYPES)
    if indexed and implementation not in ("sdpa", "eager"):
        why.append(
            f"layer_types {indexed}: the indexer picks each token's keys through the mask transformers builds "
            "only for sdpa/eager (from position_ids); prepare(model, implementation='sdpa') with "
            "config.use_cache=False vets it instead"
        )
    compressed = sorted(set(layer_types) & COMPRESSED_LAYER_TYPES)
    if compressed:
        why.append(f"layer_types {compressed} pool blocks of consecutive tokens of the row into compressed keys")
    for i, layer in enumerate(_layers(model, n)):
        unknown = sorted({type(m).__name__ for m in layer.modules() if _unknown_mixer(m)})
        if unknown:
            why.append(f"layer {i} has a token mixer packer does not know ({', '.join(unknown)})")
            break
        kind = layer_types[i] if i < len(layer_types) else None
        plain = kind is None or kind in ATTENTION_LAYER_TYPES or kind in INDEXED_LAYER_TYPES | COMPRESSED_LAYER_TYPES
        if not plain and not any(type(m).__name__ in MIXERS for m in layer.modules()):
            children = ", ".join(sorted({type(c).__name__ for c in layer.children()}))
            why.append(f"layer {i} (layer_types {kind!r}) has no mixer packer knows among {children}")
            break
    return why


def _unknown_mixer(m: torch.nn.Module) -> bool:
    """A transformers module named like a token mixer, neither known nor holding a known one (a Block, a Layer)."""
    name = type(m).__name__
    return (type(m).__module__.startswith("transformers.models.") and bool(LOOKS_LIKE_A_MIXER.search(name))
            and "Norm" not in name and not any(type(s).__name__ in MIXERS for s in m.modules()))  # fmt: skip


def attention_free(model: Any, text_config: Any) -> bool:
    """Whether the model has no attention layer (Mamba, Falcon-Mamba): it never calls packer_varlen."""
    layer_types = set(getattr(text_config, "layer_types", None) or [])
    return bool(mixer_modules(model)) and bool(layer_types) and not layer_types & (
        ATTENTION_LAYER_TYPES | INDEXED_LAYER_TYPES | COMPRESSED_LAYER_TYPES | {"hybrid", "hybrid_sliding"}
    )


def thresholds(model: Any) -> list[int]:
    """The lengths past which a known mixer computes differently: its chunks, blocks, convolution widths."""
    found = set()
    for _, _, m in mixer_modules(model):
        for name in THRESHOLD_ATTRS:
            v = getattr(m, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                found.add(v)
        for sub in m.modules():
            if isinstance(sub, torch.nn.Conv1d):
                found.add(int(sub.kernel_size[0]))
        # the chunked delta rule's chunk size is a default of the model module's function, not a config value
        module = sys.modules.get(type(m).__module__)
        for fn_name in ("torch_chunk_gated_delta_rule", "torch_chunk_kda", "chunk_gated_delta_rule"):
            fn = getattr(module, fn_name, None)
            if callable(fn):
                try:
                    default = inspect.signature(fn).parameters.get("chunk_size")
                except (TypeError, ValueError):
                    default = None
                if default is not None and isinstance(default.default, int):
                    found.add(default.default)
    return sorted(found)


def _slice(value: Any, a: int, b: int, t: int) -> Any:
    """One segment's share of a kwarg that spans the row (dim 1 of length t; a 4-D mask's diagonal block)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 4 and value.shape[-1] == t and value.shape[-2] == t:
            return value[..., a:b, a:b]
        if value.dim() >= 2 and value.shape[1] == t:
            return value[:, a:b]
        return value
    if isinstance(value, tuple):  # position_embeddings (cos, sin)
        return tuple(_slice(v, a, b, t) for v in value)
    return value


def _bounds(kwargs: dict) -> torch.Tensor | None:
    cu = kwargs.get("cu_seq_lens_q")
    return cu if cu is not None else attention.current_row()


_last: list = [None, None]  # the last row's cu_seqlens and its list: one host read a row, not one a layer


def _as_list(cu: torch.Tensor) -> list[int]:
    if _last[0] is not cu:
        _last[:] = [cu, [int(x) for x in cu.tolist()]]
    return _last[1]


def _segmented_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The mixer's own forward, once per segment of a packed row (installed as the instance's forward)."""
    inner = self.__dict__.get("_packer_inner_forward")
    run = inner if inner is not None else types.MethodType(type(self).forward, self)
    cu = _bounds(kwargs)
    if cu is None or cu.numel() <= 2:
        return run(*args, **kwargs)
    hidden = args[0] if args else kwargs.pop("hidden_states")
    rest = args[1:]
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("cache_params")))
    bounds = _as_list(cu)
    t = hidden.shape[1]
    if cache is not None:
        if not _fresh(cache, getattr(self, "layer_idx", None)):
            raise ConfigError(
                f"{type(self).__name__}: a packed row with a cache that holds a state: the state would run into the "
                "row's first example only; pass no cache (use_cache=False) with packed rows"
            )
        # a fresh cache (use_cache on in training): the row's final state is no example's, so none is kept
        for key in ("cache", "past_key_values", "cache_params"):
            if key in kwargs:
                kwargs[key] = None
    if hidden.shape[0] != 1 or bounds[-1] != t or bounds[0] != 0:
        raise ConfigError(
            f"{type(self).__name__}: the row's cu_seq_lens {bounds[:4]}... cover {bounds[-1]} tokens but the mixer got "
            f"{tuple(hidden.shape[:2])} (a context-parallel share, or tokens added to the row): packed rows of "
            "hybrid models are run whole, one row per batch; pass the loader's batch as it is"
        )
    seg_kwargs = {k: v for k, v in kwargs.items() if k not in ROW_KEYS}
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b > a:
            outs.append(run(hidden[:, a:b], *(_slice(x, a, b, t) for x in rest),
                            **{k: _slice(v, a, b, t) for k, v in seg_kwargs.items()}))  # fmt: skip
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=1)
    if isinstance(outs[0], tuple) and (type(self).__name__ in STATE_DROPPED or all(x is None for o in outs for x in o[1:])):
        return (torch.cat([o[0] for o in outs], dim=1), *(None for _ in outs[0][1:]))
    raise ConfigError(f"{type(self).__name__}: its forward returns {type(outs[0]).__name__}, which packer cannot join")


def _fresh(cache: Any, layer_idx: int | None) -> bool:
    """Whether ``cache`` holds no state yet for the mixer of layer ``layer_idx`` (the forward created it)."""
    if layer_idx is None:
        return False
    answered = False
    for name in ("get_conv_state", "get_recurrent_state", "get_linear_cache"):
        try:  # a getter for another layer kind raises (MiniMax's cache has conv getters for no layer)
            state = getattr(cache, name)(layer_idx)
        except (IndexError, KeyError, ValueError, AttributeError, TypeError):
            continue
        if state is not None:
            return False
        answered = True
    return answered


def _wrapped(module: torch.nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _segmented_forward


def _row_pre_hook(module, args, kwargs):
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        pos = kwargs.get("position_ids")
        if pos is not None and pos.dim() == 2 and pos.shape[0] == 1 and pos.shape[1] > 1 and bool((pos[0, 1:] == 0).any()):
            cu = attention.segments_from_position_ids(pos)[0]
        elif attention.current_row() is None:  # an unpacked forward at the top: say so to the layers inside
            cu = torch.zeros(0, dtype=torch.int32)
    attention.enter_row(module, cu)


def _row_post_hook(module, args, kwargs, output):
    attention.leave_row(module)


_row_pre_hook.packer_rows = True
_row_post_hook.packer_rows = True


def install(model: Any) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Run every known mixer per segment on packed rows, and keep each row's boundaries where they reach.

    Idempotent. Returns the (parent, attribute, mixer) triples, which the guard checks at every forward."""
    found = mixer_modules(model)
    for _, _, m in found:
        if _wrapped(m):
            continue
        if "forward" in m.__dict__:  # replaced on the instance before (accelerate's hooks): run that one
            m._packer_inner_forward = m.__dict__["forward"]
        m.forward = types.MethodType(_segmented_forward, m)
    if found:
        for m in model.modules():
            model_like = hasattr(m, "config") and hasattr(m, "set_attn_implementation")
            if model_like and not any(getattr(h, "packer_rows", False) for h in m._forward_pre_hooks.values()):
                m.register_forward_pre_hook(_row_pre_hook, with_kwargs=True)
                m.register_forward_hook(_row_post_hook, with_kwargs=True, always_call=True)
    return found


def installed(found: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> str | None:
    """None if every mixer ``install`` wrapped is still in place and wrapped; else what changed."""
    for parent, name, m in found:
        now = parent._modules.get(name)
        if now is not m:
            return f"{type(parent).__name__}.{name} was replaced by {type(now).__name__} after prepare()"
        if not _wrapped(m):
            return f"{type(m).__name__}'s forward was replaced after prepare()"
    return None


def uninstall_hooks(model: Any) -> None:
    """Remove the row hooks (the probe copy gets fresh ones)."""
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, h in hooks.items() if getattr(h, "packer_rows", False)]:
                del hooks[key]
                m._forward_pre_hooks_with_kwargs.pop(key, None)
                m._forward_hooks_with_kwargs.pop(key, None)
                getattr(m, "_forward_hooks_always_called", {}).pop(key, None)
