"""Padded minibatches vs packer rows on the same examples and optimizer steps, and loader vs collator.

    python -m train.bench [--shards DIR] [--steps N] [--device cuda]

1. Training. A ``batch``-mode build holds, per row, the B examples of one minibatch. The same
   randomly initialised model (seed 0), optimizer (AdamW) and rows (in order) are trained twice, each
   in a fresh process so peak memory is its own:
   - padded: the row's examples padded to the longest, attention mask, sdpa (the usual collator);
   - packed: the row as it is, ``packer_varlen`` attention (flash-attn / varlen on CUDA, per-segment
     SDPA on CPU).
   Both losses are token means over the same label tokens, so the curves should coincide. Reported:
   non-padding tokens/s, peak memory, final loss, and packed/padded ratios. Peak memory: on CUDA
   ``torch.cuda.max_memory_allocated`` above the memory held after the model is made; on CPU the rise
   of the process's max RSS (``resource.getrusage``) over the same point (allocator caching included).
2. Loader. Tokens/s of packer's loader (memory-mapped rows to the model batch, no workers) against
   transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` on the same rows' examples,
   given to it as ready Python lists (its dataset fetch is not timed, which favours it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packer import schema
from packer.loader import make_dataloader


def _ensure_build(shards: Path) -> None:
    if (shards / schema.MANIFEST_NAME).is_file():
        return
    cmd = [sys.executable, "-m", "packer.cli", "build", "flan", "--out", str(shards), "--limit", "300"]
    cmd += ["--pack", "batch", "--batch-size", "8", "--max-len", "512"]
    subprocess.run(cmd, check=True)


def _rows(shards: Path, n: int) -> list[dict[str, Any]]:
    dl = make_dataloader(shards, shuffle=False)
    return [b for _, b in zip(range(n), dl, strict=False)]


def _padded(batch: dict[str, Any], pad_id: int) -> dict[str, torch.Tensor]:
    cu = batch["cu_seq_lens_q"].tolist()
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
    n = len(cu) - 1
    out_ids = torch.full((n, longest), pad_id, dtype=torch.int64)
    out_lab = torch.full((n, longest), schema.IGNORE_INDEX, dtype=torch.int64)
    mask = torch.zeros((n, longest), dtype=torch.int64)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        out_ids[i, : b - a], out_lab[i, : b - a], mask[i, : b - a] = ids[a:b], labels[a:b], 1
    return {"input_ids": out_ids, "labels": out_lab, "attention_mask": mask}


def run_training(shards: Path, mode: str, steps: int, device: str, lr: float) -> dict[str, Any]:
    """One mode in this process: returns tokens/s, peak memory and losses."""
    from packer.attention import prepare
    from train.train import load_model

    dev = torch.device(device)
    manifest = schema.read_manifest(shards).to_json()  # train/ reads the manifest as its JSON
    pad_id = int(manifest["tokenizer"].get("pad_token_id") or 0)
    model = load_model(manifest, None, dev, seed=0)
    if mode == "packed":
        prepare(model)
    else:
        model.set_attn_implementation("sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rows = _rows(shards, steps)
    inputs = []
    for row in rows:
        if mode == "packed":
            inputs.append(row)
        else:
            inputs.append(_padded(row, pad_id))
    tokens = sum(int(r["cu_seq_lens_q"][-1]) for r in rows)
    padded_tokens = sum(int(p["input_ids"].numel()) for p in inputs) if mode == "padded" else tokens
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    losses = []
    start = time.perf_counter()
    for batch in inputs:
        batch = {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if dev.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        how = "cuda max_memory_allocated"
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
        how = "max RSS rise"
    return {
        "mode": mode,
        "steps": len(inputs),
        "tokens": tokens,
        "computed_tokens": padded_tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "peak_mib": peak,
        "memory": how,
        "losses": [float(x) for x in losses],
    }


def bench_loader(shards: Path, repeats: int = 3) -> dict[str, float]:
    from transformers import DataCollatorWithFlattening

    dl = make_dataloader(shards, shuffle=False)
    tokens = 0
    best_packer = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = 0
        for batch in dl:
            tokens += batch["input_ids"].shape[1]
        best_packer = min(best_packer, time.perf_counter() - start)
    features = []
    for batch in dl:
        cu = batch["cu_seq_lens_q"].tolist()
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        features.append(
            [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(cu[:-1], cu[1:], strict=True)]
        )
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    best_collator = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for f in features:
            collator(f)
        best_collator = min(best_collator, time.perf_counter() - start)
    return {
        "rows": len(features),
        "tokens": tokens,
        "packer_tokens_per_s": tokens / best_packer,
        "collator_tokens_per_s": tokens / best_collator,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__.split("\n")[0])
    p.add_argument("--shards", default="shards/bench", help="a batch-mode build (made here if absent)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (rows) per mode")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mode", choices=["padded", "packed"], help=argparse.SUPPRESS)  # child process
    args = p.parse_args(argv)
    shards = Path(args.shards)
    if args.mode:
        print(json.dumps(run_training(shards, args.mode, args.steps, args.device, args.lr)))
        return {}
    _ensure_build(shards)
    manifest = schema.read_manifest(shards).to_json()  # train/ reads the manifest as its JSON
    if manifest["config"].get("pack") != "batch":
        raise SystemExit(
            f"{shards}: built with --pack {manifest['config'].get('pack')}; the comparison needs batch"
        )
    results = {}
    for mode in ("padded", "packed"):
        cmd = [sys.executable, "-m", "train.bench", "--shards", str(shards), "--steps", str(args.steps)]
        cmd += ["--device", args.device, "--lr", str(args.lr), "--mode", mode]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    pad, pack = results["padded"], results["packed"]
    print(
        f"training: {pack['steps']} optimizer steps, {pack['tokens']:,} non-padding tokens, device {args.device}"
    )
    print(f"  {'':8} {'tokens/s':>10} {'peak MiB':>9} {'final loss':>10} {'computed tokens':>16}")
    for r in (pad, pack):
        print(
            f"  {r['mode']:8} {r['tokens_per_s']:>10,.0f} {r['peak_mib']:>9.1f} "
            f"{r['losses'][-1]:>10.4f} {r['computed_tokens']:>16,}"
        )
    diff = float(np.max(np.abs(np.array(pad["losses"]) - np.array(pack["losses"]))))
    print(
        f"  packed/padded: {pack['tokens_per_s'] / pad['tokens_per_s']:.2f}x tokens/s, "
        f"{pack['peak_mib'] / max(pad['peak_mib'], 1e-9):.2f}x peak memory ({pack['memory']}); "
        f"max |loss diff| over the steps {diff:.2e}"
    )
    loader = bench_loader(shards)
    results["loader"] = loader
    print(f"loader: {loader['rows']} rows, {loader['tokens']:,} tokens")
    print(f"  packer loader            {loader['packer_tokens_per_s']:>14,.0f} tokens/s")
    print(f"  DataCollatorWithFlattening {loader['collator_tokens_per_s']:>12,.0f} tokens/s")
    print(f"  packer/collator: {loader['packer_tokens_per_s'] / loader['collator_tokens_per_s']:.1f}x")
    return results


if __name__ == "__main__":
    main()
