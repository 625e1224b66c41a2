"""End to end on real `packer build` output: loader rows into a tiny Llama, gradient accumulation
normalisation, and `python -m train.train` lowering the loss on the bundled sample."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packer import schema
from packer.attention import prepare
from packer.loader import make_dataloader
from train.train import load_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The bundled sample through the CLI: 64 records, batch mode of 4, max_len 128 (small rows)."""
    out = tmp_path_factory.mktemp("train_shards")
    cmd = [sys.executable, "-m", "packer.cli", "build", "flan", "--out", str(out), "--limit", "64"]
    cmd += [
        "--pack",
        "batch",
        "--batch-size",
        "4",
        "--max-len",
        "128",
        "--tokenizer",
        str(ROOT / "data/tokenizer"),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def test_loader_batches_feed_the_model(shards):
    model = prepare(load_model(schema.read_manifest(shards).to_json(), None, torch.device("cpu"), seed=0))
    batch = next(iter(make_dataloader(shards)))
    out = model(**batch)
    assert out.logits.shape[:2] == batch["input_ids"].shape
    assert torch.isfinite(out.loss)


def test_grad_accum_normalisation_equals_the_big_batch(shards):
    """G micro-batches with num_items_in_batch give the loss and gradient of all G rows at once."""
    g = 3
    model = prepare(load_model(schema.read_manifest(shards).to_json(), None, torch.device("cpu"), seed=0))
    micro = [b for _, b in zip(range(g), make_dataloader(shards, grad_accum=g, seed=1), strict=False)]
    assert len({b["num_items_in_batch"] for b in micro}) == 1
    total = sum(float(b["num_items_in_batch"]) for b in micro[:1])
    assert total == sum(int((b["labels"] != -100).sum()) for b in micro)
    acc_loss = 0.0
    for b in micro:
        loss = model(**b).loss
        loss.backward()
        acc_loss += loss.item()
    acc_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    # the big batch: the G rows concatenated into one packed row, token-mean loss
    cat = {k: torch.cat([b[k] for b in micro], dim=1) for k in ("input_ids", "position_ids", "labels")}
    lens = torch.cat([b["cu_seq_lens_q"].diff() for b in micro])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    m = int(lens.max())
    big = model(**cat, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m).loss
    big.backward()
    assert abs(acc_loss - big.item()) <= 1e-5
    assert torch.allclose(acc_grad, model.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-4)


def test_train_cli_lowers_the_loss(shards, tmp_path):
    save = tmp_path / "model"
    cmd = [sys.executable, "-m", "train.train", "--shards", str(shards), "--steps", "6", "--grad-accum", "2"]
    cmd += ["--save", str(save)]
    out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    first, last = map(float, re.search(r"loss first ([\d.]+) last ([\d.]+)", out).groups())
    assert last < first - 0.1, out
    assert (save / "config.json").is_file() and (save / "loader_state.json").is_file()
