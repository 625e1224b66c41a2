"""Hybrid models (linear attention, state-space, convolution mixers) on packed rows: the per-segment path.

``prepare`` runs each mixer packer knows once per example (``packer/training/mixers.py``); the probe
decides; the guard refuses, at the forward, a mixer swapped afterwards, a packed row with a cache, and
gradient checkpointing where the boundaries would not reach a recomputed mixer. Tiny random configs
(``benchmarks/sweep_architectures.py``'s), fp32, CPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from benchmarks.sweep_architectures import tiny_model
from packer import prepare
from packer.errors import ConfigError
from packer.planning.context_parallel import RowView
from packer.training import guard, mixers


def _exs(lens, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lens]


def _alone(model, exs):
    with torch.no_grad():
        return [model(input_ids=e.view(1, -1), use_cache=False).logits[0] for e in exs]


def _packed(model, exs, **drop):
    row = {k: v for k, v in guard._row(exs).items() if k not in drop}
    with torch.no_grad():
        return model(**row, use_cache=False).logits[0].split([len(e) for e in exs])


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid", "mamba"])
def test_per_segment_path_is_exact_and_says_so(model_type):
    model = tiny_model(model_type)
    reference = copy.deepcopy(model)  # untouched, eager
    exs = _exs([5, 70, 9])  # 70 > the GatedDeltaNet's chunk of 64
    wrong = _packed(reference, exs, cu_seq_lens_q=0, cu_seq_lens_k=0)  # (with them transformers raises, for GDN)
    assert max((w - a).abs().max().item() for w, a in zip(wrong, _alone(reference, exs), strict=True)) > 1e-4
    prepare(model, max_tokens=128)
    assert model.packer_path == "per-segment"
    for drop in ({}, {"cu_seq_lens_q": 0, "cu_seq_lens_k": 0}):  # boundaries from kwargs, or from positions only
        got = _packed(model, exs, **drop)
        for g, a in zip(got, _alone(reference, exs), strict=True):
            assert (g - a).abs().max().item() < 1e-5
    if model_type == "granitemoehybrid":  # its tiny config's cache fails in transformers itself, prepared or not
        return
    # generation (unpacked, with a cache) runs the mixers as they are
    with torch.no_grad():
        out = model(input_ids=exs[0].view(1, -1), use_cache=True).logits
        assert torch.equal(out, reference(input_ids=exs[0].view(1, -1), use_cache=True).logits)


def test_an_attention_model_keeps_its_path():
    assert prepare(tiny_model("llama"), max_tokens=128).packer_path == "attention"


def test_the_probe_lengths_follow_the_mixers_thresholds():
    qwen = tiny_model("qwen3_5_text")
    assert 64 in mixers.thresholds(qwen) and 4 in mixers.thresholds(qwen)  # delta-rule chunk, conv width
    assert guard.probe_lengths(qwen.config, 1024, mixers.thresholds(qwen))[1] >= 67
    minimax = tiny_model("minimax", dict(block_size=16))
    assert 16 in mixers.thresholds(minimax)


def test_without_the_per_segment_path_the_probe_refuses(monkeypatch):
    """The probe is what accepts: a mixer run across the row leaks, and the probe sees it."""
    model = tiny_model("lfm2")
    monkeypatch.setattr(mixers, "install", lambda model: [])
    with pytest.raises(ConfigError, match="probe"):
        prepare(model)
    assert "forward" not in model.model.layers[0].conv.__dict__  # refused: left as it was


def test_an_unknown_mixer_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(mixers, "MIXERS", {k: v for k, v in mixers.MIXERS.items() if k != "Qwen3_5GatedDeltaNet"})
    with pytest.raises(ConfigError, match="Qwen3_5GatedDeltaNet"):
        prepare(tiny_model("qwen3_5_text"))


def test_a_mixer_swapped_after_prepare_is_refused_at_the_forward():
    model = prepare(tiny_model("qwen3_5_text"), max_tokens=128)
    layer = model.model.layers[0]
    row = guard._row(_exs([5, 9]))
    layer.linear_attn = copy.deepcopy(layer.linear_attn)  # a fresh module in its place
    del layer.linear_attn.__dict__["forward"]
    with pytest.raises(ConfigError, match="replaced"):
        model(**row)
    with torch.no_grad():  # unpacked forwards are left alone
        model(input_ids=row["input_ids"][:, :5])
    prepare(model, max_tokens=128)  # prepare again: wrapped again
    model(**row)


@pytest.mark.parametrize("model_type", ["lfm2", "minimax"])
def test_a_packed_row_with_a_cache_holding_a_state_is_refused(model_type):
    """use_cache on in training makes a fresh cache: exact; a cache that holds a state is refused."""
    model = tiny_model(model_type, dict(block_size=16) if model_type == "minimax" else None)
    reference = copy.deepcopy(model)
    prepare(model, max_tokens=128)
    exs = _exs([5, 20])
    with torch.no_grad():
        got = model(**guard._row(exs), use_cache=True).logits[0].split([5, 20])
        for g, a in zip(got, _alone(reference, exs), strict=True):
            assert (g - a).abs().max().item() < 1e-5
        past = model(input_ids=exs[0].view(1, -1), use_cache=True).past_key_values
        with pytest.raises(ConfigError, match="cache"):
            model(**guard._row(exs), past_key_values=past, use_cache=True)


def test_gradient_checkpointing_needs_boundaries_that_reach_the_mixers():
    exs = _exs([5, 9])
    mamba = prepare(tiny_model("mamba")).train()
    mamba.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="gradient checkpointing.*MambaMixer"):
        mamba(**guard._row(exs))
    qwen = tiny_model("qwen3_5_text").train()
    reference = copy.deepcopy(qwen)
    prepare(qwen)
    qwen.gradient_checkpointing_enable()
    for m, row in ((qwen, guard._row(exs)), (reference, None)):
        if row is None:
            loss = sum(m(input_ids=e.view(1, -1)).logits.pow(2).sum() for e in exs)
        else:
            loss = m(**row).logits.pow(2).sum()
        loss.backward()
    for (name, p), q in zip(qwen.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name


def test_context_parallel_with_a_hybrid_model_is_refused():
    model = prepare(tiny_model("lfm2"))
    row = guard._row(_exs([6, 10]))
    half = {**row, "input_ids": row["input_ids"][:, :8], "position_ids": row["position_ids"][:, :8]}
    with pytest.raises(ConfigError, match="cover 16 tokens"):  # a contiguous share with the row's cu_seq_lens
        model(**half)
    with pytest.raises(ConfigError, match="context-parallel"):
        model(**row, cp_cu_seqlens=row["cu_seq_lens_q"])


def _view_batch(lens):
    t = sum(lens)
    return {"input_ids": np.arange(t)[None], "position_ids": np.concatenate([np.arange(n) for n in lens])[None],
            "labels": np.arange(t)[None], "cu_seq_lens_q": np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
            "num_items_in_batch": 1}  # fmt: skip


def test_seq_idx_in_static_shapes_and_context_parallel_shares():
    static = RowView(static=(12, 3))(_view_batch([3, 5]), None)
    assert static["seq_idx"].dtype == np.int32
    assert static["seq_idx"][0].tolist() == [0] * 3 + [1] * 5 + [2] * 4  # the padding is a segment of its own
    full = np.repeat([0, 1], [4, 8])
    for rank in (0, 1):
        share = RowView(cp_size=2, cp_rank=rank, layout="zigzag")(_view_batch([4, 8]), None)
        assert share["seq_idx"][0].tolist() == full[share["input_ids"][0]].tolist()
