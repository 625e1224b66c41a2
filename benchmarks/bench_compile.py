"""torch.compile recompiles over an epoch, with and without the loader's static shapes (a script, not a
test): python benchmarks/bench_compile.py [--limit 100] [--max-tokens 512]

Builds the bundled sample (bfd rows of ``--max-tokens``, in a temporary folder), then runs one epoch of
a tiny random Llama (2 layers, fp32, CPU) compiled with ``torch.compile``, its rows from
``PackedDataset(static_shapes=False)`` and then ``static_shapes=True``, and prints how many graphs
torch compiled in the epoch (a counting backend: every compile, first or re-, is one call; dynamo's
cache limit is raised so that none is skipped for falling back to eager), for

- ``dynamic=False``: one shape per graph, what CUDA graphs and ``mode="reduce-overhead"`` need;
- the default (``dynamic=None``): dynamo marks a changed size dynamic after its first recompile.

Attention is a boundary mask built in the graph from ``cu_seq_lens_q`` (and bounded by
``max_length_q``, a Python int, as the varlen kernels take it), a stand-in for a compiled varlen
kernel that keeps the graph whole on CPU.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

from packer.contract import schema
from packer.training.loader import PackedDataset


def masked_varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                  max_length_q=None, **kwargs):
    """[1, H, T, D] → [1, T, H, D]: each token sees the earlier tokens of its own segment."""
    t = query.shape[2]
    at = torch.arange(t)
    segment = torch.searchsorted(cu_seq_lens_q[1:].long(), at, right=True)
    mask = (segment[:, None] == segment[None, :]) & (at[None, :] <= at[:, None])
    mask &= at[:, None] - at[None, :] < max_length_q  # as a varlen kernel bounds its work by max_length
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def epoch_compiles(directory: Path, static: bool, dynamic: bool | None, vocab: int) -> tuple[int, int, int]:
    """(graphs compiled, distinct input shapes, rows) over one epoch."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="bench_masked", dtype=torch.float32).eval()
    compiled = 0

    def counting(gm, example_inputs):
        nonlocal compiled
        compiled += 1
        return gm.forward

    torch._dynamo.reset()
    run = torch.compile(model, backend=counting, dynamic=dynamic)
    shapes, rows = set(), 0
    with torch.no_grad():
        for batch in PackedDataset(directory, shuffle=False, static_shapes=static):
            keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
            run(**{k: batch[k] for k in keys})
            shapes.add((tuple(batch["input_ids"].shape), tuple(batch["cu_seq_lens_q"].shape), batch["max_length_q"]))
            rows += 1
    return compiled, len(shapes), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=100, help="records of the bundled sample (default 100)")
    parser.add_argument("--max-tokens", type=int, default=512, help="row budget (default 512)")
    args = parser.parse_args()
    AttentionInterface.register("bench_masked", masked_varlen)
    torch._dynamo.config.cache_size_limit = 10**6  # count every recompile; none falls back to eager
    torch._dynamo.config.accumulated_cache_size_limit = 10**6
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bfd"
        subprocess.run([sys.executable, "-m", "packer.cli", "build", "flan", "--out", str(out), "--limit",
                        str(args.limit), "--pack", "bfd", "--max-len", str(args.max_tokens), "--max-tokens",
                        str(args.max_tokens), "-q"], check=True, capture_output=True)
        vocab = schema.read_manifest(out).tokenizer["vocab_size"]
        print(f"bundled sample, {args.limit} records, bfd rows of <= {args.max_tokens} tokens; tiny Llama, CPU, "
              f"torch {torch.__version__}")
        print(f"{'dynamic':<10}{'static_shapes':<15}{'rows':>6}{'shapes':>8}{'graphs compiled':>17}")
        for dynamic in (False, None):
            for static in (False, True):
                graphs, shapes, rows = epoch_compiles(out, static, dynamic, vocab)
                print(f"{dynamic!s:<10}{static!s:<15}{rows:>6}{shapes:>8}{graphs:>17}")


if __name__ == "__main__":
    main()
