"""Peak memory of ``packer build`` as the input grows (a script, not a test).

    python benchmarks/bench_memory.py [--factors 1 4 16] [--num-proc 1]

Writes a temporary JSON Lines file holding the bundled FLAN-style sample repeated ``factor`` times
(each copy perturbed: its text gets a copy number, so records differ and tokenize anew), builds it
with ``packer build`` in a subprocess, and reports the peak resident memory of that process and its
children (``/usr/bin/time -v`` where it exists, else psutil polling every 50 ms), with the wall time.
Flat memory means the peak does not grow with the input beyond the planner's few bytes per example.
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
SAMPLE = ROOT / "data" / "flan_sample.jsonl.gz"


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


def peak_rss(cmd: list[str], env: dict) -> tuple[float, float]:
    """(peak RSS in MiB over the process tree, wall seconds)."""
    t = time.perf_counter()
    if shutil.which("time") and Path("/usr/bin/time").exists():
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-2000:])
        kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
        return kb / 1024, time.perf_counter() - t
    import psutil

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    p, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]))
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(proc.stderr.read()[-2000:])
    return peak / 2**20, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factors", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-proc", type=int, default=1)
    ap.add_argument("--pack", default="bfd")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory-"))
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp / "hf-cache"), "PYTHONPATH": str(ROOT)}
    print(f"{'factor':>6} {'records':>9} {'input MB':>9} {'peak RSS MiB':>13} {'seconds':>8}")
    try:
        for factor in args.factors:
            data = tmp / f"flan-x{factor}.jsonl"
            n = make_input(data, factor)
            cmd = [sys.executable, "-m", "packer.cli", "build", str(data), "--recipe", "flan", "--out",
                   str(tmp / f"out-x{factor}"), "--pack", args.pack, "-j", str(args.num_proc), "-q"]
            peak, seconds = peak_rss(cmd, env)
            print(f"{factor:>6} {n:>9,} {data.stat().st_size / 1e6:>9.1f} {peak:>13.1f} {seconds:>8.1f}", flush=True)
            shutil.rmtree(tmp / f"out-x{factor}", ignore_errors=True)
            data.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
