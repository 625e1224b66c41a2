"""One side of the padded-vs-packed comparison, trained in this process: tokens/s, peak memory, losses.

Both sides take the rows of a ``batch``-mode build in order, one row (B examples) per optimizer step,
from the same random model (seed 0) and AdamW:

- ``padded``: the row's B examples padded to the longest, with an attention mask (what a padding
  collator hands the model); sdpa on CPU, ``flash_attention_2`` on CUDA (transformers unpads around
  the attention kernel, the linear layers still compute every pad token: HF's published baseline);
- ``packed``: the row as packer stores it, ``packer_varlen`` attention (flash-attn varlen on CUDA,
  one SDPA call per segment on CPU).

Both losses are token means over the same label tokens, so the two loss curves should coincide. The
first ``warmup`` steps are trained but not timed (lazy initialisation, kernel selection, the
optimizer's state). Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the whole run
(weights, gradients and optimizer state included); on CPU the rise of the process's max RSS over the
RSS once the model is made (allocator caching included).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any

import torch

from packer.contract import schema
from packer.training.loader import make_dataloader
from train.model import random_llama

MODES = ("padded", "packed")


def rows(shards: Path | str, n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of the build, in order (no shuffle), as the loader yields them."""
    loader = make_dataloader(shards, shuffle=False)
    return [b for _, b in zip(range(n), loader)]


def padded(batch: dict[str, Any], pad_id: int) -> dict[str, torch.Tensor]:
    """A packed row's examples as a padded ``[B, longest]`` minibatch with its attention mask."""
    cu = batch["cu_seq_lens_q"].tolist()
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    spans = list(zip(cu[:-1], cu[1:]))
    longest = max(b - a for a, b in spans)
    out_ids = torch.full((len(spans), longest), pad_id, dtype=torch.int64)
    out_lab = torch.full((len(spans), longest), schema.IGNORE_INDEX, dtype=torch.int64)
    mask = torch.zeros((len(spans), longest), dtype=torch.int64)
    for i, (a, b) in enumerate(spans):
        out_ids[i, : b - a], out_lab[i, : b - a], mask[i, : b - a] = ids[a:b], labels[a:b], 1
    return {"input_ids": out_ids, "labels": out_lab, "attention_mask": mask}


def run(
    shards: Path | str,
    mode: str,
    *,
    steps: int,
    warmup: int = 1,
    size: str = "tiny",
    device: str = "cpu",
    lr: float = 1e-3,
) -> dict[str, Any]:
    """Train ``warmup + steps`` optimizer steps on one side; figures cover the last ``steps``."""
    from packer import prepare

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    manifest = schema.read_manifest(shards)
    pad_id = int(manifest.tokenizer.get("pad_token_id") or 0)
    model = random_llama(manifest, size, seed=0, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
    if mode == "packed":
        prepare(model, max_tokens=manifest.stats.max_row_tokens)  # probe only what a row can reach
    else:
        model.set_attn_implementation("flash_attention_2" if cuda else "sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    chosen = rows(shards, warmup + steps)
    if len(chosen) < warmup + steps:
        raise ValueError(f"{shards}: {len(chosen)} rows, the run needs warmup {warmup} + steps {steps}")
    inputs = chosen if mode == "packed" else [padded(r, pad_id) for r in chosen]
    timed = slice(warmup, None)
    tokens = sum(int(r["cu_seq_lens_q"][-1]) for r in chosen[timed])
    computed = sum(int(b["input_ids"].numel()) for b in inputs[timed])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    losses = []
    start = 0.0
    for i, batch in enumerate(inputs):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        batch = {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # no .item() here: a host sync per step would slow CUDA
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    return {
        "mode": mode,
        "steps": steps,
        "tokens": tokens,
        "computed_tokens": computed,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_mib": peak,
        "params": sum(p.numel() for p in model.parameters()),
        "losses": [float(x) for x in losses],
    }
