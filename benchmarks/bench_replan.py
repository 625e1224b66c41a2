"""Re-planning from the token store (a script, not a test): the first build against a re-plan for each option
that acts after tokenizing, each from the shell (process start to exit), with a cache of its own.

    python benchmarks/bench_replan.py [--repeat 8] [--llama2 DIR] [--runs 1]

Data: the bundled FLAN-style sample repeated ``--repeat`` times as one JSONL file (8 → 48,000 records), the
Llama 2 tokenizer (../shared/data/llama2-tokenizer), ``--pack bfd``. The first build runs with an empty cache
(it tokenizes and keeps the tokens); then one build per changed option, each re-planned from the store, each
checked byte-identical (every file of the folder) to the same build made with ``--no-cache``, which is timed
too: a re-plan's time is shown beside the cold build it replaces. ``--runs`` repeats the first build and
the re-plans, interleaved; each figure is the best.

A mix is timed the same way: the sample repeated ``5/8`` and ``3/8`` of ``--repeat`` times as two files,
mixed by a mix file with weights 0.5, 0.5 (it ends where the smaller part runs out: that part's entry holds all of it, the
other's the records drawn from it), then other weights, seed and ``--limit``, each re-drawn from the parts'
entries: within what they hold (nothing tokenized), or beyond (another seed draws a few more of the larger
part; more weight on it draws thousands more): then only the records beyond an entry are tokenized, and the
table says how many. Each row starts from the first build's entries (the store is copied aside after it and
put back before each row). ``--only`` names rows of either table.
"""

from __future__ import annotations

import argparse
import filecmp
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
LLAMA2 = ROOT.parent / "shared" / "data" / "llama2-tokenizer"
SAMPLE = ROOT / "packer" / "data" / "flan_sample.jsonl.gz"
BASE = ["--recipe", "flan", "--pack", "bfd"]
CHANGES = {  # each option a re-plan may change, as one build's flags
    "--pack optimal": ["--pack", "optimal"],
    "--pack batch": ["--pack", "batch"],
    "--max-len 2048": ["--max-len", "2048"],
    "--max-tokens 16384": ["--max-tokens", "16384"],
    "--overlong split": ["--overlong", "split"],
    "--seed 7": ["--seed", "7"],
    "--epochs 2": ["--epochs", "2"],
    "--world-size 4 --balance attention": ["--world-size", "4", "--balance", "attention"],
    "--cp-size 2": ["--cp-size", "2"],
    "--pad-to-multiple-of 16": ["--pad-to-multiple-of", "16"],
    "--format 1": ["--format", "1"],
    "--compression zstd": ["--compression", "zstd"],
    "--shard-size 16": ["--shard-size", "16"],
}


def mix_file(tmp: Path, parts: list[Path], weights: tuple[float, float]) -> str:
    """A mix file of the two parts (each FLAN-style: --recipe is given per part in a mix) with these weights."""
    path = tmp / f"mix_{weights[0]}_{weights[1]}.json"
    path.write_text(json.dumps([{"source": str(p), "recipe": "flan", "weight": w}
                                for p, w in zip(parts, weights, strict=True)]))
    return str(path)


def mix_changes(repeat: int, tmp: Path, parts: list[Path]) -> tuple[list[str], dict[str, list[str]]]:
    """The mix's first build (weights 0.5, 0.5), and each change re-drawn from its parts' entries: what it takes
    of each part lies within them (half the records under another seed: about a quarter of each part, where the
    first build holds over a third of the larger one and all of the smaller)."""
    half = str(repeat * 3000)
    first = ["--mix", mix_file(tmp, parts, (0.5, 0.5))]
    return first, {"mix: weights 0.4,0.6": ["--mix", mix_file(tmp, parts, (0.4, 0.6))],
                   f"mix: --seed 7 --limit {half}": [*first, "--seed", "7", "--limit", half],
                   "mix: --seed 7": [*first, "--seed", "7"],
                   "mix: weights 0.6,0.4": ["--mix", mix_file(tmp, parts, (0.6, 0.4))]}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: list[str], env: dict[str, str]) -> tuple[float, dict]:
    """Wall seconds of ``packer build ARGS --json`` (CPU seconds of its process tree in ``CPU[-1]``), its output."""
    t, cpu = time.perf_counter(), children_cpu()
    done = subprocess.run([sys.executable, "-m", "packer", "build", *args, "--json"], env=env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - t
    CPU.append(children_cpu() - cpu)
    if done.returncode:
        raise SystemExit(f"packer build {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return seconds, json.loads(done.stdout)


CPU: list[float] = []


def same_folder(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=8, help="copies of the 6,000-record sample (8: 48,000 records)")
    ap.add_argument("--llama2", type=Path, default=LLAMA2, help="the Llama 2 tokenizer folder")
    ap.add_argument("--runs", type=int, default=1, help="rounds; each figure is the best")
    ap.add_argument("--only", nargs="*", help="the changes to run (default: all)")
    ap.add_argument("--no-cold", action="store_true",
                    help="skip the --no-cache builds (each a whole tokenize): re-plans timed, not compared")
    args = ap.parse_args()
    if not (args.llama2 / "tokenizer.json").is_file():
        raise SystemExit(f"{args.llama2} is absent")
    tmp = Path(tempfile.mkdtemp(prefix="bench_replan-"))
    try:
        source = tmp / f"flan_x{args.repeat}.jsonl"
        source.write_bytes(gzip.decompress(SAMPLE.read_bytes()) * args.repeat)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PACKER_CACHE": str(tmp / "cache")}
        common = [str(source), *BASE, "-t", str(args.llama2)]
        parts = [tmp / "flan_a.jsonl", tmp / "flan_b.jsonl"]
        for path, copies in zip(parts, (args.repeat * 5 // 8, args.repeat - args.repeat * 5 // 8), strict=True):
            path.write_bytes(gzip.decompress(SAMPLE.read_bytes()) * max(1, copies))
        mixed = [*BASE[2:], "-t", str(args.llama2)]
        mix_first, mixes = mix_changes(args.repeat, tmp, parts)
        tables = [(common, [], {k: v for k, v in CHANGES.items() if not args.only or k in args.only}),
                  (mixed, mix_first, {k: v for k, v in mixes.items() if not args.only or k in args.only})]
        for base, first_flags, changes in tables:
            if changes:
                _table(args, env, tmp, base, first_flags, changes, parts if first_flags else [source])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _table(args, env: dict[str, str], tmp: Path, common: list[str], first_flags: list[str],
           changes: dict[str, list[str]], sources: list[Path]) -> None:
    """The first build of ``common + first_flags`` against a re-plan of each change, printed as a table."""
    load = os.getloadavg()
    first, replans, colds, cpu, more = float("inf"), {}, {}, {}, {}
    for _ in range(args.runs):
        shutil.rmtree(tmp / "cache", ignore_errors=True)
        seconds, result = run([*common, *first_flags, "--out", str(tmp / "first"), "--overwrite"], env)
        assert not result["replanned"]
        if seconds < first:
            first, cpu["first"] = seconds, CPU[-1]
        shutil.rmtree(tmp / "first-cache", ignore_errors=True)
        shutil.copytree(tmp / "cache", tmp / "first-cache")  # each row starts from the first build's entries
        for name, flags in changes.items():
            shutil.rmtree(tmp / "cache")
            shutil.copytree(tmp / "first-cache", tmp / "cache")
            seconds, result = run([*common, *flags, "--out", str(tmp / "replan"), "--overwrite"], env)
            assert result["replanned"], name
            more[name] = sum(result.get("extended") or ())  # records tokenized beyond the entries
            if seconds < replans.get(name, float("inf")):
                replans[name], cpu[name] = seconds, CPU[-1]
            if args.no_cold:
                continue
            seconds, _ = run([*common, *flags, "--out", str(tmp / "cold"), "--overwrite", "--no-cache"], env)
            colds[name] = min(colds.get(name, float("inf")), seconds)
            if not same_folder(tmp / "replan", tmp / "cold"):
                raise SystemExit(f"{name}: the re-planned folder differs from the --no-cache build")
    records = sum(1 for source in sources for _ in source.open())
    what = "" if not first_flags else " in two parts (5/8 and 3/8 of them), weights 0.5, 0.5"
    print(f"cores {os.cpu_count()}, {records:,} records{what}, Llama 2 tokenizer, {' '.join(BASE)}; best of "
          f"{args.runs}" + ("" if args.no_cold else "; each re-planned folder byte-identical to its --no-cache build"))
    print(f"load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f} (1 minute)")
    print(f"first build (tokenizes, keeps the tokens): {first:.2f} s wall, {cpu['first']:.1f} s CPU")
    print(f"{'change':<44} {'re-plan':>8} {'/ first':>8} {'CPU':>6} {'/ first':>8} {'--no-cache':>11} "
          f"{'tokenized':>10}")
    for name in changes:
        cold = f"{colds[name]:>10.2f}s" if name in colds else f"{'-':>11}"
        print(f"{name:<44} {replans[name]:>7.2f}s {replans[name] / first:>8.1%} {cpu[name]:>5.2f}s "
              f"{cpu[name] / cpu['first']:>8.1%} {cold} {more[name]:>10,}")


if __name__ == "__main__":
    main()
