"""Packed rows with images against TRL's padded vision-language batches: tokens, and a tiny model's CPU step.

    python benchmarks/bench_vlm.py [--chats 64] [--batch 8] [--max-tokens 1024] [--steps 3] [--repeats 3]

The data: chats about crops of real photographs (matplotlib's sample photographs, crops of varied sizes
and shapes, 0-2 images a chat; examples/vlm_sft.py's demo set), through a tiny Qwen2.5-VL's processor
(benchmarks/vlm_tiny.py's ``qwen2_5_vl+bench``: a 4-layer text decoder of width 256, about ten times its
vision tower, as in the released models). Padded: TRL's ``DataCollatorForVisionLanguageModeling`` over batches of
``--batch`` chats (what SFTTrainer feeds a VLM), the model on eager attention with its attention mask.
Packed: the same chats first-fit into rows of ``--max-tokens`` (rows by hand, as the images build makes
them), the model after ``packer.prepare`` (text on packer_varlen, vision tower per image).

Reported: rows and tokens the forward runs (padding included), and for each layout in its own process
(so that peak memory is its own), ``--repeats`` times interleaved, the best run of each kept: forward +
backward over every batch, ``--steps`` passes, real (non-padding) tokens per second, and the peak resident
memory above the process's baseline. One thread,
fp32; the figure to read is the ratio. A GPU check of the flash-attn path: benchmarks/gpu_vlm_check.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.vlm_tiny import build
from examples.vlm_sft import demo_chats, make_rows


def padded_batches(processor, chats, batch: int) -> list[dict]:
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collator = DataCollatorForVisionLanguageModeling(processor)
    return [dict(collator([{"messages": m, "images": imgs} for imgs, m in chats[i : i + batch]]))
            for i in range(0, len(chats), batch)]  # fmt: skip


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(layout: str, chats_n: int, batch: int, max_tokens: int, steps: int) -> dict:
    """One layout's figures, in this process."""
    from packer import prepare

    torch.set_num_threads(1)
    model, processor = build("qwen2_5_vl+bench")
    chats = demo_chats(chats_n)
    if layout == "packed":
        batches = make_rows(model, processor, chats, max_tokens)
        t0 = time.perf_counter()
        prepare(model, processor=processor, max_tokens=max_tokens)
        probe_s = time.perf_counter() - t0
        real = sum(b["input_ids"].numel() for b in batches)
    else:
        batches = padded_batches(processor, chats, batch)
        model.set_attn_implementation({"": "sdpa", "text_config": "sdpa"})  # transformers' padded path
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        probe_s = 0.0
    total = sum(b["input_ids"].numel() for b in batches)
    images = sum(len(b["image_grid_thw"]) for b in batches if "image_grid_thw" in b)
    model.train()
    base = _maxrss_mb()  # the model and the data made: what the steps add on top is the figure
    model(**batches[0]).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for _ in range(steps):
        for b in batches:
            model(**b).loss.backward()
        model.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    return dict(layout=layout, batches=len(batches), tokens=total, real_tokens=real, images=images,
                tokens_per_s=real * steps / seconds, peak_mb=_maxrss_mb() - base, probe_s=probe_s)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each layout; the best is kept")
    p.add_argument("--layout", choices=("packed", "padded"), help=argparse.SUPPRESS)  # one layout, in a child
    args = p.parse_args(argv)
    if args.layout:
        print(json.dumps(measure(args.layout, args.chats, args.batch, args.max_tokens, args.steps)))
        return 0
    results: dict[str, dict] = {}
    for _ in range(args.repeats):  # interleaved, the best of each kept: the machine's load moves
        for layout in ("padded", "packed"):
            cmd = [sys.executable, __file__, "--layout", layout, "--chats", str(args.chats), "--batch",
                   str(args.batch), "--max-tokens", str(args.max_tokens), "--steps", str(args.steps)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            if layout not in results or r["tokens_per_s"] > results[layout]["tokens_per_s"]:
                results[layout] = r
    for layout, r in results.items():
        print(f"{layout:7s} {r['batches']:4d} batches  {r['tokens']:7,d} tokens ({r['real_tokens']:,} real, "
              f"{r['images']} images)  {r['tokens_per_s']:8,.0f} real tokens/s  peak +{r['peak_mb']:.0f} MB")  # fmt: skip
    pad, pack = results["padded"], results["packed"]
    print(f"packed/padded: tokens run {pack['tokens'] / pad['tokens']:.2f}x, batches {pack['batches'] / pad['batches']:.2f}x, "
          f"real tokens/s {pack['tokens_per_s'] / pad['tokens_per_s']:.2f}x, "
          f"peak memory {pack['peak_mb'] / max(pad['peak_mb'], 1e-9):.2f}x; prepare's probe {pack['probe_s']:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
