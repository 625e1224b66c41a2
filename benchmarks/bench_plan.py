"""Benchmark of packer.plan (a script, not a test): python benchmarks/bench_plan.py [--quick]

Prints, on FLAN-like lengths (lognormal, median ~250, mean ~470 tokens, clipped to 4096):
- bfd: wall time and rows / lower bound ceil(tokens / max_tokens) at 1M and 10M examples,
  max_tokens 4096 and 2048 (overlong="split" for 2048);
- balanced ranks, W=8: mean over steps of max/mean rank work, before (balance=None) and after,
  by tokens and by attention (sum of squared segment lengths), for batch and bfd modes.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from packer.plan import plan, rank_work_ratio


def flan_like(n: int, seed: int = 0, clip: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.ceil(rng.lognormal(np.log(250), 1.124, n)), 1, clip).astype(np.int64)


def bench_bfd(sizes: list[int], repeats: int) -> None:
    print("bfd (global best-fit-decreasing), FLAN-like lengths")
    print(
        f"{'examples':>10} {'max_tokens':>10} {'seconds':>8} {'rows':>10} {'lower_bound':>11} {'rows/LB':>9} {'fill':>7}"
    )
    for n in sizes:
        lengths = flan_like(n)
        for max_tokens in (4096, 2048):
            overlong = "split" if max_tokens < 4096 else "truncate"
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                p = plan(lengths, mode="bfd", max_len=max_tokens, max_tokens=max_tokens, overlong=overlong)
                best = min(best, time.perf_counter() - t)
            st = p.stats
            print(
                f"{n:>10,} {max_tokens:>10} {best:>8.2f} {st['rows']:>10,} {st['lower_bound']:>11,} "
                f"{st['rows'] / st['lower_bound']:>9.5f} {st['fill']:>7.4f}"
            )


def step_bound(p, w: int, b: int, by: str) -> float:
    """No partition of a step's segments into w rows beats max(largest work, mean row work)."""
    work = (p.length if by == "tokens" else p.length**2).astype(np.float64)
    steps = work.size // (w * b)
    ws = work[: steps * w * b].reshape(steps, w * b)
    mean = ws.sum(axis=1) / w
    return float((np.maximum(ws.max(axis=1), mean) / mean).mean())


def bench_balance(n: int, w: int, batch_size: int) -> None:
    lengths = flan_like(n, seed=1)
    print(f"\nbalanced ranks, W={w}, {n:,} FLAN-like examples: mean over steps of max/mean rank work")
    print("(bound: mean over steps of max(largest segment work, mean rank work) / mean, for batch mode)")
    print(f"{'mode':>28} {'by':>10} {'before':>8} {'after':>8} {'bound':>8} {'seconds':>8}")
    cases = [
        (f"batch (B={batch_size}, max_len 4096)", dict(mode="batch", max_len=4096, batch_size=batch_size)),
        ("bfd (max_tokens 4096)", dict(mode="bfd", max_len=4096)),
    ]
    for name, kw in cases:
        plain = plan(lengths, world_size=w, **kw)
        for by in ("tokens", "attention"):
            t = time.perf_counter()
            bal = plan(lengths, world_size=w, balance=by, **kw)
            dt = time.perf_counter() - t
            before = rank_work_ratio(plain, w, by)
            after = bal.stats["rank_work_max_over_mean"]
            bound = step_bound(plain, w, batch_size, by) if kw["mode"] == "batch" else float("nan")
            print(f"{name:>28} {by:>10} {before:>8.4f} {after:>8.4f} {bound:>8.4f} {dt:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k and 1M examples instead of 1M and 10M")
    ap.add_argument("--repeats", type=int, default=2, help="timing: best of this many runs")
    args = ap.parse_args()
    print(f"numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}")
    sizes = [100_000, 1_000_000] if args.quick else [1_000_000, 10_000_000]
    bench_bfd(sizes, args.repeats)
    bench_balance(sizes[0], w=8, batch_size=8)


if __name__ == "__main__":
    main()
