"""Crash safety of `packer build`, on the real process: SIGKILL at random moments, a lock against a second
build, and failed writes (a file size limit, an unwritable folder) that leave nothing half-written."""

from __future__ import annotations

import fcntl
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import ROOT, make_build

from packer import schema
from packer.cli import main
from packer.schema import LOCK
from packer.verify import verify

LIMIT = 600
ARGS = ["flan", "--limit", str(LIMIT), "--shard-size", "1", "--batch-size", "4", "-q"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def start(out: Path, *extra: str, preexec=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "packer.cli", "build", *ARGS, *extra, "--out", str(out)],
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec,
    )


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("crash") / "clean"
    began = time.perf_counter()
    proc = start(out)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    return out, time.perf_counter() - began


def test_sigkill_at_random_moments_then_rerun_is_byte_identical(clean, tmp_path):
    """One folder, killed again and again (each rerun resumes what the last one left), then finished."""
    reference, seconds = clean
    assert len(list(reference.glob("shard-*.arrow"))) > 1  # several shards: kills can land mid-commit too
    out = tmp_path / "out"
    rng = random.Random(int(os.environ.get("PACKER_CRASH_SEED", "4")))
    points = sorted(rng.uniform(0.3, 1.0) for _ in range(3))
    tried = []
    for fraction in [*points, "staging"]:
        proc = start(out)
        if fraction == "staging":  # a kill in the write stage: as soon as a staged shard exists
            deadline = time.monotonic() + 60
            while not list((out / ".packer-staging").glob("shard-*")) and proc.poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        else:
            time.sleep(fraction * seconds)
        finished = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tried.append((fraction, "finished before the kill" if finished else "killed"))
        if finished:
            assert (out / schema.MANIFEST_NAME).is_file()
            continue
        assert not (out / schema.MANIFEST_NAME).exists(), f"a manifest after a kill at {fraction}"
        if out.is_dir():
            assert not verify(out).ok  # nothing there passes for a finished build
        if (out / schema.MANIFEST_NAME).exists():  # pragma: no cover
            break
        # restart from what this kill left (the next iteration's run resumes it)
    print("crash points (fraction of a clean build's time):", tried)
    proc = start(out)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert files(out) == files(reference)
    assert not (out / LOCK).exists() and not (out / ".packer-staging").exists()
    assert sum(1 for _, what in tried if what == "killed") >= 3, tried


def test_second_build_into_the_same_folder_is_refused(tmp_path):
    out = tmp_path / "out"
    first = start(out)
    lock = out / LOCK
    deadline = time.monotonic() + 60
    while True:  # wait until the first build holds the lock
        assert time.monotonic() < deadline and first.poll() is None
        if lock.exists():
            fd = os.open(lock, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                break
            finally:
                os.close(fd)
        time.sleep(0.01)
    result = CliRunner().invoke(main, ["build", *ARGS, "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"packer: error: --out {out}: another packer build is writing there now ({LOCK} is locked); wait for it to "
        "finish or choose another --out"
    ]
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert verify(out).ok and not lock.exists()


def test_lock_left_by_a_killed_build_is_harmless(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text("")  # what SIGKILL leaves: the file, with no lock held on it
    make_build(out, limit=20)
    assert verify(out).ok and not (out / LOCK).exists()


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    return lines[0]


def test_file_size_limit_gives_a_clear_error_and_leaves_nothing(tmp_path):
    make_build(tmp_path / "warm", limit=20)  # the datasets cache exists, so only the output is written

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    for out in (tmp_path / "new" / "out", tmp_path / "warm"):  # a new folder; over a finished build
        proc = start(out, "--overwrite", preexec=limit_file_size)
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == 2, err
        assert err.splitlines() == [
            f"packer: error: --out {out}: writing failed (file too large: a file size limit (ulimit -f) was "
            "reached); the partial build was removed; free space or fix the folder's permissions and rerun, or "
            "choose another --out"
        ]
        left = [p.name for p in out.iterdir()] if out.exists() else []
        assert left == [], left


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_output_folder(tmp_path, where):
    if where == "under_a_file":
        (tmp_path / "file.txt").write_text("x")
        out = tmp_path / "file.txt" / "out"
    else:
        out = Path("/proc/packer-out")
    line = _one_line_error(CliRunner().invoke(main, ["build", "flan", "--limit", "5", "--out", str(out)]))
    assert line.startswith(f"packer: error: --out {out}: cannot write there (") and "choose a writable folder" in line
    assert not out.exists()


def test_out_is_a_file(tmp_path):
    out = tmp_path / "shards"
    out.write_text("x")
    line = _one_line_error(CliRunner().invoke(main, ["build", "flan", "--limit", "5", "--out", str(out)]))
    assert f"'{out}' is a file" in line and "--out" in line
    assert out.read_text() == "x"
