"""Streamed sources: --limit reads only what it needs, folders read like Hub dataset repos, globs and
folders read each file once, and a source failing mid-way leaves nothing half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.contract import schema


def _jsonl(path: Path, start: int, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"question": f"What is {i} times two?", "answer": f"{2 * i}"}) + "\n")
    return path


@pytest.fixture
def hub_repo(tmp_path) -> Path:
    """A folder laid out like a Hub dataset repo: data/ with a train split in three files and a test
    split; the second train file is corrupt, so reading it fails the build."""
    repo = tmp_path / "repo"
    _jsonl(repo / "data" / "train-00000-of-00003.jsonl", 0, 300)
    (repo / "data" / "train-00001-of-00003.jsonl").write_bytes(b"\x00\xff not json at all {{{\n" * 50)
    _jsonl(repo / "data" / "train-00002-of-00003.jsonl", 600, 300)
    _jsonl(repo / "data" / "test-00000-of-00001.jsonl", 1000, 40)
    (repo / "README.md").write_text("---\nlicense: mit\n---\n# a dataset card, not data\n")
    return repo


def build(*args: str):
    return CliRunner().invoke(main, ["build", *args, "-q", "-j", "1"])


def manifest(out: Path) -> dict:
    return json.loads((out / schema.MANIFEST_NAME).read_text())


def test_limit_reads_only_the_first_file_of_a_hub_layout_folder(hub_repo, tmp_path):
    out = tmp_path / "out"
    result = build(str(hub_repo), "--limit", "250", "--out", str(out))
    assert result.exit_code == 0, result.output
    m = manifest(out)
    assert m["stats"]["examples_read"] == 250
    # only the file that holds the first 250 records is read and identified; the corrupt one is never opened
    assert [Path(f["path"]).name for f in m["source"]["files"]] == ["train-00000-of-00003.jsonl"]
    verify = CliRunner().invoke(main, ["verify", str(out), "--source", str(hub_repo)])
    assert verify.exit_code == 0, verify.output


def test_a_source_failing_mid_way_is_one_line_and_leaves_no_build(hub_repo, tmp_path):
    out = tmp_path / "out"
    result = build(str(hub_repo), "--out", str(out))  # no limit: the corrupt second file is reached
    assert result.exit_code == 2 and "Traceback" not in result.output
    line, = result.stderr.splitlines()
    assert "train-00001-of-00003.jsonl:1" in line, line
    assert not (out / schema.MANIFEST_NAME).exists() and not list(out.glob("shard-*"))


def test_split_picks_the_files_of_one_split(hub_repo, tmp_path):
    out = tmp_path / "out"
    result = build(str(hub_repo), "--split", "test", "--out", str(out))
    assert result.exit_code == 0, result.output
    m = manifest(out)
    assert m["stats"]["examples_read"] == 40
    assert [Path(f["path"]).name for f in m["source"]["files"]] == ["test-00000-of-00001.jsonl"]
    bad = build(str(hub_repo), "--split", "validation", "--out", str(tmp_path / "o2"))
    assert bad.exit_code == 2 and "no split 'validation'" in bad.stderr and "test, train" in bad.stderr


def test_a_large_jsonl_is_not_converted_to_a_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    src = _jsonl(tmp_path / "big.jsonl", 0, 5000)
    result = build(str(src), "--limit", "100", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    arrow = [p for p in cache.rglob("*") if p.is_file() and p.suffix == ".arrow"] if cache.exists() else []
    assert arrow == []
    assert manifest(tmp_path / "out")["stats"]["examples_read"] == 100


def test_glob_through_a_symlink_loop_reads_each_file_once(tmp_path):
    folder = tmp_path / "d"
    _jsonl(folder / "a.jsonl", 0, 30)
    os.symlink(folder, folder / "loop")  # d/loop/loop/... leads back to d
    result = build(str(folder / "**" / "*.jsonl"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    m = manifest(tmp_path / "out")
    assert m["stats"]["examples_read"] == 30 and len(m["source"]["files"]) == 1


def test_folder_skips_hidden_files_and_folders(tmp_path):
    folder = tmp_path / "d"
    _jsonl(folder / "a.jsonl", 0, 30)
    _jsonl(folder / ".ipynb_checkpoints" / "a-checkpoint.jsonl", 0, 30)
    _jsonl(folder / ".hidden.jsonl", 0, 30)
    result = build(str(folder), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    m = manifest(tmp_path / "out")
    assert m["stats"]["examples_read"] == 30
    assert [Path(f["path"]).name for f in m["source"]["files"]] == ["a.jsonl"]
    assert "hidden files and folders" in CliRunner().invoke(main, ["build", "--help"]).output


def test_empty_source_is_an_error_not_the_current_folder(tmp_path, monkeypatch):
    _jsonl(tmp_path / "here.jsonl", 0, 10)
    monkeypatch.chdir(tmp_path)
    result = build("", "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    line, = result.stderr.splitlines()
    assert "SOURCE is empty" in line
    assert not (tmp_path / "out" / schema.MANIFEST_NAME).exists()


def test_a_bad_record_in_a_worker_ends_a_parallel_build_with_one_line(tmp_path):
    """A RecordError raised in a -j 2 worker comes back as one line (it once could not be unpickled,
    which killed the pool's result thread and left the build waiting forever)."""
    src = tmp_path / "d.jsonl"
    with open(src, "w") as f:
        for i in range(2500):
            f.write(json.dumps({"prompt": f"q{i}", "completion": f"a{i}" if i != 2100 else 7}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "packer.cli", "build", str(src), "-j", "2", "-q", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"packer: error: {src} record 2101: field 'completion' is int, not text; fix the "
                                   "record or pass --on-error skip")
