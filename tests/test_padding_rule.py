"""One padding rule in every pack mode (issue 29, class 5): ``--pad-to-multiple-of`` and ``--cp-size`` are
checked the same way in batch, bfd, optimal and wrap, before anything is written: a padded segment never
holds more than a segment may (``max_len`` in batch, the row budget elsewhere), a value that cannot hold
is one line and leaves no folder, and the disk estimate counts the padding."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import one_line
from test_bad_inputs import build_cli

from packer.building.pipeline import check_room
from packer.contract import schema
from packer.contract.config import BuildConfig
from packer.errors import ConfigError, OutputError
from packer.planning.context_parallel import Layout
from packer.planning.plan import MODES, plan

# (option values) that pad a segment of max_len 64 past what it may hold, in every mode
TOO_MUCH = [{"pad_to_multiple_of": 5_000_000}, {"cp_size": 2_500_000}, {"pad_to_multiple_of": 10**11},
            {"pad_to_multiple_of": 48}, {"cp_size": 3, "cp_layout": "zigzag"},
            {"cp_size": 5_000_000, "cp_layout": "contiguous"}]


def _mode(mode: str) -> dict:
    return {"text_field": "text", "pack": mode} if mode == "wrap" else {"pack": mode}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding", TOO_MUCH, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_padding_past_what_a_segment_holds_is_refused_in_every_mode_config_and_plan_alike(mode, padding):
    with pytest.raises(ConfigError) as config_error:
        BuildConfig(source="flan", out="x", max_len=64, **_mode(mode), **padding)
    layout = Layout(cp_size=padding.get("cp_size", 1), cp_layout=padding.get("cp_layout", "zigzag"),
                    multiple=padding.get("pad_to_multiple_of", 1))
    with pytest.raises(ConfigError) as plan_error:  # the planner holds the same rule
        plan([10, 64, 3], mode=mode, max_len=64, batch_size=8 if mode == "batch" else None, layout=layout)
    assert str(config_error.value) == str(plan_error.value)


@pytest.mark.parametrize("mode", ["batch", "bfd", "optimal"])
def test_padding_that_holds_keeps_every_segment_within_max_len(mode):
    """A multiple that divides max_len: every padded segment is at most max_len, in every mode."""
    config = BuildConfig(source="flan", out="x", max_len=64, pad_to_multiple_of=16, **_mode(mode))
    rows = plan(np.arange(1, 200) % 90 + 1, mode=mode, max_len=64, max_tokens=config.max_tokens,
                batch_size=config.batch_size, layout=config.layout(pad_id=2))
    padded = rows.length + rows.pad
    assert padded.max() <= 64 and (padded % 16 == 0).all()


@pytest.mark.parametrize("mode", ["batch", "bfd"])
def test_the_cli_refuses_a_padding_that_cannot_hold_in_one_line_before_writing(tmp_path, mode):
    """Before: --pack batch wrote segments of 5,000,000 tokens (180 MB for 3 records), and a larger value
    ended in an allocation traceback that left .packer-staging behind."""
    for value in ("5000000", "100000000000"):
        out = tmp_path / f"out-{value}"
        line = one_line(build_cli("flan", "--limit", "3", "--pack", mode, "--max-len", "4096",
                                  "--pad-to-multiple-of", value, "--out", str(out)))
        assert f"a segment of max_len 4096 tokens pads to {int(value):,}" in line or "pads to" in line, line
        assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_the_disk_estimate_counts_the_padding(tmp_path):
    """Segments of one token padded to 4096: the shards hold 4096 tokens for each, which the estimate
    counts (it counted the one token, so a build the disk cannot hold was started)."""
    free = shutil.disk_usage(tmp_path).free
    n = free // (12 * 4096) + 1  # as many as the free space holds unpadded many times over, padded not
    assert n * 12 * 2 < free
    for mode in ("batch", "bfd"):
        config = BuildConfig(source="flan", out=str(tmp_path / "out"), max_len=4096, pad_to_multiple_of=4096,
                             **_mode(mode))
        with pytest.raises(OutputError, match="the shards would take at least"):
            check_room(config, np.ones(n, np.int64), tmp_path)
        check_room(config.replace(pad_to_multiple_of=1), np.ones(n, np.int64), tmp_path)  # unpadded: fits


def test_a_padded_batch_build_pads_within_max_len(tmp_path):
    out = tmp_path / "out"
    result = build_cli("flan", "--limit", "20", "--pack", "batch", "--max-len", "64", "--overlong", "split",
                       "--pad-to-multiple-of", "16", "--out", str(out))
    assert result.exit_code == 0, result.output
    manifest = schema.read_manifest(out)
    assert manifest.stats.pad_tokens > 0 and manifest.stats.max_row_tokens <= 64 * manifest.config.batch_size
