"""Crash safety of `packer build`, on the real process: SIGKILL and Ctrl-C at chosen moments, a lock
against a second build, and failed writes (a file size limit, an unwritable folder) that leave nothing
half-written.

Every moment is chosen by an event, never by a clock, so that the tests give the same result on a
loaded machine: the build runs with an audit hook (``sys.addaudithook``: Python reports each file
opened, renamed or removed, each fork, each object unpickled) that kills, interrupts or stops the
process itself the n-th time a given event happens in it (:func:`at`).
"""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from conftest import PARALLEL, ROOT, forked, make_build

from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema
from packer.contract.schema import LOCK, LOCK_BYTES, STAGING

LIMIT = 600
# format 1: its 12 bytes a token make several 1 MB shards of these records, so kills land mid-commit too
# (format 2 takes a third; its writer is the same code, and the spill a rerun resumes is the same)
ARGS = ["flan", "--limit", str(LIMIT), "--shard-size", "1", "--batch-size", "4", "--format", "1", "-q"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
HOLD = 120  # seconds: only a hung process gets near this

# `packer build ARGS` through the console entry, with a hook that acts the NTH time EVENT happens in this
# process (not in its workers) with MATCH in its first argument ("=PATH": exactly PATH), after writing
# the moment (time.monotonic, one clock for every process) to STAMP.
_AT = """
import os, signal, sys, time
event, match, nth, action, stamp = sys.argv[1:6]
me, seen, done = os.getpid(), [0], [False]
def hook(name, args):
    if name != event or done[0] or os.getpid() != me:
        return
    first = str(args[0]) if args else ""
    if not (first == match[1:] if match.startswith("=") else match in first):
        return
    seen[0] += 1
    if seen[0] < int(nth):
        return
    done[0] = True
    with open(stamp, "w") as f:
        f.write(repr(time.monotonic()))
    if action == "kill":
        os.kill(me, signal.SIGKILL)
    elif action == "stop":
        os.kill(me, signal.SIGSTOP)
    else:
        os.killpg(os.getpgid(0), signal.SIGINT)  # as a terminal sends Ctrl-C: to the whole group
sys.addaudithook(hook)
sys.argv = ["packer", "build", *sys.argv[6:]]
from packer.__main__ import main
sys.exit(main())
"""


@dataclass(frozen=True)
class Moment:
    """The NTH time EVENT happens with MATCH in its first argument (a path relative to the output
    folder, or ``=`` for the folder itself)."""

    name: str
    event: str
    match: str = ""
    nth: int = 1


def at(moment: Moment, action: str, out: Path, args=ARGS) -> subprocess.Popen:
    """Start the build of ``args`` into ``out``, in its own process group, acting at ``moment``."""
    match = f"={out}" if moment.match == "=" else (str(out / moment.match) if moment.match else "")
    return subprocess.Popen(
        [sys.executable, "-c", _AT, moment.event, match, str(moment.nth), action, str(_stamp(out)), *args,
         "--out", str(out)],
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_default_sigint,
    )


def killed_at(moment: Moment, out: Path, args=ARGS) -> tuple[int, int]:
    """What ``at(moment, "kill", out, args)`` runs, in a forked child of this process instead of a fresh
    interpreter (the same hook, match and stamp; its own session, so its workers are its process group): a
    SIGKILL ends a process wherever it is, whichever way it started, and a fork skips a start-up of seconds.
    Ctrl-C keeps ``at``: Python's own handling of it is set up as an interpreter starts. (pid, exit code)."""
    match = f"={out}" if moment.match == "=" else (str(out / moment.match) if moment.match else "")

    def child() -> int:
        os.setsid()
        from packer.__main__ import main as entry

        me, seen, done = os.getpid(), [0], [False]

        def hook(name, hook_args):
            if name != moment.event or done[0] or os.getpid() != me:
                return
            first = str(hook_args[0]) if hook_args else ""
            if not (first == match[1:] if match.startswith("=") else match in first):
                return
            seen[0] += 1
            if seen[0] == moment.nth:
                done[0] = True
                _stamp(out).write_text(repr(time.monotonic()))
                os.kill(me, signal.SIGKILL)

        sys.addaudithook(hook)
        sys.argv = ["packer", "build", *args, "--out", str(out)]
        try:
            return entry() or 0
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1

    return forked(child)


def _stamp(out: Path) -> Path:
    return out.parent / f"{out.name}.moment"


def acted(out: Path) -> float | None:
    """When the hook acted in the last run into ``out`` (None: the moment never came); consumed."""
    path = _stamp(out)
    if not path.exists():
        return None
    when = float(path.read_text())
    path.unlink()
    return when


def start(out: Path, *extra: str, preexec=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "packer.cli", "build", *ARGS, *extra, "--out", str(out)],
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec,
    )


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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


def _wait_group_gone(pgid: int) -> None:
    deadline = time.monotonic() + HOLD
    while _group_alive(pgid):  # the workers go with the parent (killed, not orphaned)
        assert time.monotonic() < deadline, "a worker outlived its parent"
        time.sleep(0.02)


# The moments of a build, in the order they come. Each run into one folder resumes what the run before
# left, and each reaches its moment: tokenizing restarts until its marker is written; the spill is then
# reused, and the write and commit are redone on every run.
TOKENIZING = Moment("tokenizing: the spill opened", "open", f"{STAGING}/tokens/ids.bin")
TOKENIZED = Moment("tokenizing: before its completion marker", "os.rename", f"{STAGING}/tokens/progress.json.tmp")
WRITING = Moment("writing: the second shard staged", "open", f"{STAGING}/{schema.shard_name(1)}")
COMMITTING = Moment("committing: two shards moved into place", "os.rename", f"{STAGING}/{schema.shard_name(2)}")
COMMIT_POINT = Moment("committing: before the manifest's rename", "os.rename", f"{STAGING}/{schema.PENDING}")
COMMITTED = Moment("committed: the staging folder being removed", "shutil.rmtree", f"{STAGING}/tokens")
KILL_MOMENTS = [TOKENIZING, TOKENIZED, WRITING, COMMITTING, COMMIT_POINT, COMMITTED]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """ARGS built uninterrupted, in this process (the bytes do not depend on the process: test_cli)."""
    return make_build(tmp_path_factory.mktemp("crash") / "clean", limit=LIMIT, shard_size_mb=1, batch_size=4,
                      format_version=1)


def test_sigkill_at_each_moment_then_rerun_is_byte_identical(clean, tmp_path):
    """One folder, killed again and again (each rerun resumes what the last one left), then finished."""
    assert len(list(clean.glob("shard-*.arrow"))) >= 3  # several shards: kills land mid-commit too
    out = tmp_path / "out"
    for moment in KILL_MOMENTS:
        pid, code = killed_at(moment, out)
        assert acted(out) is not None and code == -signal.SIGKILL, (moment.name, code)
        _wait_group_gone(pid)
        if moment is COMMITTED:
            assert verify(out).problems[0].where.endswith(STAGING)  # finished, and the stale staging reported
        else:
            assert not (out / schema.MANIFEST_NAME).exists(), moment.name
            assert not verify(out).ok, moment.name  # nothing there passes for a finished build
    rerun = CliRunner().invoke(main, ["build", *ARGS, "--out", str(out)])  # the rerun: in this process, no kill to take
    assert rerun.exit_code == 0, rerun.output
    assert files(out) == files(clean)
    assert not (out / STAGING).exists()


def test_second_build_into_the_same_folder_is_refused(tmp_path):
    out = tmp_path / "out"
    first = at(TOKENIZING, "stop", out)  # it stops itself holding the lock, mid-build
    deadline = time.monotonic() + HOLD
    while psutil.Process(first.pid).status() != psutil.STATUS_STOPPED:
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.01)
    result = CliRunner().invoke(main, ["build", *ARGS, "--out", str(out)])
    first.send_signal(signal.SIGCONT)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"packer: error: --out {out}: another packer build is writing there now ({STAGING}/{LOCK} is locked); wait "
        "for it to finish or choose another --out"
    ]
    assert first.wait(timeout=HOLD) == 0, first.stderr.read()
    assert verify(out).ok and not (out / STAGING).exists()


@pytest.mark.parametrize("lock", [LOCK_BYTES, LOCK_BYTES[:5], None])
def test_lock_left_by_a_killed_build_is_harmless(tmp_path, lock):
    """What SIGKILL leaves: the lock file with no lock held on it, one torn while it was written, or the
    staging folder made just before it."""
    out = tmp_path / "out"
    (out / STAGING).mkdir(parents=True)
    if lock is not None:
        (out / STAGING / LOCK).write_bytes(lock)
    make_build(out, limit=20)
    assert verify(out).ok and not (out / STAGING).exists()


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    return lines[0]


def test_file_size_limit_gives_a_clear_error_and_leaves_nothing_new(tmp_path):
    """A write that fails leaves nothing of the build: a folder it created is gone, and one holding a
    finished build holds it still, byte for byte."""
    warm = make_build(tmp_path / "warm", limit=20)  # the datasets cache exists, so only the output is written
    found = files(warm)

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
        if out == warm:
            assert files(out) == found
        else:
            assert not out.exists()


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

# conftest.PARALLEL: three chunks (CHUNK records each, the last of one), so both workers get one, and the rows fill
# several shards; its uninterrupted bytes are the session's parallel_reference (built once for every such test)
INTERRUPT_ARGS = ["flan", "--limit", str(PARALLEL["limit"]), "--pack", PARALLEL["pack"], "--max-len",
                  str(PARALLEL["max_len"]), "--overlong", PARALLEL["overlong"], "--shard-size",
                  str(PARALLEL["shard_size_mb"]), "-q", "-j", "2"]
# with two workers: while they start, and once the first result came back from one
CTRL_C_MOMENTS = [Moment("tokenizing: the second worker starting", "os.fork", "", 2),
                  Moment("tokenizing: a worker's first result", "pickle.find_class"),
                  WRITING, COMMIT_POINT, COMMITTED]


def test_ctrl_c_at_each_moment_with_two_workers(tmp_path, parallel_reference):
    """Ctrl-C while the workers start, tokenizing, writing, committing and after the commit point, into
    one folder again and again: each run ends within seconds with one line and exit 130 (past its commit
    point, 0 and no complaint), takes its workers with it, leaves the lock free, and the last rerun
    completes with the bytes of an uninterrupted build."""
    reference = parallel_reference
    assert len(list(reference.glob("shard-*.arrow"))) >= 3  # the moments in writing and committing come
    out = tmp_path / "out"
    outcomes = []
    for moment in CTRL_C_MOMENTS:
        proc = at(moment, "ctrl_c", out, INTERRUPT_ARGS)
        err = proc.communicate(timeout=HOLD)[1]
        when = acted(out)
        assert when is not None, (moment.name, proc.returncode, err)  # the moment came
        ended = time.monotonic() - when
        _wait_group_gone(proc.pid)
        outcomes.append((moment.name, proc.returncode, round(ended, 2)))
        if moment is COMMITTED:
            assert (proc.returncode, err) == (0, ""), outcomes
            assert verify(out).ok, outcomes
        else:
            assert (proc.returncode, err.splitlines()) == (130, ["packer: interrupted"]), (outcomes, err)
            assert not (out / schema.MANIFEST_NAME).exists(), outcomes
        assert ended < 30, outcomes  # seconds, not a hang (it is well under one idle)
        assert _lock_is_free(out), outcomes
    print("Ctrl-C (moment, exit code, s to end):", outcomes)
    rerun = CliRunner().invoke(main, ["build", *INTERRUPT_ARGS, "--out", str(out)])  # what a rerun finds: no process
    assert rerun.exit_code == 0 and "already holds this build" in rerun.stdout, rerun.output  # needed for it
    assert files(out) == files(reference)


def _lock_is_free(out: Path) -> bool:
    try:
        fd = os.open(out / STAGING / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_ctrl_c_past_the_commit_point_is_not_reported(tmp_path):
    """Ctrl-C the moment the manifest exists (the build is complete: its folder is being fsynced): exit
    0, no complaint, and nothing left behind that the next command would trip on."""
    out = tmp_path / "out"
    # the second time the folder is opened (fsynced): the first fsyncs the moves before the new files come in
    proc = at(Moment("committed: the folder fsynced", "open", "=", 2), "ctrl_c", out, [*ARGS, "-j", "1"])
    err = proc.communicate(timeout=HOLD)[1]
    assert acted(out) is not None and (proc.returncode, err) == (0, ""), (proc.returncode, err)
    assert verify(out).ok and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_a_rerun_after_ctrl_c_says_it_resumed(tmp_path):
    """Ctrl-C while writing (every record tokenized), then the same command, not quiet: the rerun says
    above its bars what it picks up, and its summary that the build was resumed."""
    out = tmp_path / "out"
    args = ["flan", "--limit", "300", "--shard-size", "1", "--batch-size", "4", "--format", "1", "-q"]  # two shards
    proc = at(WRITING, "ctrl_c", out, args)
    err = proc.communicate(timeout=HOLD)[1]
    assert acted(out) is not None and proc.returncode == 130, err
    result = CliRunner().invoke(main, ["build", *args[:-1], "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "resuming: 300 records already tokenized (all of them)\n" in result.stderr
    assert "tokenize: 100%" in result.stderr and "300/300" in result.stderr  # the bar, with its total
    assert result.stdout.splitlines()[-1].endswith(" s (resumed: 300 of the 300 records were tokenized by the "
                                                   "interrupted run)")
    assert verify(out).ok


def test_kill_9_of_the_parent_takes_its_workers_and_frees_the_lock(tmp_path):
    out = tmp_path / "out"
    # stopped while tokenizing, once a worker has sent a result: both workers are running
    proc = at(Moment("tokenizing", "pickle.find_class"), "stop", out, ["flan", "-q", "-j", "2"])
    deadline = time.monotonic() + HOLD
    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.01)
    assert len(psutil.Process(proc.pid).children()) == 2
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    while _group_alive(proc.pid):
        assert time.monotonic() - killed < 30, "a worker outlived its killed parent"
        time.sleep(0.01)
    assert _lock_is_free(out)


def test_staging_left_after_the_commit_point_is_cleaned_by_the_next_build(tmp_path):
    """A kill between the manifest's rename and the staging folder's removal leaves both: the next
    build removes the leftovers (and reuses the finished build)."""
    out = _finished_with_stale_staging(tmp_path)
    result = CliRunner().invoke(main, ["build", "flan", "--limit", "20", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert not (out / STAGING).exists()
    assert verify(out).ok


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_inspect_and_verify_only_read(tmp_path, command):
    """The read-only commands write nothing: stale staging is reported, and left to the next build."""
    out = _finished_with_stale_staging(tmp_path)
    before = files(out)
    result = CliRunner().invoke(main, [command, str(out)])
    assert result.exit_code == (1 if command == "verify" else 0), result.output
    assert f"packer: note: {out / STAGING}: a build is writing there now, or one was stopped" in result.stderr
    assert files(out) == before


def _finished_with_stale_staging(tmp_path: Path) -> Path:
    out = make_build(tmp_path / "out", limit=20)
    (out / STAGING / "tokens").mkdir(parents=True)
    (out / STAGING / LOCK).write_bytes(LOCK_BYTES)
    (out / STAGING / "tokens" / "ids.bin").write_bytes(b"\0" * 64)
    return out


def test_ctrl_c_in_a_finaliser_is_not_lost():
    """Python ignores (prints and runs on past) a KeyboardInterrupt raised in a ``__del__``; the CLI's
    hook raises it again in the main thread, so that build stops as asked."""
    from packer.interrupt import redeliver

    class Finaliser:
        def __del__(self):
            raise KeyboardInterrupt

    # the redelivery raises SIGINT's handler; a test run started as a background job has SIGINT ignored
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous, sys.unraisablehook = sys.unraisablehook, redeliver
    try:
        with pytest.raises(KeyboardInterrupt):
            Finaliser()
            deadline = time.monotonic() + HOLD  # it comes a moment later, from another thread
            while time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        sys.unraisablehook = previous
        signal.signal(signal.SIGINT, handler)



def test_a_build_stopped_loses_at_most_a_chunk_and_a_rerun_says_what_it_resumes(tmp_path, monkeypatch):
    """Progress is committed after each chunk once spill.COMMIT_RECORDS records are done (1,000: every
    chunk; here 100-record chunks and commits, so that two chunks cost little): a build stopped before its
    first commit, and the rerun says it resumes from 0 records; stopped before its second commit, and the
    next rerun resumes from the first chunk's 100, each saying so above its bars and in its summary.
    (Stopped in this process, by a commit that raises: what a Ctrl-C there leaves, which the tests above
    prove on the real process.)"""
    from packer.building import spill

    # the promise (docs/cli.md): a commit at least every 1,000 records or 10 s, at a chunk's end
    assert max(spill.CHUNK, spill.COMMIT_RECORDS) <= 1000 and spill.COMMIT_SECONDS <= 10
    monkeypatch.setattr(spill, "CHUNK", 100)
    monkeypatch.setattr(spill, "COMMIT_RECORDS", 100)
    out = tmp_path / "out"
    args = ["build", "flan", "--limit", "150", "--batch-size", "4", "-j", "1", "--out", str(out)]  # two chunks
    real, calls = spill._commit, []

    def commit(*a, stop_at):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        real(*a)

    for stop_at, says in ((1, None), (2, "resuming: 0 records already tokenized (the interrupted run committed none)\n")):
        calls.clear()
        monkeypatch.setattr(spill, "_commit", lambda *a, n=stop_at: commit(*a, stop_at=n))
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0 and not (out / schema.MANIFEST_NAME).exists(), result.output
        assert says is None or says in result.stderr, result.stderr
    monkeypatch.setattr(spill, "_commit", real)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "resuming: 100 records already tokenized\n" in result.stderr
    assert result.stdout.splitlines()[-1].endswith(" s (resumed: 100 of the 150 records were tokenized by the "
                                                   "interrupted run)")
    assert verify(out).ok
