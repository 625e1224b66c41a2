"""prepare keeps its word on generation: ``model.generate()`` with a cache (one sequence, greedy) gives the
tokens the unprepared model gives, plain and hybrid; a packed row with a cache is still refused.
Tiny random configs (``benchmarks/sweep_architectures.py``'s), fp32, CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.sweep_architectures import tiny_model
from packer import prepare
from packer.errors import ConfigError
from packer.training import attention, guard


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", None),  # plain attention
    ("mistral", dict(sliding_window=4)),  # plain attention with a window, which the decode steps pass
    ("qwen3_next", None),  # GatedDeltaNet + attention: the per-segment path and packer_varlen
    ("minimax", None),  # lightning attention + attention
])  # fmt: skip
def test_generate_after_prepare_gives_the_unprepared_models_tokens(model_type, overrides):
    model = tiny_model(model_type, overrides)
    reference = copy.deepcopy(model)  # unprepared, the model's own eager attention
    prepare(model, max_tokens=64)
    prompt = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(0))
    expected = reference.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    before = attention.calls()
    got = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    assert attention.calls() > before  # the decode steps went through packer_varlen, with their cache
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())
    # and the model still trains on packed rows as before: a packed row with a cache is refused
    exs = [prompt[0], prompt[0, :5]]
    with torch.no_grad(), pytest.raises(ConfigError, match="a packed row|keys cover|cache"):
        model(**guard._row(exs), use_cache=True, past_key_values=_filled_cache(model, prompt))


def _filled_cache(model, prompt):
    with torch.no_grad():
        return model(input_ids=prompt, use_cache=True).past_key_values


def test_packer_varlen_with_a_cache_is_causal_from_the_keys_end():
    """The cached path alone, against SDPA over the whole sequence: the last queries of a causal pass."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=gen) for _ in range(3))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    module = torch.nn.Module().eval()
    for t_q in (1, 3):  # a decode step, and a few queries at once (assisted decoding)
        out, _ = attention.packed_attention(module, q[:, :, -t_q:], k, v, None,
                                            position_ids=torch.arange(9 - t_q, 9).view(1, -1))  # fmt: skip
        torch.testing.assert_close(out, full[:, -t_q:])
    # a batch of several sequences with a cache: their padding cannot be seen, so refused in one line
    q2, k2 = torch.cat([q, q])[:, :, -1:], torch.cat([k, k])
    with pytest.raises(ConfigError, match="one sequence at a time; it does not see the attention_mask of a batch of 2"):
        attention.packed_attention(module, q2, k2, k2, None)
    # queries whose positions restart (a packed row) with keys beyond them: refused, as with cu_seq_lens
    with pytest.raises(ConfigError, match="the keys cover 9 positions and the queries 3"):
        attention.packed_attention(module, q[:, :, -3:], k, v, None, position_ids=torch.tensor([[5, 0, 1]]))
