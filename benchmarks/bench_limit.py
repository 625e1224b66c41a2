"""What ``packer build BIG.jsonl --limit N`` reads, writes and costs (a script, not a test).

    python benchmarks/bench_limit.py [--mb 1000] [--limit 1000] [--before /path/to/an/older/packer/tree]

Writes (once, under /tmp, never committed) a JSON Lines file of about ``--mb`` MB: the bundled sample
repeated, each copy's prompts numbered. Then builds its first ``--limit`` records with ``-j 1`` in a
subprocess, with an empty `datasets` cache, and prints the wall and CPU time, the bytes the process read and
wrote through system calls (``rchar``/``wchar`` of /proc/self/io; a memory-mapped read is not counted,
a read from the page cache is), what is left in the `datasets` cache, and the peak RSS. With
``--before`` the same build is run with that tree's packer too (e.g. ``git archive <commit> | tar -x``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "packer" / "data" / "flan_sample.jsonl.gz"

_RUNNER = r"""
import atexit, os, sys
def report():
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    with open(os.environ["BENCH_IO_OUT"], "w") as f:
        f.write(f"{io['rchar']} {io['wchar']}")
atexit.register(report)
sys.argv = ["packer", *sys.argv[1:]]
from packer.cli import main
sys.exit(main())
"""


def make_input(path: Path, mb: int) -> None:
    if path.is_file() and path.stat().st_size >= mb * 1e6:
        return
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    with open(path, "w", encoding="utf-8") as f:
        copy = 0
        while f.tell() < mb * 1e6:
            for r in records:
                f.write(json.dumps({**r, "inputs": f"[{copy}] {r['inputs']}"} if copy else r) + "\n")
            copy += 1


def run(tree: Path, data: Path, limit: int, tmp: Path) -> dict:
    cache, out, io = tmp / "hf-cache", tmp / "out", tmp / "io"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "PYTHONPATH": str(tree), "BENCH_IO_OUT": str(io)}
    t = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", _RUNNER, "build", str(data), "--recipe", "flan", "--limit", str(limit),
                           "-j", "1", "-q", "--out", str(out)], env=env, capture_output=True, text=True,
                          cwd=tmp)  # not this folder: `python -c` imports packer from the working directory first
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    rchar, wchar = (int(x) for x in io.read_text().split())
    left = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    return {"seconds": seconds, "cpu": cpu, "read": rchar, "written": wchar, "cache": left,
            "rss": after.ru_maxrss if after.ru_maxrss > usage.ru_maxrss else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--before", type=Path, help="an older packer source tree to compare with")
    ap.add_argument("--data", type=Path, default=Path("/tmp/packer-bench-limit.jsonl"))
    args = ap.parse_args()
    make_input(args.data, args.mb)
    print(f"input {args.data}: {args.data.stat().st_size / 1e6:,.0f} MB; --limit {args.limit:,}, -j 1")
    print(f"{'packer':<8}{'seconds':>9}{'CPU s':>8}{'read MB':>10}{'written MB':>12}{'cache MB':>10}{'peak RSS MiB':>14}")
    trees = ([("before", args.before)] if args.before else []) + [("this", ROOT)]
    for name, tree in trees:
        with tempfile.TemporaryDirectory(prefix="bench_limit-") as tmp:
            r = run(tree, args.data, args.limit, Path(tmp))
        rss = f"{r['rss'] / 1024:,.0f}" if r["rss"] else "≤ previous"
        print(f"{name:<8}{r['seconds']:>9.1f}{r['cpu']:>8.1f}{r['read'] / 1e6:>10,.1f}{r['written'] / 1e6:>12,.1f}"
              f"{r['cache'] / 1e6:>10,.1f}{rss:>14}", flush=True)


if __name__ == "__main__":
    main()
