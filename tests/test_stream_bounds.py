"""Every record size and count limit holds on the stream, before the input is read whole (issue 29,
class 4): a huge record is refused (or skipped and counted) without being held, a mix by counts under
``--limit`` costs what the records read cost, and inputs a reader cannot decode, or paths that name
no user, are one line."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import one_line
from test_bad_inputs import GOOD, build_cli, jsonl

from packer.building import mix


# -- a mix by records counts under --limit ------------------------------------------------------------


def test_a_mix_by_counts_under_a_limit_draws_only_what_the_limit_takes():
    parts = [{"source": "a", "records": 50_000_000}, {"source": "b", "records": 3}]
    tracemalloc.start()
    try:
        drawn = mix.positions_sources(parts, 0, 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert drawn.size == 30
    assert peak < 4 << 20, f"{peak:,} bytes drawn for 30 positions"


@pytest.mark.parametrize("counts", [[7, 3000, 10_000], [1] * 5000, [40_000, 1]])
def test_a_mix_by_counts_gives_each_part_exactly_its_count_and_a_limit_is_its_prefix(counts):
    parts = [{"source": f"p{k}", "records": n} for k, n in enumerate(counts)]
    whole = mix.positions_sources(parts, 5, sum(counts))
    assert np.bincount(whole, minlength=len(counts)).tolist() == counts
    for limit in (1, 30, 4097, sum(counts) - 1):
        assert np.array_equal(mix.positions_sources(parts, 5, limit), whole[:limit])
    assert not np.array_equal(whole, mix.positions_sources(parts, 6, sum(counts))), "the seed shuffles"


# -- a ~user of no user ---------------------------------------------------------------------------------

NO_USER = "~no-such-user-packer"


@pytest.mark.parametrize(("option", "needle"), [
    ("source", "source"), ("glob", "source"), ("mix", "source"), ("--out", "--out"), ("--tokenizer", "--tokenizer"),
    ("--chat-template", "--chat-template")])
def test_a_home_of_no_user_is_one_line_for_every_path(tmp_path, option, needle):
    src = str(jsonl(tmp_path / "d.jsonl", GOOD))
    args = {"source": [f"{NO_USER}/d.jsonl"], "glob": [f"{NO_USER}/*.jsonl"], "--out": [src, "--out", f"{NO_USER}/o"],
            "--tokenizer": [src, "--tokenizer", f"{NO_USER}/tok"],
            "--chat-template": [src, "--chat-template", f"{NO_USER}/t.jinja"]}.get(option)
    if option == "mix":
        (tmp_path / "mix.yaml").write_text(f"- {{source: {NO_USER}/d.jsonl, weight: 1}}\n- {{source: {src}, weight: 1}}\n")
        args = ["--mix", str(tmp_path / "mix.yaml")]
    if "--out" not in args:
        args = [*args, "--out", str(tmp_path / "out")]
    line = one_line(build_cli(*args))
    assert line.startswith(f"packer: error: {needle} {NO_USER}/"), line
    assert "no user 'no-such-user-packer'" in line and "give the path in full" in line, line
    assert not (tmp_path / "out").exists()
