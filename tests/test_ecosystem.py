"""packer shards in the Hugging Face / PyTorch ecosystem: datasets.load_from_disk, Trainer, a plain
loop, accelerate, torchrun (2 CPU processes, gloo), and folders given as fsspec URLs. The training
tests run the scripts in examples/ for a few steps of a tiny random Llama on CPU."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys

import fsspec
import numpy as np
import pytest
from conftest import ROOT, make_build

from packer import fs
from packer.contract import schema

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(ROOT / "examples"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """48 records in batch rows of 2, max_len 256: rows of a few hundred tokens, quick to train on."""
    return make_build(tmp_path_factory.mktemp("small"), limit=48, batch_size=2, max_len=256)


@pytest.fixture
def memory_copy():
    """Copy a folder into fsspec's in-memory filesystem; yields a function folder -> memory:// URL."""
    fs = fsspec.filesystem("memory")
    made = []

    def copy(directory, name="shards"):
        fs.put(str(directory), f"/{name}", recursive=True)
        made.append(f"/{name}")
        return f"memory://{name}"

    yield copy
    for path in made:
        fs.rm(path, recursive=True)


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _row_hashes(directory) -> set[str]:
    hashes = set()
    for entry in schema.read_manifest(directory).shards:
        for ids in schema.open_shard(directory / entry.file).column("input_ids").to_pylist():
            hashes.add(hashlib.sha1(np.asarray(ids, np.int64).tobytes()).hexdigest())
    return hashes


# -- datasets ---------------------------------------------------------------------------------------


def test_load_from_disk_gives_one_row_per_pack(flan_batch):
    import datasets

    manifest = schema.read_manifest(flan_batch)
    ds = datasets.load_from_disk(str(flan_batch))
    assert len(ds) == manifest.stats.rows
    expected = manifest.row_format.schema()  # format 2: uint16 ids and positions, loss_mask booleans
    assert ds.column_names == expected.names and schema.LOSS_MASK in ds.column_names
    assert [str(f.type) for f in ds.features.arrow_schema] == [str(f.type) for f in expected]
    first = schema.open_shard(flan_batch / manifest.shards[0].file).slice(0, 1).to_pylist()[0]
    assert ds[0] == first
    assert ds.cache_files and all(f["filename"].endswith(schema.SHARD_SUFFIX) for f in ds.cache_files)  # mapped
    # the files beside the shards follow from the manifest alone (deterministic bytes)
    for name, data in schema.datasets_files(manifest).items():
        assert (flan_batch / name).read_bytes() == data
    torch_row = ds.with_format("torch")[1]
    assert int(torch_row["seq_lens"].sum()) == len(torch_row["input_ids"])


# -- training ---------------------------------------------------------------------------------------


def test_plain_loop_trains(small):
    train_loop = importlib.import_module("train_loop")
    losses = train_loop.train(small, steps=3, grad_accum=2)
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_plain_loop_says_and_skips_its_filler_rows_exactly(tmp_path, monkeypatch, capsys):
    """3 rows in steps of 2 micro-batches: each epoch's second step is completed by a filler row, which the
    loop skips (and says so): the same losses and weights as computing it."""
    import torch

    train_loop = importlib.import_module("train_loop")
    common = importlib.import_module("common")
    three = make_build(tmp_path / "three", limit=9, batch_size=3, max_len=256)
    runs = []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(train_loop, "is_filler", lambda batch: False)
        model = common.tiny_llama(three)
        runs.append((train_loop.train(three, steps=3, grad_accum=2, model=model, progress=skip),
                     [p.detach().clone() for p in model.parameters()]))
    (skipped, weights), (computed, weights_computed) = runs
    np.testing.assert_allclose(skipped, computed, rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(weights, weights_computed, strict=True))
    assert "each epoch's last step is completed by 1 filler row (no loss), skipped here" in capsys.readouterr().out


def test_trainer_uses_the_packed_loader_and_normalises_like_the_plain_loop(small, tmp_path, capsys):
    trainer_mod = importlib.import_module("trainer")
    train_loop = importlib.import_module("train_loop")
    seen = []

    class Recording(trainer_mod.PackedTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append((inputs["input_ids"].shape, int(num_items_in_batch), int(inputs["num_items_in_batch"])))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    try:
        trainer = trainer_mod.make_trainer(small, steps=2, grad_accum=2, output_dir=str(tmp_path), trainer_cls=Recording,
                                           progress=True)
        assert trainer.data_collator is not None  # Trainer's default, never called: the loader yields batches
        trainer.train()
    finally:
        _reset_accelerate()
    assert "2/2 [" in capsys.readouterr().err  # Trainer's own bar of the steps, with its total
    assert len(seen) == 4
    for shape, trainer_items, packer_items in seen:
        assert shape[0] == 1  # one packed row per micro-batch, never padded
        assert trainer_items == packer_items  # Trainer's count of the step's loss tokens is packer's
    trainer_losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    loop_losses = train_loop.train(small, steps=2, grad_accum=2)
    np.testing.assert_allclose(trainer_losses, loop_losses, rtol=1e-4)


def test_accelerate_matches_plain_loop(small, capsys):
    accelerate_loop = importlib.import_module("accelerate_loop")
    train_loop = importlib.import_module("train_loop")
    try:
        losses = accelerate_loop.train(small, steps=2, grad_accum=2, progress=True)
    finally:
        _reset_accelerate()
    seen = capsys.readouterr()
    assert "train: 100%" in seen.err and "2/2 [" in seen.err and f"step 1: loss {losses[1]:.4f}" in seen.out  # bar, losses
    np.testing.assert_allclose(losses, train_loop.train(small, steps=2, grad_accum=2), rtol=1e-4)


def test_torchrun_two_cpu_ranks_see_disjoint_rows(small, tmp_path):
    steps = 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "examples" / "torchrun.py"), str(small), "--steps", str(steps), "--report", str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    rows = [set(rep["rows"]) for rep in reports]
    assert all(len(r) == steps for r in rows)
    assert not rows[0] & rows[1]  # disjoint rows
    assert rows[0] | rows[1] <= _row_hashes(small)  # real rows of the build
    assert reports[0]["param_checksum"] == reports[1]["param_checksum"]  # DDP kept the replicas equal
    assert all(np.isfinite(rep["losses"]).all() for rep in reports)
    assert "train (rank 0 of 2): 100%" in result.stderr and f"{steps}/{steps} [" in result.stderr  # one bar: rank 0's
    assert "rank 1 of" not in result.stderr


# -- fsspec -----------------------------------------------------------------------------------------


def test_schema_reads_fsspec_urls(flan_batch, memory_copy):
    url = memory_copy(flan_batch)
    manifest = schema.read_manifest(flan_batch)
    for where in (f"file://{flan_batch}", url):
        assert schema.read_manifest(where) == manifest
        entry = manifest.shards[0]
        shard = fs.join(where, entry.file)
        assert fs.file_size(shard) == entry.bytes
        assert fs.file_sha256(shard) == entry.sha256
        assert schema.open_shard(shard).equals(schema.open_shard(flan_batch / entry.file))
        assert set(fs.list_names(where)) >= {schema.MANIFEST_NAME, entry.file, *schema.DATASETS_FILES}
    assert fs.file_size(fs.join(url, "nope.arrow")) is None


def _batches(directory, n=6):
    from packer.training.loader import make_dataloader

    loader = make_dataloader(directory, seed=3)
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_loader_reads_fsspec_urls(small, memory_copy):
    url = memory_copy(small)
    local = _batches(small)
    for where in (f"file://{small}", url):
        remote = _batches(where)
        for a, b in zip(local, remote, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]


def test_verify_reads_fsspec_urls(small, memory_copy):
    from packer.checking.verify import verify

    expected = verify(small)
    assert expected.ok
    for where in (f"file://{small}", memory_copy(small)):
        report = verify(where)
        assert report.ok, report.problems[:2]
        assert report.checked == expected.checked
