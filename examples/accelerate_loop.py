"""Train on packer shards with Hugging Face accelerate (single process or ``accelerate launch``).

    accelerate launch --num_processes 2 examples/accelerate_loop.py shards/ --steps 20

The model and optimizer go through ``accelerator.prepare``; the loader does *not*: packer's loader
already gives each rank its own rows (rank and world size from ``torch.distributed``, which accelerate
initialises), and a row is a batch, so there is nothing to shard or collate. Batches are moved with
``.to(accelerator.device)`` tensor by tensor (the Python ints stay ints). ``num_items_in_batch`` is the
loss tokens of the whole optimizer step over all ranks; DDP averages gradients over ranks, so the loss
is multiplied by ``num_processes``.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from tqdm import tqdm

from packer import make_dataloader

try:
    from common import batches_over_epochs, tiny_llama
except ImportError:  # imported as examples.accelerate_loop
    from examples.common import batches_over_epochs, tiny_llama


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def train(directory, *, steps: int = 3, grad_accum: int = 2, lr: float = 1e-3, cpu: bool = True,
          progress: bool = False) -> list[float]:
    """``steps`` optimizer steps; each step's loss. With ``progress``, the main process shows a bar of the
    steps and each step's loss as it ends (as examples/train_loop.py)."""
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=grad_accum)
    model = tiny_llama(directory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    loader = make_dataloader(directory, grad_accum=grad_accum, seed=0,
                             rank=accelerator.process_index, world_size=accelerator.num_processes)
    batches = batches_over_epochs(loader)
    losses = []
    bar = tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True,
               disable=not (progress and accelerator.is_local_main_process))
    for i in range(steps):
        step_loss = 0.0
        for _ in range(grad_accum):
            with accelerator.accumulate(model):
                loss = model(**to_device(next(batches), accelerator.device)).loss
                # accelerate divides by gradient_accumulation_steps; num_items_in_batch already did
                accelerator.backward(loss * grad_accum * accelerator.num_processes)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.item()
        losses.append(step_loss)
        bar.update()
        if progress and accelerator.is_local_main_process:
            bar.write(f"step {i}: loss {step_loss:.4f}")
    bar.close()
    return losses


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=2)
    args = p.parse_args()
    train(args.directory, steps=args.steps, grad_accum=args.grad_accum, progress=True)
