"""Benchmark of the loader's row checks (a script, not a test): python benchmarks/bench_loader.py

The loader checks each row batch's structure the first time a process reads one of its rows
(``packer.contract.rows.check_rows``). Prints, on a batch-mode build of the bundled sample (as
``train/bench.py`` builds it: batch of 8, max_len 512; 1,000 records by default, so an epoch is long
enough to time; made in a temporary folder), tokens per second of:
- the loader's first epoch in a fresh process state (every row batch checked: the worst case),
- the same first epoch with the checks marked done (what they cost is the difference),
- the loader's later epochs (checked batches are not checked again),
- ``check_rows`` alone over every batch,
- transformers' ``DataCollatorWithFlattening`` on the same rows' examples (the peer),
and the ratios loader/collator (the target: >= 40x). Times are wall seconds (as ``train/bench.py``
measures), or with ``--clock cpu`` CPU seconds of this process; best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packer.contract.rows import check_rows
from packer.training.loader import make_dataloader

clock = time.perf_counter


def build(out: Path, limit: int) -> None:
    cmd = [sys.executable, "-m", "packer.cli", "build", "flan", "--out", str(out), "--limit", str(limit),
           "--pack", "batch", "--batch-size", "8", "--max-len", "512"]
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

    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        build(shards, args.limit)
        dl = make_dataloader(shards, shuffle=False)
        batches = list(dl)
        tokens = sum(b["input_ids"].shape[1] for b in batches)

        def first_epoch(checks: bool = True) -> None:
            fresh = make_dataloader(shards, shuffle=False)
            # opening (maps, Arrow validation) is not per-row work: outside the timing
            opened = fresh.dataset._open()
            opened.checked = [not checks] * len(opened.batches)  # without checks: the same first read, marked checked
            start = clock()
            for _ in fresh:
                pass
            first_epoch.seconds = clock() - start

        seconds: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):  # interleaved, so both see the same machine
            for checks in (True, False):
                first_epoch(checks)
                seconds[checks].append(first_epoch.seconds)
        t_first, t_first_unchecked = min(seconds[True]), min(seconds[False])
        t_later = best(lambda: [None for _ in dl], args.repeats)
        cols = dl.dataset._open().batches
        t_check = best(lambda: [check_rows(c.rows, dl.dataset._vocab_size()) for c in cols], args.repeats)
        features = []
        for b in batches:
            cu = b["cu_seq_lens_q"].tolist()
            ids, labels = b["input_ids"][0].tolist(), b["labels"][0].tolist()
            features.append([{"input_ids": ids[a:z], "labels": labels[a:z]} for a, z in zip(cu[:-1], cu[1:])])
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
        t_coll = best(lambda: [collator(f) for f in features], args.repeats)

    print(f"loader checks: {len(batches)} rows, {tokens:,} tokens, {len(cols)} row batch(es); best of {args.repeats}, "
          f"{args.clock} clock")
    for name, t in (("loader, first epoch (checks)", t_first), ("loader, first epoch, no checks", t_first_unchecked),
                    ("loader, later epochs", t_later),
                    ("check_rows alone", t_check), ("DataCollatorWithFlattening", t_coll)):
        print(f"  {name:30} {tokens / t:>14,.0f} tokens/s")
    print(f"  loader/collator: first epoch {t_coll / t_first:.1f}x, later epochs {t_coll / t_later:.1f}x; "
          f"first epoch without checks {t_coll / t_first_unchecked:.1f}x")


if __name__ == "__main__":
    main()
