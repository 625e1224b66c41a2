"""The v1 contract, end to end on real builds: tokens, labels, positions, accounting, determinism."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from conftest import BUNDLED_TOKENIZER, make_build, shard_rows
from transformers import AutoTokenizer

from packer import BuildConfig, ConfigError, OutputError, build, fs
from packer.contract import schema
from packer.contract.recipes import BUNDLED_SAMPLE


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER))


@pytest.fixture(scope="module")
def records():
    with gzip.open(BUNDLED_SAMPLE, "rt") as f:
        return [json.loads(line) for line in f]


def rows_of(directory: Path) -> list[dict]:
    manifest = schema.read_manifest(directory)
    return [r for s in manifest.shards for r in shard_rows(directory / s.file)]


def segments_of(directory: Path):
    """(example_id, ids, labels, positions) for every segment of every row."""
    for row in rows_of(directory):
        bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            yield (
                row["example_ids"][k],
                np.array(row["input_ids"][lo:hi]),
                np.array(row["labels"][lo:hi]),
                np.array(row["position_ids"][lo:hi]),
            )


def test_segments_decode_to_the_formatted_examples(flan_batch, tokenizer, records):
    manifest = schema.read_manifest(flan_batch)
    max_len = manifest.config.max_len
    checked = 0
    for example_id, ids, labels, _ in segments_of(flan_batch):
        record = records[example_id]
        prompt, completion = record["inputs"] + "\n\n", record["targets"]
        # The tokens are those of the whole text (plus EOS), not prompt and completion glued.
        whole = tokenizer(prompt + completion)["input_ids"] + [tokenizer.eos_token_id]
        assert ids.tolist() == whole[: len(ids)]
        if len(whole) <= max_len:
            checked += 1
            assert len(ids) == len(whole)
            assert tokenizer.decode(ids, skip_special_tokens=True) == prompt + completion
            # The loss covers exactly the completion's tokens, and EOS.
            trained = labels != schema.IGNORE_INDEX
            assert tokenizer.decode(ids[trained], skip_special_tokens=False) == completion + tokenizer.eos_token
            assert tokenizer.decode(ids[~trained], skip_special_tokens=True) == prompt
            assert (labels[trained] == ids[trained]).all()
        else:
            assert len(ids) == max_len  # truncated to --max-len
    assert checked == 300 - manifest.stats.examples_truncated > 200


def test_labels_masked_at_every_segment_start_and_positions_restart(flan_bfd):
    for row in rows_of(flan_bfd):
        starts = np.concatenate([[0], np.cumsum(row["seq_lens"])[:-1]])
        labels, positions = np.array(row["labels"]), np.array(row["position_ids"])
        assert (labels[starts] == schema.IGNORE_INDEX).all()
        restarts = np.flatnonzero(positions == 0)
        assert restarts.tolist() == starts.tolist()
        expected = np.concatenate([np.arange(n) for n in row["seq_lens"]])
        assert (positions == expected).all()
        assert row["num_loss_tokens"] == int((labels != schema.IGNORE_INDEX).sum())
        assert row["max_seqlen"] == max(row["seq_lens"])
        assert sum(row["seq_lens"]) == len(row["input_ids"]) <= 1024


def test_segments_that_lost_their_completion_are_counted(flan_batch):
    without = sum(int((labels == schema.IGNORE_INDEX).all()) for _, _, labels, _ in segments_of(flan_batch))
    stats = schema.read_manifest(flan_batch).stats.to_json()
    # --max-len 512 truncates long few-shot prompts before their completion: they train on nothing
    assert stats["segments_without_loss"] == without > 0
    assert stats["loss_tokens"] == sum(int((labels != schema.IGNORE_INDEX).sum()) for *_, labels, _ in segments_of(flan_batch))


def test_every_example_is_accounted_for(flan_bfd):
    manifest = schema.read_manifest(flan_bfd)
    stats = manifest.stats.to_json()
    pieces: dict[int, list[int]] = {}
    for example_id, ids, _, _ in segments_of(flan_bfd):
        pieces.setdefault(example_id, []).append(len(ids))
    assert sorted(pieces) == list(range(300))  # split keeps every example
    split = sum(len(p) > 1 for p in pieces.values())
    assert split == stats["examples_split"] > 0
    assert stats["examples_packed"] + stats["examples_split"] == 300
    assert stats["tokens"] == sum(map(sum, pieces.values())) == sum(s.tokens for s in manifest.shards)
    assert stats["rows"] <= 1.05 * stats["lower_bound"]


def test_drop_and_truncate_are_counted(tmp_path):
    dropped = make_build(tmp_path / "drop", limit=200, max_len=300, overlong="drop")
    stats = schema.read_manifest(dropped).stats.to_json()
    seen = {e for e, *_ in segments_of(dropped)}
    assert stats["examples_dropped"] == 200 - len(seen) > 0
    assert stats["dropped_by_reason"] == {"overlong": stats["examples_dropped"]}
    assert stats["tokens"] + stats["tokens_dropped"] == stats["tokens_in"]


def test_two_builds_are_byte_identical(tmp_path):
    # format 1's 12 bytes a token: several 1 MB shards of 400 records
    a = make_build(tmp_path / "a", limit=400, pack="bfd", max_len=2048, shard_size_mb=1, format_version=1)
    b = make_build(tmp_path / "b", limit=400, pack="bfd", max_len=2048, shard_size_mb=1, format_version=1)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert len([f for f in files if f.endswith(".arrow")]) > 1  # several shards
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_seed_changes_the_order_not_the_content(tmp_path):
    a = make_build(tmp_path / "a", limit=100, seed=1)
    b = make_build(tmp_path / "b", limit=100, seed=2)
    order_a = [e for e, *_ in segments_of(a)]
    order_b = [e for e, *_ in segments_of(b)]
    assert order_a != order_b and sorted(order_a) == sorted(order_b)


def test_datasets_opens_a_shard(flan_batch):
    manifest = schema.read_manifest(flan_batch)
    ds = datasets.Dataset.from_file(str(flan_batch / manifest.shards[0].file))
    assert len(ds) == manifest.shards[0].rows
    assert ds.column_names == manifest.row_format.schema().names
    first = ds[0]
    assert len(first["input_ids"]) == sum(first["seq_lens"])


def test_manifest_records_config_tokenizer_and_shards(flan_batch):
    m = schema.read_manifest(flan_batch)
    assert m.config.pack == "batch" and m.config.batch_size == 4
    assert "synthetic" in m.note
    assert m.tokenizer["name_or_path"] == "bundled" and len(m.tokenizer["fingerprint"]) == 64
    assert m.stats.lower_bound == -(-m.stats.tokens // m.stats.row_budget)
    for shard in m.shards:
        path = flan_batch / shard.file
        assert path.stat().st_size == shard.bytes
        assert fs.file_sha256(path) == shard.sha256
    rows = [r for s in m.shards for r in shard_rows(flan_batch / s.file)]
    assert all(len(r["seq_lens"]) == 4 for r in rows[:-1])  # batch mode: B examples per row


def test_rebuild_of_same_config_is_reused_and_other_config_refused(tmp_path):
    out = make_build(tmp_path / "o", limit=50)
    before = (out / schema.MANIFEST_NAME).read_bytes()
    again = build(BuildConfig(source="flan", out=str(out), limit=50))
    assert again.reused and (out / schema.MANIFEST_NAME).read_bytes() == before
    with pytest.raises(OutputError, match="another build"):
        build(BuildConfig(source="flan", out=str(out), limit=60))
    replaced = build(BuildConfig(source="flan", out=str(out), limit=60, overwrite=True))
    assert not replaced.reused and replaced.manifest.stats.examples_read == 60


def test_chat_assistant_only_loss(tmp_path, tokenizer):
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": turns}) + "\n")
    out = make_build(tmp_path / "out", source=str(src))
    ((_, ids, labels, _),) = list(segments_of(out))
    rendered = tokenizer.apply_chat_template(turns, tokenize=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered
    trained = labels != schema.IGNORE_INDEX
    assert tokenizer.decode(ids[trained], skip_special_tokens=False) == "Hello!</s>4</s>"


def test_wrap_cuts_rows_at_the_budget(tmp_path):
    src = tmp_path / "text.txt"
    src.write_text("".join(f"line {i} of a plain text document\n" for i in range(400)))
    out = make_build(tmp_path / "out", source=str(src), pack="wrap", max_tokens=128)
    rows = rows_of(out)
    assert all(len(r["input_ids"]) == 128 for r in rows[:-1])
    assert schema.read_manifest(out).stats.examples_read == 400


def test_contradictory_options_are_refused():
    with pytest.raises(ConfigError, match="--max-tokens"):
        BuildConfig(source="flan", out="x", max_tokens=100)
    with pytest.raises(ConfigError, match="--batch-size"):
        BuildConfig(source="flan", out="x", pack="bfd", batch_size=4)


def test_split_pieces_tile_the_example(flan_bfd, tokenizer, records):
    max_len = schema.read_manifest(flan_bfd).config.max_len
    pieces: dict[int, list[list[int]]] = {}
    for example_id, ids, labels, _ in segments_of(flan_bfd):
        pieces.setdefault(example_id, []).append(ids.tolist())
        assert labels[0] == schema.IGNORE_INDEX  # each piece is its own segment
    long_ones = [e for e, p in pieces.items() if len(p) > 1]
    assert long_ones
    for e in long_ones:
        record = records[e]
        whole = tokenizer(record["inputs"] + "\n\n" + record["targets"])["input_ids"] + [tokenizer.eos_token_id]
        expected = [whole[i : i + max_len] for i in range(0, len(whole), max_len)]
        assert sorted(pieces[e]) == sorted(expected)


def test_shard_is_an_arrow_stream_with_the_contract_schema(flan_batch):
    path = flan_batch / schema.shard_name(0)
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        assert reader.schema.equals(schema.read_manifest(flan_batch).row_format.schema())
        assert reader.schema.names[:3] == ["input_ids", "position_ids", schema.LOSS_MASK]  # format 2
