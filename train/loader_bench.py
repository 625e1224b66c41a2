"""Tokens/s of packer's loader against transformers' ``DataCollatorWithFlattening`` on the same rows.

packer's side: a full pass of ``make_dataloader`` (memory-mapped rows to the model batch, no
workers). The collator's side: ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` over the
same rows' examples, given to it as ready Python lists (its dataset fetch is not timed, which favours
it). The two passes alternate ``repeats`` times (packer, collator, packer, …) so both see the same
machine; each side reports the median pass and the spread [min–max].
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from packer.training.loader import make_dataloader
from train.report import ratio, spread


def bench_loader(shards: Path | str, repeats: int = 7) -> dict[str, Any]:
    from transformers import DataCollatorWithFlattening

    loader = make_dataloader(shards, shuffle=False)
    features = []
    for batch in loader:
        cu = batch["cu_seq_lens_q"].tolist()
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        features.append([{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(cu[:-1], cu[1:])])
    tokens = sum(len(x["input_ids"]) for f in features for x in f)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    rates: dict[str, list[float]] = {"packer": [], "collator": []}
    for _ in range(repeats):
        start = time.perf_counter()
        seen = sum(batch["input_ids"].shape[1] for batch in loader)
        rates["packer"].append(seen / (time.perf_counter() - start))
        start = time.perf_counter()
        for f in features:
            collator(f)
        rates["collator"].append(tokens / (time.perf_counter() - start))
    assert seen == tokens  # both sides handled the same tokens
    return {
        "rows": len(features),
        "tokens": tokens,
        "repeats": repeats,
        "packer": spread(rates["packer"]),
        "collator": spread(rates["collator"]),
        "ratio": ratio(rates["packer"], rates["collator"]),
    }


def loader_lines(r: dict[str, Any]) -> list[str]:
    def fig(m):
        return f"{m[0] / 1e6:,.1f}M [{m[1] / 1e6:,.1f}–{m[2] / 1e6:,.1f}M]"

    q = r["ratio"]
    return [
        f"loader: {r['rows']} rows, {r['tokens']:,} tokens, {r['repeats']} interleaved passes per side, median [min–max]",
        f"  packer loader               {fig(r['packer'])} tokens/s",
        f"  DataCollatorWithFlattening  {fig(r['collator'])} tokens/s",
        f"  packer/collator: {q[0]:.1f}x [{q[1]:.1f}–{q[2]:.1f}]",
    ]
