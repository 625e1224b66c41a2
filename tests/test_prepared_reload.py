"""A checkpoint saved from a prepared model (save_pretrained, from_pretrained) refuses the loader's packed rows
in one line until ``prepare`` is called on it again; then each example gets its logits alone. Unpacked forwards
(generation) pass. Tiny random configs (``benchmarks/sweep_architectures.py``'s), fp32, CPU, a real build."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from conftest import make_build
from transformers import AutoModelForCausalLM

from benchmarks.sweep_architectures import tiny_model
from packer import prepare, read_manifest
from packer.errors import ConfigError
from packer.training import prepared
from packer.training.loader import make_dataloader


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_build(tmp_path_factory.mktemp("reload_shards"), limit=8, pack="batch", batch_size=3, max_len=64)


def _save_and_load(model, folder):
    with contextlib.redirect_stderr(io.StringIO()):  # the kernels' fallback notices
        model.save_pretrained(folder)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


@pytest.mark.parametrize("model_type", ["mamba", "minimax"])  # Mamba1 (no attention), lightning attention
def test_a_checkpoint_of_a_prepared_model_refuses_packed_rows_until_prepared(shards, tmp_path, model_type):
    vocab = read_manifest(shards).tokenizer["vocab_size"]
    budget = read_manifest(shards).stats.max_row_tokens
    model = prepare(tiny_model(model_type, dict(vocab_size=vocab)), max_tokens=budget)
    assert model.config.packer_prepared == {"implementation": "packer_varlen", "max_tokens": budget,
                                            "path": "per-segment"}  # fmt: skip
    loaded = _save_and_load(model, tmp_path / "checkpoint")
    assert loaded.config.packer_prepared["path"] == "per-segment"  # config.json kept the mark
    batch = next(iter(make_dataloader(shards, shuffle=False)))
    assert batch["cu_seq_lens_q"].numel() > 2
    with torch.no_grad(), pytest.raises(ConfigError, match="loaded without it") as e:
        loaded(**batch)
    assert "\n" not in str(e.value)
    # the same row without cu_seq_lens: the restarting positions say it is packed
    row = {k: batch[k] for k in ("input_ids", "position_ids")}
    for extra in ({}, {"attention_mask": torch.ones_like(row["input_ids"])}):  # a collator's mask of ones too
        with torch.no_grad(), pytest.raises(ConfigError, match="loaded without it"):
            loaded(**row, **extra)
    with torch.no_grad():  # unpacked forwards (one example, generation) are left alone
        first = batch["input_ids"][:, : int(batch["cu_seq_lens_q"][1])]
        alone = loaded(input_ids=first, use_cache=False).logits
        loaded.generate(torch.tensor([[5, 6, 7], [0, 8, 9]]), attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]),
                        max_new_tokens=2, do_sample=False)  # a left-padded batch: its positions restart, unpacked
    prepare(loaded, max_tokens=budget)
    with torch.no_grad():
        packed = loaded(**batch).logits[:, : first.shape[1]]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_a_model_loaded_before_packer_was_imported_is_found(tmp_path):
    """The scan at import finds a marked model built before it (here: its watch taken off by hand)."""
    loaded = _save_and_load(prepare(tiny_model("falcon_mamba"), max_tokens=64), tmp_path / "checkpoint")
    for key in [k for k, h in loaded._forward_pre_hooks.items() if getattr(h, "packer_watch", False)]:
        del loaded._forward_pre_hooks[key]
    row = dict(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    prepared._watch_live_models()
    with torch.no_grad(), pytest.raises(ConfigError, match="loaded without it"):
        loaded(**row)
