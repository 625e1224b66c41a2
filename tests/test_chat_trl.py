"""packer's chat shards in TRL's SFTTrainer (examples/trl_sft.py): its padding-free collator over packer's
rows, positions restarting at every example, packer's labels kept, and the same losses as packer's own
loop (examples/train_loop.py) on a tiny random Llama."""

from __future__ import annotations

import importlib
import json
import sys

import numpy as np
import pytest
from conftest import ROOT, make_build

from packer.contract import schema

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
sys.path.insert(0, str(ROOT / "examples"))


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """8 conversations in 2 rows of 4 (the bundled tokenizer's chat template), so each step of
    grad_accum 2 sees every row: the step losses do not depend on the order either side reads rows in."""
    tmp = tmp_path_factory.mktemp("chats")
    records = [{"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": f"What is {i} plus {i}?"},
                             {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
                             {"role": "user", "content": "And doubled?"},
                             {"role": "assistant", "content": f"That is {4 * i}."}]} for i in range(8)]
    (tmp / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = make_build(tmp / "out", str(tmp / "c.jsonl"), batch_size=4)
    assert schema.read_manifest(out).stats.rows == 2
    return out


def test_sft_trainer_on_packer_rows_matches_packer_loop(chats, tmp_path, capsys):
    trl_sft = importlib.import_module("trl_sft")
    train_loop = importlib.import_module("train_loop")
    rows = schema.open_shard(chats / schema.read_manifest(chats).shards[0].file).to_pylist()
    seen = []

    class Recording(trl_sft.SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
            return super().compute_loss(model, inputs, *args, **kwargs)

    try:
        trainer = trl_sft.make_trainer(chats, steps=2, grad_accum=2, output_dir=str(tmp_path), trainer_cls=Recording,
                                       progress=True)
        trainer.train()
    finally:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    assert "2/2 [" in capsys.readouterr().err  # TRL's (Trainer's) bar of the steps, with its total
    assert len(seen) == 4
    by_ids = {tuple(r["input_ids"]): r for r in rows}
    for batch in seen:
        assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one row, no padding
        row = by_ids[tuple(batch["input_ids"][0].tolist())]
        assert batch["position_ids"][0].tolist() == row["position_ids"]  # restarts at every example
        labels = [t if m else schema.IGNORE_INDEX for t, m in zip(row["input_ids"], row[schema.LOSS_MASK])]
        assert batch["labels"][0].tolist() == labels  # packer's assistant-only labels (format 2: from its mask)
        assert batch["cu_seq_lens_q"].tolist() == np.concatenate([[0], np.cumsum(row["seq_lens"])]).tolist()
    trl_losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    np.testing.assert_allclose(trl_losses, train_loop.train(chats, steps=2, grad_accum=2), rtol=1e-4)
