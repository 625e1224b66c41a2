"""Every causal-LM type of the installed transformers through ``packer.prepare``: refused, or exact.

    python benchmarks/sweep_architectures.py [TYPE ...] [--markdown]
    python benchmarks/sweep_architectures.py --vlm [TYPE ...] [--markdown]   # image-text-to-text types

For each model type in transformers' causal-LM mapping, and each of the VARIANTS below, it builds a tiny
random config (CPU, two layers, small windows, chunks and position thresholds), calls ``prepare``, and:

- refused (``ConfigError``): prints the reason; the model must be left as it was (attention
  implementation and config), which is checked;
- accepted: three examples packed in one row (a short one, one past every threshold, a short one) must
  give, independently of ``prepare``'s own probe, the logits each example gets alone through the model's
  eager attention, and the packed row's summed loss the same parameter gradients as the examples' losses
  summed alone, in train mode with dropout off (eval mode where the training forward draws random
  numbers); and the guard must stay on: switching any config or sub-config to sdpa afterwards makes a
  packed forward, of the model and of its base model, raise, and so does replacing a hybrid's mixer. A mismatch is a false accept, the one
  outcome the guard must never give.

Types whose tiny config or model cannot be built (needs a checkpoint, a vision tower, ...) are listed
as skipped. tests/test_architecture_sweep.py runs the variants and a deterministic sample of the types
through the same ``judge`` function; this script runs them all (a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
import warnings
from dataclasses import dataclass

import torch

VOCAB = 256
# Small windows, chunks and thresholds so that prepare's probe (longer than each of them) stays short.
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, is_decoder=True, keep_window_size=8, sliding_window=6, attention_chunk_size=8, floor_scale=16,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, shared_expert_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
    # multi-head latent attention
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=16,
    # state-space / recurrent mixers of hybrid models
    state_size=8, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16, mamba_expand=1, linear_num_key_heads=2,
    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    # GPT-2 / OPT style names
    rotary_dim=8, n_embd=64, n_layer=2, n_head=4, n_positions=128, ffn_dim=64, word_embed_proj_dim=64, d_model=64,
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
)
# Types whose default config hides the layers that matter (LFM2's defaults are all attention; its
# checkpoints mix short-convolution layers in).
OVERRIDES = {
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1], num_hidden_layers=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=6),
    "ctrl": dict(dff=64),
    # mixers' blocks and chunks below the rows' budget, so that the examples cross them
    "minimax": dict(block_size=16),
    "granitemoehybrid": dict(mamba_chunk_size=16),
}
# Configs made to fool the guard: name -> (model type, config overrides, dtype prepared in).
VARIANTS = {
    # a scale picked from the row's longest position (long/short mscale), no window to give it away
    "phimoe+mscale": ("phimoe", dict(sliding_window=None, rope_parameters={
        "rope_type": "linear", "factor": 1.0, "rope_theta": 1e4, "original_max_position_embeddings": 16,
        "short_mscale": 1.0, "long_mscale": 1.5}), torch.float32),  # fmt: skip
    # a window only in the mask, crossed by a few tokens: under bf16's tolerance
    "phimoe+bf16-window": ("phimoe", dict(sliding_window=16, initializer_range=0.002), torch.bfloat16),
    # keys the model never reads
    "llama+unused-keys": ("llama", dict(attention_chunk_size=8, keep_window_size=8), torch.float32),
}
# Lengths of the judge's examples: a short one, one past every threshold of SMALL and VARIANTS, another.
LENGTHS = [5, 21, 10]
# The rows' budget prepare() is told: SMALL's max_position_embeddings. Thresholds of the configs' own
# defaults at or past it (Llama 3's original_max_position_embeddings=8192) are out of a row's reach.
MAX_TOKENS = 128
MAX_PARAMS = 2_000_000
VLM_MEMORY = 10 << 30  # the --vlm sweep's address space (bytes)
TOL = 1e-5  # fp32, two layers: correct paths differ by ~1e-7 (measured), a semantic error by > 1e-3


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _small_for(cls) -> dict:
    """SMALL restricted to what the config class has and can set, with a representative layer_types."""
    default = cls()
    small = {
        k: v for k, v in SMALL.items()
        if hasattr(default, k) and not isinstance(getattr(cls, k, None), property)
    }  # fmt: skip
    types = getattr(default, "layer_types", None)
    if "qk_rope_head_dim" in small:  # MLA: the rotary embedding's head_dim is the rope part; no GQA
        small.update(head_dim=small["qk_rope_head_dim"], num_key_value_heads=small["num_attention_heads"])
    if types and not isinstance(getattr(cls, "layer_types", None), property):  # one layer of each type, in the order the full model has them
        unique = list(dict.fromkeys(types))
        small.update(layer_types=unique, num_hidden_layers=len(unique))
        if hasattr(default, "full_attn_idxs"):  # LFM2 derives layer_types from it
            small["full_attn_idxs"] = [i for i, t in enumerate(unique) if t == "full_attention"]
        if "sliding_window" in small and "attention_chunk_size" in small:
            del small["attention_chunk_size"]  # some configs refuse both on one layer
    return {**small, **OVERRIDES.get(getattr(cls, "model_type", ""), {})}


def tiny_config(model_type: str, overrides: dict | None = None):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cls(**{**_small_for(cls), **(overrides or {})})
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if text is not config:  # a multimodal wrapper: shrink its text model the same way
            config = cls(text_config={**text.to_dict(), **_small_for(type(text))})
    for c in [config, *(v for v in vars(config).values() if hasattr(v, "to_dict"))]:
        c.use_cache = False
        for name, value in list(vars(c).items()):  # train mode without dropout
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                setattr(c, name, 0.0)
    return config


def tiny_model(model_type: str, overrides: dict | None = None):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, overrides)
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):  # sized first: some configs keep large parts (vision towers, byte encoders)
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if n > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {n:,} parameters")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    probe = dict(input_ids=_examples(LENGTHS)[1].view(1, -1))
    with torch.no_grad():
        if not torch.equal(model(**probe).logits, model(**probe).logits):  # random routing in training
            model.eval()
    return model


@dataclass(frozen=True)
class Verdict:
    model_type: str
    outcome: str  # "exact", "refused", "skipped" or "LEAK" (a false accept)
    detail: str


def _examples(lens: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lens]


def _row(exs: list[torch.Tensor]) -> dict:
    lens = [len(e) for e in exs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        input_ids=torch.cat(exs).view(1, -1),
        position_ids=torch.cat([torch.arange(n) for n in lens]).view(1, -1),
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens),
    )  # fmt: skip


def _loss_and_grads(model, batches: list[dict]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Logits and parameter gradients of the summed token loss over ``batches``."""
    model.zero_grad(set_to_none=True)
    logits = []
    for batch in batches:
        out = model(**batch).logits
        labels = batch["input_ids"].clone()
        labels[0, 0] = -100
        if "position_ids" in batch:  # no label across an example boundary
            labels[batch["position_ids"] == 0] = -100
        loss = torch.nn.functional.cross_entropy(
            out[0, :-1].float(), labels[0, 1:], ignore_index=-100, reduction="sum"
        )
        loss.backward()
        logits.append(out.detach()[0])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits, grads


def _unguarded(model, row: dict) -> str | None:
    """A config or sub-config switched to sdpa after prepare whose packed forward is not refused."""
    from packer.errors import ConfigError

    configs = [model.config, *(v for v in vars(model.config).values() if hasattr(v, "_attn_implementation_internal"))]
    for config in configs:
        was = config._attn_implementation_internal
        config._attn_implementation_internal = "sdpa"
        try:
            for runner in (model, model.base_model):
                try:
                    with torch.no_grad():
                        runner(**row)
                    return f"{type(runner).__name__} ran a packed row after {type(config).__name__} went to sdpa"
                except ConfigError:
                    pass
        finally:
            config._attn_implementation_internal = was
    return _mixer_unguarded(model, row)


def _mixer_unguarded(model, row: dict) -> str | None:
    """A hybrid's mixer replaced after prepare (an unwrapped copy in its place) whose packed forward runs."""
    import copy

    from packer.errors import ConfigError
    from packer.training.mixers import mixer_modules

    found = mixer_modules(model)
    if not found:
        return None
    parent, name, mixer = found[0]
    fresh = copy.deepcopy(mixer)
    fresh.__dict__.pop("forward", None)
    parent._modules[name] = fresh
    try:
        with torch.no_grad():
            model(**row)
        return f"a packed row ran after {type(mixer).__name__} was replaced"
    except ConfigError:
        return None
    finally:
        parent._modules[name] = mixer


def lengths_for(model) -> list[int]:
    """LENGTHS, the long one past every chunk, block and convolution width of the model's mixers below MAX_TOKENS."""
    from packer.training.mixers import thresholds

    reach = [t for t in thresholds(model) if t < MAX_TOKENS - 3]
    return [LENGTHS[0], max([LENGTHS[1], *(t + 3 for t in reach)]), LENGTHS[2]]


def judge(model_type: str, implementation: str = "packer_varlen") -> Verdict:
    """Refused (and left unchanged), or exact against eager alone (logits and gradients) and guarded; else LEAK.

    ``model_type`` is a transformers model type or a name in VARIANTS."""
    from packer import prepare
    from packer.errors import ConfigError

    base, overrides, dtype = VARIANTS.get(model_type, (model_type, None, torch.float32))
    try:
        model = tiny_model(base, overrides)
    except Exception as e:
        return Verdict(model_type, "skipped", f"tiny model not buildable: {type(e).__name__}: {e}"[:160])
    model.to(dtype).float()  # the weights the prepared model will have, for the reference too
    before = (model.config._attn_implementation, model.config.to_json_string())
    exs = _examples(lengths_for(model))
    # the reference: each example alone, through the model's own eager attention, no cache
    try:
        ref_logits, ref_grads = _loss_and_grads(model, [dict(input_ids=e.view(1, -1)) for e in exs])
    except Exception as e:
        return Verdict(model_type, "skipped", f"eager forward fails alone: {type(e).__name__}: {e}"[:160])
    try:
        prepare(model.to(dtype), implementation=implementation, max_tokens=MAX_TOKENS)
    except ConfigError as e:
        after = (model.config._attn_implementation, model.config.to_json_string())
        if after != before:
            return Verdict(model_type, "LEAK", f"refused but left changed: {e}")
        return Verdict(model_type, "refused", str(e))
    finally:
        model.float()  # judged in float32: a model accepted in bf16 is the same model
    model.config.use_cache = False
    logits, grads = _loss_and_grads(model, [_row(exs)])
    got = logits[0].split([len(e) for e in exs])
    d_logits = max((g - r).abs().max().item() for g, r in zip(got, ref_logits, strict=True))
    d_grads = max(
        ((grads[n] - g).abs().max() / (g.abs().max() + 1)).item() for n, g in ref_grads.items()
    ) if ref_grads else 0.0  # fmt: skip
    if set(grads) != set(ref_grads) or not (d_logits <= TOL and d_grads <= TOL):
        return Verdict(model_type, "LEAK", f"accepted, but logits differ by {d_logits:.3g}, grads by {d_grads:.3g}")
    unguarded = _unguarded(model, _row(exs))
    if unguarded:
        return Verdict(model_type, "LEAK", f"accepted, but the guard is off: {unguarded}")
    return Verdict(model_type, "exact", f"logits within {d_logits:.1e}, grads within {d_grads:.1e}")


def image_text_to_text_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _vlm_rows(model, processor, seed: int):
    """Four examples made by the processor alone (other images and texts than prepare's probe: two images of
    new sizes, one, none, one large), and their packed row as the loader yields it."""
    from packer.training import vision_probe

    s = vision_probe.nominal_size(processor.image_processor)
    sizes = [(int(s * 0.8), int(s * 1.7)), (int(s * 2.1), int(s * 0.7)), (int(s * 0.5), int(s * 0.5)),
             (int(s * 2.6), int(s * 2.2))]  # fmt: skip
    images = [vision_probe._image(max(8, h), max(8, w), seed + i) for i, (h, w) in enumerate(sizes)]
    token = processor.image_token
    specs = [(f"two {token} and {token} here", images[:2]), (f"one {token} there", images[2:3]), ("no image at all", []),
             (f"big {token}", images[3:])]  # fmt: skip
    exs = []
    for text, imgs in specs:
        try:
            got = dict(processor(text=[text], images=[imgs] if imgs else None, return_tensors="pt"))
        except ValueError:
            if imgs:
                raise
            specs = [s for s in specs if s[1]]  # a family whose every example has an image (PaliGemma)
            continue
        got.pop("attention_mask", None)
        exs.append({k: v for k, v in got.items() if isinstance(v, torch.Tensor)})
    return exs, vision_probe.row(model, exs, [len(i) for _, i in specs])


def _vlm_loss_and_grads(model, batches: list[dict], cu_list: list[list[int]]):
    """Logits and parameter gradients of the summed token loss (no label across a boundary)."""
    model.zero_grad(set_to_none=True)
    logits = []
    for batch, bounds in zip(batches, cu_list, strict=True):
        out = model(**batch).logits
        labels = batch["input_ids"].clone()
        for b in bounds[:-1]:
            labels[0, b] = -100
        loss = torch.nn.functional.cross_entropy(out[0, :-1].float(), labels[0, 1:], ignore_index=-100, reduction="sum")
        loss.backward()
        logits.append(out.detach()[0])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits, grads


def _vlm_unguarded(model, row: dict, exs: list[dict]) -> str | None:
    """What prepare changed, undone or broken after it, whose packed forward runs (None: each refused)."""
    from packer.errors import ConfigError

    def runs(batch) -> bool:
        try:
            with torch.no_grad():
                model(**batch)
            return True
        except ConfigError:
            return False

    for key in [None, *model.config.sub_configs]:
        config = model.config if key is None else getattr(model.config, key)
        if config is None:
            continue
        was = config._attn_implementation_internal
        config._attn_implementation_internal = "sdpa" if was != "sdpa" else "eager"
        try:
            if runs(row):
                return f"a packed row ran after {key or 'the config'}'s attention went from {was!r} to another"
        finally:
            config._attn_implementation_internal = was
    pixels = [k for k in row if k.startswith("pixel_values")]
    if pixels and runs({k: v for k, v in row.items() if k not in pixels}):
        return "a packed row with image placeholders ran without its pixel_values"
    return None


def judge_vlm(model_type: str) -> Verdict:
    """A vision-language type: refused (left unchanged), or exact on packed rows with images against each
    example alone through an untouched eager copy (logits, every parameter's gradient) and guarded."""
    import copy

    try:
        from vlm_tiny import build
    except ImportError:  # imported as benchmarks.sweep_architectures
        from benchmarks.vlm_tiny import build
    from packer import prepare
    from packer.errors import ConfigError

    try:
        model, processor = build(model_type)
        reference = copy.deepcopy(model)
        exs, row = _vlm_rows(model, processor, seed=7)
        lens = [e["input_ids"].shape[1] for e in exs]
        ref_logits, ref_grads = _vlm_loss_and_grads(reference, exs, [[0, n] for n in lens])
    except Exception as e:  # MemoryError included: its default image sizes are beyond the sweep's memory
        return Verdict(model_type, "skipped", f"tiny model not buildable: {type(e).__name__}: {e}"[:200].replace("\n", " "))
    before = (model.config.to_json_string(), [(c, c._attn_implementation) for c in _sub_configs(model)])
    implementation = "packer_varlen"
    budget = max(MAX_TOKENS * 4, row["input_ids"].shape[1])  # the rows' budget: the judge's row fits
    try:
        try:
            prepare(model, processor=processor, max_tokens=budget)
        except ConfigError as e:
            if "implementation='sdpa'" not in str(e):
                raise
            implementation = "sdpa"  # the model's own mask, per example (Gemma 3): what the message says to try
            prepare(model, processor=processor, implementation="sdpa", max_tokens=budget)
    except ConfigError as e:
        after = (model.config.to_json_string(), [(c, c._attn_implementation) for c in _sub_configs(model)])
        if after != before:
            return Verdict(model_type, "LEAK", f"refused but left changed: {e}")
        return Verdict(model_type, "refused", str(e))
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    try:
        logits, grads = _vlm_loss_and_grads(model, [row], [bounds])
    except Exception as e:  # accepted, then refused or failing on a row made as the contract says: a broken promise
        return Verdict(model_type, "LEAK", f"accepted, but its packed row fails: {type(e).__name__}: {e}"[:200])
    got = logits[0].split(lens)
    d_logits = max(((g - r).abs().max() / (r.abs().max() + 1e-30)).item() for g, r in zip(got, ref_logits, strict=True))
    d_grads = max(((grads[n] - g).abs().max() / (g.abs().max() + 1)).item() for n, g in ref_grads.items())
    if set(grads) != set(ref_grads) or not (d_logits <= TOL and d_grads <= TOL):
        return Verdict(model_type, "LEAK", f"accepted, but logits differ by {d_logits:.3g}, grads by {d_grads:.3g}")
    unguarded = _vlm_unguarded(model, row, exs)
    if unguarded:
        return Verdict(model_type, "LEAK", f"accepted, but the guard is off: {unguarded}")
    how = "" if implementation == "packer_varlen" else f" (implementation={implementation!r})"
    return Verdict(model_type, "exact", f"logits within {d_logits:.1e} (relative), grads within {d_grads:.1e}{how}")


def _sub_configs(model) -> list:
    return [model.config, *(getattr(model.config, k) for k in model.config.sub_configs if getattr(model.config, k, None))]


# docs/attention.md's table: one row per reason, the message fragment that identifies it
REASONS = [
    ("transformers would not set", "attention not replaceable: transformers refuses a custom attention function"),
    ("non-causal", "non-causal attention module"),
    ("not a causal decoder", "not a causal decoder"),
    ("the indexer picks", "indexed attention: keys picked through the mask transformers builds for sdpa/eager only (`implementation=\"sdpa\"` vets it)"),
    ("pool blocks of consecutive tokens", "compressed attention: blocks of consecutive tokens of the row pooled into keys"),
    ("token mixer packer does not know", "a token mixer packer does not know (named in the message)"),
    ("additive position bias", "an additive position bias from the row's offsets (Inkling's relative logits)"),
    ("soft-capping / sinks", "attention logit soft-capping or sinks (use `implementation=\"flash_attention_2\"`)"),
    ("rope_type=", "RoPE frequencies from the longest example in the row (`dynamic`, `longrope`)"),
    ("attn_temperature_tuning", "query temperature from the offset in the row (Llama 4)"),
    ("depend on the tokens of the other examples", "probe: a non-zero gradient from one example to another"),
    ("away from the ones it gets alone", "probe: packed logits differ from eager alone (learned positions from the row offset, masks only in the model, chunks, a scale from the row, ...)"),
    ("gradient packed is", "probe: packed gradients differ from eager alone"),
    ("probe forward failed", "probe: the packed forward fails"),
    ("image probe: its packed row with images was refused", "image probe: the text model's attention is not causal (PaliGemma's prefix attends both ways)"),
    ("image probe: example", "image probe: packed logits with images differ from each example alone"),
    ("image probe: the gradient", "image probe: packed gradients with images differ from each example alone"),
    ("probed with images made by its processor", "no processor given"),
]


def markdown_table(verdicts: list[Verdict]) -> str:
    rows: dict[str, list[str]] = {}
    for v in verdicts:
        if v.outcome == "refused":
            why = next((label for key, label in REASONS if key in v.detail), v.detail[:80])
            rows.setdefault(why, []).append(f"`{v.model_type}`")
    lines = ["| why refused (first rule that fails) | model types |", "|---|---|"]
    lines += [f"| {why} | {', '.join(types)} |" for why, types in rows.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("types", nargs="*", help="model types or VARIANTS (default: every causal-LM type and variant)")
    p.add_argument("--implementation", default="packer_varlen")
    p.add_argument("--markdown", action="store_true", help="print the refused ones as docs/attention.md's table")
    p.add_argument("--vlm", action="store_true", help="the image-text-to-text types, on packed rows with images")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.vlm:  # a family's default image sizes can ask for tens of GB: a MemoryError here, not the OOM killer
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (VLM_MEMORY, VLM_MEMORY))
    verdicts = []
    t0 = time.perf_counter()
    default = image_text_to_text_types() if args.vlm else [*causal_lm_types(), *VARIANTS]
    for t in args.types or default:
        v = judge_vlm(t) if args.vlm else judge(t, args.implementation)
        verdicts.append(v)
        print(f"{v.outcome:8s} {t:28s} {v.detail}", flush=True)
    counts = {o: sum(v.outcome == o for v in verdicts) for o in ("exact", "refused", "skipped", "LEAK")}
    print(f"{len(verdicts)} types in {time.perf_counter() - t0:.0f} s: " + ", ".join(f"{n} {o}" for o, n in counts.items()))
    if args.markdown:
        print(markdown_table(verdicts))
    return 1 if counts["LEAK"] else 0


if __name__ == "__main__":
    sys.exit(main())
