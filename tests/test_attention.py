"""Boundary-safe attention: packed logits equal unpadded logits per example (packer_varlen and
transformers' own position_ids path), the packed loss equals the padded-batch loss, no example sees
another, and models that would leak across examples are refused. Tiny random models, fp32, CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from packer.errors import ConfigError
from packer.training.attention import ATTN_IMPLEMENTATION, backend_for, packed_attention, register
from packer.training.guard import prepare

TOL = 1e-5
VOCAB = 97
LENS = [7, 3, 11, 5]
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SMALL),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "mistral-sliding-window": lambda: MistralConfig(**SMALL, sliding_window=4),
}


def tiny(family: str = "llama", attn: str = "sdpa"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        FAMILIES[family](), attn_implementation=attn, dtype=torch.float32
    )
    return model.eval()


def examples(seed: int = 0, lens=LENS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lens]


def packed_batch(exs: list[torch.Tensor], with_cu: bool = True) -> dict:
    lens = torch.tensor([len(e) for e in exs])
    cu = torch.zeros(len(exs) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    batch = {
        "input_ids": torch.cat(exs).view(1, -1),
        "position_ids": torch.cat([torch.arange(n) for n in lens.tolist()]).view(1, -1),
    }
    if with_cu:
        m = int(lens.max())
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)
    return batch


def split(logits: torch.Tensor, exs) -> list[torch.Tensor]:
    return list(logits[0].split([len(e) for e in exs]))


@torch.no_grad()
def alone_logits(model, exs) -> list[torch.Tensor]:
    model.set_attn_implementation("sdpa")
    return [model(input_ids=e.view(1, -1)).logits[0] for e in exs]


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_packed_logits_equal_alone_packer_varlen(family):
    model = tiny(family)
    exs = examples()
    ref = alone_logits(model, exs)
    prepare(model)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    for with_cu in (True, False):  # from the loader's cu_seq_lens, or derived from position_ids
        got = split(model(**packed_batch(exs, with_cu)).logits, exs)
        for g, r in zip(got, ref, strict=True):
            assert (g - r).abs().max().item() <= TOL


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_packed_logits_equal_alone_transformers_position_ids_path(family, attn):
    """transformers 5.x builds a block-diagonal causal mask from position_ids when no attention_mask and
    no cache is given (masking_utils.find_packed_sequence_indices): its own packed path on CPU, with
    sdpa and eager. With a cache (use_cache=True, the config default, also in train mode) it builds
    none and the examples leak into each other: prepare() refuses that setting (test below)."""
    model = tiny(family)
    exs = examples(1)
    ref = alone_logits(model, exs)
    model.set_attn_implementation(attn)
    batch = packed_batch(exs, with_cu=False)
    got = split(model(**batch, use_cache=False).logits, exs)
    for g, r in zip(got, ref, strict=True):
        assert (g - r).abs().max().item() <= TOL
    leaky = split(model(**batch, use_cache=True).logits, exs)
    assert (leaky[1] - ref[1]).abs().max().item() > 1e-3


def test_prepare_vets_transformers_sdpa_by_use_cache():
    model = tiny("llama")
    assert model.config.use_cache
    with pytest.raises(ConfigError, match="other examples.*with use_cache=True transformers builds no packed mask for 'sdpa'"):
        prepare(model, implementation="sdpa")
    model.config.use_cache = False
    prepare(model, implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", ["llama", "mistral-sliding-window"])
@torch.no_grad()
def test_batch_row_loss_equals_padded_batch_loss(family):
    model = tiny(family)
    exs = examples(2, lens=[9, 4, 12, 6])
    prompts = [3, 1, 5, 2]
    labels = [torch.cat([torch.full((p,), -100), e[p:]]) for e, p in zip(exs, prompts, strict=True)]
    longest = max(len(e) for e in exs)
    pad = lambda t, v: torch.cat([t, torch.full((longest - len(t),), v)])  # noqa: E731
    padded = model(
        input_ids=torch.stack([pad(e, 0) for e in exs]),
        attention_mask=torch.stack([pad(torch.ones(len(e), dtype=torch.long), 0) for e in exs]),
        labels=torch.stack([pad(lab, -100) for lab in labels]),
    ).loss
    prepare(model)
    packed = model(**packed_batch(exs), labels=torch.cat(labels).view(1, -1)).loss
    assert abs(packed.item() - padded.item()) <= TOL


@torch.no_grad()
def test_changing_one_example_leaves_the_others_unchanged():
    model = prepare(tiny("llama"))
    exs = examples(3)
    before = split(model(**packed_batch(exs)).logits, exs)
    changed = list(exs)
    changed[1] = (exs[1] + 17) % VOCAB
    after = split(model(**packed_batch(changed)).logits, exs)
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if i == 1:
            assert (b - a).abs().max().item() > 1e-3
        else:
            assert (b - a).abs().max().item() <= TOL


def test_gradients_do_not_cross_boundaries():
    model = prepare(tiny("llama"))
    exs = examples(4)
    batch = packed_batch(exs)
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, **batch).logits
    logits[0, sum(LENS[:2]) : sum(LENS[:3])].sum().backward()  # loss on example 2 only
    grad = embeds.grad[0].abs().sum(-1)
    assert (grad[: sum(LENS[:2])] == 0).all() and (grad[sum(LENS[:3]) :] == 0).all()
    assert (grad[sum(LENS[:2]) : sum(LENS[:3])] > 0).any()


def test_refuses_model_without_attention_interface():
    from transformers import MambaConfig, MambaForCausalLM

    # no attention at all: its Mamba mixers run once per example (tests/test_mixers.py), the probe judges
    model = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert prepare(model).packer_path == "per-segment"
    with pytest.raises(ConfigError, match="not a transformers PreTrainedModel"):
        prepare(torch.nn.Linear(2, 2))


def test_refuses_model_whose_attention_ignores_the_interface():
    model = tiny("llama")

    def leaky_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        # attends over the whole row as one sequence, never calling the registered function
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2).repeat_interleave(2, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None

    for layer in model.model.layers:
        layer.self_attn.forward = leaky_forward.__get__(layer.self_attn)
    with pytest.raises(ConfigError, match="depend on the tokens of the other examples"):
        prepare(model)
    assert model.config._attn_implementation == "sdpa", "a refused model keeps its attention setting"


def test_refuses_a_registered_function_that_ignores_boundaries(monkeypatch):
    """The probe catches an implementation that runs but treats the row as one sequence."""
    import packer.training.attention as attention

    def whole_row(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
        kwargs.pop("position_ids", None)
        return packed_attention(module, query, key, value, None, **{**kwargs, "position_ids": None})

    model = tiny("llama")
    monkeypatch.setattr(attention, "packed_attention", whole_row)
    with pytest.raises(ConfigError, match="depend on the tokens of the other examples"):
        prepare(model)
    monkeypatch.undo()
    register()  # restore the real function in transformers' registry


def test_cpu_backend_is_per_segment_sdpa():
    q = torch.zeros(1, 4, 8, 16)
    assert backend_for(q) == "sdpa"
    assert backend_for(q.half()) == "sdpa"  # CUDA only for the varlen kernels
