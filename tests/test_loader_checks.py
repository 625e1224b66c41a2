"""The loader's checks of what it reads: a damaged shard of the same size is refused with one clear
ShardFormatError (naming the shard and row) instead of being streamed to the attention kernel, and
mistyped or edited manifests are refused at open. Shards are damaged in place, keeping their size and
the manifest as built (only ``verify=True``, which hashes every byte, would see them otherwise)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import make_build, rewrite_column

from packer.contract import schema
from packer.errors import ShardFormatError
from packer.training.loader import PackedDataset, Position, make_dataloader


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_build(tmp_path_factory.mktemp("checks") / "out", limit=80, pack="bfd", max_len=512, num_proc=1)


@pytest.fixture(scope="module")
def built1(tmp_path_factory):
    """The same in format 1, whose int32 columns (labels, signed ids) the CASES below damage."""
    return make_build(tmp_path_factory.mktemp("checks1") / "out", limit=80, pack="bfd", max_len=512, num_proc=1,
                      format_version=1)


@pytest.fixture
def copy(built1, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(built1, out)
    return out


@pytest.fixture
def copy2(built, tmp_path):
    """A copy of the format-2 build (uint16 ids and positions, the loss as a bit mask)."""
    out = tmp_path / "out2"
    shutil.copytree(built, out)
    return out


def damage(out, column: str, change) -> None:
    """Apply ``change(values, offsets)`` to one column of shard 0, keeping the file's size."""
    path = out / schema.shard_name(0)
    before = path.stat().st_size
    rewrite_column(path, column, change)
    assert path.stat().st_size == before


def _vocab(out) -> int:
    return schema.read_manifest(out).tokenizer["vocab_size"]


def _shift_boundary(values, offsets):
    """Move the boundary between the first two segments of the first row holding two: the lengths still
    sum to the row's, only the positions no longer restart there."""
    first = int(offsets[np.flatnonzero(np.diff(offsets) >= 2)[0]])
    values[first] += 1
    values[first + 1] -= 1


CASES = {
    "seq_len 10^9": ("seq_lens", lambda v, o: v.__setitem__(0, 10**9), "seq_lens do not sum"),
    "seq_len 0": ("seq_lens", lambda v, o: v.__setitem__(0, 0), "segment length ≤ 0"),
    "seq_len negative": ("seq_lens", lambda v, o: v.__setitem__(0, -5), "segment length ≤ 0"),
    "seq_lens shifted": ("seq_lens", _shift_boundary, "position_ids|max_seqlen"),
    "position restarts late": ("position_ids", lambda v, o: v.__setitem__(0, 1), "position_ids"),
    "position jumps": ("position_ids", lambda v, o: v.__setitem__(5, 50), "position_ids"),
    "id = vocab": ("input_ids", lambda v, o: v.__setitem__(1, 10**6), "outside"),
    "id negative": ("input_ids", lambda v, o: v.__setitem__(1, -1), "outside"),
    "label at a start": ("labels", lambda v, o: v.__setitem__(0, 7), "segment start"),
    "label not the id": ("labels", lambda v, o: v.__setitem__(np.flatnonzero(v != -100)[0], 3), "neither -100"),
    "max_seqlen": ("max_seqlen", lambda v, o: v.__setitem__(0, v[0] + 1), "max_seqlen"),
    "max_seqlen huge": ("max_seqlen", lambda v, o: v.__setitem__(0, 2**31 - 1), "max_seqlen"),
}


# Format 2's own: its ids are unsigned and its labels the ids by construction, so what can be damaged is
# an id past the vocab, a mask bit at a segment start, and the positions
CASES_2 = {
    "id = vocab": ("input_ids", lambda v, o: v.__setitem__(1, 65_535), "outside"),
    "mask at a start": ("loss_mask", lambda v, o: v.__setitem__(0, True), "segment start"),
    "position restarts late": ("position_ids", lambda v, o: v.__setitem__(0, 1), "position_ids"),
    "seq_lens shifted": ("seq_lens", _shift_boundary, "position_ids|max_seqlen"),
}


@pytest.mark.parametrize("case", sorted(CASES_2))
def test_damaged_format_2_row_is_refused_when_read(copy2, case):
    from packer.checking.verify import verify

    column, change, needle = CASES_2[case]
    damage(copy2, column, change)
    with pytest.raises(ShardFormatError, match=needle) as caught:
        for _ in make_dataloader(copy2, shuffle=False):
            pass
    found = [p.message for p in verify(copy2).problems if p.check == "rows"]
    assert found and f": {found[0]}; " in str(caught.value), (found, str(caught.value))


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_row_is_refused_when_read(copy, case):
    column, change, needle = CASES[case]
    damage(copy, column, change)
    with pytest.raises(ShardFormatError, match=needle) as caught:
        for _ in make_dataloader(copy, shuffle=False):
            pass
    assert "shard-00000.arrow row " in str(caught.value) and "rebuild" in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_loader_verify_and_inspect_apply_the_one_row_checker(copy, case):
    """One statement of the row invariants (packer.contract.rows): the loader raises the first problem verify
    reports, and inspect, which reads only offsets and the small columns, refuses a broken layout alike."""
    from packer.checking import inspect_
    from packer.checking.verify import verify

    column, change, _ = CASES[case]
    damage(copy, column, change)
    with pytest.raises(ShardFormatError) as caught:
        for _ in make_dataloader(copy, shuffle=False):
            pass
    found = [p.message for p in verify(copy).problems if p.check == "rows"]
    assert found and f": {found[0]}; " in str(caught.value), (found, str(caught.value))
    layout = {"seq_len 10^9", "seq_len 0", "seq_len negative", "max_seqlen", "max_seqlen huge", "seq_lens shifted"}
    if case in layout:
        with pytest.raises(ShardFormatError) as seen:
            inspect_.summary(copy)
        assert f": {found[0]}; " in str(seen.value)
    else:
        inspect_.summary(copy)


def test_label_moved_to_another_row_is_refused_at_open(copy):
    """Loss tokens that no longer add up to the manifest's: refused before the first step."""
    def untrain(values, offsets):
        values[np.flatnonzero(values != -100)[:3]] = -100
    damage(copy, "labels", untrain)
    with pytest.raises(ShardFormatError, match="num_loss_tokens|loss_tokens"):
        for _ in PackedDataset(copy, shuffle=False):
            pass


def test_num_loss_tokens_changed_is_refused(copy):
    damage(copy, "num_loss_tokens", lambda v, o: v.__setitem__(0, v[0] + 1))
    with pytest.raises(ShardFormatError, match="num_loss_tokens"):
        PackedDataset(copy, shuffle=False)


def test_zeroed_tail_is_refused(copy):
    path = copy / schema.shard_name(0)
    data = bytearray(path.read_bytes())
    data[-4096:] = bytes(4096)
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="rebuild"):
        for _ in PackedDataset(copy, shuffle=False):
            pass


def test_shard_of_another_build_is_refused(copy, tmp_path):
    other = make_build(tmp_path / "other", limit=80, pack="bfd", max_len=500, num_proc=1)
    shutil.copy(other / schema.shard_name(0), copy / schema.shard_name(0))
    with pytest.raises(ShardFormatError, match="shard-00000.arrow"):
        PackedDataset(copy)


def test_intact_build_streams_every_row(built):
    rows = list(make_dataloader(built, shuffle=False))
    assert len(rows) == schema.read_manifest(built).stats.rows


MISTYPED = [
    ("stats", "examples", None), ("stats", "rows", "12"), ("stats", "loss_tokens", 1.5), ("stats", "fill", None),
    ("stats", "dropped_by_reason", []), ("shards", "rows", None), ("shards", "bytes", "x"), ("shards", "sha256", 5),
    ("shards", "file", "../x.arrow"), ("tokenizer", "vocab_size", None), ("tokenizer", "vocab_size", "32000"),
    ("tokenizer", "vocab_size", -1), ("", "shards", {}), ("", "stats", None), ("", "config", []),
    ("", "tokenizer", "x"), ("", "format_version", "1"), ("", "note", 3),
]


@pytest.mark.parametrize(("section", "key", "value"), MISTYPED)
def test_mistyped_manifest_values_give_one_line_errors(copy, section, key, value):
    """Values re-hashed, as a tool rewriting the manifest consistently would: only the types are wrong."""
    path = copy / schema.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    target = manifest if not section else manifest[section][0] if section == "shards" else manifest[section]
    target[key] = value
    manifest[schema.CONTENT_HASH] = schema.content_sha256(manifest)
    path.write_bytes(schema.dump_manifest(manifest))
    with pytest.raises(ShardFormatError) as caught:
        for _ in PackedDataset(copy, shuffle=False):
            pass
    assert "\n" not in str(caught.value) and str(copy) in str(caught.value)


# -- resume states ---------------------------------------------------------------------------------

def _tamperings(state: dict) -> dict[str, object]:
    """Every way a saved state can be wrong: types, ranges, missing or extra keys, another build or order."""
    t = {
        "a list": [state], "None": None, "a string": "state",
        "no version": {k: v for k, v in state.items() if k != "version"},
        "version 7": {**state, "version": 7}, "version '1'": {**state, "version": "1"},
        "version True": {**state, "version": True},
        "no manifest_sha256": {k: v for k, v in state.items() if k != "manifest_sha256"},
        "manifest_sha256 an int": {**state, "manifest_sha256": 5},
        "another build": {**state, "manifest_sha256": "0" * 64},
        "no epoch": {k: v for k, v in state.items() if k != "epoch"},
        "epoch -1": {**state, "epoch": -1}, "epoch 2**70": {**state, "epoch": 2**70},
        "epoch 1.0": {**state, "epoch": 1.0}, "epoch '1'": {**state, "epoch": "1"},
        "no rows_done": {k: v for k, v in state.items() if k != "rows_done"},
        "rows_done -1": {**state, "rows_done": -1}, "rows_done past the epoch": {**state, "rows_done": 10**6},
        "rows_done 2.5": {**state, "rows_done": 2.5}, "rows_done True": {**state, "rows_done": True},
        "rows_done None": {**state, "rows_done": None},
        "micro_done -1": {**state, "micro_done": -1}, "micro_done = grad_accum": {**state, "micro_done": 1},
        "order_world_size 0": {**state, "order_world_size": 0}, "order_grad_accum True": {**state, "order_grad_accum": True},
        "world_size '2'": {**state, "world_size": "2"}, "grad_accum 0": {**state, "grad_accum": 0},
        "other seed": {**state, "seed": 1},
        "shuffle 1": {**state, "shuffle": 1}, "other shuffle": {**state, "shuffle": not state["shuffle"]},
        "other remainder": {**state, "remainder": "drop"},
        "a version 1 state without steps_done": {**{k: v for k, v in state.items() if k != "rows_done"}, "version": 1},
        "other num_rows": {**state, "num_rows": state["num_rows"] + 1},
        "an unknown key": {**state, "extra": 1},
    }
    return t


def test_every_tampered_resume_state_is_refused_with_one_clear_error(built):
    from packer.errors import ConfigError

    dl = make_dataloader(built, rank=0, world_size=2, seed=3)
    it = iter(dl)
    next(it), next(it)
    state = json.loads(json.dumps(dl.state_dict()))
    tamperings = _tamperings(state)
    assert len(tamperings) >= 23
    for name, bad in tamperings.items():
        fresh = make_dataloader(built, rank=0, world_size=2, seed=3)
        with pytest.raises((ConfigError, ShardFormatError)) as caught:
            fresh.load_state_dict(bad)
        message = str(caught.value)
        assert "\n" not in message and "loader state" in message, (name, message)
        assert fresh.dataset.position == Position(0, order=(2, 1)), name  # nothing was half-applied
    resumed = make_dataloader(built, rank=0, world_size=2, seed=3)
    resumed.load_state_dict(state)
    assert resumed.dataset.position == Position(0, rows=4, order=(2, 1))


# -- remainder="drop" ---------------------------------------------------------------------------------

def test_drop_rotates_what_it_drops_across_epochs(built):
    n = schema.read_manifest(built).stats.rows
    w, g = 4, 3
    assert (n // w) % g, f"{n} rows leave no whole group to drop: the test needs some"
    kept_per_epoch = []
    for epoch in range(8):
        seen = []
        for rank in range(w):
            ds = PackedDataset(built, rank=rank, world_size=w, grad_accum=g, remainder="drop", seed=1)
            ds.set_epoch(epoch)
            seen += [hash(b["input_ids"].numpy().tobytes()) for b in ds]
        kept_per_epoch.append(frozenset(seen))
        assert len(seen) == (n // (w * g)) * g * w
    assert len(set(kept_per_epoch)) > 1, "the same rows were dropped every epoch"
    every = frozenset().union(*kept_per_epoch)
    assert len(every) > len(kept_per_epoch[0])


def test_drop_that_leaves_an_epoch_empty_is_refused(built):
    from packer.errors import ConfigError

    n = schema.read_manifest(built).stats.rows
    with pytest.raises(ConfigError, match="every epoch would be empty"):
        PackedDataset(built, world_size=4, rank=0, grad_accum=n // 4 + 1, remainder="drop")
    assert len(PackedDataset(built, world_size=4, rank=0, grad_accum=n // 4 + 1, remainder="pad")) > 0


def test_a_manifest_listing_a_shard_twice_is_refused(copy):
    path = copy / schema.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["shards"].append(dict(manifest["shards"][0]))
    manifest["stats"]["rows"] *= 2
    manifest[schema.CONTENT_HASH] = schema.content_sha256(manifest)
    path.write_bytes(schema.dump_manifest(manifest))
    with pytest.raises(ShardFormatError, match="lists a shard twice"):
        PackedDataset(copy)
