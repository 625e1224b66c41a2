"""End-to-end build against the peers, one run, same data and cores (a script, not a test).

    python benchmarks/bench_build.py [--num-proc N] [--max-tokens 4096] [--repeats 5]

For each dataset (the bundled FLAN-style sample; ../shared/data/gsm8k_train.jsonl), with the Llama 2
tokenizer (../shared/data/llama2-tokenizer):

- packer: ``packer.build`` (read, format, tokenize, plan bfd, write shards + manifest);
- peers:  ``datasets.map`` tokenization (batched, the same formatted text, 1,000-row batches) +
  TRL ``pack_dataset(strategy="bfd")`` (which packs each 1,000-row map batch apart) + ``save_to_disk``.

Prints both wall times, the ratio, and rows / lower bound (⌈tokens / max_tokens⌉) for both. Also
prints packer's rows / lower bound at 4,096 and 2,048 tokens. Both sides read the same file through
the warm `datasets` cache and each is run once untimed first (which also does transformers' lazy
imports for the peers). Then each side runs ``--repeats`` times, interleaved (packer, peers, peers,
packer, …, so a drift of the machine's load hits both alike); a time is wall clock from before the
source is resolved to after the output is on disk (module imports done before, tokenizer loading
inside, both sides). Reported: the median and the spread [min–max] per side; the speedup is the
ratio of the medians, with the smallest and largest ratio any two runs give.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
LLAMA2 = SHARED / "llama2-tokenizer"


def packer_build(source: str, recipe: str | None, out: Path, max_tokens: int, num_proc: int) -> tuple[float, dict]:
    from packer import BuildConfig, build

    config = BuildConfig(source=source, recipe=recipe, out=str(out), tokenizer=str(LLAMA2), pack="bfd",
                         max_len=max_tokens, max_tokens=max_tokens, overlong="truncate", num_proc=num_proc,
                         overwrite=True)
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    result = build(config)
    return time.perf_counter() - t, result.manifest.stats.to_json()


def peers_build(source: str, recipe: str | None, out: Path, max_tokens: int, num_proc: int) -> tuple[float, int, int]:
    """datasets.map tokenization + TRL pack_dataset(bfd) + save_to_disk, on packer's formatted text."""
    import datasets
    from transformers import AutoTokenizer
    from trl.data_utils import pack_dataset

    from packer import BuildConfig
    from packer.building import sources
    from packer.building.formatting import Formatter, make_spec

    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    src = sources.resolve(source, recipe=recipe)
    ds = datasets.load_dataset(src.builder, data_files=list(src.files), split="train")
    tokenizer = AutoTokenizer.from_pretrained(str(LLAMA2))
    cfg = BuildConfig(source=source, recipe=recipe, out=str(out))
    formatter = Formatter(make_spec(recipe=src.recipe, config=cfg, columns=list(ds.column_names)), tokenizer)
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        names = list(batch)
        texts = ["".join(p for p, _ in formatter({n: batch[n][i] for n in names})) for i in range(len(batch[names[0]]))]
        ids = tokenizer(texts, truncation=True, max_length=max_tokens - 1)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    tokenized = ds.map(tokenize, batched=True, batch_size=1000, remove_columns=ds.column_names,
                       num_proc=num_proc if num_proc > 1 else None, load_from_cache_file=False)
    packed = pack_dataset(tokenized, seq_length=max_tokens, strategy="bfd",
                          map_kwargs={"load_from_cache_file": False})
    packed.save_to_disk(str(out))
    seconds = time.perf_counter() - t
    tokens = sum(len(x) for x in tokenized["input_ids"])
    return seconds, len(packed), tokens


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-proc", type=int, default=1, help="packer --num-proc and datasets.map num_proc")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side, interleaved")
    args = ap.parse_args()
    if not (LLAMA2 / "tokenizer.json").is_file():
        raise SystemExit(f"{LLAMA2} is absent")
    print(f"cores {os.cpu_count()}, num_proc {args.num_proc}, bfd into {args.max_tokens}-token rows, Llama 2 tokenizer, "
          f"{args.repeats} interleaved runs per side, median [min–max]")
    cases = [("flan (bundled sample)", "flan", None), ("gsm8k_train.jsonl", str(SHARED / "gsm8k_train.jsonl"), "gsm8k")]
    tmp = Path(tempfile.mkdtemp(prefix="bench_build-"))
    try:
        head = f"{'dataset':<24}{'packer s':>20}{'peers s':>20}{'speedup':>22}{'packer rows/LB':>16}{'peers rows/LB':>15}"
        lines = []
        for name, source, recipe in cases:
            packer_build(source, recipe, tmp / "warm", args.max_tokens, args.num_proc)  # warm caches
            peers_build(source, recipe, tmp / "warm-peers", args.max_tokens, args.num_proc)  # and lazy imports
            p_times, t_times = [], []
            for r in range(args.repeats):
                for side in ("packer", "peers") if r % 2 == 0 else ("peers", "packer"):
                    if side == "packer":
                        p_s, st = packer_build(source, recipe, tmp / "packer", args.max_tokens, args.num_proc)
                        p_times.append(p_s)
                    else:
                        t_s, t_rows, t_tokens = peers_build(source, recipe, tmp / "peers", args.max_tokens, args.num_proc)
                        t_times.append(t_s)
            lb_p = st["lower_bound"]
            lb_t = math.ceil(t_tokens / args.max_tokens)
            speedup = (f"{statistics.median(t_times) / statistics.median(p_times):.2f}x "
                       f"[{min(t_times) / max(p_times):.2f}–{max(t_times) / min(p_times):.2f}]")
            lines.append(f"{name:<24}{spread(p_times):>20}{spread(t_times):>20}{speedup:>22}"
                         f"{st['rows'] / lb_p:>16.4f}{t_rows / lb_t:>15.4f}"
                         f"   (packer {st['rows']:,} rows / LB {lb_p:,}; peers {t_rows:,} / {lb_t:,})")
            for budget in (4096, 2048):
                _, s2 = packer_build(source, recipe, tmp / "b", budget, args.num_proc)
                lines.append(f"{'':<24}packer bfd ≤ {budget}: {s2['rows']:,} rows, lower bound {s2['lower_bound']:,}, "
                             f"ratio {s2['rows'] / s2['lower_bound']:.4f}")
        print(head)
        print("\n".join(lines))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
