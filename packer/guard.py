"""``prepare(model)``: switch a causal LM to packed attention only if packed rows stay exact, and stay on guard.

A model is accepted only when all of these hold (else ``ConfigError``, and the model is left exactly as
it was: attention implementation of every sub-config, config values, no hook):

1. **Structure**: a transformers causal decoder whose attention goes through ``AttentionInterface``,
   and whose layers all mix tokens by attention (``layer_types`` has no ``conv``, ``mamba``,
   ``linear_attention``, ...: such a mixer runs across the whole row, whatever the attention does).
2. **Config rules**, settings whose output depends on the row rather than the example, named in the
   message: RoPE types that pick frequencies from the longest position in the row (``dynamic``,
   ``longrope``), Llama 4's attention temperature tuning (scales queries by the offset in the *row*),
   and, for ``packer_varlen``, masks it does not implement (``attention_chunk_size``, Doge's dynamic
   ``keep_window_size`` mask).
3. **No path from one example to another**: in a packed probe row, the gradient of each example's
   outputs with respect to every *other* example's input embeddings is exactly zero. Structural, not
   a tolerance: any leak, however small on an untrained model (LFM2's convolution leaks 2e-5 at
   initialisation and 6.4 after 40 steps), gives a non-zero gradient.
4. **The model's own semantics**: each probe example, packed in one row as the loader yields it, gets
   the logits it gets *alone* through the model's eager attention (an independent reference: scaling,
   soft-capping, sinks, windows and chunks as the model's own code does them). The probe examples are
   longer than every window, chunk and position threshold the config declares.

After ``prepare`` a forward pre-hook stays on the model: a packed forward (``cu_seq_lens_*`` kwargs, or
``position_ids`` restarting inside a row) raises ``ConfigError`` if the attention implementation was
changed since (``set_attn_implementation``, ``config._attn_implementation = ...``), or, for the
implementations that find the packing from ``position_ids`` (sdpa, eager, flex), if a cache is used
(transformers then builds no packed mask). Unpacked forwards (generation) are left alone. The check costs
a few attribute reads per forward.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from . import attention
from .errors import ConfigError

# Implementations that see the packing only through the block-diagonal mask transformers builds from
# position_ids, which it skips when a cache is used.
MASK_FROM_POSITIONS = ("sdpa", "eager", "flex_attention")
# Layer types that mix tokens by attention; any other (conv, mamba, linear_attention, ...) is a mixer
# running across the row.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
# RoPE types whose frequencies depend on max(position_ids) + 1: in a row, the longest example's length.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
PROBE_MIN_LEN = 8

__all__ = ["prepare", "probe_tolerance"]


def probe_tolerance(dtype: torch.dtype) -> float:
    """The largest logit difference (relative to the largest logit) two correct paths may show.

    sqrt(eps): the packed and the reference path compute the same function through different kernels,
    so they differ by rounding only, which accumulates to a few eps per layer, far below half the
    mantissa (fp32: 3.5e-4; measured differences are ~1e-6 on the architecture sweep). A semantic
    error (wrong scale, a dropped window, chunk, soft-cap or sink, a leak) changes logits by 1e-2 to 1
    relative: above it. In bf16 (0.088) only large errors are resolved by logits; the exact gradient
    rule catches leaks in every dtype, and probing before casting to bf16 resolves the rest."""
    return math.sqrt(torch.finfo(dtype).eps)


def _configs(model: Any) -> Iterator[Any]:
    """The model's config and every sub-config (text, vision, ...), each once."""
    seen, todo = set(), [model.config]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        todo.extend(v for v in vars(c).values() if hasattr(v, "_attn_implementation_internal"))


def _text_config(model: Any) -> Any:
    c = model.config
    return c.get_text_config() if hasattr(c, "get_text_config") else c


def _refuse(model: Any, why: str) -> ConfigError:
    return ConfigError(
        f"{type(model).__name__}: packed rows would not be exact ({why}); use a decoder whose every layer "
        "is attention through transformers' AttentionInterface (Llama, Qwen2/3, Mistral, Gemma, ...) "
        "or train it on padded batches"
    )


def _rope_types(config: Any) -> set[str]:
    """Every rope_type named in rope_parameters / rope_scaling, per layer type too."""
    found, todo = set(), [getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)]
    while todo:
        p = todo.pop()
        if isinstance(p, dict):
            for key in ("rope_type", "type"):
                if isinstance(p.get(key), str):
                    found.add(p[key])
            todo.extend(v for v in p.values() if isinstance(v, dict))
    return found


def config_refusals(config: Any, implementation: str) -> list[str]:
    """Settings of a (text) config that make an example's output depend on its row; each names itself."""
    why = []
    mixers = sorted({t for t in getattr(config, "layer_types", None) or [] if t not in ATTENTION_LAYER_TYPES})
    if mixers:
        why.append(f"layer_types {mixers} mix tokens outside attention, across the whole row")
    for rope in sorted(_rope_types(config) & set(LENGTH_DEPENDENT_ROPE)):
        why.append(
            f"rope_type={rope!r} takes its frequencies from the longest example in the row (max position_ids), "
            "so an example changes beside a longer one"
        )
    nope = [i for i, r in enumerate(getattr(config, "no_rope_layers", None) or []) if not r]
    if getattr(config, "attn_temperature_tuning", False) and nope:
        why.append("attn_temperature_tuning scales queries by the token's offset in the row, not in its example")
    if implementation == attention.ATTN_IMPLEMENTATION:
        if getattr(config, "attention_chunk_size", None):
            why.append(f"attention_chunk_size={config.attention_chunk_size}: chunked attention is not implemented")
        if getattr(config, "keep_window_size", None):
            why.append("keep_window_size: a dynamic mask computed in the model, which packer_varlen cannot apply")
    return why


def _probe_lengths(config: Any) -> tuple[int, int]:
    """Two example lengths, both longer than every window, chunk and position threshold of the config."""
    limits = [PROBE_MIN_LEN]
    for name in ("sliding_window", "attention_chunk_size", "keep_window_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            limits.append(value)
    if getattr(config, "attn_temperature_tuning", False):
        limits.append(int(getattr(config, "floor_scale", 0) or 0))
    # original_max_position_embeddings is a threshold only for the RoPE types that switch at it
    # (dynamic, longrope: refused by config_refusals); llama3/yarn scale the same at every length, and
    # probing past their 8,192 would cost an 8K-token eager forward for nothing.
    params = [getattr(config, "rope_parameters", None) or {}]
    while params:
        p = params.pop()
        if isinstance(p, dict):
            if p.get("rope_type") in LENGTH_DEPENDENT_ROPE:
                limits.append(int(p.get("original_max_position_embeddings") or 0))
            params.extend(v for v in p.values() if isinstance(v, dict))
    n = max(limits) + 2
    return n + 3, n


def _snapshot(model: Any) -> list[tuple[Any, Any, dict]]:
    return [(c, c._attn_implementation_internal, c.to_dict()) for c in _configs(model)]


def _restore(model: Any, snapshot: list[tuple[Any, Any, dict]]) -> None:
    for config, impl, values in snapshot:
        config._attn_implementation_internal = impl
        for key in ("use_cache",):
            if key in values:
                setattr(config, key, values[key])


def _probe_rows(model: Any) -> tuple[list[torch.Tensor], dict]:
    config = _text_config(model)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    exs = [torch.randint(3, config.vocab_size, (n,), generator=gen).to(device) for n in _probe_lengths(config)]
    return exs, _row(exs)


def _row(exs: list[torch.Tensor]) -> dict:
    """One packed row, called as the loader's batches are."""
    lens = [len(e) for e in exs]
    device = exs[0].device
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    return dict(
        input_ids=torch.cat(exs).view(1, -1),
        position_ids=torch.cat([torch.arange(n, device=device) for n in lens]).view(1, -1),
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens),
    )  # fmt: skip


def _check_no_path_between_examples(model: Any, extra: dict) -> None:
    """Gradient of each example's outputs w.r.t. the other examples' input embeddings: exactly zero."""
    exs = [e[:PROBE_MIN_LEN + 1] for e in _probe_rows(model)[0]]  # short: only the boundary matters here
    batch = _row(exs)
    captured = []

    def grab(module, args, output):
        output = output.detach().requires_grad_(True)
        captured.append(output)
        return output

    handle = model.get_input_embeddings().register_forward_hook(grab)
    try:
        with torch.enable_grad():
            logits = model(**batch, **extra).logits[0].float()
            embeds = captured[0]
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(logits.device)
            bounds = batch["cu_seq_lens_q"].tolist()
            for i in range(len(exs)):
                out = (logits[bounds[i] : bounds[i + 1]] * weights[bounds[i] : bounds[i + 1]]).sum()
                (grad,) = torch.autograd.grad(out, embeds, retain_graph=True, allow_unused=True)
                if grad is None:
                    continue
                outside = torch.cat([grad[0, : bounds[i]], grad[0, bounds[i + 1] :]])
                if outside.abs().max().item() != 0:
                    raise _refuse(
                        model,
                        f"probe: example {i}'s outputs depend on the tokens of the other examples in its row "
                        f"(gradient {outside.abs().max().item():.3g}, must be exactly 0)",
                    )
    finally:
        handle.remove()


@torch.no_grad()
def _check_against_eager_alone(model: Any, implementation: str, extra: dict) -> None:
    """Each example packed must get the logits it gets alone through the model's eager attention."""
    exs, batch = _probe_rows(model)
    model.set_attn_implementation("eager")
    alone = [model(input_ids=e.view(1, -1), use_cache=False).logits[0].float() for e in exs]
    model.set_attn_implementation(implementation)
    before = attention.calls()
    packed = model(**batch, **extra).logits[0].float().split([len(e) for e in exs])
    if implementation == attention.ATTN_IMPLEMENTATION and attention.calls() == before:
        raise _refuse(model, "its forward never called the registered attention function")
    diff = max((p - a).abs().max().item() for p, a in zip(packed, alone, strict=True))
    scale = max(a.abs().max().item() for a in alone)
    tol = probe_tolerance(next(model.parameters()).dtype)
    if diff <= tol * scale:
        return
    raise _refuse(
        model,
        f"probe: an example packed in a row gets logits {diff:.3g} away from the ones it gets alone through "
        f"eager attention (tolerance {tol * scale:.2g}), with attn_implementation={implementation!r}",
    )


def _probe(model: Any, implementation: str) -> None:
    """Both probes, as the loader's batches are called; says when a cache is the cause."""
    try:
        _check_no_path_between_examples(model, {})
        _check_against_eager_alone(model, implementation, {})
    except ConfigError as e:
        if not (implementation in MASK_FROM_POSITIONS and _uses_cache(model, {})):
            raise
        try:  # the same probes without a cache: if they pass, the cache was the cause
            _check_no_path_between_examples(model, {"use_cache": False})
            _check_against_eager_alone(model, implementation, {"use_cache": False})
        except ConfigError:
            raise e from None
        raise ConfigError(
            f"{e}; with use_cache=True transformers builds no packed mask for {implementation!r}: "
            "set model.config.use_cache=False"
        ) from None


def _uses_cache(model: Any, kwargs: dict) -> bool:
    use = kwargs.get("use_cache")
    return bool(_text_config(model).use_cache if use is None else use) or kwargs.get("past_key_values") is not None


def _is_packed(kwargs: dict) -> bool:
    if kwargs.get("cu_seq_lens_q") is not None:
        return True
    pos = kwargs.get("position_ids")
    # a host sync, paid only when the setting has changed (see _guard)
    return pos is not None and pos.dim() == 2 and pos.shape[-1] > 1 and bool((pos[:, 1:] == 0).any())


def _guard(implementation: str):
    def hook(model, args, kwargs):
        now = model.config._attn_implementation
        changed = now != implementation
        cached = implementation in MASK_FROM_POSITIONS and _uses_cache(model, kwargs)
        if not (changed or cached) or not _is_packed(kwargs):
            return None
        what = (
            f"attn_implementation changed from {implementation!r} to {now!r}"
            if changed
            else "use_cache is on, so transformers builds no packed mask"
        )
        raise ConfigError(
            f"{type(model).__name__}: a packed row after prepare(), but {what}: its examples would attend to "
            f"each other; call packer.prepare(model) again (or set model.config.use_cache=False)"
        )

    return hook


def prepare(model: Any, *, implementation: str = attention.ATTN_IMPLEMENTATION, probe: bool = True) -> Any:
    """Switch a transformers causal LM to ``implementation`` if packed rows are exact on it; keep guard.

    ``implementation`` is ``"packer_varlen"`` (default) or a transformers one to vet instead (e.g.
    ``"flash_attention_2"``, which takes the loader's ``cu_seq_lens`` kwargs, or ``"sdpa"``, which
    builds a packed mask from ``position_ids`` only without a cache: ``config.use_cache=False``).
    ``probe=False`` skips the two probes (the structural and config rules still apply).

    Raises ``ConfigError`` naming the reason, and leaves the model exactly as it was, when any rule of
    the module docstring fails. Returns the model, with a forward pre-hook that raises if the setting is
    later changed so that a packed row would leak.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise _refuse(model, "not a transformers PreTrainedModel, its attention cannot be replaced")
    text = _text_config(model)
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_causal", True) is False:
        raise _refuse(model, "not a causal decoder")
    # No check of the model class's `_supports_attention_backend` flag: StableLM calls the interface
    # without setting it, and Falcon/GPT-Neo are exact with transformers' sdpa. transformers refuses a
    # custom implementation it cannot set, and the probes judge what the forward actually does.
    why = config_refusals(text, implementation)
    if why:
        raise _refuse(model, "; ".join(why))
    attention.register()
    snapshot = _snapshot(model)
    was_training = model.training
    handle = getattr(model, "_packer_guard", None)
    try:
        try:
            model.set_attn_implementation(implementation)
        except (ValueError, KeyError, ImportError) as e:
            raise _refuse(model, f"transformers would not set attn_implementation={implementation!r}: {e}") from e
        if config._attn_implementation != implementation:
            raise _refuse(model, f"transformers would not set attn_implementation={implementation!r}")
        if probe:
            model.eval()
            try:
                _probe(model, implementation)
            except ConfigError:
                raise
            except Exception as e:  # a forward that fails on a packed row cannot be vouched for
                raise _refuse(model, f"probe forward failed: {type(e).__name__}: {e}") from e
    except BaseException:
        _restore(model, snapshot)
        raise
    finally:
        model.train(was_training)
    if handle is not None:
        handle.remove()
    model._packer_guard = model.register_forward_pre_hook(_guard(implementation), with_kwargs=True)
    return model
