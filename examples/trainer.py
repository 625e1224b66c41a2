"""Train on packer shards with Hugging Face ``Trainer``: packer's loader, no data collator.

    python examples/trainer.py shards/ --steps 20 --grad-accum 4

``PackedTrainer`` hands Trainer packer's ``DataLoader`` (one packed row per batch, already split by
rank, resumable) instead of letting it batch and collate; nothing is padded and no collator runs. The
attention is ``packer_varlen`` (``packer.prepare``), which keeps the examples of a row apart
using the loader's ``cu_seq_lens_*`` / ``max_length_*`` kwargs.

Loss normalisation: Trainer counts the loss tokens of each optimizer step itself (``labels != -100``
over its ``gradient_accumulation_steps`` micro-batches, summed across ranks when
``average_tokens_across_devices``) and passes that as ``num_items_in_batch`` to the model, replacing the
loader's value, which is the same number (packer rows are labelled -100 at every example's first
token, so Trainer's shifted count equals ``num_loss_tokens``). The loss is then ``sum of token losses /
tokens of the step``: every token weighs the same, however the examples are packed or accumulated.

MoE models with ``output_router_logits=True`` add ``router_aux_loss_coef * aux_loss`` to each
micro-batch's loss; that term is a per-micro-batch mean that ``num_items_in_batch`` does not normalise,
so a step sums it over its ``gradient_accumulation_steps`` micro-batches (and Trainer scales the loss by
the world size when ``average_tokens_across_devices``). To keep one big batch's weight, set
``model.config.router_aux_loss_coef = coef / (gradient_accumulation_steps * world_size)`` before training.
"""

from __future__ import annotations

import argparse

from transformers import Trainer, TrainingArguments

from packer import PackedDataLoader, PackedDataset

try:
    from common import tiny_llama
except ImportError:  # imported as examples.trainer
    from examples.common import tiny_llama


class PackedTrainer(Trainer):
    """A Trainer whose training data is a packer shard folder, read by ``packer.training.loader``."""

    def __init__(self, *args, shards: str, seed: int = 0, **kwargs):
        self.shards = shards
        self.shards_seed = seed
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self) -> PackedDataLoader:
        args = self.args
        dataset = PackedDataset(self.shards, seed=self.shards_seed, rank=args.process_index,
                                world_size=args.world_size, grad_accum=args.gradient_accumulation_steps)
        # Not passed through accelerator.prepare: the rows are already split by rank, and a row is a batch.
        return PackedDataLoader(dataset, num_workers=args.dataloader_num_workers,
                                pin_memory=args.dataloader_pin_memory and args.device.type == "cuda")


def make_trainer(directory, *, steps: int = 3, grad_accum: int = 2, output_dir: str = "trainer-out",
                 lr: float = 1e-3, model=None, trainer_cls=PackedTrainer, progress: bool = False) -> PackedTrainer:
    model = model if model is not None else tiny_llama(directory)
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=1,  # one packed row per micro-batch
        gradient_accumulation_steps=grad_accum,
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping, so a step equals the plain loop's (examples/train_loop.py)
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=not progress,  # its bar of the steps, with the total (max_steps)
    )
    # train_dataset is only for Trainer's bookkeeping; get_train_dataloader reads the shards.
    return trainer_cls(model=model, args=args, shards=str(directory),
                       train_dataset=PackedDataset(directory, grad_accum=grad_accum))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--output-dir", default="trainer-out")
    args = p.parse_args()
    trainer = make_trainer(args.directory, steps=args.steps, grad_accum=args.grad_accum, output_dir=args.output_dir,
                           progress=True)
    trainer.train()
    for entry in trainer.state.log_history:
        print(entry)
