"""The per-segment path's cost on CPU: packed rows vs padded batches vs the unpacked per-example loop.

    python benchmarks/bench_mixers.py [--model-type qwen3_5_text] [--examples 64] [--rows-of 8]

A small random hybrid (the model type's config at hidden 128, 4 layers, one of each layer type in
turn), fp32, train mode, forward + backward; the same examples three ways, interleaved, the best of
three runs each, tokens per second of real tokens (padding not counted):

- packed: rows of ``--rows-of`` examples through ``prepare`` (each mixer runs once per example);
- padded: batches of ``--rows-of`` examples right-padded to the batch's longest, eager attention;
- alone: one example per forward, no padding (what the per-segment path does inside each mixer).

Also: the time ``prepare`` (its probe) takes on the model, with ``max_tokens`` 4096. One run, figures
printed; no timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time

import torch

from benchmarks.sweep_architectures import tiny_config
from packer import prepare


def _model(model_type: str, overrides: dict):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, overrides), attn_implementation="eager")


def _lengths(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(16, 200, (n,), generator=gen)).tolist()


def _step(model, **batch) -> None:
    out = model(**batch, use_cache=False)
    out.logits.float().pow(2).mean().backward()


def _best(fns: dict, rounds: int = 3) -> dict:
    """The fastest of ``rounds`` runs of each, interleaved (on a shared machine: the least disturbed run)."""
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-type", default="qwen3_5_text")
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--rows-of", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    size = dict(hidden_size=128, intermediate_size=256, vocab_size=1024)
    if args.model_type == "granitemoehybrid":  # its Mamba heads must tile the hidden size
        size.update(mamba_d_head=32, mamba_chunk_size=64)
    base = _model(args.model_type, size)
    if getattr(base.config, "layer_types", None):
        types = list(dict.fromkeys(base.config.layer_types))
        base = _model(args.model_type, {**size, "layer_types": (types * 4)[:4], "num_hidden_layers": 4})
    base.train()
    plain = copy.deepcopy(base)
    t0 = time.perf_counter()
    packed = prepare(copy.deepcopy(base), max_tokens=4096)
    probe_s = time.perf_counter() - t0
    lens = _lengths(args.examples)
    gen = torch.Generator().manual_seed(1)
    exs = [torch.randint(3, 1024, (n,), generator=gen) for n in lens]
    groups = [exs[i : i + args.rows_of] for i in range(0, len(exs), args.rows_of)]
    tokens = sum(lens)

    def run_packed():
        for g in groups:
            cu = torch.tensor([0, *itertools.accumulate(len(e) for e in g)], dtype=torch.int32)
            _step(packed, input_ids=torch.cat(g)[None], position_ids=torch.cat([torch.arange(len(e)) for e in g])[None],
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(map(len, g)), max_length_k=max(map(len, g)))  # fmt: skip

    def run_padded():
        for g in groups:
            t = max(map(len, g))
            ids = torch.zeros(len(g), t, dtype=torch.long)
            mask = torch.zeros(len(g), t, dtype=torch.long)
            for i, e in enumerate(g):
                ids[i, : len(e)], mask[i, : len(e)] = e, 1
            _step(plain, input_ids=ids, attention_mask=mask)

    def run_alone():
        for e in exs:
            _step(plain, input_ids=e[None])

    padded_tokens = sum(len(g) * max(map(len, g)) for g in groups)
    print(f"{args.model_type}: {sum(p.numel() for p in base.parameters()):,} parameters, 4 layers "
          f"({', '.join(dict.fromkeys(getattr(base.config, 'layer_types', None) or ['?']))}); {args.examples} examples, "
          f"{tokens} tokens, rows of {args.rows_of} (padding adds {padded_tokens / tokens - 1:.0%}); CPU, 1 thread, fp32, "
          "forward + backward")  # fmt: skip
    print(f"prepare (probe, max_tokens=4096): {probe_s:.2f} s")
    fns = {"packed (per-segment path)": run_packed, "padded batches": run_padded, "alone, one per forward": run_alone}
    results = {name: tokens / t for name, t in _best(fns).items()}
    ref = results["packed (per-segment path)"]
    for name, tps in results.items():
        print(f"{name:28s} {tps:10,.0f} tokens/s  ({tps / ref:.2f}x packed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
