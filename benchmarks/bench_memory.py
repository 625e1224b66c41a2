"""Peak memory of ``packer build`` as the input grows (a script, not a test).

    python benchmarks/bench_memory.py [--factors 1 4 16] [--num-proc 1]

Writes a temporary JSON Lines file holding the bundled FLAN-style sample repeated ``factor`` times
(each copy perturbed: its text gets a copy number, so records differ and tokenize anew), builds it
with ``packer build`` in a subprocess, and reports the peak resident memory of that process and its
children (``/usr/bin/time -v`` where it exists, else psutil polling every 50 ms), with the wall time.

Max RSS counts file-backed pages too: the `datasets` Arrow cache and the token spill files are
memory-mapped, and their page-cache pages count while mapped although the kernel can reclaim them.
So the build process also samples its own anonymous memory (``RssAnon`` in /proc/self/status, every
10 ms in a thread) and reports the peak: that is the memory that really grows if something is held.
Flat memory means the peak anonymous memory does not grow with the input beyond the planner's few
bytes per example (with ``-j N`` the workers' anonymous memory is not included).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "packer" / "data" / "flan_sample.jsonl.gz"


def make_input(path: Path, factor: int) -> int:
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for copy in range(factor):
            for r in records:
                r = dict(r)
                if copy:
                    r["inputs"] = f"[{copy}] {r['inputs']}"
                f.write(json.dumps(r) + "\n")
                n += 1
    return n


# Runs the CLI in-process with a thread sampling RssAnon; prints the peak on exit (to a file).
_RUNNER = r"""
import atexit, os, sys, threading, time
peak = [0]
def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0
def sample():
    while True:
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
def report():
    peak[0] = max(peak[0], rss_anon())
    with open(os.environ["BENCH_ANON_OUT"], "w") as f:
        f.write(str(peak[0]))
atexit.register(report)
sys.argv = ["packer", *sys.argv[1:]]
from packer.cli import main
sys.exit(main())
"""


def peak_rss(cmd: list[str], env: dict) -> tuple[float, float, float]:
    """(peak RSS in MiB over the process tree, peak anonymous MiB of the main process, wall seconds)."""
    t = time.perf_counter()
    anon_file = Path(env["BENCH_ANON_OUT"])
    if shutil.which("time") and Path("/usr/bin/time").exists():
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-2000:])
        kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
        return kb / 1024, int(anon_file.read_text()) / 1024, time.perf_counter() - t
    import psutil

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    p, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]))
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(proc.stderr.read()[-2000:])
    return peak / 2**20, int(anon_file.read_text()) / 1024, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factors", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-proc", type=int, default=1)
    ap.add_argument("--pack", default="bfd")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory-"))
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp / "hf-cache"), "PYTHONPATH": str(ROOT),
           "BENCH_ANON_OUT": str(tmp / "anon-peak")}
    print(f"{'factor':>6} {'records':>9} {'input MB':>9} {'max RSS MiB':>12} {'peak anon MiB':>14} {'seconds':>8}")
    try:
        for factor in args.factors:
            data = tmp / f"flan-x{factor}.jsonl"
            n = make_input(data, factor)
            cmd = [sys.executable, "-c", _RUNNER, "build", str(data), "--recipe", "flan", "--out",
                   str(tmp / f"out-x{factor}"), "--pack", args.pack, "-j", str(args.num_proc), "-q"]
            peak, anon, seconds = peak_rss(cmd, env)
            print(f"{factor:>6} {n:>9,} {data.stat().st_size / 1e6:>9.1f} {peak:>12.1f} {anon:>14.1f} {seconds:>8.1f}",
                  flush=True)
            shutil.rmtree(tmp / f"out-x{factor}", ignore_errors=True)
            data.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
