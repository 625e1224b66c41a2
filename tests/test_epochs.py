"""--epochs E: every epoch its own shuffle of the examples, written into the shards, played by the loader.

The reference for batch mode is padded training as people run it: a torch DataLoader over the
tokenized examples, transformers' DataCollatorForSeq2Seq padding each minibatch, and a sampler that
reshuffles every epoch by drawing the next permutation from one generator seeded once (what
RandomSampler(generator=torch.Generator().manual_seed(seed)) does with torch.randperm). packer plans
in numpy, never torch, so its documented generator is ``numpy.random.default_rng(seed)``; the sampler
here draws from that.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import BUNDLED_TOKENIZER, make_build
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast

from packer import BuildConfig, render
from packer.building.engines import LocalEngine
from packer.building.pipeline import open_source
from packer.building.tokenization import load_tokenizer
from packer.checking import inspect_
from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema
from packer.errors import ConfigError
from packer.planning.plan import plan_epochs
from packer.training.loader import PackedDataset

E, B, N = 3, 4, 120  # epochs, examples per row, records


@pytest.fixture(scope="module")
def epochs_build(tmp_path_factory):
    return make_build(tmp_path_factory.mktemp("ep") / "b", limit=N, batch_size=B, epochs=E, seed=7)


@pytest.fixture(scope="module")
def one_epoch_build(tmp_path_factory):
    return make_build(tmp_path_factory.mktemp("ep1") / "b", limit=N, batch_size=B, seed=7)


class Reshuffle(Sampler):
    """A new permutation of the examples each epoch, drawn from one generator seeded once."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng = n, np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())


def _examples(config: BuildConfig) -> list[dict]:
    """The build's examples (its own reading, formatting and tokenizing), as padded training takes them."""
    tokenizer = load_tokenizer(str(BUNDLED_TOKENIZER))
    opened = open_source(config, tokenizer, skip_errors=False)
    out = []
    for chunk in LocalEngine().encode_chunks(opened.stream, opened.encoder, 0):
        ends = np.cumsum(chunk.lengths)
        for ids, trained in zip(np.split(chunk.ids, ends[:-1]), np.split(chunk.trained, ends[:-1]), strict=True):
            out.append({"input_ids": ids.tolist(), "labels": np.where(trained == 1, ids, -100).tolist()})
    return out


def _unpad(batch: dict) -> list[tuple[list[int], list[int]]]:
    keep = batch["attention_mask"].bool()
    return [(batch["input_ids"][i][keep[i]].tolist(), batch["labels"][i][keep[i]].tolist()) for i in range(len(keep))]


def _split_row(row: dict) -> list[tuple[list[int], list[int]]]:
    cu = row["cu_seq_lens_q"].tolist()
    ids, labels = row["input_ids"][0].tolist(), row["labels"][0].tolist()
    return [(ids[a:b], labels[a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)]


def test_batch_epochs_are_the_minibatches_of_reshuffling_padded_training(epochs_build):
    manifest = schema.read_manifest(epochs_build)
    config = manifest.config
    assert manifest.stats.examples_truncated == 0  # so padded training sees the very same examples
    examples = _examples(config)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_TOKENIZER / "tokenizer.json"), pad_token="<pad>")
    padded = DataLoader(examples, batch_size=B, sampler=Reshuffle(len(examples), config.seed),
                        collate_fn=DataCollatorForSeq2Seq(hf, padding=True, label_pad_token_id=-100))
    packed = PackedDataset(epochs_build, shuffle=False)
    assert len(packed) == len(padded) == -(-N // B)
    epochs = []
    for epoch in range(E):
        packed.set_epoch(epoch)
        want = [_unpad(batch) for batch in padded]  # one pass over the DataLoader = one epoch of the sampler
        got = [_split_row(row) for row in packed]
        assert got == want, f"epoch {epoch}: packer's rows are not the padded run's minibatches"
        epochs.append(got)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # every epoch groups the examples anew


def test_epoch_0_is_the_one_epoch_build_and_the_manifest_counts_every_epoch(epochs_build, one_epoch_build):
    one, many = schema.read_manifest(one_epoch_build), schema.read_manifest(epochs_build)
    assert "epochs" not in one.to_json()["config"] and one.stats.epochs is None  # a default build keeps its keys
    assert many.config.epochs == E and many.stats.epochs == E
    rows = one.stats.rows
    assert many.stats.rows == E * rows and many.stats.tokens == E * one.stats.tokens
    assert many.stats.loss_tokens == E * one.stats.loss_tokens and many.stats.segments == E * one.stats.segments
    for key in ("examples", "examples_packed", "examples_truncated", "tokens_in", "tokens_truncated", "examples_read"):
        assert getattr(many.stats, key) == getattr(one.stats, key), key
    a = schema.open_shard(one_epoch_build / one.shards[0].file)
    b = schema.open_shard(epochs_build / many.shards[0].file)
    assert b.slice(0, rows).equals(a)  # epoch 0: exactly the rows a one-epoch build writes
    # every epoch holds every example once
    ex = b.column("example_ids").to_pylist()
    for e in range(E):
        assert sorted(x for r in ex[e * rows:(e + 1) * rows] for x in r) == list(range(N))
    assert verify(epochs_build, source="flan").ok


def test_loader_plays_epoch_e_and_replays_past_the_last(epochs_build):
    ds = PackedDataset(epochs_build, shuffle=True, seed=3)
    rows = ds.epoch_rows
    table = schema.open_shard(epochs_build / ds.manifest.shards[0].file)
    first_ids = [r[:12] for r in table.column("input_ids").to_pylist()]
    seen = []
    for epoch in range(E):
        ds.set_epoch(epoch)
        got = [row["input_ids"][0, :12].tolist() for row in ds]
        assert sorted(got) == sorted(first_ids[epoch * rows:(epoch + 1) * rows])  # epoch e's rows, shuffled
        seen.append(got)
    with pytest.warns(UserWarning, match=f"epoch {E} replays planned epoch 0"):
        ds.set_epoch(E)
    replay = [row["input_ids"][0, :12].tolist() for row in ds]
    assert sorted(replay) == sorted(seen[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds.set_epoch(E + 1)  # warned once
    # resume in the middle of epoch 1: the rest of epoch 1, nothing else
    ds.set_epoch(1)
    it = iter(ds)
    head = [next(it)["input_ids"][0, :12].tolist() for _ in range(5)]
    state = ds.state_dict()
    again = PackedDataset(epochs_build, shuffle=True, seed=3)
    again.load_state_dict(state)
    tail = [row["input_ids"][0, :12].tolist() for row in again]
    assert head + tail == seen[1]


def test_bfd_epochs_are_plans_of_their_own(tmp_path):
    out = make_build(tmp_path / "bfd", limit=300, pack="bfd", max_len=1024, max_tokens=2048, epochs=E)
    one = make_build(tmp_path / "bfd1", limit=300, pack="bfd", max_len=1024, max_tokens=2048)
    m, m1 = schema.read_manifest(out), schema.read_manifest(one)
    assert m.stats.rows == E * m1.stats.rows  # the same multiset of lengths: the same number of rows
    rows = m1.stats.rows
    table = schema.open_shard(out / m.shards[0].file)
    assert table.slice(0, rows).equals(schema.open_shard(one / m1.shards[0].file))
    groups = [{frozenset(r) for r in table.column("example_ids").to_pylist()[e * rows:(e + 1) * rows]} for e in range(E)]
    for e in range(1, E):
        assert len(groups[e] - groups[0]) > rows // 4, "later epochs must group other examples together"
        assert sorted(x for g in groups[e] for x in g) == sorted(x for g in groups[0] for x in g)
    assert verify(out, source="flan").ok


def test_disk_cost_is_stated_by_inspect(epochs_build, one_epoch_build):
    view = inspect_.summary(epochs_build)
    one = sum(s.bytes for s in schema.read_manifest(one_epoch_build).shards)
    disk = view.to_json()["disk"]
    assert disk["epochs"] == E and disk["bytes"] == sum(s.bytes for s in view.shards)
    assert abs(disk["bytes"] - E * one) < 0.01 * E * one  # E epochs cost E times the disk
    text = "\n".join(render.summary_lines(view, color=False))
    assert f"{E} planned, each its own shuffle" in text and f"written {E} times" in text
    # the per-example figures are of one epoch; --example lists the example once per epoch
    assert np.array_equal(inspect_.plot_data(epochs_build).example_tokens,
                          inspect_.plot_data(one_epoch_build).example_tokens)
    found = inspect_.find_example(epochs_build, 5)
    assert [p.epoch for p in found.pieces] == list(range(E)) and not found.split
    assert found.tokens == inspect_.find_example(one_epoch_build, 5).tokens


@pytest.mark.parametrize(("args", "needle"), [
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--epochs", "2", "--pack", "wrap", "--text-field", "inputs"], "wrap keeps source order"),
])
def test_bad_epochs_is_one_line_exit_2(tmp_path, args, needle):
    result = CliRunner().invoke(main, ["build", "flan", "--limit", "10", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize("overlong", ["split", "truncate-left"])
def test_plan_epochs_batch_is_one_permutation_per_epoch_from_one_generator(overlong):
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 700, 1000)
    answers = np.minimum(lengths, 50)
    p = plan_epochs(lengths, epochs=4, mode="batch", batch_size=5, max_len=300, overlong=overlong, seed=11,
                    answers=answers if overlong == "truncate-left" else None)
    # the segments in example order, written out by hand
    segs = []
    for k, n in enumerate(lengths.tolist()):
        if n <= 300:
            segs.append((k, 0, n))
        elif overlong == "split":
            segs += [(k, s, min(300, n - s)) for s in range(0, n, 300)]
        else:
            segs.append((k, n - 300, 300))
    segs = np.array(segs)
    gen = np.random.default_rng(11)
    want = np.concatenate([segs[gen.permutation(len(segs))] for _ in range(4)])
    assert np.array_equal(np.stack([p.example, p.start, p.length], 1), want)
    rows = -(-len(segs) // 5)
    assert p.num_rows == 4 * rows and np.array_equal(np.diff(p.row_splits)[:rows], np.diff(p.row_splits)[rows:2 * rows])
    assert p.stats["epochs"] == 4 and p.stats["segments"] == 4 * len(segs)
    assert p.stats["tokens"] == 4 * (p.stats["tokens_in"] - p.stats["tokens_truncated"])


def test_plan_epochs_refuses_wrap_and_zero():
    with pytest.raises(ConfigError, match="wrap keeps source order"):
        plan_epochs([5, 6], epochs=2, mode="wrap", max_len=8)
    with pytest.raises(ConfigError, match="epochs must be >= 1"):
        plan_epochs([5, 6], epochs=0, mode="batch", batch_size=2, max_len=8)
