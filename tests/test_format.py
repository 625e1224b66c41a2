"""Format version 2 against version 1 (packer.contract.schema.RowFormat): the same config built in both
gives the same loader batches, tensor for tensor, where the options meet (padding, static shapes,
mixes, epochs, chat, wrap, compression), and the narrow types switch exactly at 65,536 ids or
positions."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
from conftest import BUNDLED_TOKENIZER, make_build

from packer.checking.inspect_ import row as row_view
from packer.checking.verify import verify
from packer.contract import rows, schema
from packer.errors import OutputError, ShardFormatError

torch = pytest.importorskip("torch")
from packer.training.loader import make_dataloader  # noqa: E402


def _batches(directory, **options):
    return list(make_dataloader(directory, seed=5, **options))


def _same_batches(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if torch.is_tensor(x[k]):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def _bytes_per_token(directory):
    m = schema.read_manifest(directory)
    return sum(e.bytes for e in m.shards) / m.stats.tokens


def _text(tmp_path, records=60, words=300):
    """Plain text records (for --pack wrap): about ``words`` tokens each."""
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}: " + "word " * words}) + "\n" for i in range(records)))
    return str(path)


def _both(tmp_path, source="flan", **options):
    if options.get("text_field") and source == "flan":
        source = _text(tmp_path)
    v1 = make_build(tmp_path / "v1", source, format_version=1, **options)
    v2 = make_build(tmp_path / "v2", source, **options)
    return v1, v2


CASES = {
    "batch": dict(limit=60, batch_size=4, max_len=256),
    "bfd-split": dict(limit=60, pack="bfd", max_len=256, overlong="split"),
    "wrap": dict(limit=60, pack="wrap", max_len=300, text_field="text"),
    "epochs": dict(limit=40, batch_size=4, max_len=256, epochs=2),
    "cp-zigzag": dict(limit=40, pack="bfd", max_len=256, max_tokens=1024, cp_size=2),
    "pad16-batch": dict(limit=40, batch_size=4, max_len=256, pad_to_multiple_of=16),
    "zstd": dict(limit=60, batch_size=4, max_len=256, compression="zstd"),
}


@pytest.mark.parametrize("case", CASES)
def test_format_2_yields_format_1s_batches(tmp_path, case):
    options = CASES[case]
    v1, v2 = _both(tmp_path, **options)
    m1, m2 = schema.read_manifest(v1), schema.read_manifest(v2)
    assert (m1.format_version, m1.columns) == (1, None)
    assert m2.format_version == 2 and m2.columns == {"input_ids": "uint16", "position_ids": "uint16",
                                                      "loss_mask": "bool"}
    assert m1.stats == m2.stats
    _same_batches(_batches(v1), _batches(v2))
    if m1.stats.padded:  # a context-parallel rank's share and the fixed shapes, from both
        _same_batches(_batches(v1, static_shapes=True), _batches(v2, static_shapes=True))
        if m1.config.cp_size > 1:
            _same_batches(_batches(v1, cp_rank=1, cp_size=2), _batches(v2, cp_rank=1, cp_size=2))
    assert verify(v2).ok and verify(v1).ok
    assert row_view(v1, 1) == row_view(v2, 1)  # inspect takes the same row apart
    # a tiny build's schema and per-row bytes weigh more than a real one's (benchmarks/bench_format.py: 4.2)
    assert _bytes_per_token(v2) < _bytes_per_token(v1) / (1 if options.get("compression") else 2.5)


def test_mix_and_chat_in_format_2(tmp_path):
    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}) + "\n" for i in range(20)))
    mix = ({"source": "flan", "weight": 0.5}, {"source": str(chats), "weight": 0.5})
    v1, v2 = _both(tmp_path, "flan+chat", mix=mix, limit=40, batch_size=4, max_len=256)
    _same_batches(_batches(v1), _batches(v2))
    assert verify(v2, source="flan," + str(chats)).ok


def test_verify_source_checks_the_mask(tmp_path):
    out = make_build(tmp_path / "v2", limit=40, batch_size=4, max_len=256)
    assert verify(out, source="flan").ok
    # a mask bit set at a token the source trains nowhere (not a segment start, so the rows still hold),
    # and its row's num_loss_tokens to match: only the source can tell
    from test_verify import rewrite_shard

    hit = []

    def flip(values, offsets):
        at = int(np.flatnonzero(~values)[1])  # [0] is row 0's first token, a segment start
        values[at] = True
        hit.append(int(np.searchsorted(offsets, at, side="right") - 1))

    def count(values, offsets):
        values[hit[0]] += 1

    rewrite_shard(out, schema.LOSS_MASK, flip)
    rewrite_shard(out, "num_loss_tokens", count)
    report = verify(out, source="flan")
    assert any("trained where the source's loss mask says otherwise" in p.message for p in report.problems)


def _wide_tokenizer(tmp_path, size):
    """The bundled tokenizer with unreachable vocab entries up to ``size`` ids, its last an added
    token ``<|top|>`` (id ``size - 1``) that text can name."""
    folder = tmp_path / f"tok{size}"
    shutil.copytree(BUNDLED_TOKENIZER, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), size - 1):
        vocab[f"<unused{i}>"] = i
    data["added_tokens"].append({"id": size - 1, "content": "<|top|>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("size, narrow", [(65_536, "uint16"), (65_537, "uint32")])
def test_ids_narrow_only_below_65536(tmp_path, size, narrow):
    tok = _wide_tokenizer(tmp_path, size)
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"q": f"Say the top token {i}.", "a": "<|top|> it is"}) + "\n" for i in range(12)))
    opts = dict(tokenizer=str(tok), prompt_field="q", completion_field="a", batch_size=4, max_len=64)
    v1, v2 = _both(tmp_path, str(src), **opts)
    assert schema.read_manifest(v2).columns["input_ids"] == narrow
    b1, b2 = _batches(v1), _batches(v2)
    _same_batches(b1, b2)
    assert max(int(b["input_ids"].max()) for b in b2) == size - 1  # the top id, intact
    assert verify(v2).ok


@pytest.mark.parametrize("budget, narrow", [(65_536, "uint16"), (65_537, "uint32")])
def test_positions_narrow_only_below_65536(tmp_path, budget, narrow):
    v1, v2 = _both(tmp_path, _text(tmp_path, 1, 70_000), pack="wrap", max_len=budget, text_field="text")  # one long row
    assert schema.read_manifest(v2).columns["position_ids"] == narrow
    b1, b2 = _batches(v1, shuffle=False), _batches(v2, shuffle=False)
    _same_batches(b1, b2)
    assert int(b2[0]["position_ids"].max()) == budget - 1  # a whole row of one segment, counted to its top


def test_a_segment_past_uint16_positions_is_refused():
    n = 65_537  # positions that wrap to 0 inside one segment look like steps of 1 in uint16
    pos = (np.arange(n) % 65_536).astype(np.uint16)
    off = pa.array([0, n], pa.int32())
    batch = pa.RecordBatch.from_arrays([
        pa.ListArray.from_arrays(off, pa.array(np.zeros(n, np.uint16))),
        pa.ListArray.from_arrays(off, pa.array(pos)),
        pa.ListArray.from_arrays(off, pa.array(np.zeros(n, bool))),
        pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array([n], pa.int32())),
        pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array([0], pa.int64())),
        pa.array([0], pa.int32()), pa.array([n], pa.int32())], schema=schema.RowFormat(2, "uint16", "uint16").schema())
    problems = rows.check_arrow(batch, 10)
    assert [p.message for p in problems] == ["a segment longer than its uint16 position_ids can count (65,536)"]


def test_manifest_columns_are_checked(tmp_path):
    out = make_build(tmp_path / "v2", limit=20, batch_size=4, max_len=128)
    data = json.loads((out / schema.MANIFEST_NAME).read_text())
    for bad in ({**data["columns"], "input_ids": "int8"}, None):
        edited = {**data, "columns": bad} if bad is not None else {k: v for k, v in data.items() if k != "columns"}
        edited[schema.CONTENT_HASH] = schema.content_sha256(edited)
        with pytest.raises(ShardFormatError, match="columns"):
            schema.Manifest.from_json(edited)
    # a shard of another format than its manifest records is refused by name
    with pytest.raises(ShardFormatError, match="not the row schema the manifest records"):
        schema.open_shard(out / "shard-00000.arrow", schema.RowFormat(1))


def test_rebuilding_a_format_1_folder_says_what_changes(tmp_path):
    out = make_build(tmp_path / "out", limit=20, batch_size=4, max_len=128, format_version=1)
    assert make_build(out, limit=20, batch_size=4, max_len=128, format_version=1)  # the same build: reused
    with pytest.raises(OutputError, match=r"format 1 → 2: ids and positions in the narrowest type.*--format 1"):
        make_build(out, limit=20, batch_size=4, max_len=128)
    make_build(out, limit=20, batch_size=4, max_len=128, overwrite=True)
    assert schema.read_manifest(out).format_version == 2


def test_datasets_sees_the_mask_as_booleans(tmp_path):
    datasets = pytest.importorskip("datasets")
    out = make_build(tmp_path / "v2", limit=20, batch_size=4, max_len=128)
    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == ["input_ids", "position_ids", "loss_mask", "seq_lens", "example_ids",
                               "num_loss_tokens", "max_seqlen"]
    assert str(ds.features["loss_mask"].feature.dtype) == "bool" and ds.features["input_ids"].feature.dtype == "uint16"
    row = ds[0]
    batch = next(iter(make_dataloader(out, shuffle=False)))
    labels = np.where(row["loss_mask"], row["input_ids"], -100)
    assert labels.tolist() == batch["labels"][0].tolist()
