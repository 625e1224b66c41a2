"""Train a causal LM on packer shards: the loader's rows straight into the model, no collation.

    python -m packer.cli build flan --out shards --pack batch --batch-size 4 --tokenizer packer/data/tokenizer
    python -m train.train --shards shards --steps 20 [--grad-accum 2] [--model PATH] [--save DIR]

By default a tiny randomly initialised Llama sized to the build's tokenizer (the manifest's vocab size
and special ids; ``--size`` picks another shape from train/model.py); ``--model`` takes any local
Hugging Face causal LM directory. The model is switched to ``packer_varlen`` attention by ``packer.prepare`` (flash-attn / torch varlen on CUDA,
per-segment SDPA on CPU), which refuses a model that would let examples see each other.

One optimizer step is ``--grad-accum`` micro-batches (rows) per rank. Every micro-batch carries
``num_items_in_batch``, the loss tokens of the whole step, so each micro loss is a sum over tokens
divided by the step's total and the accumulated gradient is the big batch's. Under ``torchrun`` the
loss is multiplied by the world size, because DDP averages gradients over ranks. The logged loss is
the step's token-mean loss; tokens/s counts the rows' tokens, all of them real (no padding).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from packer import prepare
from packer.contract import schema
from packer.training.loader import make_dataloader
from train.model import SIZES, random_llama


def batches_over_epochs(loader) -> Iterator[dict[str, Any]]:
    """Batch after batch, epoch after epoch, with ``set_epoch`` so each epoch has its own order."""
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader


def load_model(
    manifest: schema.Manifest, model_path: str | None, device: torch.device, seed: int, size: str = "tiny"
):
    """``model_path`` (a local Hugging Face causal LM), else a random Llama of ``size`` (train.model)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if model_path is None:
        return random_llama(manifest, size, seed=seed, device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if model.config.vocab_size < int(manifest.tokenizer["vocab_size"]):
        raise SystemExit(
            f"{model_path}: vocab size {model.config.vocab_size} < the build tokenizer's "
            f"{manifest.tokenizer['vocab_size']}; build the shards with this model's tokenizer"
        )
    model.config.use_cache = False  # training: no KV cache
    return model.to(device)


def _setup_distributed(device_arg: str | None) -> tuple[torch.device, int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device_arg:
        device = torch.device(device_arg)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    rank = torch.distributed.get_rank() if world > 1 else 0
    return device, rank, world


def train(
    shards: str,
    *,
    steps: int,
    grad_accum: int = 1,
    lr: float | None = None,
    model_path: str | None = None,
    size: str = "tiny",
    save: str | None = None,
    seed: int = 0,
    device: str | None = None,
    num_workers: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps; returns {"losses": [...], "tokens_per_s": ..., "tokens": ...}."""
    dev, rank, world = _setup_distributed(device)
    manifest = schema.read_manifest(shards)
    # the build's longest row bounds what the probe must reach (a real Llama 3's 8K threshold otherwise)
    model = prepare(load_model(manifest, model_path, dev, seed, size), max_tokens=manifest.stats.max_row_tokens)
    if lr is None:
        lr = 3e-3 if model_path is None else 2e-5
    loader = make_dataloader(
        shards, seed=seed, grad_accum=grad_accum, num_workers=num_workers, pin_memory=dev.type == "cuda"
    )
    ddp_model = model
    if world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()

    stream = batches_over_epochs(loader)
    losses: list[float] = []
    tokens = 0
    bar = tqdm(total=steps, desc="train", unit="step", disable=not progress or rank != 0)
    start = time.perf_counter()
    for _ in range(steps):
        step_loss = torch.zeros((), device=dev)
        for _ in range(grad_accum):
            batch = next(stream)
            tokens += batch["input_ids"].numel()
            batch = {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            loss = ddp_model(**batch).loss
            (loss * world).backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss.item())
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens * world / elapsed:,.0f}")
        bar.update()
    bar.close()
    elapsed = time.perf_counter() - start
    result = {"losses": losses, "tokens": tokens * world, "tokens_per_s": tokens * world / elapsed}
    if save and rank == 0:
        out = Path(save)
        model.save_pretrained(out)
        (out / "loader_state.json").write_text(json.dumps(loader.state_dict(), indent=2))
        torch.save({"optimizer": optimizer.state_dict(), "steps": steps}, out / "optimizer.pt")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m train.train", description=__doc__.split("\n")[0])
    p.add_argument("--shards", default="shards", help="a packer build directory (default: shards)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches (rows) per optimizer step")
    p.add_argument(
        "--lr", type=float, default=None, help="AdamW learning rate (3e-3 tiny model, 2e-5 --model)"
    )
    p.add_argument("--model", default=None, help="local Hugging Face causal LM (default: tiny random Llama)")
    p.add_argument("--size", choices=list(SIZES), default="tiny", help="random Llama size (train/model.py)")
    p.add_argument("--save", default=None, help="save the model, loader and optimizer state here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    args = p.parse_args(argv)
    result = train(
        args.shards,
        steps=args.steps,
        grad_accum=args.grad_accum,
        lr=args.lr,
        model_path=args.model,
        size=args.size,
        save=args.save,
        seed=args.seed,
        device=args.device,
        num_workers=args.workers,
    )
    losses = result["losses"]
    print(
        f"steps {len(losses)} · loss first {losses[0]:.4f} last {losses[-1]:.4f} · "
        f"{result['tokens']:,} tokens · {result['tokens_per_s']:,.0f} non-padding tokens/s"
    )
    return result


if __name__ == "__main__":
    main()
