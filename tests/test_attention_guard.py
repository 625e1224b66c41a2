"""prepare() decides against the model's own eager attention, refuses row-dependent settings by name,
leaves a refused model as it was, and stays on guard after it accepted. Tiny random configs, fp32, CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    CTRLConfig,
    DogeConfig,
    DynamicCache,
    FuyuConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    Lfm2Config,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PhimoeConfig,
)

import packer.training.attention as attention
import packer.training.guard as guard
import packer.training.mixers as mixers
from packer.errors import ConfigError
from packer.training.attention import packed_attention
from packer.training.guard import prepare

VOCAB = 97
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip


def tiny(config, attn: str = "sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def row(lens=(7, 5)) -> dict:
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        input_ids=torch.randint(1, VOCAB, (1, sum(lens)), generator=gen),
        position_ids=torch.cat([torch.arange(n) for n in lens]).view(1, -1),
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens),
    )  # fmt: skip


def assert_refused_unchanged(model, match: str, **kwargs) -> str:
    before = [(c._attn_implementation_internal, c.to_json_string()) for c in guard._configs(model)]
    with pytest.raises(ConfigError, match=match) as e:
        prepare(model, **kwargs)
    after = [(c._attn_implementation_internal, c.to_json_string()) for c in guard._configs(model)]
    assert after == before, "a refused model is left exactly as it was"
    assert getattr(model, "_packer_guard", None) is None
    return str(e.value)


# --- what packed vs alone through the same attention misses, and eager as the reference catches ----------


def test_refuses_chunked_attention_and_row_offset_temperature_tuning():
    """Llama 4's chunks are used by its eager attention and not by packer_varlen: the probe sees it."""
    config = Llama4TextConfig(**SMALL, attention_chunk_size=8, attn_temperature_tuning=False, floor_scale=16,
                              num_local_experts=2, intermediate_size_mlp=64)  # fmt: skip
    assert_refused_unchanged(tiny(config), r"gets logits .* away from the ones it gets alone through eager")
    config = Llama4TextConfig(**SMALL, attention_chunk_size=None, attn_temperature_tuning=True, floor_scale=16,
                              no_rope_layers=[1, 0], num_local_experts=2, intermediate_size_mlp=64)  # fmt: skip
    assert_refused_unchanged(tiny(config), r"attn_temperature_tuning scales queries by the token's offset in the row")


def test_refuses_a_window_that_exists_only_in_the_mask():
    """PhiMoE's sliding window is only in the mask it builds (packer_varlen never sees it): the eager
    reference, with probe examples longer than the window, shows it."""
    config = PhimoeConfig(**SMALL, sliding_window=4, num_local_experts=2)
    message = assert_refused_unchanged(tiny(config), r"gets logits .* away from the ones it gets alone through eager")
    assert "use_cache" not in message, "the cache hint only when the cache is the cause"


def test_refuses_dynamic_masks_and_length_dependent_rope():
    assert_refused_unchanged(tiny(DogeConfig(**SMALL, keep_window_size=8)), r"gets logits .* away from .* alone")
    dynamic = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert_refused_unchanged(tiny(dynamic), r"rope_type='dynamic' takes its frequencies from the longest example")
    longrope = Phi3Config(**{**SMALL, "max_position_embeddings": 64}, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 32,
        "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})  # fmt: skip
    assert_refused_unchanged(tiny(longrope), r"rope_type='longrope'")


def test_refuses_non_attention_mixers_by_structure_and_by_exact_gradient(monkeypatch):
    """LFM2's short convolution runs across the row. With a small init its leak is ~1e-5 at the probe
    (it grows with training): accepted only because its convolution runs once per example (the
    per-segment path); without that path, refused by the gradient rule, which asks for exactly zero, not
    for a small difference."""
    config = Lfm2Config(**{k: v for k, v in SMALL.items() if k != "head_dim"}, layer_types=["conv", "full_attention"],
                        full_attn_idxs=[1], initializer_range=1e-3)  # fmt: skip
    assert prepare(tiny(config)).packer_path == "per-segment"
    monkeypatch.setattr(mixers, "install", lambda model: [])
    assert_refused_unchanged(tiny(config), r"outputs depend on the tokens of the other examples .*must be exactly 0")


# --- mutations of packer_varlen that the reference must catch ------------------------------------------


def _mutated(monkeypatch, **overrides):
    """packer_varlen with some of the arguments the model passes replaced (e.g. scaling ignored)."""

    def mutant(module, query, key, value, attention_mask, **kwargs):
        return packed_attention(module, query, key, value, attention_mask, **{**kwargs, **overrides})

    monkeypatch.setattr(attention, "packed_attention", mutant)


@pytest.fixture
def restore_registry():
    yield
    attention.register()  # the real function back in transformers' registry


@pytest.mark.parametrize(
    "config",
    [
        Gemma3TextConfig(**SMALL, query_pre_attn_scalar=64, sliding_window=4),  # scaling 64**-0.5, not 8**-0.5
        GraniteConfig(**SMALL, attention_multiplier=0.5),
    ],
    ids=["gemma3-query_pre_attn_scalar", "granite-attention_multiplier"],
)
def test_a_packer_varlen_that_ignores_scaling_is_refused(config, monkeypatch, restore_registry):
    prepare(tiny(config))  # the real function is exact
    _mutated(monkeypatch, scaling=None)
    assert_refused_unchanged(tiny(config), r"gets logits .* away from the ones it gets alone through eager")


def test_a_packer_varlen_that_ignores_the_window_is_refused(monkeypatch, restore_registry):
    config = MistralConfig(**SMALL, sliding_window=4)
    prepare(tiny(config))
    _mutated(monkeypatch, sliding_window=None)
    assert_refused_unchanged(tiny(config), r"gets logits .* away from the ones it gets alone through eager")


@pytest.mark.parametrize("kind", ["softcap", "sinks"])
def test_soft_capping_and_sinks_are_refused_and_ignoring_them_is_caught(kind, monkeypatch, restore_registry):
    if kind == "softcap":
        config = Gemma2Config(**SMALL, attn_logit_softcapping=1.0, initializer_range=1.0, final_logit_softcapping=None, sliding_window=4)
        ignore = dict(softcap=None)
    else:
        config = GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1, sliding_window=4)
        ignore = dict(s_aux=None)
    assert_refused_unchanged(tiny(config, "eager"), r"soft-capping / sinks are not supported")
    _mutated(monkeypatch, **ignore)
    assert_refused_unchanged(tiny(config, "eager"), r"gets logits .* away from the ones it gets alone through eager")


# --- the guard that stays on ---------------------------------------------------------------------------


def test_guard_raises_when_the_attention_implementation_changes_after_prepare():
    model = prepare(tiny(LlamaConfig(**SMALL)))
    with torch.no_grad():
        model(**row())
        model.set_attn_implementation("sdpa")
        with pytest.raises(ConfigError, match="attn_implementation changed from 'packer_varlen' to 'sdpa'"):
            model(**row())
        without_cu = {k: v for k, v in row().items() if not k.startswith(("cu_", "max_"))}
        with pytest.raises(ConfigError, match="changed from 'packer_varlen' to 'sdpa'"):
            model(**without_cu)  # packed by its position_ids alone
        model(input_ids=row()["input_ids"])  # an unpacked forward (generation) is left alone
        model.config._attn_implementation = "eager"
        with pytest.raises(ConfigError, match="changed from 'packer_varlen' to 'eager'"):
            model(**row())
        prepare(model)  # prepared again: packed rows run
        model(**row())


def test_guard_raises_when_a_cache_comes_back_on_a_model_prepared_with_sdpa():
    model = tiny(LlamaConfig(**SMALL, use_cache=False))
    prepare(model, implementation="sdpa")
    with torch.no_grad():
        model(**row())
        with pytest.raises(ConfigError, match="use_cache is on, so transformers builds no packed mask"):
            model(**row(), use_cache=True)
        model.config.use_cache = True
        with pytest.raises(ConfigError, match="use_cache is on"):
            model(**row())


def test_probe_examples_cross_every_declared_threshold():
    """One example past every threshold a row can reach, the others below the smallest."""

    def crosses(config, *thresholds, max_tokens=None):
        short1, longest, short2 = guard.probe_lengths(config, max_tokens)
        return all(longest > t > max(short1, short2) for t in thresholds)

    assert crosses(MistralConfig(**SMALL, sliding_window=4096), 4096)
    config = Llama4TextConfig(**SMALL, attention_chunk_size=8192, floor_scale=8192, attn_temperature_tuning=True)
    assert crosses(config, 8192)
    config = Phi3Config(**SMALL, sliding_window=20, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 40,
        "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})  # fmt: skip
    assert crosses(config, 20, 40)
    llama3 = LlamaConfig(**SMALL, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})  # fmt: skip
    assert crosses(llama3, 8192)
    # a budget leaves out what no row reaches, and adds the position table's end where it is below it
    assert guard.probe_lengths(llama3, max_tokens=4096) == [63, 67, 31]  # SMALL's max_position_embeddings=64
    assert guard.probe_lengths(llama3, max_tokens=60) == [7, 11, 3]



# --- a guard's possible gaps, one test each: scales from the row, sub-configs, caches, training-only limits,
# the base model, bf16, false refusals ---------------------------------------------------------------------


def test_1_a_scale_picked_from_the_row_is_caught():
    """PhiMoE picks long_mscale or short_mscale from the row's longest position for any rope type but
    "default": short examples beside one past original_max_position_embeddings change."""
    rope = {"rope_type": "linear", "factor": 1.0, "rope_theta": 1e4, "original_max_position_embeddings": 16,
            "short_mscale": 1.0, "long_mscale": 1.5}  # fmt: skip
    config = PhimoeConfig(**SMALL, sliding_window=None, num_local_experts=2, rope_parameters=rope)
    assert_refused_unchanged(tiny(config), r"example 0 \(15 tokens, packed beside .*\) gets logits .* alone")


def _fuyu():
    text = dict(model_type="persimmon", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, use_cache=False)  # fmt: skip
    return tiny(FuyuConfig(text_config=text, vocab_size=VOCAB, hidden_size=32, patch_size=4))


def test_2_a_sub_config_switched_after_prepare_is_caught():
    model = prepare(_fuyu())
    with torch.no_grad():
        model(**row())
        model.set_attn_implementation({"text_config": "sdpa"})
        assert model.config._attn_implementation == "packer_varlen", "the top-level config did not change"
        with pytest.raises(ConfigError, match="PersimmonConfig's attn_implementation changed from 'packer_varlen'"):
            model(**row())


def test_3_a_cache_in_a_packed_forward_is_refused():
    """A pre-filled cache (what PEFT prefix tuning passes) makes the keys cover prefix + row."""
    model = prepare(tiny(LlamaConfig(**SMALL)))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 4
        for name in ("cache", "past_key_values"):  # the second: its name before transformers 5.40
            with warnings.catch_warnings(), pytest.raises(ConfigError, match="its cache holds 4 positions"):
                warnings.simplefilter("ignore", FutureWarning)
                model(**row(), **{name: cache})
        # packer_varlen itself, whoever calls it: keys beyond the row's queries are refused
        q, k = torch.randn(1, 4, 12, 8), torch.randn(1, 4, 16, 8)
        cu = torch.tensor([0, 7, 12], dtype=torch.int32)
        with pytest.raises(ConfigError, match="the keys cover 16 positions and the queries 12"):
            packed_attention(torch.nn.Module(), q, k, k, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                             max_length_q=7, max_length_k=7)  # fmt: skip
        with pytest.raises(ValueError, match=r"do not span the row's 12 queries"):
            packed_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu[:2], cu_seq_lens_k=cu[:2],
                             max_length_q=7, max_length_k=7)  # fmt: skip


def test_3_peft_prefix_tuning_is_refused():
    peft = pytest.importorskip("peft")
    model = prepare(tiny(LlamaConfig(**SMALL)))
    config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    tuned = peft.get_peft_model(model, config)
    with pytest.raises(ConfigError, match="its cache holds 4 positions|the keys cover"):
        tuned(**row())


class CapacityMoE(torch.nn.Module):
    """Top-1 mixture of experts with a Switch-style capacity: in training each expert takes at most
    ceil(tokens / experts) tokens of the batch, first come first served; the rest pass on the residual."""

    def __init__(self, hidden: int, experts: int = 2):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        capacity = -(-len(flat) // len(self.experts)) if self.training else len(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == e).reshape(-1)[:capacity]
            out = out.index_put((idx,), expert(flat[idx]))
        return out.view_as(x)


def test_4_a_capacity_limit_applied_only_in_training_is_caught():
    model = tiny(LlamaConfig(**SMALL))
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = CapacityMoE(SMALL["hidden_size"])
    model.eval()
    assert_refused_unchanged(model, r"gets logits .* away from the ones it gets alone through eager")
    assert not model.training, "the probe's train mode is on a copy"


def test_5_the_base_model_is_guarded_too():
    model = prepare(tiny(LlamaConfig(**SMALL)))
    with torch.no_grad():
        model.model(**row())
        model.set_attn_implementation("sdpa")
        with pytest.raises(ConfigError, match="LlamaModel: a packed row after prepare.*changed from 'packer_varlen'"):
            model.model(**row())
        model(input_ids=row()["input_ids"])  # unpacked: left alone


def test_6_a_bf16_model_is_probed_in_float32():
    """A window only in PhiMoE's mask, crossed by a few tokens, hides under a bf16 tolerance."""
    config = PhimoeConfig(**SMALL, sliding_window=16, num_local_experts=2)  # accepted in bf16 before
    model = tiny(config).to(torch.bfloat16)
    assert_refused_unchanged(model, r"gets logits .* away from the ones it gets alone through eager")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_7_no_false_refusals_in_place_embeddings_and_unused_keys():
    """CTRL scales its input embeddings in place; a Llama config may carry keys its model never reads."""
    ctrl = CTRLConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=64)
    model, rng = tiny(ctrl, "eager"), torch.get_rng_state()
    prepare(model)
    assert torch.equal(torch.get_rng_state(), rng), "the probe's draws leave the caller's generator alone"
    assert not model.training and next(model.parameters()).requires_grad, "the probe ran on a copy"
    prepare(tiny(LlamaConfig(**SMALL, attention_chunk_size=4)))
    prepare(tiny(LlamaConfig(**SMALL, keep_window_size=4)))


def test_a_model_that_cannot_be_copied_for_the_probe_is_refused_with_the_way_out():
    model = tiny(LlamaConfig(**SMALL))
    model.stream = (x for x in [])  # a generator: deepcopy refuses it, as it refuses some quantized weights
    assert_refused_unchanged(model, r"the probe runs on a float32 copy .* which failed: TypeError.*probe=False")
    prepare(model, probe=False)


def test_a_row_longer_than_the_vetted_budget_is_refused():
    model = prepare(tiny(LlamaConfig(**SMALL)), max_tokens=12)
    with torch.no_grad():
        model(**row((7, 5)))
        with pytest.raises(ConfigError, match="the row has 13 tokens, more than max_tokens=12"):
            model(**row((8, 5)))


def test_the_probe_forwards_the_long_row_once(monkeypatch):
    """The long example is the probe's cost (its row is thousands of tokens for a real window or RoPE
    threshold): it is forwarded packed once and alone once; the check for random draws uses the short row."""
    model = tiny(MistralConfig(**SMALL, sliding_window=16))
    lengths, forward = [], type(model).forward

    def counted(self, *args, **kwargs):
        lengths.append(kwargs["input_ids"].shape[1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counted)
    prepare(model)
    short1, longest, short2 = guard.probe_lengths(model.config)
    assert lengths.count(short1 + longest + short2) == 1 and lengths.count(longest) == 1, lengths


def test_a_model_whose_training_forward_is_random_is_probed_in_eval_mode():
    """PhiMoE with jitter draws random numbers in training (beyond dropout): packed against alone would differ
    by the draws, not by the packing. The probe sees the draws on its short row and compares in eval mode."""
    config = PhimoeConfig(**SMALL, sliding_window=None, num_local_experts=4, router_jitter_noise=0.5,
                          input_jitter_noise=0.1)
    model = prepare(tiny(config).train())
    assert model.config._attn_implementation == attention.ATTN_IMPLEMENTATION and model.training
