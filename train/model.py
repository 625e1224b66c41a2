"""Randomly initialised Llama-shaped models sized to a build's tokenizer, the one place they are made.

Sizes (the vocabulary always comes from the manifest, so the model fits the build):

- ``tiny``: hidden 64, 2 layers. Seconds on a CPU; tests and examples. Per-call overhead (Python,
  kernel launches) dominates its step time, so a padded-vs-packed ratio measured with it says what
  Python costs, not what padding costs.
- ``cpu``: hidden 512, 4 layers, MLP 1,408. Big enough that the matmuls, which scale with the tokens
  computed, dominate a CPU step (see ``python -m train.bench``), small enough for minutes on 2 cores.
- ``1b``: Llama 3.2 1B's shape (hidden 2,048, 16 layers, 32 heads, 8 KV heads, MLP 8,192): about
  1.0B parameters with a 32K vocabulary, 1.2B with 128K. For one GPU, bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packer.contract import schema


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SIZES = {
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256),
    "cpu": Shape(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408),
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
}


def llama_config(manifest: schema.Manifest, size: str = "tiny"):
    """The ``LlamaConfig`` of ``size`` for the build's tokenizer (vocab size and special ids)."""
    from transformers import LlamaConfig

    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    shape = SIZES[size]
    tok = manifest.tokenizer
    return LlamaConfig(
        vocab_size=int(tok["vocab_size"]),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(4096, manifest.stats.max_row_tokens),
        bos_token_id=tok.get("bos_token_id"),
        eos_token_id=tok.get("eos_token_id"),
        pad_token_id=tok.get("pad_token_id"),
        tie_word_embeddings=True,
        use_cache=False,  # training: no KV cache (and packer.prepare refuses one)
    )


def random_llama(
    manifest: schema.Manifest,
    size: str = "tiny",
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """A ``LlamaForCausalLM`` of ``size``, initialised from ``seed`` directly on ``device`` (a 1B model
    made on the CPU first takes longer to initialise than to benchmark). The same seed, device and
    dtype give the same weights, so two processes can train the same model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(manifest, size), dtype=dtype)
    return model
