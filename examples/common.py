"""Shared by the examples: a tiny random Llama sized for a shard folder's tokenizer (CPU, seconds), and
the endless stream of batches over epochs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from packer import schema
from packer.attention import prepare


def tiny_llama(directory, *, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A randomly initialised Llama whose vocabulary fits the build's tokenizer, attention switched to
    ``packer_varlen`` (``packer.attention.prepare`` refuses a model that would leak across examples)."""
    vocab = schema.read_manifest(directory).tokenizer["vocab_size"]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return prepare(model)


def batches_over_epochs(loader) -> Iterator[dict]:
    """Batch after batch, epoch after epoch, with ``set_epoch`` so each epoch has its own order."""
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader
