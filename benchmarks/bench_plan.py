"""Benchmark of packer.planning.plan (a script, not a test): python benchmarks/bench_plan.py [--quick]

Prints, in one run on the same machine:

- rows / lower bound ⌈tokens / max_tokens⌉ and planning milliseconds for ``bfd`` (exact best-fit-decreasing)
  and ``optimal`` (BFD, then the loose rows refilled with items lent by full rows), beside TRL's ``pack_dataset(strategy="bfd")``
  (``trl.data_utils``; BFD per 1,000-row map batch) where it runs: on real lengths (the bundled
  FLAN-style sample with the bundled and the Llama 2 tokenizers, GSM8K train with Llama 2; the
  ``../shared/data`` ones when present) and on synthetic lengths of four shapes at 10k, 1M and 10M
  (TRL at 10k only: it needs every token in a ``datasets.Dataset``), each at 2,048 and 4,096 tokens.
  Over-long examples are truncated, as TRL's ``bfd`` does, so both sides pack the same tokens;
- balanced ranks, W=8: mean over steps of max/mean rank work, before (balance=None) and after,
  by tokens and by attention (sum of squared segment lengths), for batch and bfd modes.

TRL's time is its whole ``pack_dataset`` call (it moves the tokens, packer plans from lengths only).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np

from packer.planning.plan import plan, rank_work_ratio

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
LLAMA2 = SHARED / "llama2-tokenizer"
BUDGETS = (2048, 4096)


def flan_like(n: int, seed: int = 0, clip: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.ceil(rng.lognormal(np.log(250), 1.124, n)), 1, clip).astype(np.int64)


def synthetic(shape: str, n: int, budget: int, seed: int = 0) -> np.ndarray:
    """Lengths in [1, budget] of one shape (the test suite's shapes, tests/test_plan_optimal.py)."""
    rng = np.random.default_rng(seed)
    if shape == "lognormal":  # FLAN-like: median ~250, mean ~470, heavy tail
        return flan_like(n, seed, clip=budget)
    if shape == "uniform":
        return rng.integers(16, budget // 2, n)
    if shape == "bimodal":  # 70% short answers, 30% long documents
        return np.where(rng.random(n) < 0.7, rng.integers(40, 200, n), rng.integers(budget // 4, budget * 6 // 10, n))
    if shape == "equal":  # half the examples of one length (a template), the rest lognormal
        x = np.clip(np.ceil(rng.lognormal(np.log(250), 1.0, n)), 1, budget).astype(np.int64)
        x[rng.random(n) < 0.5] = 512
        return x
    raise ValueError(shape)


SHAPES = ("lognormal", "uniform", "bimodal", "equal")


def real_data() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, token ids, lengths) of every example, through packer's own format and tokenize steps."""
    from packer import BuildConfig
    from packer.building import sources
    from packer.building.formatting import make_spec
    from packer.building.pipeline import tokenizer_path
    from packer.building.tokenization import Encoder, load_tokenizer

    cases = [("sample, bundled tokenizer", "flan", None, None)]
    if (LLAMA2 / "tokenizer.json").is_file():
        cases.append(("sample, Llama 2", "flan", None, str(LLAMA2)))
        if (SHARED / "gsm8k_train.jsonl").is_file():
            cases.append(("GSM8K, Llama 2", str(SHARED / "gsm8k_train.jsonl"), "gsm8k", str(LLAMA2)))
    out = []
    for name, source, recipe, tok in cases:
        src = sources.resolve(source, recipe=recipe)
        stream = sources.open_stream(src)
        spec = make_spec(recipe=src.recipe, config=BuildConfig(source=source, recipe=recipe, out="-"),
                         columns=stream.columns())
        enc = Encoder(load_tokenizer(tokenizer_path(tok)), spec)
        parts = [enc.encode(records, lo) for lo, records in stream.chunks(0, 2000)]
        out.append((name, np.concatenate([p.ids for p in parts]), np.concatenate([p.lengths for p in parts])))
    return out


def trl_rows(ids: np.ndarray | None, lengths: np.ndarray, budget: int) -> tuple[int, float]:
    """Rows and seconds of TRL's pack_dataset(strategy="bfd") over a Dataset of these examples."""
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    offsets = np.zeros(lengths.size + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = ids.astype(np.int32) if ids is not None else np.zeros(int(offsets[-1]), np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    ds = datasets.Dataset(pa.table({"input_ids": column}))
    t = time.perf_counter()
    packed = pack_dataset(ds, seq_length=budget, strategy="bfd", map_kwargs={"load_from_cache_file": False})
    return len(packed), time.perf_counter() - t


def timed_plan(lengths: np.ndarray, mode: str, budget: int, repeats: int):
    best, p = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        p = plan(lengths, mode=mode, max_len=budget, overlong="truncate")
        best = min(best, time.perf_counter() - t)
    return p, best


def row(name: str, lengths: np.ndarray, budget: int, repeats: int, ids=None, trl: bool = False) -> None:
    b, tb = timed_plan(lengths, "bfd", budget, repeats)
    o, to = timed_plan(lengths, "optimal", budget, repeats)
    lb = b.stats["lower_bound"]
    assert o.num_rows <= b.num_rows and o.stats["lower_bound"] == lb
    line = (f"{name:<26}{lengths.size:>11,}{budget:>6}{lb:>10,}  "
            f"{b.num_rows:>10,} {b.num_rows / lb:.5f} {tb * 1e3:>8.1f}  {o.num_rows:>10,} {o.num_rows / lb:.5f} "
            f"{to * 1e3:>8.1f} {to / tb:>5.2f}x")
    if trl:
        t_rows, t_s = trl_rows(ids, lengths, budget)
        line += f"  {t_rows:>8,} {t_rows / lb:.5f} {t_s * 1e3:>8.1f}"
    print(line, flush=True)


def bench_rows(sizes: list[int], repeats: int) -> None:
    print("rows / lower bound and planning milliseconds: bfd, optimal (and its time over bfd's), TRL pack_dataset bfd")
    print(f"{'data':<26}{'examples':>11}{'T':>6}{'LB':>10}  {'bfd rows':>10} {'ratio':>7} {'ms':>8}  "
          f"{'opt rows':>10} {'ratio':>7} {'ms':>8} {'opt/bfd':>6}  {'TRL rows':>8} {'ratio':>7} {'ms':>8}")
    for name, ids, lengths in real_data():
        for budget in BUDGETS:
            row(name, lengths, budget, repeats, ids=ids, trl=True)
    for n in sizes:
        for shape in SHAPES:
            for budget in BUDGETS:
                row(shape, synthetic(shape, n, budget), budget, repeats if n < 5_000_000 else 1, trl=n <= 10_000)


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
        ("optimal (max_tokens 4096)", dict(mode="optimal", max_len=4096)),
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
    ap.add_argument("--quick", action="store_true", help="10k and 1M synthetic examples, not 10M")
    ap.add_argument("--repeats", type=int, default=3, help="timing: best of this many runs (one at 10M)")
    args = ap.parse_args()
    print(f"numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}")
    sizes = [10_000, 1_000_000] if args.quick else [10_000, 1_000_000, 10_000_000]
    bench_rows(sizes, args.repeats)
    bench_balance(1_000_000, w=8, batch_size=8)


if __name__ == "__main__":
    main()
