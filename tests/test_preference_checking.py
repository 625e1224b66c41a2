"""Reading a preference build: ``packer inspect`` counts pairs and compares the modes over pairs (never
split), draws each segment as pair k chosen / rejected (CP padding included), finds a record's two
sequences; ``packer verify --source`` re-checks the pairs' tokens, loss mask and roles against the source;
``packer build`` reports pairs. Small real builds with the bundled tokenizer."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from conftest import make_build, rewrite_column
from test_verify import edit_manifest, rewrite_shard

from packer import BuildConfig
from packer.building.pipeline import BuildResult
from packer.checking import inspect_
from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema
from packer.render import build_lines, example_lines, row_lines, summary_lines

WORDS = "the sky is blue and grass is green while snow stays white".split()


def records(n: int = 24) -> list[dict]:
    """Pairs of varied lengths (prompts 3..14 words, completions 1..26), a few over 48 tokens."""
    out = []
    for i in range(n):
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 12))
        good = " ".join(WORDS[(2 * i + k) % len(WORDS)] for k in range(1 + (7 * i) % 26))
        bad = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(1 + (5 * i + 3) % 19))
        out.append({"prompt": f"Q{i}: {prompt}?\nA:", "chosen": " " + good, "rejected": " no " + bad})
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs_src") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return path


@pytest.fixture(scope="module")
def batch_build(src, tmp_path_factory):
    """Batch of 3 pairs a row, sequences cut at 40 tokens, format 1 (whose int32 labels the damage edits)."""
    return make_build(tmp_path_factory.mktemp("pairs_batch") / "out", str(src), pack="batch", batch_size=3,
                      max_len=40, overlong="truncate", format_version=1)


@pytest.fixture(scope="module")
def cp_build(src, tmp_path_factory):
    """bfd into 128-token rows, a CP group of 2 (every segment padded to even), format 2, 2 epochs."""
    return make_build(tmp_path_factory.mktemp("pairs_cp") / "out", str(src), pack="bfd", max_len=48, max_tokens=128,
                      overlong="truncate", cp_size=2, format_version=2, epochs=2)


def cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(map(str, args)), env={"NO_COLOR": "1"})
    assert result.exit_code == code, result.output
    return result.output


def rows_of(out) -> list[dict]:
    rows = []
    for entry in schema.read_manifest(out).shards:
        rows += schema.open_shard(out / entry.file).to_pylist()
    return rows


def textbook_bfd(sizes, budget: int) -> int:
    """Best-fit decreasing, one item at a time: each goes to the fullest open row it still fits."""
    loads: list[int] = []
    for s in sorted(sizes, reverse=True):
        fits = [k for k, load in enumerate(loads) if load + s <= budget]
        if fits:
            best = max(fits, key=lambda k: loads[k])
            loads[best] += s
        else:
            loads.append(s)
    return len(loads)


# -- inspect: the summary ---------------------------------------------------------------------------


def test_modes_place_pairs_whole_on_a_hand_counted_case():
    """Three pairs of (7, 4) into rows of 20: a pair is 11 tokens, so two never share a row: 3 rows. Over
    single segments (7 + 7 + 4, 7 + 4 + 4) it would be 2 rows, which splits pairs; per step: 3 pairs."""
    lengths = np.array([7, 4, 7, 4, 7, 4])
    built = np.array([0, 2, 4, 6])  # the build's own rows: a pair each
    config = BuildConfig(source="flan", out="", pack="optimal", max_len=10, max_tokens=20)
    modes = {m.mode: m for m in inspect_.compare_modes(lengths, built, config, paired=True)}
    assert modes["optimal"].built and modes["optimal"].rows == 3
    assert modes["bfd"].rows == 3 == textbook_bfd([11, 11, 11], 20)
    assert textbook_bfd(lengths.tolist(), 20) == 2  # what a count over segments would have said
    # batch of DEFAULT_BATCH (8) pairs: one row of the 3 pairs; padded DPO: 6 sequences padded to 7
    assert modes["batch"].rows == 1 and modes["batch"].examples_per_step == 3.0
    assert modes["padded"].computed_tokens == 6 * 7 and modes["padded"].tokens == 33
    assert modes["bfd"].examples_per_step == 1.0
    unpaired = {m.mode: m for m in inspect_.compare_modes(lengths, np.array([0, 2, 4, 6]), config)}
    assert unpaired["bfd"].rows == 2  # the same lengths as SFT examples: the count differs, so the flag matters


def test_summary_counts_pairs_and_compares_modes_over_pairs(batch_build):
    view = inspect_.summary(batch_build)
    s = view.stats
    rows = rows_of(batch_build)
    per_row = [len(r["seq_lens"]) // 2 for r in rows]
    assert view.row_pairs == (min(per_row), sum(per_row) / len(per_row), max(per_row))
    assert max(per_row) == 3 and sum(per_row) == s.pairs == 24  # every pair, three a row (the last fewer)
    out = view.to_json()
    assert out["pairs"] == {"pairs": 24, "sequences": 48, "per_row": {"min": min(per_row), "mean": 24 / len(rows),
                                                                       "max": 3}}
    assert out["modes_unit"] == "pairs"
    modes = {m.mode: m for m in view.modes}
    # independent counts from the rows themselves: pair sizes, and padded DPO batches of each row's sequences
    pairs = [sum(r["seq_lens"][k:k + 2]) for r in rows for k in range(0, len(r["seq_lens"]), 2)]
    padded = sum(len(r["seq_lens"]) * max(r["seq_lens"]) for r in rows)
    assert modes["batch"].built and modes["batch"].rows == len(rows) == math.ceil(24 / 3)
    assert modes["padded"].computed_tokens == padded == s.padded_tokens
    assert modes["batch"].examples_per_step == 24 / len(rows)
    budget = max(sum(r["seq_lens"]) for r in rows)  # a batch build's bfd packs into its largest row
    assert modes["bfd"].peak_row_tokens == budget
    assert modes["bfd"].rows == textbook_bfd(pairs, budget)
    assert modes["optimal"].rows <= modes["bfd"].rows
    text = "\n".join(summary_lines(view, color=False))
    assert "pairs        24 read" in text and "24 pairs → 48 sequences in 8 rows" in text
    assert "pairs a row  3.0 (3..3)" in text and "pairs/step" in text and "3 pairs per row (6 sequences)" in text
    assert "the modes on these 24 pairs (48 segments" in text
    assert json.loads(cli("inspect", batch_build, "--json"))["pairs"]["pairs"] == 24


def test_summary_of_a_cp_build_over_epochs(cp_build):
    view = inspect_.summary(cp_build)
    s = view.stats
    assert s.epochs == 2 and s.padded and s.pairs + s.examples_dropped == 24
    rows = rows_of(cp_build)
    per_row = [len(r["seq_lens"]) // 2 for r in rows]
    assert view.row_pairs[0] == min(per_row) and view.row_pairs[2] == max(per_row)
    assert sum(per_row) == 2 * s.pairs  # both epochs' rows
    modes = {m.mode: m for m in view.modes}
    assert modes["bfd"].built and modes["bfd"].rows == len(rows)
    pairs = [sum(r["seq_lens"][k:k + 2]) for r in rows for k in range(0, len(r["seq_lens"]), 2)]  # padded sizes
    assert modes["bfd"].tokens == sum(pairs)
    # a bfd build's batch comparison: DEFAULT_BATCH (8) pairs a row, over both epochs' pairs
    assert modes["batch"].rows == math.ceil(len(pairs) / inspect_.DEFAULT_BATCH) and len(pairs) == 2 * s.pairs
    assert modes["optimal"].rows <= textbook_bfd(pairs, 128)


# -- inspect: one row, one record -------------------------------------------------------------------


def test_row_marks_each_segment_pair_and_role(batch_build):
    shard_row = rows_of(batch_build)[1]
    view = inspect_.row(batch_build, 1)
    assert view.pairs == len(shard_row["seq_lens"]) // 2
    roles = {1: "chosen", 0: "rejected"}
    assert [(s.pair, s.role) for s in view.segments] == [(k // 2, roles[r]) for k, r in enumerate(shard_row["pair_roles"])]
    assert all(s.pad_tokens is None for s in view.segments)
    data = json.loads(cli("inspect", batch_build, "--row", 1, "--json"))
    assert data["pairs"] == view.pairs
    assert [(s["pair"], s["role"]) for s in data["segments"]] == [(s.pair, s.role) for s in view.segments]
    text = cli("inspect", batch_build, "--row", 1)
    assert "(3 pairs)" in text.splitlines()[0]
    for k in range(view.pairs):
        assert f"pair {k} chosen · example {view.segments[2 * k].example_id}" in text
        assert f"pair {k} rejected · example {view.segments[2 * k].example_id}" in text


def test_row_of_a_cp_build_keeps_roles_and_padding(cp_build):
    from packer.building.pipeline import tokenizer_path
    from packer.building.tokenization import load_tokenizer
    rows = rows_of(cp_build)
    r = next(i for i, row in enumerate(rows) if any(row["pad_lens"]))  # a row with padding
    view = inspect_.row(cp_build, r, load_tokenizer(tokenizer_path(None)))
    assert [s.role for s in view.segments] == ["chosen", "rejected"] * view.pairs
    assert [s.pad_tokens for s in view.segments] == rows[r]["pad_lens"]
    multiple = schema.read_manifest(cp_build).config.layout().segment_multiple  # zigzag CP 2: a multiple of 4
    assert multiple > 1 and all(s.length % multiple == 0 for s in view.segments)
    for s in view.segments:  # the runs decode the segment's own tokens, the padding is counted apart
        assert sum(run.tokens for run in s.runs) == s.length - s.pad_tokens
    text = "\n".join(row_lines(view, show_ids=False, color=False, width=100))
    assert "padding" in text and "pair 0 chosen" in text and "EOS packer appends" not in text


def test_example_shows_both_sequences_of_a_pair(batch_build):
    ex = rows_of(batch_build)[0]["example_ids"][0]
    view = inspect_.find_example(batch_build, ex)
    assert view.paired and not view.split and len(view.pieces) == 2
    assert [p.role for p in view.pieces] == ["chosen", "rejected"]
    assert [p.segment for p in view.pieces] == [0, 1] and view.pieces[0].row == view.pieces[1].row == 0
    assert view.tokens == sum(p.length for p in view.pieces)
    text = "\n".join(example_lines(view, str(batch_build), color=False))
    assert text.startswith(f"pair {ex}:") and "chosen" in text and "rejected" in text and "split" not in text
    assert [p["role"] for p in json.loads(cli("inspect", batch_build, "--example", ex, "--json"))["pieces"]] == [
        "chosen", "rejected"]


def test_truncated_pairs_are_the_manifests(batch_build):
    """A pair is truncated when either of its sequences is cut at --max-len: counted as the build counts."""
    s = schema.read_manifest(batch_build).stats
    found = [inspect_.find_example(batch_build, i) for i in range(s.examples_read)]
    assert all(v.found and not v.split for v in found)
    assert 0 < sum(v.truncated for v in found) == s.examples_truncated


# -- verify --source ----------------------------------------------------------------------------------


@pytest.fixture
def damaged(batch_build, tmp_path):
    out = tmp_path / "shards"
    shutil.copytree(batch_build, out)
    return out


def _problems(out, src) -> dict[str, list[str]]:
    report = verify(out, source=str(src))
    found: dict[str, list[str]] = {}
    for p in report.problems:
        found.setdefault(p.check, []).append(p.message)
    return found


def test_verify_source_passes_clean_pair_builds(batch_build, cp_build, src):
    for out in (batch_build, cp_build):
        report = verify(out, source=str(src))
        assert report.ok, report.problems
    assert cli("verify", cp_build, "--source", src, "-q").startswith(f"{cp_build}: OK")


def _trained_positions(out) -> tuple[np.ndarray, np.ndarray]:
    table = pa.ipc.open_stream(pa.BufferReader((out / schema.shard_name(0)).read_bytes())).read_all()
    labels = table.column("labels").combine_chunks().values.to_numpy()
    ids = table.column("input_ids").combine_chunks().values.to_numpy()
    return np.flatnonzero(labels != schema.IGNORE_INDEX), ids


def test_verify_source_catches_a_changed_token(damaged, src):
    """One trained token changed in ids and labels alike: every row rule holds, only the source disagrees."""
    trained, ids = _trained_positions(damaged)
    at = int(trained[len(trained) // 2])
    other = int(ids[at]) + 1 if ids[at] + 1 < 200 else int(ids[at]) - 1

    def change(values, _):
        values[at] = other

    rewrite_shard(damaged, "input_ids", change)
    rewrite_shard(damaged, "labels", change)
    assert verify(damaged).ok  # the rows and the pairing hold
    found = _problems(damaged, src)
    assert set(found) == {"source"} and any("1 tokens differ from the source's tokens" in m for m in found["source"])


def test_verify_source_catches_a_changed_loss_mask(damaged, src):
    """A pair's last trained token (its EOS) made untrained, its counts kept consistent: only the source sees it."""
    trained, _ = _trained_positions(damaged)
    first_len = rows_of(damaged)[0]["seq_lens"][0]
    at = int(trained[trained < first_len][-1])  # the chosen sequence's last trained token, in row 0

    rewrite_shard(damaged, "labels", lambda values, _: values.__setitem__(at, schema.IGNORE_INDEX))
    rewrite_shard(damaged, "num_loss_tokens", lambda values, _: values.__setitem__(0, values[0] - 1))
    edit_manifest(damaged, lambda m: m["stats"].update(loss_tokens=m["stats"]["loss_tokens"] - 1))
    assert verify(damaged).ok
    found = _problems(damaged, src)
    assert set(found) == {"source"}
    assert any("1 tokens are trained where the source's loss mask says otherwise" in m for m in found["source"])


def test_verify_source_catches_a_flipped_role(damaged, src):
    rewrite_shard(damaged, schema.PAIR_COLUMN, lambda values, _: values.__setitem__(slice(0, 2), values[[1, 0]]))
    found = _problems(damaged, src)
    assert any("2 segments carry another pair role than the source's" in m for m in found["source"])
    assert any("not chosen, rejected in turn" in m for m in found["rows"])


def test_verify_source_catches_swapped_sequences(damaged, src):
    """Row 0's first pair's two sequences exchanged, the roles left 1, 0: every row rule and pairing rule
    holds (the prompt is shared), yet the rejected sequence now reads as chosen; the source check sees it."""
    a, b = rows_of(damaged)[0]["seq_lens"][:2]  # row 0 starts the shard's flat values
    path = damaged / schema.shard_name(0)

    def swap(values, _):
        chunk = values[: a + b].copy()
        values[:b], values[b : a + b] = chunk[a:], chunk[:a]

    for column in ("input_ids", "labels", "position_ids"):
        rewrite_column(path, column, swap)
    rewrite_shard(damaged, "seq_lens", lambda values, _: values.__setitem__(slice(0, 2), [b, a]))
    assert verify(damaged).ok
    found = _problems(damaged, src)
    # sequences of one length: the same segments, other tokens; else other lengths than the plan's
    said = "tokens differ from the source's tokens" if a == b else "differ from the plan of this source"
    assert set(found) == {"source"} and any(said in m for m in found["source"]), found


# -- build output ---------------------------------------------------------------------------------------


def test_build_output_counts_pairs(batch_build, cp_build, src, tmp_path):
    m = schema.read_manifest(batch_build)
    lines = build_lines(BuildResult(out=batch_build, manifest=m, reused=False, seconds=0.5))
    text = "\n".join(lines)
    s = m.stats
    assert lines[0].startswith("note: tokenized by packer's bundled toy tokenizer")  # no --tokenizer: said first
    assert lines[1].startswith(f"pairs     24 read · {s.examples_packed} packed whole · "
                               f"{s.examples_truncated} truncated")
    assert "24 pairs → 48 sequences in 8 rows (3.0 pairs a row" in text
    assert "rows      8 (batch of 3 pairs) · padded DPO batches (6 sequences each)" in text
    assert "examples" not in text
    epochs = "\n".join(build_lines(BuildResult(out=cp_build, manifest=schema.read_manifest(cp_build), reused=False,
                                               seconds=0.5)))
    cs = schema.read_manifest(cp_build).stats
    assert f"{cs.pairs} pairs × 2 epochs → {cs.segments} sequences" in epochs
    # a drop build: dropped pairs by reason, and --json keeps its keys with the pairs beside them
    out = cli("build", src, "--out", tmp_path / "drop", "--pack", "bfd", "--max-len", 24, "--max-tokens", 64,
              "--overlong", "drop", "--json")
    stats = json.loads(out[out.index("{"):])["stats"]
    assert stats["pairs"] + stats["examples_dropped"] == 24 and stats["examples_dropped"] > 0
    assert stats["segments"] == 2 * stats["pairs"] and stats["dropped_by_reason"] == {"overlong": stats["examples_dropped"]}
    gone = next(i for i in range(24) if not inspect_.find_example(tmp_path / "drop", i).found)
    said = example_lines(inspect_.find_example(tmp_path / "drop", gone), "drop", color=False)
    assert said == [f"pair {gone}: in no row; it was dropped (overlong: {stats['examples_dropped']} in this build)"]
    text = "\n".join(build_lines(BuildResult(out=tmp_path / "drop", manifest=schema.read_manifest(tmp_path / "drop"),
                                             reused=False, seconds=0.1)))
    assert f"dropped: overlong {stats['examples_dropped']}" in text and f"{stats['pairs']} pairs →" in text


# -- the loader's context-parallel share ---------------------------------------------------------------


def test_loader_cp_share_keeps_pair_roles(cp_build):
    pytest.importorskip("torch")
    from packer.training.loader import PackedDataset
    batch = next(iter(PackedDataset(cp_build, cp_size=2, cp_rank=0)))
    assert "pair_roles" in batch  # carried onto the share by the loader (tests/test_preference_options.py)
