"""Packed DPO to float64 accuracy: each sequence's log-prob summed in float64, so the loss and gradient of
``dpo_step`` on 437-930-token sequences are within 1e-6 relative of an independent float64 per-sequence
reference on the same logits (``benchmarks/dpo_precision.py`` measures it on random logits; before: 5.6e-5
and 1.05e-4)."""

from __future__ import annotations

import torch

from benchmarks.dpo_precision import LENGTHS, ROLES, measure, reference_loss
from packer import prepare
from packer.training.preference import MODEL_KEYS, dpo_step


def test_the_loss_and_gradient_on_random_logits_are_float64s():
    loss_rel, grad_rel = measure(vocab=1024, scale=3.0)
    assert loss_rel < 1e-6 and grad_rel < 1e-6, (loss_rel, grad_rel)


def _tiny_llama(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return prepare(LlamaForCausalLM(config).float().train(), max_tokens=4096, probe=False)  # not what is tested


def test_dpo_step_is_within_1e_6_of_a_float64_reference_and_returns_the_policys_dtype():
    vocab = 512
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(3, vocab, (1, int(cu[-1])), generator=gen)
    labels = ids.clone()
    for a in cu[:-1].tolist():
        labels[0, a : a + 50] = -100  # the prompt, and the segment's first token
    batch = dict(input_ids=ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 position_ids=torch.cat([torch.arange(n) for n in LENGTHS]).view(1, -1),
                 max_length_q=max(LENGTHS), max_length_k=max(LENGTHS), pair_roles=ROLES, pair_ids=torch.tensor([7, 9]),
                 num_items_in_batch=2)  # fmt: skip
    policy, reference = _tiny_llama(vocab, 0), _tiny_llama(vocab, 1)
    with torch.no_grad():
        ref_logits = reference(**{k: batch[k] for k in MODEL_KEYS}).logits
    logits = policy(**{k: batch[k] for k in MODEL_KEYS}).logits
    want = reference_loss(logits, ref_logits, labels, cu)  # float64, one sequence at a time
    want.backward()
    want_grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    got = dpo_step(policy, reference, batch, beta=0.1)
    got.loss.backward()
    assert got.loss.dtype == torch.float32 and got.chosen_logps.dtype == torch.float32  # the policy's
    assert abs(got.loss.item() - want.item()) <= 1e-6 * abs(want.item())
    for p, w in zip(policy.parameters(), want_grads, strict=True):
        assert (p.grad - w).abs().max() <= 1e-6 * w.abs().max(), (p.grad - w).abs().max() / w.abs().max()
    assert abs(want.item() - 0.6931) > 1e-3  # not log 2, the loss of equal margins: two different models
