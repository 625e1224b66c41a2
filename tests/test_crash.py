"""Crash safety of `packer build`, on the real process: SIGKILL at random moments, a lock against a second
build, and failed writes (a file size limit, an unwritable folder) that leave nothing half-written."""

from __future__ import annotations

import contextlib
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


# ---- Ctrl-C ----------------------------------------------------------------------------------------

INTERRUPT_ARGS = ["flan", "--limit", "2500", "--shard-size", "1", "--batch-size", "4", "-q", "-j", "2"]


def interrupt_at(out: Path, delay: float, args=INTERRUPT_ARGS) -> tuple[int | None, str, float]:
    """Start a build in its own process group, Ctrl-C it (SIGINT to the whole group, as a terminal does)
    after ``delay`` seconds; return its exit code, stderr and the seconds it took to end after the
    signal (None: still running after 20 s, then killed)."""
    proc = subprocess.Popen([sys.executable, "-m", "packer.cli", "build", *args, "--out", str(out)], cwd=ROOT,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)
    time.sleep(delay)
    signalled = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        err = proc.communicate(timeout=20)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[1], 20.0
    ended = time.monotonic() - signalled
    deadline = time.monotonic() + 5  # the workers are gone with the parent (killed, not orphaned)
    while _group_alive(proc.pid):
        assert time.monotonic() < deadline, "a worker outlived the interrupted build"
        time.sleep(0.02)
    return proc.returncode, err, ended


def _default_sigint() -> None:
    # a shell starts background jobs with SIGINT ignored, and Python then never sees Ctrl-C: undo that
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a zombie's group on some kernels
        return True


def test_ctrl_c_at_many_moments_with_two_workers(tmp_path):
    """Ctrl-C during loading, tokenizing (two workers), planning, writing and committing, into
    one folder again and again: each run ends within seconds with one line and exit 130 (or, past
    its commit point, 0 and no complaint), leaves the lock free, and the last rerun completes with
    the bytes of an uninterrupted build."""
    reference = tmp_path / "reference"
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "packer.cli", "build", *INTERRUPT_ARGS, "--out", str(reference)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seconds = time.monotonic() - began
    out = tmp_path / "out"
    rng = random.Random(int(os.environ.get("PACKER_CRASH_SEED", "11")))
    outcomes = []
    began = time.monotonic()  # Python importing numpy, pyarrow, datasets: packer's own code runs after it
    subprocess.run([sys.executable, "-c", "import packer.cli"], cwd=ROOT, env=ENV, check=True)
    startup = 2 * (time.monotonic() - began)  # with a margin: a loaded machine imports slower some runs
    for delay in sorted(startup + rng.uniform(0.0, 1.05) * max(seconds - startup, 1.0) for _ in range(6)):
        code, err, ended = interrupt_at(out, delay)
        outcomes.append((round(delay, 2), code, round(ended, 2)))
        assert code is not None, f"Ctrl-C at {delay:.2f} s hung: {err}"
        if code in (130, -signal.SIGINT):  # a shell reports both as 130 (see the report of issue 11)
            assert err.splitlines() == ["packer: interrupted"], err
        else:  # finished before the signal, or got past its commit point
            assert code == 0 and err == "", (code, err)
        assert ended < 10, outcomes
        assert not (out / LOCK).exists(), outcomes
        if (out / schema.MANIFEST_NAME).exists():
            assert verify(out).ok, outcomes  # complete, or it has no manifest
            (out / schema.MANIFEST_NAME).unlink()  # make the next run build again (a crash leaves no manifest)
    print("Ctrl-C (delay s, exit code, s to end):", outcomes)
    assert sum(code != 0 for _, code, _ in outcomes) >= 3, outcomes
    proc = subprocess.run([sys.executable, "-m", "packer.cli", "build", *INTERRUPT_ARGS, "--out", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert files(out) == files(reference)


def test_ctrl_c_past_the_commit_point_is_not_reported(tmp_path):
    """Ctrl-C the moment the manifest exists (the build is complete): exit 0, no complaint, and nothing
    left behind that the next command would trip on."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "packer.cli", "build", *ARGS, "-j", "1", "--out", str(out)],
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)
    while not (out / schema.MANIFEST_NAME).exists():
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.0005)
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert (proc.returncode, err) == (0, ""), (proc.returncode, err)
    assert verify(out).ok and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_kill_9_of_the_parent_takes_its_workers_and_frees_the_lock(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "packer.cli", "build", "flan", "-q", "-j", "2", "--out", str(out)],
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    import psutil

    deadline = time.monotonic() + 120
    while len(psutil.Process(proc.pid).children()) < 2:  # both tokenizing workers are running
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    while _group_alive(proc.pid):
        assert time.monotonic() - killed < 2, "a worker outlived its killed parent"
        time.sleep(0.01)
    fd = os.open(out / LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it any more
    finally:
        os.close(fd)


@pytest.mark.parametrize("command", ["build", "verify", "inspect"])
def test_staging_left_after_the_commit_point_is_cleaned_by_the_next_command(tmp_path, command):
    """A kill between the manifest's rename and the staging folder's removal leaves both: the next
    command on the folder removes the leftovers (a build then reuses the finished build)."""
    out = make_build(tmp_path / "out", limit=20)
    (out / ".packer-staging" / "tokens").mkdir(parents=True)
    (out / ".packer-staging" / "tokens" / "ids.bin").write_bytes(b"\0" * 64)
    (out / schema.MANIFEST_TMP).write_text("{}")
    argv = {"build": ["build", "flan", "--limit", "20", "--out", str(out)], "verify": ["verify", str(out)],
            "inspect": ["inspect", str(out)]}[command]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert not (out / ".packer-staging").exists() and not (out / schema.MANIFEST_TMP).exists()
    assert verify(out).ok


def test_ctrl_c_in_a_finaliser_is_not_lost():
    """Python ignores (prints and runs on past) a KeyboardInterrupt raised in a ``__del__``; the CLI's
    hook raises it again in the main thread, so that build stops as asked."""
    from packer.cli import _redeliver_interrupt

    class Finaliser:
        def __del__(self):
            raise KeyboardInterrupt

    previous, sys.unraisablehook = sys.unraisablehook, _redeliver_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            Finaliser()
            time.sleep(2)
    finally:
        sys.unraisablehook = previous
