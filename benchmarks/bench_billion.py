"""A first build at scale (a script, not a test): ~1B tokens of JSON Lines, `packer build` timed from the shell
with its peak memory.

    python benchmarks/bench_billion.py [--tokens 1e9] [--dir DIR] [--keep]

Data: the bundled FLAN-style sample (6,000 records) repeated as one JSON Lines file until it holds about
``--tokens`` tokens as the build counts them (Llama 2 tokenizer: 2.82M tokens a copy, so 1B tokens is 355
copies, 2.1M records, 3.7 GB). Repetition costs the tokenizer what new text would (Llama 2's tokenizer
tokenizes each text whole, with no cache of words), and packer neither knows nor uses it. The build is
``packer build DATA --recipe flan -t LLAMA2 --pack bfd --out OUT -q`` with every other default (format 2, the
token store on, in a cache of its own under ``--dir``), in a fresh process, timed from the shell.

Memory: the peak resident set of the largest process (``ru_maxrss`` of the build and its workers), and the
peak of the whole process tree's summed proportional set size (PSS: pages the forked workers share with
the parent counted once, shared among them), sampled every 0.2 s from /proc. What the build holds in memory
grows with the data only by what the plan needs (its lengths: 4 bytes an example, and the plan's own
arrays: ~48 bytes an example), so the figures at 1B tokens show that nothing else does.

Disk: the data (3.7 GB), the token spill (5 bytes a token: 5 GB, kept by the token store by a link, not
a copy) and the shards (format 2: ~4.1 bytes a token): ~13 GB under ``--dir`` at 1B tokens, removed at the
end unless ``--keep``. The script refuses to start without that room.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA2 = ROOT.parent / "shared" / "data" / "llama2-tokenizer"
SAMPLE = ROOT / "packer" / "data" / "flan_sample.jsonl.gz"
BYTES_PER_TOKEN = 3.7 + 5 + 4.2  # the data, the spill, the shards (format 2, Llama 2's ids in uint16)


def tokens_per_copy(sample: bytes, llama2: Path, folder: Path) -> int:
    """The tokens one copy of the sample gives in a build (its texts' tokens plus one EOS each: the manifest's
    ``tokens_in``), counted by a build of the sample alone, in ``folder`` with its cache: which keeps the
    tokenizer's parts, as any build after a tokenizer's first finds them (``bench_speed.py`` does the same)."""
    source = folder / "one.jsonl"
    source.write_bytes(sample)
    out = folder / "one"
    subprocess.run([sys.executable, "-m", "packer.cli", "build", str(source), "--recipe", "flan", "-t", str(llama2),
                    "--pack", "bfd", "--out", str(out), "-q"], check=True, env=env_for(folder), capture_output=True)
    tokens = int(json.loads((out / "manifest.json").read_text())["stats"]["tokens_in"])
    source.unlink()
    shutil.rmtree(out)
    return tokens


def env_for(folder: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PACKER_CACHE": str(folder / "packer-cache"),
            "HF_DATASETS_CACHE": str(folder / "hf-datasets-cache")}


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """The peak of the summed PSS of a process tree, every ``every`` seconds until ``stop``."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak_kb, self.done = pid, every, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.peak_kb = max(self.peak_kb, sum(pss_kb(p) for p in tree(self.pid)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=1e9, help="about how many tokens the data holds (default 1e9)")
    ap.add_argument("--dir", type=Path, default=None, help="where the data, the cache and the shards go (default: a "
                    "new folder under the system's temporary folder)")
    ap.add_argument("--llama2", type=Path, default=LLAMA2, help="the Llama 2 tokenizer folder (default: ../shared/data)")
    ap.add_argument("--keep", action="store_true", help="keep the data and the shards")
    args = ap.parse_args()
    if not (args.llama2 / "tokenizer.json").is_file():
        raise SystemExit(f"{args.llama2} is absent")
    sample = gzip.decompress(SAMPLE.read_bytes())
    folder = Path(tempfile.mkdtemp(prefix="bench_billion-", dir=args.dir))
    try:
        per_copy = tokens_per_copy(sample, args.llama2, folder)
        copies = max(1, math.ceil(args.tokens / per_copy))
        need = int(copies * per_copy * BYTES_PER_TOKEN)
        free = shutil.disk_usage(folder).free
        if need > free * 0.9:
            raise SystemExit(f"{folder.parent} has {free / 1e9:.1f} GB free; the run needs ~{need / 1e9:.1f} GB")
        data = folder / f"flan_x{copies}.jsonl"
        t = time.perf_counter()
        with open(data, "wb") as f:
            for _ in range(copies):
                f.write(sample)
        print(f"data: {copies} copies of the bundled sample, {copies * 6000:,} records, {data.stat().st_size / 1e9:.2f} GB, "
              f"~{copies * per_copy / 1e9:.3f}B tokens ({per_copy:,} a copy), written in {time.perf_counter() - t:.0f} s",
              flush=True)
        out = folder / "out"
        cmd = [sys.executable, "-m", "packer.cli", "build", str(data), "--recipe", "flan", "-t", str(args.llama2),
               "--pack", "bfd", "--out", str(out), "-q"]
        print("command: python " + " ".join(cmd[1:]) + f"  (PACKER_CACHE={folder / 'packer-cache'})", flush=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env_for(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        stdout, stderr = proc.communicate()
        wall = time.perf_counter() - t
        sampler.done.set()
        sampler.join()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            raise SystemExit(f"the build failed ({proc.returncode}):\n{stderr[-3000:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        manifest = json.loads((out / "manifest.json").read_text())
        stats = manifest["stats"]
        shards = sum(s["bytes"] for s in manifest["shards"])
        print(f"build: {wall:.1f} s wall ({wall / 60:.2f} min), {cpu:.0f} s CPU (the build and its workers), "
              f"{stats['tokens_in']:,} tokens tokenized = {stats['tokens_in'] / wall / 1e6:.2f}M tokens/s; "
              f"{stats['examples_read']:,} examples, {stats['rows']:,} rows in {len(manifest['shards'])} shards "
              f"({shards / 1e9:.2f} GB)")
        print(f"memory: peak RSS of the largest process {after.ru_maxrss / 1024:.0f} MiB (ru_maxrss), peak PSS of the "
              f"whole process tree {sampler.peak_kb / 1024:.0f} MiB (sampled every 0.2 s); load average "
              f"{os.getloadavg()[0]:.1f} at the end")
        print(f"goal: <= 10 min and <= 512 MB: {'met' if wall <= 600 and after.ru_maxrss * 1024 <= 512e6 else 'NOT met'}"
              + ("" if copies * per_copy >= 0.99e9 else f" (at {copies * per_copy / 1e9:.3f}B tokens, not 1B)"))
    finally:
        if args.keep:
            print(f"kept: {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
