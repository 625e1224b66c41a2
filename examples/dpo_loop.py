"""DPO on packer's preference shards with a plain PyTorch loop: pairs packed, no padding, TRL's loss.

    packer build prefs.jsonl --pack bfd --max-len 1024 --max-tokens 4096 --out dpo/   # README's pair build
    python examples/dpo_loop.py dpo/ --steps 3 --grad-accum 2
    python examples/dpo_loop.py dpo/ --steps 3 --reference-logps ref.arrow   # the reference run once, stored

Time: a micro-batch of a full 4,096-token row costs the tiny model ~8 CPU-seconds (the policy's forward and
backward, the reference's forward), so the second line takes ~50 CPU-seconds (400 GSM8K pairs in 44
rows); 20 steps of 4 take ~11 CPU-minutes. A build of fewer rows than a step's micro-batches completes
its steps with filler rows, which train nothing: the loop says how many and skips them.

Every batch is one packed row of whole pairs (chosen, then rejected: ``pair_roles``); one forward of the
policy and one of the reference (no grad) on the same row give every segment's summed completion log-prob
(``packer.training.preference``), and ``num_items_in_batch`` counts the pairs of the whole optimizer step,
so the accumulated gradient is that of the mean DPO loss over the step's pairs. With ``--reference-logps
PATH`` the reference runs once over the build first (``precompute_reference``; PATH is reused when it
holds this build's values, a file of another build is refused) and each step reads its values by the
row's ``pair_ids`` instead of a second forward.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from tqdm import tqdm

from packer import make_dataloader
from packer.training.preference import StoredReference, dpo_step, precompute_reference

try:
    from common import batches_over_epochs, filler_note, is_filler, tiny_llama
except ImportError:  # imported as examples.dpo_loop
    from examples.common import batches_over_epochs, filler_note, is_filler, tiny_llama


def stored_reference(reference, directory, path, *, progress: bool = False) -> StoredReference:
    """The reference's log-probs at ``path``: read when the file is there (refused if another build's), else
    computed once over the build and written."""
    if Path(path).is_file():
        return StoredReference(path, directory)
    bar = None if not progress else (lambda rows, total: tqdm(rows, total=total, desc="reference", unit="row"))
    return precompute_reference(reference, directory, path, progress=bar)


def train(directory, *, steps: int = 3, grad_accum: int = 2, lr: float = 1e-3, beta: float = 0.1,
          model=None, reference_logps=None, progress: bool = False) -> list[dict[str, float]]:
    """``steps`` optimizer steps; each step's loss and mean rewards. ``reference_logps``: a path where the
    reference's log-probs are stored (computed first if absent) instead of a reference forward a step."""
    model = model if model is not None else tiny_llama(directory)
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # prepare()'s guard travels with the copy
    if reference_logps is not None:
        reference = stored_reference(reference, directory, reference_logps, progress=progress)
    model.train()
    loader = make_dataloader(directory, grad_accum=grad_accum, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batches = batches_over_epochs(loader)
    if progress and filler_note(loader):
        print(filler_note(loader))
    log = []
    bar = tqdm(total=steps, desc="dpo", unit="step", disable=not progress, dynamic_ncols=True)
    for _ in range(steps):
        loss = chosen = rejected = 0.0
        for _ in range(grad_accum):
            batch = next(batches)
            if is_filler(batch):  # no loss, no rewards, zero gradient: not computed
                continue
            out = dpo_step(model, reference, batch, beta=beta)  # loss already / the step's pairs
            out.loss.backward()
            loss += out.loss.item()
            chosen += out.chosen_rewards.sum().item()
            rejected += out.rejected_rewards.sum().item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append({"loss": loss, "rewards/chosen_sum": chosen, "rewards/rejected_sum": rejected})
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update(1)
    bar.close()
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--reference-logps", metavar="PATH",
                        help="store the reference's log-probs here once (or read them) instead of a forward a step")
    args = parser.parse_args()
    log = train(args.directory, steps=args.steps, grad_accum=args.grad_accum, beta=args.beta,
                reference_logps=args.reference_logps, progress=True)
    for step, entry in enumerate(log):
        print(f"step {step}: loss {entry['loss']:.4f}  rewards chosen {entry['rewards/chosen_sum']:+.4f} "
              f"rejected {entry['rewards/rejected_sum']:+.4f}")


if __name__ == "__main__":
    main()
