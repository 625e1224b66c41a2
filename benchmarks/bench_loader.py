"""Benchmark of the loader's row checks (a script, not a test): python benchmarks/bench_loader.py

The loader checks each row batch's structure the first time a process reads one of its rows
(``packer.contract.rows.check_rows``). Prints, on a batch-mode build of the bundled sample (as
``train/bench.py`` builds it: batch of 8, max_len 512; 1,000 records by default, so an epoch is long
enough to time; made in a temporary folder), tokens per second of:
- the loader's first epoch in a fresh process state (every row batch checked: the worst case),
- the same first epoch with the checks marked done (what they cost is the difference),
- the loader's later epochs (checked batches are not checked again), in order and shuffled (as
  training reads them), and in order with numpy decoding the rows instead of the C kernel (what an
  install without a C compiler gets; packer/training/decode.py),
- ``check_rows`` alone over every batch,
- a fresh loader's whole first epoch, opening included, from the page cache and from disk (each shard
  file's pages dropped first with ``posix_fadvise(DONTNEED)``: what a training run's first epoch reads,
  and every epoch of a build larger than the machine's page cache),
- transformers' ``DataCollatorWithFlattening`` on the same rows' examples (the peer),
and the ratios loader/collator (the target: >= 40x). Each of these for a format-2 build (the
default: uint16 ids and positions, the loss as a bit mask) and a format-1 build (``--format 1``, int32)
of the same config, measured in the same run, and format 2's tokens/s over format 1's (the target:
at least 1). Times are wall seconds (as ``train/bench.py`` measures), or with ``--clock cpu`` CPU
seconds of this process; best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packer.contract.rows import check_rows
from packer.training import decode
from packer.training.loader import make_dataloader

clock = time.perf_counter
KERNEL = decode.KERNEL  # the decoder the loader uses; set to None for a numpy pass


def build(out: Path, limit: int, version: int) -> None:
    cmd = [sys.executable, "-m", "packer.cli", "build", "flan", "--out", str(out), "--limit", str(limit),
           "--pack", "batch", "--batch-size", "8", "--max-len", "512", "--format", str(version)]
    subprocess.run(cmd, check=True, capture_output=True)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=1000, help="records of the bundled sample")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = p.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    from transformers import DataCollatorWithFlattening

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for version in (1, 2):
            shards = Path(tmp) / f"shards{version}"
            build(shards, args.limit, version)
        rows, tokens, nbatches = info(Path(tmp) / "shards2")
        features = flattening_features(Path(tmp) / "shards2")
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
        # both formats' epochs and the collator's pass interleaved, so a drift of the machine's load (or
        # its clock) hits all alike
        measured: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
        collated = []
        for _ in range(args.repeats):
            for v in (1, 2):
                for key, t in measure(Path(tmp) / f"shards{v}", 1).items():
                    measured[v].setdefault(key, []).extend(t)
                for key, t in measure_fresh(Path(tmp) / f"shards{v}", 1).items():
                    measured[v].setdefault(key, []).extend(t)
            collated.append(best(lambda: [collator(f) for f in features], 1))
        results = {v: {k: min(t) for k, t in m.items()} for v, m in measured.items()}
    t_coll = min(collated)

    print(f"loader checks: {rows} rows, {tokens:,} tokens, {nbatches} row batch(es); best of {args.repeats}, "
          f"{args.clock} clock; rows decoded by {'the C kernel' if KERNEL else 'numpy (no C kernel built)'}")
    print(f"  {'':30} {'format 2':>14} {'format 1':>14}   2 / 1")
    names = (("loader, first epoch (checks)", "first"), ("loader, first epoch, no checks", "unchecked"),
             ("loader, later epochs", "later"), ("later epochs, shuffled", "shuffled"),
             ("later epochs, numpy decoding", "numpy"), ("check_rows alone", "check"),
             ("fresh loader, page cache", "fresh"), ("fresh loader, from disk", "cold"))
    for name, key in names:
        r2, r1 = tokens / results[2][key], tokens / results[1][key]
        print(f"  {name:30} {r2:>14,.0f} {r1:>14,.0f}   {r2 / r1:.2f}x  tokens/s")
    print(f"  {'DataCollatorWithFlattening':30} {tokens / t_coll:>14,.0f}")
    for v in (2, 1):
        r = results[v]
        print(f"  format {v} loader/collator: first epoch {t_coll / r['first']:.1f}x, later epochs "
              f"{t_coll / r['later']:.1f}x; first epoch without checks {t_coll / r['unchecked']:.1f}x")


def measure(shards: Path, repeats: int) -> dict[str, list[float]]:
    from packer.training.loader import make_dataloader

    times: dict[str, list[float]] = {"first": [], "unchecked": [], "later": [], "shuffled": [], "numpy": [],
                                     "check": []}
    dl = make_dataloader(shards, shuffle=False)
    list(dl)
    shuffled = make_dataloader(shards, seed=1)
    list(shuffled)

    def first_epoch(checks: bool) -> float:
        fresh = make_dataloader(shards, shuffle=False)
        # opening (maps, Arrow validation) is not per-row work: outside the timing
        opened = fresh.dataset._open()
        opened.checked = [not checks] * len(opened.batches)  # without checks: the same first read, marked checked
        start = clock()
        for _ in fresh:
            pass
        return clock() - start

    cols = dl.dataset._open().batches
    vocab = dl.dataset._vocab_size()
    for _ in range(repeats):
        times["first"].append(first_epoch(True))
        times["unchecked"].append(first_epoch(False))
        # a later epoch takes ~1 ms: three of each a repeat, the formats alternating, steady their best
        times["later"].append(best(lambda: [None for _ in dl], 3))
        times["shuffled"].append(best(lambda: [None for _ in shuffled], 3))
        decode.KERNEL = None
        try:
            times["numpy"].append(best(lambda: [None for _ in dl], 3))
        finally:
            decode.KERNEL = KERNEL
        times["check"].append(best(lambda: [check_rows(c.rows, vocab) for c in cols], 1))
    return times


def measure_fresh(shards: Path, repeats: int) -> dict[str, list[float]]:
    """Called once ``measure``'s loaders are gone: a live mapping keeps its pages in the page cache."""
    times: dict[str, list[float]] = {"fresh": [], "cold": []}
    for _ in range(repeats):
        times["fresh"].append(fresh_epoch(shards, cold=False))
        times["cold"].append(fresh_epoch(shards, cold=True))
    return times


def fresh_epoch(shards: Path, cold: bool) -> float:
    """A new loader's first epoch, opening and checks included; ``cold``: its shards' pages dropped from
    the page cache first (Linux drops the clean pages no live mapping holds, so old loaders go first)."""
    gc.collect()
    if cold:
        for shard in shards.glob("*.arrow"):
            fd = os.open(shard, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    start = clock()
    for _ in make_dataloader(shards, shuffle=False):
        pass
    return clock() - start


def info(shards: Path) -> tuple[int, int, int]:
    dl = make_dataloader(shards, shuffle=False)
    batches = list(dl)
    return len(batches), sum(b["input_ids"].shape[1] for b in batches), len(dl.dataset._open().batches)


def flattening_features(shards: Path) -> list:
    features = []
    for b in make_dataloader(shards, shuffle=False):
        cu = b["cu_seq_lens_q"].tolist()
        ids, labels = b["input_ids"][0].tolist(), b["labels"][0].tolist()
        features.append([{"input_ids": ids[a:z], "labels": labels[a:z]} for a, z in zip(cu[:-1], cu[1:])])
    return features


if __name__ == "__main__":
    main()
