"""What the CLI prints, by value: render's functions are pure (view → lines), so each line is compared
whole, and an arithmetic slip in a figure (padding removed, fill, rows over the lower bound) fails."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from packer import BuildConfig, render
from packer.building.pipeline import BuildResult, tokenizer_path
from packer.building.tokenization import load_tokenizer
from packer.checking import inspect_
from packer.checking.verify import verify
from packer.contract import schema
from packer.planning.plan import plan

STATS = dict(
    examples=100, examples_packed=97, examples_split=0, examples_truncated=2, examples_dropped=1, segments=99,
    tokens_in=1_600, tokens=1_500, tokens_truncated=60, tokens_dropped=40, rows=13, max_row_tokens=400,
    row_budget=400, lower_bound=4, fill=0.5, world_size=1, rank_work_max_over_mean=1.0, examples_read=101,
    records_skipped=1, dropped_by_reason={"empty_text": 1, "overlong": 1}, loss_tokens=600, segments_without_loss=0,
)

BFD_100 = BuildConfig(source="flan", out="", pack="bfd", max_tokens=100, max_len=100)


def _result(config: dict, **stats) -> BuildResult:
    manifest = schema.Manifest(created_by="test", note=None, config=BuildConfig(source="flan", out="", **config),
                               tokenizer={}, source={},
                               stats=schema.Stats(**{**STATS, **stats}),
                               shards=(schema.ShardEntry(file="shard-00000.arrow", rows=13, tokens=1_500,
                                                         bytes=2_500_000, sha256="0" * 64),))
    return BuildResult(Path("out"), manifest, False, 1.25)


def test_batch_build_summary_says_the_padding_packing_removes():
    lines = render.build_lines(_result({"pack": "batch", "batch_size": 8}, padded_tokens=6_000))
    assert lines == [
        "examples  101 read · 97 packed whole · 0 split · 2 truncated · dropped: empty_text 1, overlong 1",
        "tokens    1,500 in rows (600 trained) · 60 truncated · 40 dropped",
        "rows      13 (batch of 8) · padded batches would hold 6,000 tokens: packing removes 75.0% of them",
        "shards    1 in out (2.5 MB)",
        "time      1.2 s",
    ]


def test_bfd_build_summary_says_fill_and_lower_bound():
    lines = render.build_lines(_result({"pack": "bfd", "max_tokens": 4096}, rows=5, segments_without_loss=3))
    assert lines[2].startswith("warning   3 segments hold no trained token")
    assert lines[3] == "rows      5 (bfd, ≤ 4,096 tokens) · fill 50.0% · 1.250 × lower bound 4"


def test_reused_build_and_note_come_first():
    result = _result({"pack": "batch", "batch_size": 8}, padded_tokens=1_500)
    result = dataclasses.replace(result, reused=True,
                                 manifest=dataclasses.replace(result.manifest, note="a synthetic sample"))
    lines = render.build_lines(result)
    assert lines[:2] == ["out: already holds this build (same source, config and tokenizer); nothing to do",
                         "note: a synthetic sample"]
    assert lines[4].endswith("packing removes 0.0% of them")


def test_summary_lines_without_colour_carry_no_escapes(flan_batch):
    view = inspect_.summary(flan_batch)
    plain, styled = render.summary_lines(view, color=False), render.summary_lines(view, color=True)
    assert [line for line in plain if "\x1b[" in line] == []
    assert any("\x1b[" in line for line in styled) and len(plain) == len(styled)
    assert plain[1] == (f"{flan_batch}: {view.stats.rows:,} rows (batch of 4), tokenizer bundled")


def test_row_lines_fit_the_width(flan_batch):
    view = inspect_.row(flan_batch, 0, load_tokenizer(tokenizer_path(None)), elide=None)
    lines = render.row_lines(view, show_ids=True, color=False, width=60)
    body = [line for line in lines if line.startswith("│ ") and not line.startswith("│ segment")]
    assert body and max(len(line) for line in body) <= 2 + 60  # the bar and a space, then at most `width`
    numbers = [int(t) for line in body for t in line[2:].replace("«", " ").replace("»", " ").split()]
    assert numbers == [i for seg in view.segments for i in seg.ids]


def test_verify_lines_are_the_verdict_then_each_problem(flan_batch):
    report = verify(flan_batch, quick=True)
    assert render.verify_lines(report) == [report.verdict()]
    report.add("files", "x.arrow", "missing")
    assert render.verify_lines(report) == [report.verdict(), "  x.arrow: missing"]


def test_summary_modes_table_has_an_optimal_line(flan_bfd):
    """47, 47, 37, 37, 16, 16 into rows of 100: bfd 3 rows, optimal 2 (tests/test_inspect.py says why)."""
    lengths = np.array([47, 47, 37, 37, 16, 16])
    bfd = plan(lengths, mode="bfd", max_len=100)
    view = dataclasses.replace(inspect_.summary(flan_bfd, compare=False),
                               modes=tuple(inspect_.compare_modes(bfd.length, bfd.row_splits, BFD_100)))
    lines = render.summary_lines(view, color=False)
    assert lines[-3:-1] == [
        "  ▸ bfd           3           3            2.0        200     0.0%       100  66.7%   rows filled up to 100 tokens",
        "    optimal       2           2            3.0        200     0.0%       100 100.0%   bfd's rows refilled: 1 fewer",
    ]
    assert lines[-1].endswith("optimal: bfd's budget in 2 rows, 1 fewer.")
    assert "bfd: 200% more rows" in lines[-1]  # batch (8 a row) needs 1 row: 3 bfd rows are 200% more


def test_chat_row_says_which_eos_packer_appended():
    """A chat render ending `<|im_end|>` and a newline gets packer's EOS after it: the view says so, once,
    under that segment; a segment whose only EOS ends it (packer's, after a completion) gets no note."""
    from packer.checking.views import Row, Run, Segment

    def segment(k, ids, text):
        return Segment(segment=k, example_id=k, offset=0, length=len(ids), trained_tokens=0, ids=ids,
                       trained=[False] * len(ids), runs=(Run(trained=False, tokens=len(ids), ids=ids, text=text),))

    chat = segment(0, [7, 8, 2, 10, 2], "Hello.<|im_end|>\n<|im_end|>")
    plain = segment(1, [7, 8, 2], "Hello.</s>")
    view = Row(row=0, shard="s", tokens=8, num_loss_tokens=0, max_seqlen=5, segments=(chat, plain), eos_token_id=2)
    lines = render.row_lines(view, show_ids=False, color=False, width=100)
    notes = [i for i, line in enumerate(lines) if "the EOS packer appends" in line]
    assert len(notes) == 1 and notes[0] < next(i for i, line in enumerate(lines) if "boundary" in line)
    assert "EOS packer" not in " ".join(render.row_lines(dataclasses.replace(view, eos_token_id=None),
                                                         show_ids=False, color=False, width=100))


def test_own_data_on_the_bundled_tokenizer_small_sizes_and_one_row_read_right():
    """A build of one's own data with no --tokenizer says it used the bundled toy tokenizer; a size under
    a megabyte is shown in its unit (never 0.0 MB), and a count of one is singular."""
    result = _result({"pack": "batch", "batch_size": 8}, padded_tokens=1_500, rows=1, segments=1, pairs=None)
    manifest = dataclasses.replace(result.manifest, tokenizer={"name_or_path": "bundled", "vocab_size": 12_000},
                                   shards=(dataclasses.replace(result.manifest.shards[0], rows=1, bytes=1_536),))
    lines = render.build_lines(dataclasses.replace(result, manifest=manifest))
    assert lines[0].startswith("note: tokenized by packer's bundled toy tokenizer (vocab 12,000") and "--tokenizer" in lines[0]
    assert lines[-2] == "shards    1 in out (1.5 kB)"
    assert [render.size_text(n) for n in (0, 1, 999, 1_536, 2_500_000)] == ["0 bytes", "1 byte", "999 bytes", "1.5 kB",
                                                                            "2.5 MB"]
    assert render.pairs_text(dataclasses.replace(manifest.stats, pairs=1, segments=2, rows=1)).startswith(
        "1 pair → 2 sequences in 1 row ")
    flan = render.build_lines(_result({"pack": "batch", "batch_size": 8}, padded_tokens=1_500))
    assert not flan[0].startswith("note")  # a named tokenizer: nothing to say
