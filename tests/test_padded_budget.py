"""A padded build (--cp-size, --pad-to-multiple-of) shows its rows' true budget, max_tokens rounded down to
the padding's multiple, wherever it shows one; and inspect's modes table plans, for a contiguous CP build
(whose rows take padding of their own), rows the CP group can split: each mode's rows padded to the CP
multiple inside the row budget, as the build's own planner (``plan(..., layout=)``) pads them."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import make_build

from packer import render
from packer.checking import inspect_
from packer.contract import schema
from packer.planning.plan import plan


@pytest.fixture(scope="module")
def text_source(tmp_path_factory):
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog and runs far into the tall forest".split()
    path = tmp_path_factory.mktemp("text") / "text.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 300)))})
                            + "\n" for _ in range(60)))
    return path


@pytest.fixture(scope="module")
def contiguous_wrap(tmp_path_factory, text_source):
    return make_build(tmp_path_factory.mktemp("wrap"), str(text_source), text_field="text", pack="wrap",
                      max_len=598, max_tokens=598, cp_size=4, cp_layout="contiguous", num_proc=1)


def test_the_summary_and_inspect_say_the_rows_true_budget(contiguous_wrap):
    manifest = schema.read_manifest(contiguous_wrap)
    assert manifest.config.row_budget() == 596 and manifest.stats.max_row_tokens <= 596
    view = inspect_.summary(contiguous_wrap)
    head = render.summary_lines(view, color=False)[0]
    assert "(wrap, ≤ 596 tokens: --max-tokens 598 rounded down to a multiple of 4)" in head, head
    assert "598" not in head.replace("--max-tokens 598", "")
    assert view.to_json()["row_budget"] == 596 and view.to_json()["max_tokens"] == 598


def test_the_modes_of_a_contiguous_cp_build_plan_rows_the_group_can_split(contiguous_wrap):
    manifest = schema.read_manifest(contiguous_wrap)
    config, layout = manifest.config, manifest.config.layout()
    modes = {m.mode: m for m in inspect_.summary(contiguous_wrap).modes}
    for m in modes.values():
        assert m.peak_row_tokens % 4 == 0 and m.peak_row_tokens <= (596 if m.mode in ("bfd", "optimal") else 10**9)
    # the build's segments without the rows' padding, planned as a bfd build with the same layout pads them
    segments = inspect_._segments(contiguous_wrap, manifest)
    real = segments.seq_lens - segments.pad_lens
    for mode in ("bfd", "optimal"):
        want = plan(real, mode=mode, max_len=int(real.max()), max_tokens=config.max_tokens, layout=layout,
                    seed=config.seed)
        assert (want.row_lengths() % 4 == 0).all() and want.row_lengths().max() <= 596
        assert (modes[mode].rows, modes[mode].computed_tokens) == (want.num_rows, int(want.row_lengths().sum()))
    assert modes["bfd"].tokens == int(real.sum())  # the rows' padding is each mode's, not the segments'
    rows = np.diff(segments.row_splits)
    assert modes["batch"].computed_tokens > modes["batch"].tokens and rows.size == manifest.stats.rows
