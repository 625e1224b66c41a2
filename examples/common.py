"""Shared by the examples: the random Llama and the epoch stream come from train/ (one copy of each);
this module makes ``train`` importable when an example runs as a script from anywhere."""

from __future__ import annotations

import sys
from pathlib import Path

from packer import prepare
from packer.contract import schema

try:
    from train.model import random_llama
    from train.train import batches_over_epochs
except ModuleNotFoundError:  # `python examples/x.py`: sys.path holds examples/, not the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from train.model import random_llama
    from train.train import batches_over_epochs

__all__ = ["batches_over_epochs", "filler_note", "is_filler", "tiny_llama"]


def tiny_llama(directory, *, seed: int = 0):
    """train.model's tiny Llama for the build in ``directory``, attention switched to ``packer_varlen``
    (``packer.prepare`` refuses a model that would leak across examples)."""
    manifest = schema.read_manifest(directory)
    return prepare(random_llama(manifest, "tiny", seed=seed), max_tokens=manifest.stats.max_row_tokens)


def is_filler(batch) -> bool:
    """Whether ``batch`` trains nothing: a filler row (the loader's copy of a row with every label -100, which
    completes an epoch's last optimizer step) or a row whose segments hold no trained token. Its loss and
    gradient are zero (packer.training.preference gives a DPO filler no loss either), so a single-process
    loop skips its forward and backward; under DDP every rank runs every micro-batch, to stay in step."""
    return not bool((batch["labels"] != -100).any())


def filler_note(loader) -> str | None:
    """What the epoch's filler rows are, said once before training (None when there are none)."""
    data = loader.dataset
    fillers = len(data) - data.epoch_rows  # one process: the epoch's micro-batches beyond its rows
    if not fillers:
        return None
    rows = f"{data.epoch_rows:,} row{'s' * (data.epoch_rows != 1)}"
    return (f"note: {rows} an epoch, in optimizer steps of {data.grad_accum} micro-batches: each epoch's "
            f"last step is completed by {fillers} filler row{'s' * (fillers != 1)} (no loss), skipped here "
            "(build more rows, or lower --grad-accum, to train on whole steps)")
