"""Bytes per token and build time of format 1 against format 2, side by side (a script, not a test).

    python benchmarks/bench_format.py [--repeats 3] [--num-proc N]

For each build (the bundled sample with its own tokenizer, whole; GSM8K train with Llama 2's, Llama
3.1's and Qwen3's tokenizers from ../shared/data), all in batch mode (batch of 8, max_len 4096, the
defaults), prints for ``--format 1``, ``--format 2`` and ``--format 2 --compression zstd``: the
shards' bytes over ``stats.tokens`` (Arrow's list offsets, schema and padding included: what is on
disk), the token columns' types, and the build's wall time (median of ``--repeats``, the formats
interleaved so that a drift of the machine's load hits each alike; the tokenizer loading and the
source's reading are inside, module imports outside). The target: format 2 ≤ 4.3 bytes a token with a
vocab of ≤ 65,536 ids, ≤ 6.3 with a larger one, and no slower to build than format 1.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from packer import BuildConfig, build
from packer.contract import schema

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
BUILDS = {
    "bundled (vocab 12,000)": dict(source="flan"),
    "gsm8k, Llama 2 (32,000)": dict(source=str(SHARED / "gsm8k_train.jsonl"), recipe="gsm8k",
                                    tokenizer=str(SHARED / "llama2-tokenizer")),
    "gsm8k, Llama 3.1 (128,256)": dict(source=str(SHARED / "gsm8k_train.jsonl"), recipe="gsm8k",
                                       tokenizer=str(SHARED / "tokenizers" / "llama3_1")),
    "gsm8k, Qwen3 (151,669)": dict(source=str(SHARED / "gsm8k_train.jsonl"), recipe="gsm8k",
                                   tokenizer=str(SHARED / "tokenizers" / "qwen3")),
}
FORMATS = {"format 1": dict(format_version=1), "format 2": dict(format_version=2),
           "format 2 + zstd": dict(format_version=2, compression="zstd")}


def one(out: Path, options: dict, num_proc: int) -> tuple[float, float, str]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = build(BuildConfig(out=str(out), num_proc=num_proc, **options)).manifest
    seconds = time.perf_counter() - start
    per_token = sum(e.bytes for e in manifest.shards) / manifest.stats.tokens
    fmt = manifest.row_format
    return seconds, per_token, f"{fmt.ids}/{fmt.positions}/{fmt.loss}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-proc", type=int, default=0)
    p.add_argument("--only", help="run only the builds whose name contains this")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, source in BUILDS.items():
            if args.only and args.only not in name:
                continue
            times: dict[str, list[float]] = {f: [] for f in FORMATS}
            sizes, types = {}, {}
            for options in FORMATS.values():  # untimed first: the page cache and lazy imports
                one(Path(tmp) / "warm", {**source, **options}, args.num_proc)
            for _ in range(args.repeats):
                for f, options in FORMATS.items():
                    seconds, sizes[f], types[f] = one(Path(tmp) / f.replace(" ", "_"), {**source, **options},
                                                      args.num_proc)
                    times[f].append(seconds)
            tokens = schema.read_manifest(Path(tmp) / "format_1").stats.tokens
            print(f"{name}: {tokens:,} tokens")
            for f in FORMATS:
                t = statistics.median(times[f])
                print(f"  {f:16} {sizes[f]:6.2f} bytes/token  {types[f]:22}  build {t:6.2f} s "
                      f"[{min(times[f]):.2f}-{max(times[f]):.2f}]")
            print(f"  format 2 / format 1: {sizes['format 2'] / sizes['format 1']:.3f} of the bytes, build time "
                  f"{statistics.median(times['format 2']) / statistics.median(times['format 1']):.2f}x")


if __name__ == "__main__":
    main()
