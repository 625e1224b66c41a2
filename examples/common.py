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

__all__ = ["batches_over_epochs", "tiny_llama"]


def tiny_llama(directory, *, seed: int = 0):
    """train.model's tiny Llama for the build in ``directory``, attention switched to ``packer_varlen``
    (``packer.prepare`` refuses a model that would leak across examples)."""
    manifest = schema.read_manifest(directory)
    return prepare(random_llama(manifest, "tiny", seed=seed), max_tokens=manifest.stats.max_row_tokens)
