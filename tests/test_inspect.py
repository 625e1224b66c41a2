"""packer inspect: the summary's mode comparison, the row drawing (colour, NO_COLOR, elision, ids),
--example against the rows themselves, --plot, --json for every view, and fsspec URLs."""

from __future__ import annotations

import dataclasses
import json
import re

import fsspec
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import make_build, one_line

from packer import BuildConfig
from packer.building.pipeline import tokenizer_path
from packer.building.tokenization import load_tokenizer
from packer.checking import inspect_
from packer.checking.views import Elided, Piece, Run
from packer.cli import main
from packer.contract import schema
from packer.planning.plan import plan

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run(*args, color: bool = False, env: dict | None = None, code: int = 0):
    result = CliRunner().invoke(main, ["inspect", *map(str, args)], color=color, env=env or {"NO_COLOR": ""})
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tokenizer_path("bundled"))


# -- summary --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flan_optimal(tmp_path_factory):
    """flan_bfd's records and rows of 1,024 tokens, under --pack optimal."""
    return make_build(tmp_path_factory.mktemp("flan_optimal"), limit=300, pack="optimal", max_len=1024, overlong="split")


def test_summary_compares_modes_on_the_builds_own_rows(flan_batch, flan_bfd, flan_optimal):
    for directory in (flan_batch, flan_bfd, flan_optimal):
        view = json.loads(run(directory, "--json"))
        stats, modes = view["stats"], {m["mode"]: m for m in view["modes"]}
        assert set(modes) == {"padded", "batch", "bfd", "optimal"}
        assert [m["mode"] for m in view["modes"] if m["built"]] == [view["pack"]]
        built = modes[view["pack"]]
        assert built["rows"] == stats["rows"]  # the built mode is measured, not re-planned
        for m in modes.values():
            assert m["tokens"] == stats["tokens"]
            assert m["computed_tokens"] >= m["tokens"]
            assert m["optimizer_steps"] == m["rows"]  # world size 1
        assert modes["batch"]["padding"] == modes["bfd"]["padding"] == 0
        assert modes["padded"]["rows"] == modes["batch"]["rows"]  # same steps as padded training
        assert stats["lower_bound"] <= modes["optimal"]["rows"] <= modes["bfd"]["rows"]
        assert modes["optimal"]["peak_row_tokens"] == modes["bfd"]["peak_row_tokens"]
        if view["pack"] == "batch":  # bfd then packs into the largest batch row: never more rows
            assert modes["bfd"]["rows"] <= modes["batch"]["rows"]
            assert modes["bfd"]["peak_row_tokens"] == modes["batch"]["peak_row_tokens"]
    batch = {m["mode"]: m for m in json.loads(run(flan_batch, "--json"))["modes"]}
    assert batch["padded"]["computed_tokens"] == json.loads(run(flan_batch, "--json"))["stats"]["padded_tokens"]


def test_optimal_line_counts_the_rows_of_a_refill_that_wins():
    """47, 47, 37, 37, 16, 16 into rows of 100: BFD pairs the 47s (6 left, nothing fits), then 37 + 37 +
    16, and the last 16 alone: 3 rows; 47 + 37 + 16 twice fills 2 rows exactly, the lower bound."""
    lengths = np.array([47, 47, 37, 37, 16, 16])
    bfd = plan(lengths, mode="bfd", max_len=100)
    modes = {m.mode: m for m in inspect_.compare_modes(bfd.length, bfd.row_splits,
                                                           BuildConfig(source="flan", out="", pack="bfd", max_tokens=100,
                                                                       max_len=100))}
    assert modes["bfd"].rows == 3 and modes["bfd"].built
    assert dataclasses.asdict(modes["optimal"]) == {"mode": "optimal", "rows": 2, "tokens": 200, "computed_tokens": 200, "padding": 0.0,
                                "peak_row_tokens": 100, "fill": 1.0, "optimizer_steps": 2, "examples_per_step": 3.0,
                                "built": False, "note": "bfd's rows refilled: 1 fewer"}


def test_summary_text(flan_batch):
    out = run(flan_batch)
    assert "the modes on these" in out
    for mode in ("padded", "batch", "bfd", "optimal"):
        assert re.search(rf"^\s+[▸ ] {mode}\s+\d", out, re.M), out
    assert "▸ batch" in out and "fewer" in out
    assert not ANSI.search(out)


# -- --row ----------------------------------------------------------------------------------------


def test_row_plain_is_readable_without_colour(flan_batch, tok):
    out = run(flan_batch, "--row", 0)
    assert not ANSI.search(out)
    view = inspect_.row(flan_batch, 0, tok)
    assert out.count("╞═ boundary") == len(view.segments) - 1
    for seg in view.segments:
        assert f"example {seg.example_id} · tokens {seg.offset:,}..{seg.offset + seg.length:,}" in out
    assert "«" in out and "»" in out  # trained runs are marked when colour cannot mark them
    trained_text = "".join(r.text for s in view.segments for r in s.runs if isinstance(r, Run) and r.trained)
    assert trained_text.strip().split()[0] in out


def test_row_elides_long_segments_with_a_count(flan_batch, tok):
    view = inspect_.row(flan_batch, 0, tok)
    long = [s for s in view.segments if s.length > 3 * inspect_.ELIDE_KEEP]
    assert long, "the fixture has 512-token segments"
    for seg in long:
        elided = [r for r in seg.runs if isinstance(r, Elided)]
        assert len(elided) == 1 and elided[0].elided == seg.length - 2 * inspect_.ELIDE_KEEP
        kept = sum(r.tokens for r in seg.runs if isinstance(r, Run))
        assert kept + elided[0].elided == seg.length
        assert len(seg.ids) == seg.length  # --json keeps the whole segment
    out = run(flan_batch, "--row", 0)
    assert f"⋯ {long[0].length - 2 * inspect_.ELIDE_KEEP:,} tokens" in out
    assert not re.search(r"⋯ [\d,]+ tokens", run(flan_batch, "--row", 0, "--full"))


def test_row_ids(flan_batch, tok):
    out = run(flan_batch, "--row", 1, "--ids", "--full")
    view = inspect_.row(flan_batch, 1, tok, elide=None)
    flat = " ".join(line[2:] for line in out.splitlines() if line.startswith("│ ") and "segment" not in line)
    numbers = [int(t) for t in re.findall(r"-?\d+", flat.replace("«", " ").replace("»", " "))]
    assert numbers == [i for s in view.segments for i in s.ids]


def test_row_colour_one_per_segment_and_no_color(flan_batch):
    out = run(flan_batch, "--row", 1, color=True)
    assert ANSI.search(out)
    bars = re.findall(r"\x1b\[(3\d)m▌", out)
    segments = len(json.loads(run(flan_batch, "--row", 1, "--json"))["segments"])
    assert len(dict.fromkeys(bars)) == min(segments, 6)  # a colour per segment, cycling the palette
    assert "\x1b[2m" in out  # masked tokens dimmed
    plain = run(flan_batch, "--row", 1, color=True, env={"NO_COLOR": "1"})
    assert not ANSI.search(plain) and "╞═ boundary" in plain


def test_row_out_of_range_is_one_line(flan_batch):
    result = CliRunner().invoke(main, ["inspect", str(flan_batch), "--row", "100000"])
    assert result.exit_code == 2 and "out of range" in result.output
    assert "Traceback" not in result.output


# -- --example ------------------------------------------------------------------------------------


def test_example_found_where_the_rows_say(flan_batch, tok):
    view = inspect_.row(flan_batch, 2, tok)
    for seg in view.segments:
        found = inspect_.find_example(flan_batch, seg.example_id)
        assert found.found and not found.split
        assert found.pieces == (Piece(row=2, shard=view.shard, segment=seg.segment, offset=seg.offset,
                                      length=seg.length),)


def test_example_truncated_count_matches_manifest(flan_batch):
    stats = schema.read_manifest(flan_batch).stats.to_json()
    flags = [inspect_.find_example(flan_batch, i).truncated for i in range(stats["examples_read"])]
    assert sum(flags) == stats["examples_truncated"] > 0


def test_example_split_pieces(flan_bfd):
    manifest = schema.read_manifest(flan_bfd)
    ids = np.concatenate([
        np.concatenate(schema.open_shard(flan_bfd / s.file).column("example_ids").to_pylist())
        for s in manifest.shards
    ])
    uniq, counts = np.unique(ids, return_counts=True)
    assert (counts > 1).sum() == manifest.stats.examples_split > 0
    split_id = int(uniq[counts > 1][0])
    found = inspect_.find_example(flan_bfd, split_id)
    assert found.split and len(found.pieces) == counts[counts > 1][0]
    assert all(p.length <= manifest.config.max_len for p in found.pieces)
    out = run(flan_bfd, "--example", split_id)
    assert f"split into {len(found.pieces)} pieces" in out
    assert out.count("  row ") == len(found.pieces)


def test_example_errors(flan_batch):
    result = CliRunner().invoke(main, ["inspect", str(flan_batch), "--example", "99999"])
    assert result.exit_code == 2 and "out of range" in result.output
    result = CliRunner().invoke(main, ["inspect", str(flan_batch), "--example", "1", "--row", "1"])
    assert result.exit_code == 2


# -- --plot and --json ------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["flan_batch", "flan_bfd"])
def test_plot_writes_a_png(which, request, tmp_path):
    pytest.importorskip("matplotlib")
    directory = request.getfixturevalue(which)
    png = tmp_path / "figure.png"
    out = json.loads(run(directory, "--plot", png, "--json"))
    assert out["plot"] == str(png) and "modes" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.parametrize("which", ["flan_batch", "flan_bfd"])
def test_plot_titles_and_labels_stay_inside_the_figure(which, request):
    """Every title and label is drawn inside the figure (the fill panel's title was cut at the right edge);
    the padded bar is labelled by its padding, as the table says it, the packed bars by their fill."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from packer import plot

    fig = plot.figure(inspect_.plot_data(request.getfixturevalue(which)))
    try:
        fig.canvas.draw()
        renderer, width = fig.canvas.get_renderer(), fig.bbox.width
        drawn = [fig._suptitle, *(t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts))]
        texts = [t for t in drawn if t is not None and t.get_text().strip()]
        outside = [t.get_text() for t in texts if t.get_window_extent(renderer).x0 < -1
                   or t.get_window_extent(renderer).x1 > width + 1]
        assert not outside, outside
        labels = " ".join(t.get_text() for t in texts)
        assert "padding" in labels and "fill 9%" not in labels  # the padded bar's fill of its peak is not shown
    finally:
        plt.close(fig)


def test_plot_data_is_consistent(flan_batch):
    data = inspect_.plot_data(flan_batch)
    stats = data.stats
    assert data.row_tokens.sum() == stats.tokens == data.example_tokens.sum()
    assert data.row_examples.sum() == stats.segments
    assert data.row_padded.sum() == stats.padded_tokens


def test_every_view_has_json(flan_batch):
    assert json.loads(run(flan_batch, "--json"))["stats"]["rows"] > 0
    assert json.loads(run(flan_batch, "--row", 0, "--json"))["segments"]
    assert json.loads(run(flan_batch, "--example", 0, "--json"))["found"]


# -- fsspec -----------------------------------------------------------------------------------------


def test_inspect_reads_fsspec_urls(flan_batch):
    fs = fsspec.filesystem("memory")
    fs.put(str(flan_batch), "/inspect-test", recursive=True)
    try:
        local = json.loads(run(flan_batch, "--json"))
        for url in (f"file://{flan_batch}", "memory://inspect-test"):
            remote = json.loads(run(url, "--json"))
            assert remote["stats"] == local["stats"] and remote["modes"] == local["modes"]
            assert json.loads(run(url, "--row", 3, "--json"))["segments"] == \
                json.loads(run(flan_batch, "--row", 3, "--json"))["segments"]
            assert inspect_.find_example(url, 7).pieces == inspect_.find_example(flan_batch, 7).pieces
        bad = CliRunner().invoke(main, ["inspect", "memory://no-such-build"])
        assert bad.exit_code == 2 and "no such folder" in bad.output
    finally:
        fs.rm("/inspect-test", recursive=True)


def test_inspect_and_verify_of_a_data_file_say_what_it_is_and_what_to_run(tmp_path):
    """A user's first `packer inspect data.jsonl`: the file exists, so it is never "no such" anything;
    the line says it is a file and which commands to run on it."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "q", "completion": "a"}\n')
    for command in ("inspect", "verify"):
        line = one_line(CliRunner().invoke(main, [command, str(data)]))
        assert line.startswith(f"packer: error: {data}: a file, not a build's folder"), line
        assert f"`packer build {data} --out shards/`, then `packer inspect shards/`" in line and "no such" not in line
