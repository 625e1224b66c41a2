"""What a build refuses before or while it runs, rather than record something untrue or run without
bound: a source that changes while it is read, more epochs than the disk (or memory) can hold."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import one_line

from packer import BuildConfig, build
from packer.building import readers
from packer.cli import main
from packer.contract import schema
from packer.errors import SourceError

RECORDS = [{"prompt": f"question {i}?", "completion": f"answer {i}."} for i in range(20)]
FIELDS = {"prompt_field": "prompt", "completion_field": "completion", "num_proc": 1}


def write_jsonl(path: Path, records=RECORDS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("change", ["grows", "replaced", "rewritten"])
def test_a_source_that_changes_while_it_is_read_fails_the_build(tmp_path, monkeypatch, change):
    """The file changes the moment its first record has been read (another program writing it then)."""
    src = write_jsonl(tmp_path / "data.jsonl")
    real = readers.records

    def records_then_change(builder, path, skip=0):
        records = real(builder, path, skip)
        try:
            yield next(records)
        except StopIteration as end:
            return end.value
        if path == str(src):
            if change == "grows":
                with open(src, "a") as f:
                    f.write(json.dumps({"prompt": "late?", "completion": "late."}) + "\n")
            elif change == "replaced":
                write_jsonl(tmp_path / "new.jsonl", RECORDS[::-1])
                os.replace(tmp_path / "new.jsonl", src)
            else:  # same size, other bytes
                src.write_text(src.read_text().replace("question", "Question"))
        return (yield from records)  # what the real reader passed over, as it returns it

    monkeypatch.setattr(readers, "records", records_then_change)
    out = tmp_path / "out"
    with pytest.raises(SourceError, match="while the build read it"):
        build(BuildConfig(source=str(src), out=str(out), **FIELDS))
    assert not out.exists()


def test_a_source_that_stays_the_same_builds(tmp_path):
    src = write_jsonl(tmp_path / "data.jsonl")
    build(BuildConfig(source=str(src), out=str(tmp_path / "out"), **FIELDS))
    assert schema.read_manifest(tmp_path / "out").source["files"][0]["bytes"] == src.stat().st_size


def test_epochs_past_the_bound_are_refused_before_anything_is_read(tmp_path):
    line = one_line(CliRunner().invoke(main, ["build", "flan", "--limit", "20", "--epochs", "1000000000", "-q",
                                              "--out", str(tmp_path / "out")]))
    assert "--epochs 1,000,000,000: more than 10,000 epochs" in line and "set_epoch" in line
    assert not (tmp_path / "out").exists()


def test_epochs_the_disk_cannot_hold_are_refused_with_the_figures(tmp_path):
    """Under the bound, but more than the disk holds: the estimate (a floor) against the free space."""
    out = tmp_path / "out"
    data = write_jsonl(tmp_path / "big.jsonl", [{"text": "word " * 4000}] * 300)  # ~1.2M tokens an epoch
    free = __import__("shutil").disk_usage(tmp_path).free
    per_epoch = 12 * 300 * 4000  # at least 12 bytes a token (format 1), and each word is at least one token
    if free > 9_000 * per_epoch:
        pytest.skip(f"the disk has {free / 1e12:.1f} TB free: 9,000 epochs of this source fit")
    line = one_line(CliRunner().invoke(main, ["build", str(data), "--text-field", "text", "--max-len", "8192",
                                              "--epochs", "9000", "-q", "-j", "1", "--format", "1", "--out", str(out)]))
    assert line.startswith("packer: error: --epochs 9,000: the shards would take at least ") and " free; " in line
    assert not out.exists()


def test_examples_that_overlong_drop_drops_take_no_room(tmp_path):
    """The disk estimate is a floor: an example ``--overlong drop`` drops writes nothing, so a build whose
    kept examples fit is not refused for the dropped ones."""
    out = tmp_path / "out"
    long = [{"text": "word " * 4200}] * 200  # each over --max-len 4096: dropped
    data = write_jsonl(tmp_path / "mostly-long.jsonl", [{"text": "a short one"}, *long])
    free = __import__("shutil").disk_usage(tmp_path).free
    epochs = 10_000
    if free > epochs * 12 * 4096 * len(long):
        pytest.skip(f"the disk has {free / 1e12:.1f} TB free: {epochs:,} epochs of the long examples would fit")
    result = CliRunner().invoke(main, ["build", str(data), "--text-field", "text", "--max-len", "4096", "--overlong",
                                       "drop", "--epochs", str(epochs), "-q", "-j", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    stats = schema.read_manifest(out).stats
    assert (stats.examples_dropped, stats.rows) == (len(long), epochs)


def test_one_epoch_the_disk_cannot_hold_is_refused_without_naming_epochs(tmp_path):
    """At --epochs 1 the message must not tell the user to lower --epochs: the fix is space or --limit.
    The lengths are the planner's input, as large as no disk holds (12 bytes a token: 120 TB)."""
    import numpy as np

    from packer.building.pipeline import check_room
    from packer.errors import OutputError

    config = BuildConfig(source=str(tmp_path / "x.jsonl"), out=str(tmp_path / "out"), text_field="text",
                         pack="bfd", max_len=4096, overlong="split")
    with pytest.raises(OutputError) as e:
        check_room(config, np.full(10**4, 10**9, dtype=np.int64), tmp_path)
    message = str(e.value)
    assert message.startswith("the shards would take at least ") and "--epochs" not in message
    assert "--limit" in message and "larger disk" in message
