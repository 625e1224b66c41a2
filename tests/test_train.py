"""End to end on real `packer build` output: loader rows into a tiny Llama, gradient accumulation
normalisation, `python -m train.train` lowering the loss on the bundled sample, and the CPU parts of
the padded-vs-packed benchmark (its GPU run needs CUDA and flash-attn)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import matplotlib.image as plt_image
import numpy as np
import pytest
import torch
from conftest import make_build

from packer import prepare
from packer.contract import schema
from packer.training.loader import make_dataloader
from train import bench, measure, report
from train.bench import BenchError, check_cuda
from train.loader_bench import bench_loader
from train.model import SIZES, random_llama
from train.train import load_model
from train.train import main as train_main


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The bundled sample: 64 records, batch mode of 4, max_len 128 (small rows). Built in this process:
    what the CLI adds to a build is tested in test_cli."""
    return make_build(tmp_path_factory.mktemp("train_shards"), limit=64, pack="batch", batch_size=4, max_len=128)


def test_loader_batches_feed_the_model(shards):
    model = prepare(load_model(schema.read_manifest(shards), None, torch.device("cpu"), seed=0))
    batch = next(iter(make_dataloader(shards)))
    out = model(**batch)
    assert out.logits.shape[:2] == batch["input_ids"].shape
    assert torch.isfinite(out.loss)


def test_grad_accum_normalisation_equals_the_big_batch(shards):
    """G micro-batches with num_items_in_batch give the loss and gradient of all G rows at once."""
    g = 3
    model = prepare(load_model(schema.read_manifest(shards), None, torch.device("cpu"), seed=0))
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


def test_train_cli_lowers_the_loss(shards, tmp_path, capsys):
    """``python -m train.train``'s own entry (``main``, which its ``__main__`` calls), in this process: torch
    is imported here already, and a fresh interpreter would only add its import."""
    save = tmp_path / "model"
    result = train_main(["--shards", str(shards), "--steps", "6", "--grad-accum", "2", "--save", str(save)])
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"loss first ([\d.]+) last ([\d.]+)", out).groups())
    assert (first, last) == (pytest.approx(result["losses"][0], abs=1e-4), pytest.approx(result["losses"][-1], abs=1e-4))
    assert last < first - 0.1, out
    assert (save / "config.json").is_file() and (save / "loader_state.json").is_file()


# --- the padded-vs-packed benchmark (train/bench.py): every part that does not need CUDA ---------------


def test_model_sizes_fit_the_build(shards):
    """One constructor for every size: the vocabulary and special ids come from the build; the GPU
    size is ~1B parameters (counted on the meta device, no memory)."""
    manifest = schema.read_manifest(shards)
    tiny = random_llama(manifest, "tiny")
    assert tiny.config.vocab_size == manifest.tokenizer["vocab_size"]
    assert tiny.config.eos_token_id == manifest.tokenizer["eos_token_id"]
    assert tiny.config.hidden_size == SIZES["tiny"].hidden and not tiny.config.use_cache
    same = random_llama(manifest, "tiny")  # the same seed gives the same weights (both bench sides)
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), same.parameters()))
    llama2 = dataclasses.replace(manifest, tokenizer={"vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2})
    big = random_llama(llama2, "1b", device="meta")
    assert 0.95e9 < sum(p.numel() for p in big.parameters()) < 1.1e9
    with pytest.raises(ValueError, match="unknown model size"):
        random_llama(manifest, "7b")


def test_bench_cuda_refusals():
    check_cuda(True, True)
    with pytest.raises(BenchError, match="CUDA is not available"):
        check_cuda(False, True)
    with pytest.raises(BenchError, match=r"pip install -e '\.\[train,flash\]'"):
        check_cuda(True, False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps 0: must be at least 1"),
        (["--repeats", "0"], "--repeats 0: must be at least 1"),
        (["--plot", "curves.svg"], "give a .png file name"),
        pytest.param(
            ["--device", "cuda"],
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present"),
        ),
    ],
)
def test_bench_refuses_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", *argv] if "--device" not in argv else argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_loader_bench_counts_the_same_tokens(shards):
    r = bench_loader(shards, repeats=2)
    assert r["tokens"] == schema.read_manifest(shards).stats.tokens
    assert r["packer"][1] <= r["packer"][0] <= r["packer"][2] and r["ratio"][0] > 0


def test_bench_quick_mode_is_small_and_yields_to_the_command_line():
    quick = bench.parse(["--quick", "--device", "cpu"])
    assert (quick.size, quick.steps, quick.warmup, quick.repeats, quick.datasets, quick.no_loader) == \
        ("tiny", 2, 0, 1, ["flan"], True)
    assert bench.parse(["--quick", "--device", "cpu", "--steps", "3"]).steps == 3
    full = bench.parse(["--device", "cpu"])
    assert (full.size, full.steps, full.repeats, full.datasets, full.no_loader) == ("cpu", 6, 3, ["flan", "math"], False)


def test_bench_command_end_to_end(shards, tmp_path, capsys, monkeypatch):
    """The command itself (its quick mode, 1 untimed + 3 timed steps), each run the command line of a fresh
    process. The packed side runs in one (its attention registered there, as the command runs it); the padded
    side's command line runs through the same entry in this process, which has torch and transformers loaded
    already (a fresh interpreter would only add their import: seconds). The padded side (transformers' own sdpa
    with a padding mask) is the reference: the packed rows give the same loss at every step. Then the table and
    the figure from these runs."""
    ran = []

    def run(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "train.bench", "--child"], cmd
        mode = json.loads(cmd[4])["mode"]
        ran.append(mode)
        if mode == "packed":
            return subprocess.run(cmd, **kwargs)
        threads, out = torch.get_num_threads(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                bench.main(cmd[3:])
        finally:
            torch.set_num_threads(threads)
        return subprocess.CompletedProcess(cmd, 0, out.getvalue(), "")

    monkeypatch.setattr(bench, "subprocess", types.SimpleNamespace(run=run))
    png = tmp_path / "bench.png"
    results = bench.main(["--shards", str(shards), "--device", "cpu", "--quick", "--steps", "3", "--warmup", "1",
                          "--plot", str(png)])
    out = capsys.readouterr().out
    assert "padded vs packed: tiny Llama" in out and "packed/padded:" in out
    assert ran == ["padded", "packed"]
    (name,) = results
    runs, s = results[name]["runs"], results[name]["summary"]
    pad, pack = runs["padded"][0], runs["packed"][0]
    assert len(pad["losses"]) == len(pack["losses"]) == 4
    pad_l, pack_l = np.array(pad["losses"]), np.array(pack["losses"])
    # a row whose trained tokens were all cut at max-len 128 has no loss: 0/0 = nan padded, 0 packed
    empty = np.isnan(pad_l)
    assert (pack_l[empty] == 0).all() and (~empty).sum() >= 2
    np.testing.assert_allclose(pad_l[~empty], pack_l[~empty], atol=1e-5)
    assert pack["computed_tokens"] == pack["tokens"] < pad["computed_tokens"]  # packed computes no padding
    tps = {m: [r["tokens_per_s"] for r in runs[m]] for m in measure.MODES}
    assert s["speedup"][0] == pytest.approx(np.median(tps["packed"]) / np.median(tps["padded"]))
    assert s["speedup"][1] <= s["speedup"][0] <= s["speedup"][2]
    assert s["max_loss_diff"] < 1e-5
    lines = report.table(name, s, "max RSS rise")
    assert "\n".join(lines) in out  # the table the command printed is the one of its runs
    assert f"packed/padded: {s['speedup'][0]:.2f}x tokens/s [{s['speedup'][1]:.2f}–{s['speedup'][2]:.2f}]" in lines[-1]
    padding = 1 - pack["computed_tokens"] / pad["computed_tokens"]
    assert f"({padding:.1%} padding)" in lines[0]
    image = plt_image.imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 900  # one dataset row: loss curves + tokens/s
