"""The padded-vs-packed table and figure, from the runs of ``train.measure`` (pure: runs in, lines out).

A figure is the median of a side's runs with its spread [min–max]. A ratio is of medians; its spread
is the worst case of the runs, [min packed / max padded – max packed / min padded], so a rerun on the
same machine should land inside it (the runs of one side differ only by the machine's noise).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Ratio of medians, and the smallest and largest ratio any two runs give (nan where a figure is 0:
    a max RSS that did not rise, e.g. in a process that peaked before the run)."""
    if min(den) <= 0:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(num) / statistics.median(den), min(num) / max(den), max(num) / min(den)


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians, spreads and ratios of one dataset's runs (``runs["padded"]``, ``runs["packed"]``)."""
    pad, pack = runs["padded"], runs["packed"]
    tps = {m: [r["tokens_per_s"] for r in rs] for m, rs in runs.items()}
    mem = {m: [r["peak_mib"] for r in rs] for m, rs in runs.items()}
    # every run of both sides, step by step: the curves should lie on each other. A row without a
    # trained token has no loss (padded: 0/0 = nan, packed: 0); such steps are left out.
    all_losses = np.array([r["losses"] for r in pad + pack])
    all_losses = all_losses[:, np.isfinite(all_losses).all(axis=0) & (all_losses != 0).all(axis=0)]
    return {
        "steps": pack[0]["steps"],
        "tokens": pack[0]["tokens"],
        "computed": {m: rs[0]["computed_tokens"] for m, rs in runs.items()},
        "params": pack[0]["params"],
        "runs": len(pack),
        "tokens_per_s": {m: spread(v) for m, v in tps.items()},
        "peak_mib": {m: spread(v) for m, v in mem.items()},
        "final_loss": {m: rs[0]["losses"][-1] for m, rs in runs.items()},
        "max_loss_diff": float((all_losses.max(axis=0) - all_losses.min(axis=0)).max()),
        "speedup": ratio(tps["packed"], tps["padded"]),
        "memory": ratio(mem["packed"], mem["padded"]),
    }


def _fig(m: tuple[float, float, float], fmt: str) -> str:
    return f"{m[0]:{fmt}} [{m[1]:{fmt}}–{m[2]:{fmt}}]"


def table(name: str, s: dict[str, Any], memory_kind: str) -> list[str]:
    """One dataset's block of the table."""
    comp = s["computed"]
    lines = [
        f"{name}: model {s['params'] / 1e6:,.1f}M parameters, {s['steps']} timed optimizer steps, "
        f"{s['tokens']:,} non-padding tokens; padded minibatches compute {comp['padded']:,} "
        f"({1 - comp['packed'] / comp['padded']:.1%} padding)",
        f"  {'':8}{'non-padding tokens/s':>28}{'peak MiB (' + memory_kind + ')':>32}{'final loss':>12}",
    ]
    for m in ("padded", "packed"):
        lines.append(
            f"  {m:8}{_fig(s['tokens_per_s'][m], ',.0f'):>28}{_fig(s['peak_mib'][m], ',.0f'):>32}"
            f"{s['final_loss'][m]:>12.4f}"
        )
    sp, me = s["speedup"], s["memory"]
    lines.append(
        f"  packed/padded: {sp[0]:.2f}x tokens/s [{sp[1]:.2f}–{sp[2]:.2f}], {me[0]:.2f}x peak memory "
        f"[{me[1]:.2f}–{me[2]:.2f}], max |loss difference| over all steps and runs {s['max_loss_diff']:.1e}"
    )
    return lines


def plot(results: dict[str, dict[str, Any]], path: str | Path, title: str) -> None:
    """Per dataset: the loss per optimizer step of both sides on one axis, and tokens/s per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * len(names)), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2, 1]})
    colours = {"padded": "#d62728", "packed": "#1f77b4"}
    for row, name in zip(axes, names):
        runs, s = results[name]["runs"], results[name]["summary"]
        ax = row[0]
        for m, style in (("padded", dict(lw=4, alpha=0.45)), ("packed", dict(lw=1.5, ls="--", marker="."))):
            losses = runs[m][0]["losses"]
            ax.plot(range(1, len(losses) + 1), losses, color=colours[m], label=m, **style)
        ax.set_title(f"{name}: loss per optimizer step (max |difference| {s['max_loss_diff']:.1e})", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.legend()
        ax = row[1]
        meds = [s["tokens_per_s"][m][0] for m in ("padded", "packed")]
        lo = [meds[i] - s["tokens_per_s"][m][1] for i, m in enumerate(("padded", "packed"))]
        hi = [s["tokens_per_s"][m][2] - meds[i] for i, m in enumerate(("padded", "packed"))]
        ax.bar(["padded", "packed"], meds, yerr=[lo, hi], capsize=6, color=[colours["padded"], colours["packed"]])
        sp = s["speedup"]
        ax.set_title(f"non-padding tokens/s: {sp[0]:.2f}x [{sp[1]:.2f}–{sp[2]:.2f}]", fontsize=10)
        ax.set_ylabel(f"tokens/s (median of {s['runs']}, min–max)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
