"""Train on packer shards with TRL's ``SFTTrainer``, on its own padding-free path.

    packer build chats.jsonl --messages-field messages -t <tokenizer> --out shards/
    python examples/trl_sft.py shards/ --steps 20 --grad-accum 2

A packer row is what TRL's packing makes: the examples' tokens concatenated, and their lengths. TRL
names that column ``seq_lengths`` where packer's format says ``seq_lens``, so the shards are opened with
``datasets.load_from_disk`` (memory-mapped, no copy) and the column renamed at load time; the on-disk
format does not change. A format-2 build stores the loss as ``loss_mask`` (a bit per token) instead of
``labels``; its labels (the ids where the mask is set, -100 elsewhere) are made as rows are read
(``with_transform``: still memory-mapped, nothing written). ``dataset_kwargs={"skip_prepare_dataset": True}`` keeps SFTTrainer from
re-tokenizing, and ``padding_free=True`` makes its collator (TRL's ``DataCollatorForLanguageModeling``)
concatenate the batch, restart ``position_ids`` at every example from ``seq_lengths``, keep packer's
``labels`` (assistant-only, -100 at each example's first token) and pass ``cu_seq_lens_*`` /
``max_length_*`` to the attention; no collation of packer's own runs. One packed row per micro-batch
(``per_device_train_batch_size=1``), as packer planned them.

The attention must honour those boundaries: ``packer_varlen`` here (``examples/common.tiny_llama``), or
``flash_attention_2`` on a GPU.
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from packer.building.pipeline import tokenizer_path
from packer.contract import schema

try:
    from common import tiny_llama
except ImportError:  # imported as examples.trl_sft
    from examples.common import tiny_llama


def load_rows(directory):
    """packer's rows as the dataset SFTTrainer takes: input_ids, labels, seq_lengths (renamed, not rewritten)."""
    import datasets

    rows = datasets.load_from_disk(str(directory))
    if schema.LOSS_MASK in rows.column_names:  # format 2: labels from the mask, as each row is read
        return rows.select_columns(["input_ids", schema.LOSS_MASK, "seq_lens"]).with_transform(_labels)
    return rows.select_columns(["input_ids", "labels", "seq_lens"]).rename_column("seq_lens", "seq_lengths")


def _labels(batch: dict) -> dict:
    """A batch of format-2 rows with their labels: the id where the loss mask is set, else -100."""
    labels = [[t if m else schema.IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
              for ids, mask in zip(batch["input_ids"], batch[schema.LOSS_MASK], strict=True)]
    return {"input_ids": batch["input_ids"], "labels": labels, "seq_lengths": batch["seq_lens"]}


def make_trainer(directory, *, steps: int = 3, grad_accum: int = 2, output_dir: str = "trl-out", lr: float = 1e-3,
                 model=None, trainer_cls=SFTTrainer, progress: bool = False) -> SFTTrainer:
    model = model if model is not None else tiny_llama(directory)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(schema.read_manifest(directory).tokenizer["name_or_path"]))
    if tokenizer.pad_token is None:  # the collator pads a batch of one row by nothing, but wants an id
        tokenizer.pad_token = tokenizer.eos_token
    args = SFTConfig(
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
        padding_free=True,
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,  # the columns are chosen in load_rows (a format-2 transform reads loss_mask)
        max_length=None,  # packer already bounded every row (--max-len, --max-tokens)
    )
    return trainer_cls(model=model, args=args, train_dataset=load_rows(directory), processing_class=tokenizer)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--output-dir", default="trl-out")
    args = p.parse_args()
    make_trainer(args.directory, steps=args.steps, grad_accum=args.grad_accum, output_dir=args.output_dir,
                 progress=True).train()
