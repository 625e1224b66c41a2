"""DPO on packer's preference shards with a plain PyTorch loop: pairs packed, no padding, TRL's loss.

    packer build prefs.jsonl --out pairs/ --pack bfd --max-len 1024 --max-tokens 4096
    python examples/dpo_loop.py pairs/ --steps 20 --grad-accum 4

Every batch is one packed row of whole pairs (chosen, then rejected: ``pair_roles``); one forward of the
policy and one of the reference (no grad) on the same row give every segment's summed completion log-prob
(``packer.training.preference``), and ``num_items_in_batch`` counts the pairs of the whole optimizer step,
so the accumulated gradient is that of the mean DPO loss over the step's pairs.
"""

from __future__ import annotations

import argparse
import copy

import torch

from packer import make_dataloader
from packer.training.preference import dpo_step

try:
    from common import batches_over_epochs, tiny_llama
except ImportError:  # imported as examples.dpo_loop
    from examples.common import batches_over_epochs, tiny_llama


def train(directory, *, steps: int = 3, grad_accum: int = 2, lr: float = 1e-3, beta: float = 0.1,
          model=None) -> list[dict[str, float]]:
    """``steps`` optimizer steps; each step's loss and mean rewards."""
    model = model if model is not None else tiny_llama(directory)
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # prepare()'s guard travels with the copy
    model.train()
    loader = make_dataloader(directory, grad_accum=grad_accum, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batches = batches_over_epochs(loader)
    log = []
    for _ in range(steps):
        loss = chosen = rejected = 0.0
        for _ in range(grad_accum):
            out = dpo_step(model, reference, next(batches), beta=beta)  # loss already / the step's pairs
            out.loss.backward()
            loss += out.loss.item()
            chosen += out.chosen_rewards.sum().item()
            rejected += out.rejected_rewards.sum().item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append({"loss": loss, "rewards/chosen_sum": chosen, "rewards/rejected_sum": rejected})
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()
    for step, entry in enumerate(train(args.directory, steps=args.steps, grad_accum=args.grad_accum, beta=args.beta)):
        print(f"step {step}: loss {entry['loss']:.4f}  rewards chosen {entry['rewards/chosen_sum']:+.4f} "
              f"rejected {entry['rewards/rejected_sum']:+.4f}")


if __name__ == "__main__":
    main()
