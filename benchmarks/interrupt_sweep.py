"""Ctrl-C at many moments of `packer build`, for each -j: how each run ended and how fast.

Each run is started in its own process group and sent SIGINT (as a terminal does to every process of
its foreground group) after a delay drawn across a clean build's duration. A run passes when it ends
within 10 s with exactly "packer: interrupted" and exit 130 (or, past its commit point, exit 0 and an
empty stderr), leaves its lock free and no live worker. A finished run's folder is removed, so the next run builds
again; an interrupted run's staging stays, and the next run resumes its token spill. The last rerun of
each -j must give the clean build's bytes.

    python benchmarks/interrupt_sweep.py --runs 36 --jobs 1 2
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packer.contract.schema import LOCK, STAGING

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def build(out: Path, jobs: int, limit: int) -> subprocess.Popen:
    args = ["flan", "--limit", str(limit), "--shard-size", "1", "--batch-size", "4", "-q", "-j", str(jobs)]
    return subprocess.Popen([sys.executable, "-m", "packer.cli", "build", *args, "--out", str(out)], cwd=ROOT,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)


def default_sigint() -> None:
    # a shell starts background jobs with SIGINT ignored, and Python then never sees Ctrl-C: undo that
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def lock_held(out: Path) -> bool:
    """Whether a process still holds the build's flock (an interrupted build keeps its staging and the
    lock file in it, for the rerun to resume; the lock itself must be free)."""
    try:
        fd = os.open(out / STAGING / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=36)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--limit", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for jobs in a.jobs:
            reference = Path(tmp) / f"ref-{jobs}"
            began = time.monotonic()
            assert build(reference, jobs, a.limit).wait() == 0
            seconds = time.monotonic() - began
            out = Path(tmp) / f"out-{jobs}"
            counts: dict[str, int] = {}
            slowest = 0.0
            for _ in range(a.runs):
                proc = build(out, jobs, a.limit)
                time.sleep(rng.uniform(0.02, 1.05) * seconds)
                sent = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT)
                try:
                    err = proc.communicate(timeout=30)[1]
                    ended = time.monotonic() - sent
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    err, ended = "HUNG " + proc.communicate()[1], 30.0
                time.sleep(0.5)
                orphans = group_alive(proc.pid)
                if proc.returncode in (130, -signal.SIGINT) and err.splitlines() == ["packer: interrupted"]:
                    what = "interrupted"
                elif proc.returncode == 0 and err == "":
                    what = "finished"
                else:
                    what = f"BAD exit {proc.returncode}: {err.strip()[-300:]!r}"
                if orphans:
                    what += " +ORPHANS"
                if lock_held(out):
                    what += " +LOCK HELD"
                if ended > 10:
                    what += " +SLOW"
                counts[what] = counts.get(what, 0) + 1
                slowest = max(slowest, ended)
                if (out / "manifest.json").exists():  # finished: the next run builds afresh (an interrupted
                    shutil.rmtree(out)  # one's staging stays, for the next run to resume)
            final = build(out, jobs, a.limit)
            same = final.wait() == 0 and tree(out) == tree(reference)
            print(f"-j {jobs}: clean build {seconds:.1f} s; {a.runs} Ctrl-C: {counts}; slowest end {slowest:.2f} s "
                  f"after the signal; rerun byte-identical: {same}")


if __name__ == "__main__":
    main()
