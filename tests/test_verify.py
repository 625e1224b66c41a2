"""packer verify: a clean build passes; every kind of corruption is caught, reported, and exits 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from conftest import BUNDLED_TOKENIZER, make_build, rewrite_column

from packer import fs
from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema
from packer.errors import ShardFormatError


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    # format 1, whose int32 labels the damage below edits (format 2's damage: tests/test_loader_checks.py)
    return make_build(tmp_path_factory.mktemp("verify_clean"), limit=120, batch_size=4, max_len=512, format_version=1)


@pytest.fixture
def copy(clean, tmp_path) -> Path:
    out = tmp_path / "shards"
    shutil.copytree(clean, out)
    return out


def run(*args: str):
    return CliRunner().invoke(main, ["verify", *map(str, args)])


def shard(folder: Path) -> Path:
    return folder / schema.shard_name(0)


def read_table(path: Path) -> pa.Table:
    """Read into memory (not memory-mapped: the tests rewrite these files in place)."""
    return pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()


def edit_manifest(folder: Path, change) -> None:
    """Edit the manifest and re-record its content hash, as a tool that rewrites it consistently would,
    so the checks behind the hash are what is tested (tests/test_hardening_data.py tests the hash)."""
    path = folder / schema.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest[schema.CONTENT_HASH] = schema.content_sha256(manifest)
    path.write_bytes(schema.dump_manifest(manifest))
    parsed, _ = schema.parse_manifest(manifest)
    if parsed is not None:  # the datasets files derive from the shards' hashes: keep them consistent too
        for name, data in schema.datasets_files(parsed).items():
            (folder / name).write_bytes(data)


def rewrite_shard(folder: Path, column: str, change) -> None:
    """Rewrite shard 0 with ``change(flat_values, offsets)`` applied to one column, and re-record its bytes and
    sha256 in the manifest, so that only the row checks can see what changed."""
    path = shard(folder)
    rewrite_column(path, column, change)

    def fix(m):
        m["shards"][0]["bytes"] = path.stat().st_size
        m["shards"][0]["sha256"] = fs.file_sha256(path)

    edit_manifest(folder, fix)


def second_segment_start(folder: Path) -> int:
    """Flat token index of row 0's second segment."""
    return int(read_table(shard(folder)).column("seq_lens")[0].as_py()[0])


def assert_caught(folder: Path, *needles: str, check: str | None = None, **kwargs) -> None:
    report = verify(folder, **kwargs)
    assert not report.ok
    text = "\n".join(str(p) for p in report.problems)
    for needle in needles:
        assert needle in text, text
    if check is not None:
        assert {p.check for p in report.problems} == {check}, text
    result = run(folder, *[f"--{k}={v}" for k, v in kwargs.items() if k != "quick"], *(["--quick"] if kwargs.get("quick") else []))
    assert result.exit_code == 1, result.output
    assert "problem" in result.stdout.splitlines()[0]


# -- clean -------------------------------------------------------------------------------------------


def test_clean_build_passes_every_check(clean):
    report = verify(clean, tokenizer=str(BUNDLED_TOKENIZER), source="flan")
    assert report.ok, report.problems
    assert report.checked["rows"] > 0 and report.checked["shards"] == 1
    result = run(clean)
    assert result.exit_code == 0 and result.stdout.startswith(f"{clean}: OK"), result.output
    data = json.loads(run(clean, "--quick", "--json").stdout)
    assert data["ok"] and data["quick"] and data["problems"] == []


def test_verify_shows_progress_on_its_long_steps_with_their_totals(clean):
    """Hashing every byte, every row, re-tokenizing the source and recomputing its loss mask: a bar each on
    stderr, ending at its total (the shards' bytes, the rows, the records the build read); none with -q or
    --json."""
    manifest = schema.read_manifest(clean)
    result = CliRunner().invoke(main, ["verify", str(clean), "--source", "flan"])
    assert result.exit_code == 0, result.output
    bars = result.stderr
    size = sum(e.bytes for e in manifest.shards)
    from tqdm import tqdm

    shown = tqdm.format_sizeof(size)
    assert "hash: 100%" in bars and f"{shown}/{shown}" in bars, bars
    assert "rows: 100%" in bars and f"{manifest.stats.rows}/{manifest.stats.rows}" in bars, bars
    read = manifest.stats.examples_read
    assert "re-tokenize: 100%" in bars and f"{read}/{read}" in bars, bars
    assert "loss mask: 100%" in bars, bars  # the source read again for the mask, as long again
    for quiet in (["-q"], ["--json"]):
        result = CliRunner().invoke(main, ["verify", str(clean), "--source", "flan", *quiet])
        assert result.exit_code == 0 and "100%" not in result.stderr, result.stderr


def test_bfd_split_build_passes(tmp_path):
    out = make_build(tmp_path / "bfd", limit=80, pack="bfd", max_len=256, overlong="split")
    report = verify(out, source="flan")
    assert report.ok, report.problems


def test_cannot_run_exits_2(tmp_path):
    result = run(tmp_path / "nope")
    assert result.exit_code == 2 and "no such folder" in result.stderr and len(result.stderr.splitlines()) == 1


# -- files and manifest --------------------------------------------------------------------------------


def test_flipped_byte(copy):
    data = bytearray(shard(copy).read_bytes())
    data[len(data) // 2] ^= 0x01
    shard(copy).write_bytes(bytes(data))
    assert_caught(copy, "sha256 differs")
    assert_caught(copy, "sha256 differs", quick=True)


def test_truncated_shard(copy):
    data = shard(copy).read_bytes()
    shard(copy).write_bytes(data[: len(data) // 3])
    assert_caught(copy, "bytes, the manifest records", "sha256 differs", "cannot be read as an Arrow stream")


def test_deleted_shard(copy):
    shard(copy).unlink()
    assert_caught(copy, "missing, the manifest lists it")


def test_missing_manifest(copy):
    (copy / schema.MANIFEST_NAME).unlink()
    assert_caught(copy, "not a finished build", check="manifest")


def test_corrupted_manifest(copy):
    (copy / schema.MANIFEST_NAME).write_text('{"format": "packer", "format_')
    assert_caught(copy, "not valid JSON")


def test_unknown_format_version(copy):
    edit_manifest(copy, lambda m: m.update(format_version=99))
    assert_caught(copy, "format version 99")


def test_misspelt_or_missing_manifest_keys_are_manifest_problems(copy):
    def misspell(m):
        m["stats"]["loss_tokenz"] = m["stats"].pop("loss_tokens")
        del m["shards"][0]["sha256"]

    edit_manifest(copy, misspell)
    # the contract's own parser finds both, and verify reports each
    assert_caught(copy, "stats: lacks or mistypes loss_tokens, unknown keys loss_tokenz",
                  "shards[0]: entry lacks or mistypes sha256", check="manifest")
    with pytest.raises(ShardFormatError, match="lacks or mistypes loss_tokens"):
        schema.read_manifest(copy)


def test_manifest_round_trips_to_its_own_bytes(clean):
    data = (clean / schema.MANIFEST_NAME).read_bytes()
    assert schema.Manifest.from_json(json.loads(data)).dumps() == data


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ("rows", "rows = "),
        ("tokens", "tokens = "),
        ("loss_tokens", "loss_tokens = "),
        ("examples_truncated", "packed + split + truncated + dropped"),
        ("records_skipped", "records are unaccounted for"),
    ],
)
def test_edited_manifest_stats(copy, key, needle):
    edit_manifest(copy, lambda m: m["stats"].update({key: m["stats"][key] + 1}))
    assert_caught(copy, needle, check="stats")


def test_edited_manifest_shard_rows(copy):
    edit_manifest(copy, lambda m: m["shards"][0].update(rows=m["shards"][0]["rows"] - 1))
    assert_caught(copy, "rows, the manifest records")


def test_edited_manifest_sha(copy):
    edit_manifest(copy, lambda m: m["shards"][0].update(sha256="0" * 64))
    assert_caught(copy, "sha256 differs", check="files", quick=True)


def test_edited_manifest_budget(copy):
    edit_manifest(copy, lambda m: m["config"].update(batch_size=2))
    assert_caught(copy, "more than batch_size=2 segments", check="rows")


@pytest.mark.parametrize("name", [schema.shard_name(7)])  # a name a build writes (others: test_verify_ownership)
def test_extra_file(copy, name):
    (copy / name).write_text("hello")
    assert_caught(copy, f"{name}: not listed in the manifest", check="files")


def test_staging_folder_is_left_to_the_next_build(copy):
    """A staging folder of packer's is reported, and the report says what removes it: the next build,
    not the user (removing it by hand could pull the lock from under a build writing there now)."""
    (copy / schema.STAGING).mkdir()
    (copy / schema.STAGING / schema.LOCK).write_bytes(schema.LOCK_BYTES)
    [problem] = verify(copy).problems
    assert problem.check == "files" and "the next `packer build`" in problem.message
    assert "remove it" not in problem.message


# -- rows written by hand (sha and bytes re-recorded, so only the row checks see it) ------------------------


def test_label_crosses_boundary(copy):
    start = second_segment_start(copy)
    ids = read_table(shard(copy)).column("input_ids")[0].as_py()

    def change(labels, offsets):
        labels[start] = ids[start]  # the first token of segment 2 trained: a label across the boundary

    rewrite_shard(copy, "labels", change)
    # A careful forgery: the row's loss count and the manifest's total agree with the new label.
    rewrite_shard(copy, "num_loss_tokens", lambda v, _: v.__setitem__(0, v[0] + 1))
    edit_manifest(copy, lambda m: m["stats"].update(loss_tokens=m["stats"]["loss_tokens"] + 1))
    report = verify(copy)
    assert [p.message for p in report.problems] == [
        "a label is not -100 at a segment start: a label crosses an example boundary"
    ], report.problems
    assert_caught(copy, "row 0", "not -100 at a segment start", check="rows")
    assert verify(copy, quick=True).ok  # the hashes match: only the row checks can see it


def test_label_not_the_input(copy):
    def change(labels, offsets):
        i = int(np.flatnonzero(labels != schema.IGNORE_INDEX)[0])
        labels[i] = (labels[i] + 1) % 100

    rewrite_shard(copy, "labels", change)
    assert_caught(copy, "neither -100 nor the input id", check="rows")


def test_wrong_position_ids(copy):
    start = second_segment_start(copy)

    def change(pos, offsets):
        pos[start] = start  # no restart at the second segment

    rewrite_shard(copy, "position_ids", change)
    assert_caught(copy, "row 0", "position_ids do not run", check="rows")


def test_wrong_num_loss_tokens(copy):
    rewrite_shard(copy, "num_loss_tokens", lambda v, _: v.__setitem__(3, v[3] + 1))
    assert_caught(copy, "row 3", "num_loss_tokens differs", check="rows")


def test_wrong_max_seqlen(copy):
    rewrite_shard(copy, "max_seqlen", lambda v, _: v.__setitem__(5, v[5] - 1))
    assert_caught(copy, "row 5", "max_seqlen differs", check="rows")


def test_seq_lens_do_not_sum(copy):
    def change(seq, offsets):
        seq[0] -= 1
        seq[1] += 1  # same total per row, but the boundary moved: positions and labels no longer agree

    rewrite_shard(copy, "seq_lens", change)
    assert_caught(copy, "row 0", "position_ids do not run", check="rows")


def test_token_id_beyond_vocab(copy):
    vocab = json.loads((copy / schema.MANIFEST_NAME).read_text())["tokenizer"]["vocab_size"]
    rewrite_shard(copy, "input_ids", lambda v, _: v.__setitem__(0, vocab + 5))
    assert_caught(copy, "row 0", f"token ids outside [0, {vocab:,})", check="rows")


# -- tokenizer and source ------------------------------------------------------------------------------------


def test_wrong_tokenizer(clean, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-tokenizer"
    tok = AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER))
    tok.add_tokens(["<not-in-the-build>"])
    tok.save_pretrained(str(other))
    assert_caught(clean, "fingerprint differs", "vocab_size differs", check="tokenizer", tokenizer=str(other))


def test_source_accounting(tmp_path):
    rows = [{"prompt": f"question {i}?", "completion": f"answer {i} " * (1 + i % 7)} for i in range(40)]
    rows[5]["completion"] = ""  # skipped: empty_text
    rows[9]["completion"] = "very long " * 200  # dropped: overlong
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = make_build(tmp_path / "out", source=str(src), max_len=64, overlong="drop", on_error="skip", batch_size=3)
    stats = json.loads((out / schema.MANIFEST_NAME).read_text())["stats"]
    assert stats["dropped_by_reason"] == {"empty_text": 1, "overlong": 1} and stats["records_skipped"] == 1
    assert verify(out, source=str(src)).ok

    rows[20]["completion"] = "a different answer"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_caught(out, "sha256 differ from the ones the build recorded", check="source", source=str(src))

    rows[20]["completion"] = ""  # one more record that fails to format
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_caught(out, "skipped records by reason", check="source", source=str(src))


# -- the loader refuses a damaged folder at open, not mid-epoch -------------------------------------------


@pytest.mark.parametrize("damage", ["deleted", "truncated", "no_manifest", "foreign"])
def test_loader_refuses_damaged_folder_at_open(copy, damage):
    loader = pytest.importorskip("packer.training.loader")
    from packer.errors import ShardFormatError

    if damage == "deleted":
        shard(copy).unlink()
    elif damage == "truncated":
        shard(copy).write_bytes(shard(copy).read_bytes()[:1000])
    elif damage == "no_manifest":
        (copy / schema.MANIFEST_NAME).unlink()
    else:
        (copy / schema.MANIFEST_NAME).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ShardFormatError):
        loader.PackedDataset(copy)


@pytest.mark.parametrize("damage", ["negative", "the whole segment"])
def test_a_damaged_pad_count_is_reported_by_verify_and_refused_by_the_loader(tmp_path, damage):
    """A padded build's pad_lens broken in one row: verify lists the problem (it used to stop in a numpy
    error while totalling the padding) and the loader refuses the shard in one line (it used to raise
    numpy's ValueError from the padding check)."""
    torch = pytest.importorskip("torch")  # noqa: F841 (the loader's module imports it)
    from packer.training.loader import make_dataloader

    out = make_build(tmp_path / "b", limit=40, pack="bfd", max_len=256, max_tokens=1024, cp_size=2)
    seq0 = int(pa.ipc.open_stream(pa.BufferReader((out / "shard-00000.arrow").read_bytes())).read_all()
               .column("seq_lens")[0].as_py()[0])

    def change(values, offsets):
        values[0] = -1 if damage == "negative" else seq0

    rewrite_shard(out, schema.PAD_COLUMN, change)
    report = verify(out)
    assert not report.ok
    assert any("pad_lens is not one count per segment" in str(p) for p in report.problems), report.problems
    with pytest.raises(ShardFormatError, match="row 0: pad_lens is not one count per segment"):
        list(make_dataloader(out))
