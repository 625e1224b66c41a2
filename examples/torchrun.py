"""Train on packer shards with torchrun and DDP, on CPU (gloo) or GPU (nccl).

    torchrun --nproc_per_node 2 examples/torchrun.py shards/ --steps 20
    python -m torch.distributed.run --nproc_per_node 2 examples/torchrun.py shards/ --steps 3 --report out/

``make_dataloader`` reads rank and world size from ``torch.distributed``: rank r takes the r-th row of
every group of ``world_size`` rows, so the ranks see disjoint rows and together every row once per
epoch (the last group is completed with filler rows that carry no loss). ``num_items_in_batch`` counts
the loss tokens of the step over all ranks; DDP averages the gradients over ranks, so each loss is
multiplied by the world size. ``--report DIR`` writes what each rank saw (for tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from packer import make_dataloader

try:
    from common import tiny_llama
except ImportError:  # imported as examples.torchrun
    from examples.common import tiny_llama


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--report", help="folder to write rank-N.json into")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    model = tiny_llama(args.directory).to(device)  # same seed on every rank; DDP broadcasts rank 0's anyway
    model = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loader = make_dataloader(args.directory, grad_accum=args.grad_accum, seed=0)  # rank, world from dist
    seen, losses, it = [], [], iter(loader)
    # rank 0 shows the steps (every rank takes the same number); the others would only repeat it
    bar = tqdm(total=args.steps, desc=f"train (rank 0 of {world})", unit="step", disable=rank != 0, dynamic_ncols=True)
    for _ in range(args.steps):
        for micro in range(args.grad_accum):
            batch = next(it)
            seen.append(hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest())
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            sync = micro == args.grad_accum - 1
            with model.no_sync() if not sync else _nullcontext():
                loss = model(**batch).loss
                (loss * world).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        Path(args.report, f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "world_size": world, "rows": seen, "losses": losses, "param_checksum": checksum}))
    print(f"rank {rank}/{world}: {len(seen)} rows, last loss {losses[-1]:.4f}")
    dist.destroy_process_group()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
