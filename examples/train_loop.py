"""Train on packer shards with a plain PyTorch loop: no collator, no padding, exact loss normalisation.

    python examples/train_loop.py shards/ --steps 5 --grad-accum 4     # the tour's shards: 80 CPU-seconds

Every batch is one packed row (``packer.training.loader``); ``model(**batch)`` gets ``num_items_in_batch``, the
loss tokens of the whole optimizer step, so each micro-batch's loss is ``sum of its token losses /
tokens of the step`` and the accumulated gradient is that of the one big batch: no ``/ grad_accum``.
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from packer import make_dataloader

try:
    from common import batches_over_epochs, filler_note, is_filler, tiny_llama
except ImportError:  # imported as examples.train_loop
    from examples.common import batches_over_epochs, filler_note, is_filler, tiny_llama


def train(directory, *, steps: int = 3, grad_accum: int = 2, lr: float = 1e-3, model=None,
          progress: bool = False) -> list[float]:
    """``steps`` optimizer steps; returns each step's loss (the step's mean token loss). With ``progress``,
    a bar of the steps (a CPU step over full rows takes seconds) and each step's loss as it ends."""
    model = model if model is not None else tiny_llama(directory)
    model.train()
    loader = make_dataloader(directory, grad_accum=grad_accum, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batches = batches_over_epochs(loader)
    if progress and filler_note(loader):
        print(filler_note(loader))
    losses = []
    bar = tqdm(total=steps, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    for i in range(steps):
        step_loss = 0.0
        for _ in range(grad_accum):
            batch = next(batches)
            if is_filler(batch):  # zero loss, zero gradient: not computed
                continue
            loss = model(**batch).loss  # already divided by the step's loss tokens
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        bar.update()
        if progress:
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
