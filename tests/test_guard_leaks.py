"""After ``prepare``, every way a packed row can reach the model with boundaries that no longer hold is
refused at the forward in one line, or computed exactly (issue 29): a 2-D ``attention_mask`` beside
the row, PEFT prompt tuning (virtual tokens prepended to the whole row, position_ids dropped), PEFT
prefix tuning (a cache of prefix keys), and ``inputs_embeds`` in place of ``input_ids`` (exact)."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.sweep_architectures import tiny_model
from packer import prepare
from packer.errors import ConfigError
from packer.training import guard

IMPLEMENTATIONS = ["packer_varlen", "sdpa"]


def _exs(lens=(5, 12, 7)):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=gen) for n in lens]


def _alone(model, exs):
    with torch.no_grad():
        return torch.cat([model(input_ids=e.view(1, -1), use_cache=False).logits[0] for e in exs])


def _prepared(model_type, implementation):
    model = tiny_model(model_type)
    reference = copy.deepcopy(model)
    return prepare(model, implementation=implementation, max_tokens=128), reference


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_packed_row_with_an_attention_mask_is_refused(implementation):
    model, reference = _prepared("llama", implementation)
    row = guard._row(_exs())
    ones = torch.ones_like(row["input_ids"])
    if implementation == "sdpa":  # why: sdpa builds its mask from the 2-D one, across the examples
        reference.set_attn_implementation("sdpa")
        with torch.no_grad():
            leaked = reference(**row, attention_mask=ones, use_cache=False).logits[0]
        assert (leaked - _alone(reference, _exs())).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="attention_mask is passed with it"):
        model(**row, attention_mask=ones)
    with pytest.raises(ConfigError, match="attention_mask"):  # positions alone, as a user's collator makes
        model(input_ids=row["input_ids"], position_ids=row["position_ids"], attention_mask=ones)
    with torch.no_grad():  # unpacked rows with a mask (generation, padded batches) are left alone
        model(input_ids=row["input_ids"], attention_mask=ones)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_inputs_embeds_in_place_of_input_ids_is_exact(model_type):
    model, reference = _prepared(model_type, "packer_varlen")
    exs = _exs((5, 70, 7))
    row = guard._row(exs)
    embeds = model.get_input_embeddings()(row.pop("input_ids"))
    with torch.no_grad():
        got = model(inputs_embeds=embeds, **row).logits[0]
    assert (got - _alone(reference, exs)).abs().max() < 1e-5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("tuning, refusal", [("PromptTuningConfig", "PEFT prompt tuning"),
                                             ("PrefixTuningConfig", "cache|prefix")])
def test_peft_virtual_tokens_are_refused(implementation, tuning, refusal):
    """Prompt tuning prepends virtual tokens to the row, prefix tuning a key/value prefix to every layer:
    either crosses every boundary of a packed row."""
    import peft

    model, _ = _prepared("llama", implementation)
    config = getattr(peft, tuning)(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(ConfigError, match=refusal):
        peft.get_peft_model(model, config)(**guard._row(_exs()))


def test_lora_stays_exact():
    """An adapter that leaves the tokens and positions alone is fine (the contrast to the refusals)."""
    from peft import LoraConfig, get_peft_model

    model, reference = _prepared("llama", "packer_varlen")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=True))
    exs = _exs()
    with torch.no_grad():
        got = peft_model(**guard._row(exs)).logits[0]
    assert (got - _alone(reference, exs)).abs().max() < 1e-5
