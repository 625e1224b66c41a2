"""End to end on CPU: a tiny Qwen3.5-style model (GatedDeltaNet + attention) and a tiny Mamba2 hybrid
(GraniteMoeHybrid) train on `packer build` rows through `make_dataloader`, each example's loss equal to
its loss alone, and two optimizer steps on packed rows give the parameters of the same steps taken on
the examples one by one (unprepared, eager)."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_build

from benchmarks.sweep_architectures import tiny_model
from packer import prepare, read_manifest
from packer.training.loader import make_dataloader

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """16 bundled records in batch rows of 2, max_len 128, built in this process."""
    return make_build(tmp_path_factory.mktemp("hybrid_shards"), limit=16, pack="batch", batch_size=2, max_len=128)


def _token_losses(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_hybrid_trains_on_packed_rows_as_on_each_example_alone(shards, model_type):
    vocab = read_manifest(shards).tokenizer["vocab_size"]
    model = tiny_model(model_type, dict(vocab_size=vocab, tie_word_embeddings=True))
    reference = copy.deepcopy(model)  # unprepared, eager: each example alone
    prepare(model, max_tokens=read_manifest(shards).stats.max_row_tokens)
    assert model.packer_path == "per-segment"
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    batches = list(make_dataloader(shards, shuffle=False))[:2]
    assert all(b["cu_seq_lens_q"].numel() > 2 for b in batches)  # several examples a row
    for batch in batches:
        out = model(**batch)
        cu = batch["cu_seq_lens_q"].tolist()
        token_losses = _token_losses(out.logits[0], batch["labels"][0])
        loss_ref = 0
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            alone = reference(input_ids=batch["input_ids"][:, a:b], use_cache=False).logits[0]
            mine = _token_losses(alone, batch["labels"][0, a:b]).sum()
            packed = token_losses[a : b - 1].sum()  # the row's last token of a segment predicts nothing here
            assert torch.allclose(packed, mine, rtol=1e-5, atol=1e-5), (a, b)
            loss_ref = loss_ref + mine
        (loss_ref / batch["num_items_in_batch"]).backward()
        torch.testing.assert_close(out.loss, loss_ref / batch["num_items_in_batch"], rtol=1e-5, atol=1e-6)
        out.loss.backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p - q).abs().max() <= 1e-5 * (1 + q.abs().max()), name


def test_hybrid_in_trl_sft_trainer_gets_each_examples_loss(shards, tmp_path, monkeypatch):
    """TRL's SFTTrainer on its padding-free path (examples/trl_sft.py) over a prepared Qwen3.5-style model:
    each micro-batch's loss is the examples' losses alone, summed over the step's loss tokens."""
    pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "examples"))
    import trl_sft
    from accelerate.state import AcceleratorState, GradientState, PartialState

    # fp32: SFTConfig's default bf16=True autocasts on the CPU too, and bf16 would hide a leak (docs/training.md)
    monkeypatch.setattr(trl_sft, "SFTConfig", functools.partial(trl_sft.SFTConfig, bf16=False))

    model = tiny_model("qwen3_5_text", dict(vocab_size=read_manifest(shards).tokenizer["vocab_size"]))
    reference = copy.deepcopy(model)
    prepare(model, max_tokens=read_manifest(shards).stats.max_row_tokens)
    seen = []

    class Recording(trl_sft.SFTTrainer):
        def compute_loss(self, model, inputs, *args, num_items_in_batch=None, **kwargs):
            loss = super().compute_loss(model, inputs, *args, num_items_in_batch=num_items_in_batch, **kwargs)
            seen.append(({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()},
                         float(loss), int(num_items_in_batch)))  # fmt: skip
            return loss

    try:
        trl_sft.make_trainer(shards, steps=1, grad_accum=2, output_dir=str(tmp_path), model=model,
                             trainer_cls=Recording).train()  # fmt: skip
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    assert len(seen) == 2  # one optimizer step: both micro-batches saw the initial parameters
    for inputs, loss, items in seen:
        cu = inputs["cu_seq_lens_q"].tolist()
        assert len(cu) > 2 and "attention_mask" not in inputs
        with torch.no_grad():
            alone = sum(_token_losses(reference(input_ids=inputs["input_ids"][:, a:b], use_cache=False).logits[0],
                                      inputs["labels"][0, a:b]).sum() for a, b in zip(cu[:-1], cu[1:], strict=True))  # fmt: skip
        assert abs(loss - float(alone) / items) <= 1e-5 * abs(loss)
