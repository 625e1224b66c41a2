"""``prepare(model)``: switch a causal LM to packed attention only if packed rows stay exact, and stay on guard.

A model is accepted only when all of these hold (else ``ConfigError``, and the model is left exactly as
it was: attention implementation of every sub-config, config values, no hook):

1. **Structure**: a transformers causal decoder whose attention goes through ``AttentionInterface``,
   and whose other token mixers (``layer_types`` ``conv``, ``mamba``, ``linear_attention``, ...: run
   across the whole row, whatever the attention does) are ones ``mixers`` runs once per example (the
   per-segment path, installed on the probe copy and, once accepted, on the model); an unknown mixer is
   refused naming its class, indexed attention under ``packer_varlen`` and compressed attention by type.
2. **Config rules**, settings used by the model whose output depends on the row rather than the
   example, named in the message: RoPE types that pick frequencies from the longest position in the row
   (``dynamic``, ``longrope``) and Llama 4's attention temperature tuning (scales queries by the offset in
   the *row*). Everything else is judged by behaviour, not by a key's presence (a Llama config carrying an
   unused ``attention_chunk_size`` is exact and accepted; Llama 4's chunks are used, and the probe sees it).
3. **The probe**, on a float32 copy of the model (whatever its dtype: a window crossed by a few tokens
   hides under a bf16 tolerance) in train mode with dropout off (the mode it will be used in: a MoE's
   capacity limit may apply only in training), every sub-config on ``implementation``:

   - *the model's own semantics*: one row packs an example longer than every position threshold the
     config declares (windows, chunks, ``original_max_position_embeddings``, ``max_position_embeddings``
     where below ``max_tokens``) beside short ones below them, so that a behaviour picked from the *row*
     (PhiMoE's long/short ``mscale``, a length-dependent RoPE, a capacity limit) changes the short ones;
     each must get the logits it gets *alone* through the model's eager attention (an independent
     reference: scaling, soft-capping, sinks, windows and chunks as the model's own code does them);
   - *no path from one example to another*: on the examples' first ``PROBE_MIN_LEN + 1`` tokens, the
     gradient of each example's outputs with respect to every *other* example's input embeddings is
     exactly zero (structural, not a tolerance: LFM2's convolution leaks 2e-5 at initialisation and 6.4
     after 40 steps), and with respect to its own equals the gradient it gets alone.

   A model whose training forward draws random numbers beyond dropout (PhiMoE's sparsemixer) cannot be
   compared packed against alone in train mode; it is probed in eval mode. Cost: the model's
   parameters once more in float32, one eager forward of each example alone (the short ones are just
   below the smallest threshold) and one of the packed row (docs/training.md); ``max_tokens`` (the
   longest row you will train on) leaves out the thresholds no row can reach.

After ``prepare`` a forward pre-hook stays on every ``PreTrainedModel`` inside the model (the causal LM,
its base model, a composite's language model: each builds the mask for the layers it runs, and each can be
called with a batch). A packed forward (``cu_seq_lens_*`` kwargs, or ``position_ids`` restarting inside a
row) raises ``ConfigError`` if the attention implementation of any config or sub-config was changed since
(``set_attn_implementation``, ``config._attn_implementation = ...``), if a non-empty cache is passed
(``cache``/``past_key_values``: PEFT prefix tuning), if the row is longer than ``max_tokens``, or, for the implementations that
find the packing from ``position_ids`` (sdpa, eager, flex), if a cache is used (transformers then builds
no packed mask); and whatever implementation, if an ``attention_mask`` comes with the row, if
``cu_seq_lens`` come without ``position_ids`` (PEFT prompt tuning) or cover another length, or, on a
hybrid model, if a mixer was replaced, a context-parallel share arrives, or gradient checkpointing would
recompute a mixer out of the boundaries' reach (``_boundaries_lost``). Unpacked forwards (generation) are left alone. The check costs a few attribute reads per
forward and model.

A vision-language model (``prepare(model, processor=processor)``) has only its text model switched, its
vision tower left per image and without the row's keys, a probe with images (``vision_probe``), and the
row's images checked at every packed forward (``vision_guard``; Gemma 3's mask: ``vision_masks``).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError
from . import attention, mixers, prepared, vision_guard, vision_probe

# Implementations that see the packing only through the block-diagonal mask transformers builds from
# position_ids, which it skips when a cache is used.
MASK_FROM_POSITIONS = ("sdpa", "eager", "flex_attention")
# RoPE types whose frequencies depend on max(position_ids) + 1: in a row, the longest example's length.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Config values past which a model may behave differently (a window, a chunk, a RoPE switch point).
THRESHOLDS = ("sliding_window", "attention_chunk_size", "keep_window_size", "original_max_position_embeddings")
# Where no threshold is declared the examples are still this long, and the gradient probe keeps this many
# tokens of each (only the boundary matters there; the eager reference's memory grows with the square).
PROBE_MIN_LEN = 8
# The largest logit or gradient difference, relative to the largest value alone, two correct paths show
# in float32: sqrt(eps) = 3.5e-4. They compute the same function through different kernels and differ by
# rounding (~1e-6 measured on the architecture sweep); a semantic error (a wrong scale, a dropped window,
# chunk, soft-cap or sink, a row-dependent scale) changes them by 1e-2 to 1.
PROBE_TOLERANCE = math.sqrt(torch.finfo(torch.float32).eps)

__all__ = ["prepare", "PROBE_TOLERANCE"]
log = logging.getLogger("packer")


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
        f"{type(model).__name__}: packed rows would not be exact ({why}); use a decoder whose layers are "
        "attention through transformers' AttentionInterface (Llama, Qwen2/3, Mistral, Gemma, ...) or mixers packer "
        "runs per example (Qwen3.5, LFM2, Granite 4, Jamba, Mamba, MiniMax: docs/attention.md), "
        "or train it on padded batches"
    )


def _rope_dicts(config: Any) -> Iterator[dict]:
    """rope_parameters / rope_scaling and the dicts nested in them (per layer type)."""
    todo = [getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)]
    while todo:
        p = todo.pop()
        if isinstance(p, dict):
            yield p
            todo.extend(v for v in p.values() if isinstance(v, dict))


def config_refusals(config: Any, implementation: str) -> list[str]:
    """Settings of a (text) config that make an example's output depend on its row; each names itself."""
    why = []
    # layer_types that are not attention are the per-segment path's (mixers.refusals judges them on the model)
    ropes = {p.get(key) for p in _rope_dicts(config) for key in ("rope_type", "type")}
    for rope in sorted(ropes & set(LENGTH_DEPENDENT_ROPE)):
        why.append(
            f"rope_type={rope!r} takes its frequencies from the longest example in the row (max position_ids), "
            "so an example changes beside a longer one"
        )
    nope = [i for i, r in enumerate(getattr(config, "no_rope_layers", None) or []) if not r]
    if getattr(config, "attn_temperature_tuning", False) and nope:
        why.append("attn_temperature_tuning scales queries by the token's offset in the row, not in its example")
    return why


def probe_lengths(config: Any, max_tokens: int | None = None, extra: list[int] = ()) -> list[int]:
    """The probe row's example lengths: a short one, one past every threshold a row can reach, a short one.

    The short ones stay below the smallest threshold, so that whatever the model picks from the row's
    longest position (a scale, a frequency) differs between them alone and them packed beside the long one.
    ``extra``: the thresholds of the model's mixers (chunks, blocks, convolution widths: ``mixers.thresholds``)."""
    values = [getattr(config, name, None) for name in THRESHOLDS] + list(extra)
    values += [p.get("original_max_position_embeddings") for p in _rope_dicts(config)]
    if getattr(config, "attn_temperature_tuning", False):
        values.append(getattr(config, "floor_scale", None))
    if max_tokens is not None:  # positions in a row never reach the budget; below it, the table's end is one
        values.append(getattr(config, "max_position_embeddings", None))
    limits = {int(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool) and v > 0}
    if max_tokens is not None:
        limits = {t for t in limits if t < max_tokens}
    longest = max(limits, default=PROBE_MIN_LEN) + 3
    if max_tokens is not None:
        longest = min(longest, max_tokens)
    short = max(2, min(limits, default=PROBE_MIN_LEN) - 1)
    return [short, longest, max(2, short // 2)]


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


def _probe_copy(model: Any) -> Any:
    """A float32 copy in train mode with dropout off, without packer's hooks and parameter gradients."""
    probe = copy.deepcopy(model).float()
    mixers.uninstall_hooks(probe)
    prepared.unwatch(probe)  # a checkpoint's mark would refuse the probe's packed rows
    for m in probe.modules():
        for key in [k for k, h in m._forward_pre_hooks.items() if getattr(h, "packer_guard", False)]:
            del m._forward_pre_hooks[key]
            m._forward_pre_hooks_with_kwargs.pop(key, None)
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
    for obj in [*probe.modules(), *_configs(probe)]:  # dropout read from attributes at forward time
        for name, value in list(vars(obj).items()):
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                setattr(obj, name, 0.0)
    probe.requires_grad_(False)
    return probe.train()


def _forward(model: Any, batch: dict, seeds: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits, and with ``seeds`` (one a segment of the row) the gradient of each segment's
    sum(logits * weights) w.r.t. the input embeddings, the weights drawn from the segment's seed."""
    if seeds is None:
        with torch.no_grad():
            return model(**batch).logits[0].float(), None
    captured = []

    def grab(module, args, output):
        leaf = output.detach().requires_grad_(True)
        captured.append(leaf)
        return leaf.clone()  # not the leaf itself: CTRL scales its embeddings in place

    handle = model.get_input_embeddings().register_forward_hook(grab)
    try:
        with torch.enable_grad():
            logits = model(**batch).logits[0].float()
            cu = batch.get("cu_seq_lens_q")
            bounds = [0, logits.shape[0]] if cu is None else cu.tolist()
            grads = []
            for i, seed in enumerate(seeds):
                part = logits[bounds[i] : bounds[i + 1]]
                weights = torch.randn(part.shape, generator=torch.Generator().manual_seed(seed)).to(part.device)
                (grad,) = torch.autograd.grad((part * weights).sum(), captured[0], retain_graph=True, allow_unused=True)
                grads.append(torch.zeros_like(captured[0]) if grad is None else grad)
    finally:
        handle.remove()
    return logits.detach(), torch.stack(grads)


def _examples(model: Any, lengths: list[int]) -> list[torch.Tensor]:
    config = _text_config(model)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, config.vocab_size, (n,), generator=gen).to(device) for n in lengths]


def _compare(model: Any, implementation: str, exs: list[torch.Tensor], extra: dict, grads: bool) -> None:
    """Each example packed gets the logits (and gradients) it gets alone through eager attention."""
    lens = [len(e) for e in exs]
    settings = [(c, c._attn_implementation_internal) for c in _configs(model)]
    model.set_attn_implementation("eager")
    alone = [
        _forward(model, dict(input_ids=e.view(1, -1), use_cache=False), [i] if grads else None)
        for i, e in enumerate(exs)
    ]
    for c, impl in settings:  # back as they were (a vision tower keeps its own implementation)
        c._attn_implementation_internal = impl
    before = attention.calls()
    logits, grad = _forward(model, {**_row(exs), **extra}, list(range(len(exs))) if grads else None)
    bounds = [0, *itertools.accumulate(lens)]
    for i, (a_logits, a_grad) in enumerate(alone):
        if grad is not None and len(exs) > 1:  # the structural rule first: it names the cause
            row = grad[i, 0]
            outside = torch.cat([row[: bounds[i]], row[bounds[i + 1] :]]).abs().max().item()
            if outside != 0:
                raise _refuse(
                    model,
                    f"probe: example {i}'s outputs depend on the tokens of the other examples in its row "
                    f"(gradient {outside:.3g}, must be exactly 0)",
                )
        d = (logits[bounds[i] : bounds[i + 1]] - a_logits).abs().max().item()
        scale = a_logits.abs().max().item()
        if d > PROBE_TOLERANCE * scale:
            raise _refuse(
                model,
                f"probe: example {i} ({lens[i]} tokens, packed beside {sum(lens) - lens[i]}) gets logits {d:.3g} "
                f"away from the ones it gets alone through eager attention (tolerance {PROBE_TOLERANCE * scale:.2g}), "
                f"with attn_implementation={implementation!r}",
            )
        if grad is None:
            continue
        d = (grad[i, 0, bounds[i] : bounds[i + 1]] - a_grad[0, 0]).abs().max().item()
        scale = a_grad.abs().max().item()
        if d > PROBE_TOLERANCE * scale:
            raise _refuse(
                model,
                f"probe: example {i}'s gradient packed is {d:.3g} away from its gradient alone through eager "
                f"attention (tolerance {PROBE_TOLERANCE * scale:.2g}), with attn_implementation={implementation!r}",
            )
    attention_free = mixers.attention_free(model, _text_config(model))
    if implementation == attention.ATTN_IMPLEMENTATION and attention.calls() == before and not attention_free:
        raise _refuse(model, "its forward never called the registered attention function")


def _random_in_training(model: Any, batch: dict) -> bool:
    """Whether two train-mode forwards of one row differ with dropout off (random routing, jitter)."""
    with torch.no_grad():
        return not torch.equal(model(**batch).logits, model(**batch).logits)


def _probe(model: Any, implementation: str, max_tokens: int | None, processor: Any = None) -> None:
    """The probes on a float32 copy, as the loader's batches are called; says when a cache is the cause."""
    try:
        probe = _probe_copy(model)
    except Exception as e:  # e.g. quantized weights that cannot be cast
        raise _refuse(
            model, f"the probe runs on a float32 copy of the model, which failed: {type(e).__name__}: {e}; "
            "prepare(model, probe=False) skips the probe"
        ) from e
    try:
        probe.set_attn_implementation(vision_guard.implementation_for(probe, implementation))
    except (ValueError, KeyError, ImportError) as e:
        raise _refuse(model, f"transformers would not set attn_implementation={implementation!r}: {e}") from e
    if probe.config._attn_implementation != implementation:
        raise _refuse(model, f"transformers would not set attn_implementation={implementation!r}")
    mixers.install(probe)  # the per-segment path is what is probed (one segment alone runs the mixer as it is)
    vision_guard.install(probe)  # a vision-language model's hooks, as prepare will install them
    exs = _examples(probe, probe_lengths(_text_config(probe), max_tokens, mixers.thresholds(probe)))
    heads = [e[: PROBE_MIN_LEN + 1] for e in exs]
    # random draws show on any tokens: the short row, not the long one (quadratic in the eager reference)
    if _random_in_training(probe, {**_row(heads), "use_cache": False}):
        probe.eval()

    def both(extra: dict) -> None:
        _compare(probe, implementation, heads, extra, grads=True)
        _compare(probe, implementation, exs, extra, grads=False)
        if processor is not None:  # a vision-language model: packed rows with images (vision_probe)
            vision_probe.compare(probe, implementation, processor, PROBE_TOLERANCE, lambda why: _refuse(model, why))

    try:
        both({})
    except ConfigError as e:
        if not (implementation in MASK_FROM_POSITIONS and _uses_cache(_text_config(probe), {})):
            raise
        try:  # the same probes without a cache: if they pass, the cache was the cause
            both({"use_cache": False})
        except ConfigError:
            raise e from None
        raise ConfigError(
            f"{e}; with use_cache=True transformers builds no packed mask for {implementation!r}: "
            "set model.config.use_cache=False"
        ) from None


def _uses_cache(text_config: Any, kwargs: dict) -> bool:
    use = kwargs.get("use_cache")
    return bool(text_config.use_cache if use is None else use) or _cache(kwargs) is not None


def _cache(kwargs: dict) -> Any:
    """The cache a forward was given (``cache``; ``past_key_values`` before transformers 5.40)."""
    given = kwargs.get("cache")
    return kwargs.get("past_key_values") if given is None else given


def _cached_positions(past: Any) -> int:
    """The positions a cache holds (0: none, or a cache of only linear-attention / mamba states)."""
    try:
        return int(past.get_seq_length()) if past is not None and hasattr(past, "get_seq_length") else 0
    except ValueError:  # transformers: "can only be called on Attention layers" (a hybrid's fresh cache)
        return 0


def _is_packed(kwargs: dict) -> bool:
    if kwargs.get("cu_seq_lens_q") is not None:
        return True
    pos = kwargs.get("position_ids")
    # a host sync, paid only when something is amiss (see _guard)
    return pos is not None and pos.dim() == 2 and pos.shape[-1] > 1 and bool((pos[:, 1:] == 0).any())


def _row_length(args: tuple, kwargs: dict) -> int:
    x = kwargs.get("input_ids", args[0] if args else None)
    x = kwargs.get("inputs_embeds") if x is None else x
    return 0 if x is None else x.shape[1]


def _boundaries_lost(module: Any, kwargs: dict, found: list, row_length: int) -> str | None:
    """What, in a forward's own inputs, makes a packed row's boundaries no longer the examples' (None: nothing).

    Shapes and attributes only, no host sync (cu_seq_lens on the CPU are read: free)."""
    cu = kwargs.get("cu_seq_lens_q")
    mask = kwargs.get("attention_mask")
    if mask is not None and not vision_guard.outer_mask(module, mask):
        return ("an attention_mask is passed with it (sdpa and eager then build their mask from it, across the "
                "examples): drop the attention_mask column, the row's position_ids and cu_seq_lens carry its boundaries")
    if cu is not None and kwargs.get("position_ids") is None:
        return ("its cu_seq_lens come without position_ids (PEFT prompt tuning drops them and prepends virtual "
                "tokens to the whole row): pass the loader's batch as it is, with an adapter that leaves the tokens "
                "alone (LoRA, ...)")
    if cu is not None and cu.device.type == "cpu" and cu.numel() and row_length and int(cu[-1]) != row_length:
        return f"its cu_seq_lens cover {int(cu[-1])} tokens but the row has {row_length} (tokens added to the row)"
    if not found:
        return None
    moved = mixers.installed(found)
    if moved:
        return f"{moved}, so it is no longer run once per example"
    if any(k.startswith("cp_") for k in kwargs):
        return ("a context-parallel share of the row: its mixers carry a state from one rank's tokens to the next "
                "rank's, which the per-segment path cannot pass; train hybrid models without context parallelism")
    checkpointing = "is_activation_checkpointing" if hasattr(type(module), "is_activation_checkpointing") else (
        "is_gradient_checkpointing")
    if module.training and getattr(module, checkpointing, False) and torch.is_grad_enabled():
        blind = sorted({type(m).__name__ for _, _, m in found if not mixers.MIXERS[type(m).__name__]})
        if cu is None or blind:
            who = f"{', '.join(blind)} get no kwargs" if blind else "the batch has no cu_seq_lens kwargs"
            return (f"gradient checkpointing recomputes its mixers in the backward pass, where only cu_seq_lens "
                    f"kwargs reach them and {who}: turn gradient checkpointing off, or pass the loader's batch")
    return None


def _guard(model: Any, implementation: str, max_tokens: int | None, found: list | None = None):
    """The pre-hook: a packed forward raises if the setting that prepare() vetted no longer holds."""
    expected = [(c, c._attn_implementation) for c in _configs(model)]
    text = _text_config(model)
    found = found or []
    vision_model = vision_guard.is_vision_language(model)

    def hook(module, args, kwargs):
        changed = [(c, was) for c, was in expected if c._attn_implementation != was]
        past = _cache(kwargs)
        prefix = _cached_positions(past) > 0
        cached = implementation in MASK_FROM_POSITIONS and _uses_cache(text, kwargs)
        longer = max_tokens is not None and _row_length(args, kwargs) > max_tokens
        lost = _boundaries_lost(module, kwargs, found, _row_length(args, kwargs))
        packed = _is_packed(kwargs) or vision_guard.packed_3d(kwargs)
        lost = lost or (vision_model and packed and vision_guard.row_refusal(module, kwargs))
        if not (changed or prefix or cached or longer or lost) or not packed:
            return None
        if lost:
            what = lost
        elif changed:
            c, was = changed[0]
            what = f"{type(c).__name__}'s attn_implementation changed from {was!r} to {c._attn_implementation!r}"
        elif prefix:
            what = f"its cache holds {_cached_positions(past)} positions (a prefix, e.g. PEFT prefix tuning)"
        elif cached:
            what = "use_cache is on, so transformers builds no packed mask"
        else:
            what = f"the row has {_row_length(args, kwargs)} tokens, more than max_tokens={max_tokens} it was vetted for"
        raise ConfigError(
            f"{type(module).__name__}: a packed row after prepare(), but {what}: its examples would not be "
            "computed as alone; call packer.prepare(model) again (or set model.config.use_cache=False)"
        )

    hook.packer_guard = True
    return hook


def prepare(
    model: Any,
    *,
    implementation: str = attention.ATTN_IMPLEMENTATION,
    probe: bool = True,
    max_tokens: int | None = None,
    processor: Any = None,
) -> Any:
    """Switch a transformers causal LM to ``implementation`` if packed rows are exact on it; keep guard.

    ``implementation`` is ``"packer_varlen"`` (default) or a transformers one to vet instead (e.g.
    ``"flash_attention_2"``, which takes the loader's ``cu_seq_lens`` kwargs, or ``"sdpa"``, which
    builds a packed mask from ``position_ids`` only without a cache: ``config.use_cache=False``).
    ``max_tokens``: the longest row you will feed (the build's budget); thresholds a row cannot reach are
    not probed, and a longer packed row raises. ``probe=False`` skips the probes (the structural and
    config rules still apply). ``processor``: a vision-language model's own processor, which the probe
    makes its rows with images with (required with the probe on such a model; ``vision_probe``).

    Raises ``ConfigError`` naming the reason, and leaves the model exactly as it was, when any rule of
    the module docstring fails. Returns the model, with forward pre-hooks that raise if the setting is
    later changed so that a packed row would not be exact.
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
    why = config_refusals(text, implementation) + mixers.refusals(model, text, implementation)
    if probe and processor is None and vision_guard.is_vision_language(model):
        why.append("a vision-language model is probed with images made by its processor: "
                   "prepare(model, processor=processor)")
    if why:
        raise _refuse(model, "; ".join(why))
    attention.register()
    if probe:
        try:
            device = next(model.parameters()).device
            # the probe's random draws (routing in training) leave the caller's generators as they were
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                _probe(model, implementation, max_tokens, processor if vision_guard.is_vision_language(model) else None)
        except ConfigError:
            raise
        except Exception as e:  # a forward that fails on a packed row cannot be vouched for
            longest = max(probe_lengths(text, max_tokens))
            raise _refuse(
                model,
                f"probe forward failed: {type(e).__name__}: {e} (its longest example has {longest} tokens; "
                "max_tokens=your rows' budget leaves out the thresholds they cannot reach)",
            ) from e
    snapshot = [(c, c._attn_implementation_internal) for c in _configs(model)]
    try:
        model.set_attn_implementation(vision_guard.implementation_for(model, implementation))
        if config._attn_implementation != implementation:
            raise _refuse(model, f"transformers would not set attn_implementation={implementation!r}")
    except (ValueError, KeyError, ImportError, ConfigError) as e:
        for c, impl in snapshot:
            c._attn_implementation_internal = impl
        raise e if isinstance(e, ConfigError) else _refuse(
            model, f"transformers would not set attn_implementation={implementation!r}: {e}"
        ) from e
    for handle in getattr(model, "_packer_guard", None) or []:
        handle.remove()
    found = mixers.install(model)  # before the guard's hooks: the row's boundaries are pushed first
    model.packer_path = "per-segment" if found else "attention"
    if found:
        names = sorted({type(m).__name__ for _, _, m in found})
        log.info("prepare: %s: %d mixers (%s) run once per example of a packed row (the per-segment path)",
                 type(model).__name__, len(found), ", ".join(names))
    hook = _guard(model, implementation, max_tokens, found)
    model._packer_guard = [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in model.modules()
        if hasattr(m, "config") and hasattr(m, "set_attn_implementation")
    ] + vision_guard.install(model)
    prepared.mark(model, implementation, max_tokens, model.packer_path)  # save_pretrained keeps it: prepared.py
    return model
