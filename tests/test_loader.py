"""The loader: the batch contract, open-time checks, ranks × workers coverage, shuffling, remainder,
num_items_in_batch and exact resume. Shards are written by hand here with the schema module, so these
tests depend on the on-disk contract only, not on `packer build`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from packer import BuildConfig, fs
from packer.contract import schema
from packer.errors import ConfigError, ShardFormatError
from packer.training.loader import PackedDataset, make_dataloader

ROW_TAG = 1000  # each row's first token is ROW_TAG + row index, so a batch names its row


def write_build(directory: Path, n_rows: int, *, rows_per_shard: int = 7, rows_per_batch: int = 3, seed: int = 0,
                epochs: int = 1, config: dict | None = None) -> list[dict]:
    """A finished build by hand: random examples (1–4 per row), completion-only labels, manifest last;
    ``epochs`` planned epochs of ``n_rows // epochs`` rows each."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    example_id = 0
    for r in range(n_rows):
        lens = rng.integers(3, 13, size=rng.integers(1, 5)).tolist()
        ids, pos, labels = [], [], []
        for n in lens:
            toks = rng.integers(5, 100, size=n).tolist()
            prompt = int(rng.integers(1, n))
            ids += toks
            pos += list(range(n))
            labels += [-100] * prompt + toks[prompt:]
        ids[0] = ROW_TAG + r
        rows.append(
            {
                "input_ids": ids,
                "position_ids": pos,
                "labels": labels,
                "seq_lens": lens,
                "example_ids": list(range(example_id, example_id + len(lens))),
                "num_loss_tokens": sum(lab != -100 for lab in labels),
                "max_seqlen": max(lens),
            }
        )
        example_id += len(lens)
    shards = []
    for i, start in enumerate(range(0, n_rows, rows_per_shard)):
        chunk = rows[start : start + rows_per_shard]
        table = pa.Table.from_pylist(chunk, schema=schema.ROW_SCHEMA)
        path = directory / schema.shard_name(i)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema.ROW_SCHEMA) as writer:
            for batch in table.to_batches(max_chunksize=rows_per_batch):  # several record batches per shard
                writer.write_batch(batch)
        shards.append(schema.ShardEntry(file=path.name, rows=len(chunk), tokens=sum(len(r["input_ids"]) for r in chunk),
                                        bytes=path.stat().st_size, sha256=fs.file_sha256(path)))
    tokens = sum(len(r["input_ids"]) for r in rows)
    longest = max(len(r["input_ids"]) for r in rows)
    stats = schema.Stats(
        examples=example_id, examples_packed=example_id, examples_split=0, examples_truncated=0, examples_dropped=0,
        segments=example_id, tokens_in=tokens, tokens=tokens, tokens_truncated=0, tokens_dropped=0, rows=n_rows,
        max_row_tokens=longest, row_budget=longest, lower_bound=-(-tokens // longest), fill=tokens / (n_rows * longest),
        world_size=1, rank_work_max_over_mean=1.0, examples_read=example_id, records_skipped=0, dropped_by_reason={},
        loss_tokens=sum(r["num_loss_tokens"] for r in rows), segments_without_loss=0,
        epochs=epochs if epochs > 1 else None,
    )
    manifest = schema.Manifest(
        created_by="tests/test_loader.py", note=None, config=BuildConfig(
            source="test", out="", format_version=1, **(config or {"pack": "batch"})),  # format 1's int32 columns
        tokenizer={"name_or_path": "test", "vocab_size": ROW_TAG + n_rows, "pad_token_id": 0}, source={},
        stats=stats, shards=tuple(shards),
    )
    (directory / schema.MANIFEST_NAME).write_bytes(manifest.dumps())
    return rows


def row_of(batch: dict) -> int:
    return int(batch["input_ids"][0, 0]) - ROW_TAG


def is_filler(batch: dict) -> bool:
    return bool((batch["labels"] == -100).all())


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    directory = tmp_path_factory.mktemp("build")
    rows = write_build(directory, 23)
    return directory, rows


def test_batch_matches_row(build):
    directory, rows = build
    ds = PackedDataset(directory, shuffle=False)
    batches = list(ds)
    assert len(batches) == len(rows) == len(ds)
    for batch, row in zip(batches, rows, strict=True):
        assert set(batch) == {
            "input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k",
            "max_length_q", "max_length_k", "seq_idx", "num_items_in_batch",
        }  # fmt: skip
        # each token's segment index: what causal-conv1d and the Mamba2 scan take
        assert batch["seq_idx"].dtype == torch.int32 and batch["seq_idx"].shape == (1, len(row["input_ids"]))
        assert batch["seq_idx"][0].tolist() == [i for i, n in enumerate(row["seq_lens"]) for _ in range(n)]
        for key in ("input_ids", "position_ids", "labels"):
            assert batch[key].dtype == torch.int64 and batch[key].shape == (1, len(row["input_ids"]))
            assert batch[key][0].tolist() == row[key]
        assert batch["cu_seq_lens_q"].dtype == torch.int32
        assert batch["cu_seq_lens_q"].tolist() == [0, *np.cumsum(row["seq_lens"]).tolist()]
        assert batch["cu_seq_lens_k"].tolist() == batch["cu_seq_lens_q"].tolist()
        assert type(batch["max_length_q"]) is int and batch["max_length_q"] == max(row["seq_lens"])
        assert type(batch["max_length_k"]) is int and batch["max_length_k"] == max(row["seq_lens"])
        assert batch["num_items_in_batch"] == row["num_loss_tokens"]
        # the contract's invariant: a segment starts where position == 0, and its label there is ignored
        starts = batch["cu_seq_lens_q"][:-1].long()
        assert (batch["position_ids"][0, starts] == 0).all()
        assert (batch["labels"][0, starts] == -100).all()


def test_open_refuses_bad_directories(tmp_path):
    with pytest.raises(ShardFormatError, match="no such folder"):
        PackedDataset(tmp_path / "nope")
    with pytest.raises(ShardFormatError, match="no manifest.json"):
        PackedDataset(tmp_path)
    write_build(tmp_path / "v", 5)
    m = json.loads((tmp_path / "v" / "manifest.json").read_text())
    m["format_version"] = 99
    (tmp_path / "v" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardFormatError, match="format version 99"):
        PackedDataset(tmp_path / "v")
    write_build(tmp_path / "missing", 12, rows_per_shard=5)
    (tmp_path / "missing" / schema.shard_name(1)).unlink()
    with pytest.raises(ShardFormatError, match="shard-00001.arrow: missing"):
        PackedDataset(tmp_path / "missing")
    write_build(tmp_path / "short", 12, rows_per_shard=5)
    path = tmp_path / "short" / schema.shard_name(2)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ShardFormatError, match="truncated"):
        PackedDataset(tmp_path / "short")
    write_build(tmp_path / "corrupt", 6)
    path = tmp_path / "corrupt" / schema.shard_name(0)
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="sha256"):
        PackedDataset(tmp_path / "corrupt", verify=True)


def _rank_streams(directory, world_size, workers, **kw):
    streams = []
    for rank in range(world_size):
        dl = make_dataloader(directory, rank=rank, world_size=world_size, num_workers=workers, **kw)
        streams.append([(row_of(b), is_filler(b), b["num_items_in_batch"]) for b in dl])
    return streams


# Every world size in this process, and in worker processes: one worker at world size 1, two (each rank's steps
# dealt out between them) at world sizes 1 (23 steps: an odd count), 2 and 4 (12 and 6 steps, a filler each). One
# worker at world sizes 2-4 and two at 3 (8 steps, a filler) were cases of these that each forked this process again.
@pytest.mark.parametrize("world_size, workers", [(1, 0), (2, 0), (3, 0), (4, 0), (1, 1), (1, 2), (2, 2), (4, 2)])
def test_every_row_once_per_epoch(build, world_size, workers):
    directory, rows = build
    streams = _rank_streams(directory, world_size, workers, seed=3)
    assert len({len(s) for s in streams}) == 1, "every rank makes the same number of steps"
    real = Counter(r for s in streams for r, filler, _ in s if not filler)
    assert real == Counter(range(len(rows))), "every real row exactly once over all ranks"
    fillers = sum(filler for s in streams for _, filler, _ in s)
    assert fillers == -len(rows) % world_size
    # the stream does not depend on the number of workers
    assert streams == _rank_streams(directory, world_size, 0, seed=3)


def test_shuffle_groups_and_epochs(build):
    directory, rows = build
    w = 3

    def order(epoch, seed=0):
        out = []
        for rank in range(w):
            ds = PackedDataset(directory, rank=rank, world_size=w, seed=seed)
            ds.set_epoch(epoch)
            out.append([row_of(b) for b in ds])
        return np.array(out).T  # steps × ranks

    e0 = order(0)
    assert (order(0) == e0).all(), "deterministic per (seed, epoch)"
    assert not (order(1) == e0).all() and not (order(0, seed=1) == e0).all()
    # whole groups move: each step holds rows g*w .. g*w+w-1 (fillers are copies of rows mod n)
    for step in e0:
        g = [r for r in step]
        starts = {x // w for x in g if x < len(rows) - len(rows) % w}
        assert len(starts) <= 1
    unshuffled = [row_of(b) for b in PackedDataset(directory, shuffle=False, rank=1, world_size=w)]
    assert unshuffled[:7] == [1, 4, 7, 10, 13, 16, 19]


def test_remainder_drop(build):
    directory, rows = build
    streams = _rank_streams(directory, 4, 0, remainder="drop", grad_accum=2, shuffle=False)
    assert all(
        len(s) == 4 for s in streams
    )  # 23 rows // (4 ranks × 2) = 2 optimizer steps of 2 micro-batches
    assert not any(f for s in streams for _, f, _ in s)
    assert sorted(r for s in streams for r, _, _ in s) == list(range(16))


@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (1, 4), (2, 3), (4, 2)])
def test_num_items_in_batch_is_global_step_loss_tokens(build, world_size, grad_accum):
    directory, rows = build
    streams = _rank_streams(directory, world_size, 0, grad_accum=grad_accum, seed=5)
    n_steps = len(streams[0])
    assert n_steps % grad_accum == 0, "every optimizer step has grad_accum micro-batches"
    for step in range(0, n_steps, grad_accum):
        micro = [s[k] for s in streams for k in range(step, step + grad_accum)]
        expected = sum(rows[r]["num_loss_tokens"] for r, filler, _ in micro if not filler)
        assert {items for _, _, items in micro} == {max(expected, 1)}


def test_filler_rows_have_no_loss(build):
    directory, rows = build
    ds = PackedDataset(directory, rank=3, world_size=4, shuffle=False)
    last = list(ds)[-1]
    assert is_filler(last) and last["input_ids"].shape[1] > 0
    assert last["num_items_in_batch"] == sum(r["num_loss_tokens"] for r in rows[20:23])


def _stream(dl):
    return [(row_of(b), is_filler(b)) for b in dl]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_anywhere_equals_uninterrupted(build, workers):
    directory, _ = build
    rng = np.random.default_rng(workers)
    kw = dict(rank=1, world_size=2, grad_accum=2, seed=11, num_workers=workers)
    full = []
    ref = make_dataloader(directory, **kw)
    for epoch in range(2):
        ref.set_epoch(epoch)
        full += _stream(ref)
    steps = len(ref.dataset)
    points = rng.choice(2 * steps + 1, size=12 if workers == 0 else 3, replace=False)
    for point in points:
        dl = make_dataloader(directory, **kw)
        got, state, done = [], dl.state_dict() if point == 0 else None, 0
        for epoch in range(2):
            if state is not None:
                break
            dl.set_epoch(epoch)
            for batch in dl:  # a state taken after receiving a batch counts that batch as consumed
                got.append((row_of(batch), is_filler(batch)))
                done += 1
                if done == point:
                    state = dl.state_dict()
                    break
        state = json.loads(json.dumps(state))  # a checkpoint survives serialisation
        resumed = make_dataloader(directory, **kw)
        resumed.load_state_dict(state)
        epoch = state["epoch"]
        while epoch < 2:
            got += _stream(resumed)
            epoch += 1
            resumed.set_epoch(epoch)
        assert got == full, f"resume at step {point}"


def test_dataset_state_dict_without_workers(build):
    directory, _ = build
    ds = PackedDataset(directory, seed=2)
    full = [row_of(b) for b in ds]
    it = iter(ds)
    head = [row_of(next(it)) for _ in range(9)]
    state = ds.state_dict()
    ds2 = PackedDataset(directory, seed=2)
    ds2.load_state_dict(state)
    assert head + [row_of(b) for b in ds2] == full


def test_resume_refuses_another_order_or_directory(build, tmp_path):
    directory, _ = build
    dl = make_dataloader(directory, rank=0, world_size=2)
    next(iter(dl))
    state = dl.state_dict()
    with pytest.raises(ConfigError, match="seed"):
        make_dataloader(directory, rank=0, world_size=2, seed=9).load_state_dict(state)
    with pytest.raises(ConfigError, match="shuffle"):
        make_dataloader(directory, rank=0, world_size=2, shuffle=False).load_state_dict(state)
    write_build(tmp_path / "other", 23, seed=1)
    with pytest.raises(ShardFormatError, match="another shard directory"):
        make_dataloader(tmp_path / "other", rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="version"):
        make_dataloader(directory, rank=0, world_size=2).load_state_dict({**state, "version": 7})
    # the position is global: another rank, or another world size (tests/test_loader_resume.py), resumes it
    make_dataloader(directory, rank=1, world_size=2).load_state_dict(state)


def test_rank_and_world_size_validated(build):
    directory, _ = build
    with pytest.raises(ConfigError, match="rank 2 with world size 2"):
        PackedDataset(directory, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="grad_accum 0"):
        PackedDataset(directory, grad_accum=0)


def test_importing_packer_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, packer, packer.contract.schema, packer.errors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
