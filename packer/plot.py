"""``packer inspect --plot FILE.png``: one figure of a build, from :func:`packer.checking.inspect_.plot_data`.

Four panels: the example lengths (tokens kept in the rows) against ``--max-len``; the fill of every
row, sorted; the examples per row (``bfd``/``optimal``/``wrap``); for ``batch`` mode each row's tokens
against what a padded batch of the same examples would hold (the padding packer removed); and the
same examples under padded / batch / bfd / optimal: tokens computed, rows, optimizer steps
(``inspect_.compare_modes``). matplotlib is imported here only (the ``plot`` extra), with the Agg
backend, so it never needs a display.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .checking.views import Mode, PlotData
from .errors import ConfigError, OutputError

TOKENS = "#1f77b4"
PAD = "#d62728"
EMPTY = "#c7c7c7"


def plot_build(data: PlotData, path: str | os.PathLike) -> Path:
    """Draw the figure of ``data`` (``inspect_.plot_data``) into ``path`` (format from its suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'packer[plot]'") from e

    path = Path(path)
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix.lower().lstrip(".") not in formats:
        what = f"{path.suffix!r} is not one matplotlib writes" if path.suffix else "it has none"
        raise ConfigError(f"--plot {path}: the file's suffix sets the figure's format, and {what} "
                          f"({', '.join(sorted(formats))}); name it {path.stem}.png, .svg or .pdf")
    fig = figure(data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise OutputError(f"--plot {path}: cannot be written ({e.strerror or e}); check the folder") from None
    finally:
        plt.close(fig)
    return path


def figure(data: PlotData):
    """The four panels of ``data`` as a matplotlib figure (the caller saves and closes it)."""
    import matplotlib.pyplot as plt

    s, cfg = data.stats, data.config
    budget = max(1, data.row_budget)
    mode = cfg.pack + (f" of {cfg.batch_size}" if cfg.pack == "batch" else f", rows ≤ {budget:,} tokens")

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    # a preference build counts pairs, each two sequences (packer.planning.pairs)
    read = f"{s.examples_read:,} pairs" if s.paired else f"{s.examples_read:,} examples"
    what = f"{s.rows:,} rows ({mode}) · {s.tokens:,} tokens · {read}"
    # a long folder name gets its own line, so the title stays inside the figure
    fig.suptitle(f"{data.directory}{' — ' if len(str(data.directory)) + len(what) < 90 else chr(10)}{what}",
                 fontsize=13, fontweight="bold")

    _lengths_panel(axes[0, 0], data)
    _fill_panel(axes[0, 1], data, budget)
    _examples_panel(axes[1, 0], data)
    _padding_panel(axes[1, 1], data)
    return fig


def _lengths_panel(ax, data: PlotData) -> None:
    """(a) example lengths (tokens kept in the rows) against --max-len."""
    s, cfg, ex_len = data.stats, data.config, data.example_tokens
    if ex_len.size:
        ax.hist(ex_len, bins=min(60, max(10, int(np.sqrt(ex_len.size)))), color=TOKENS, alpha=0.85)
    if cfg.pack != "wrap":
        ax.axvline(cfg.max_len, color=PAD, ls="--", lw=1.5)
        ax.text(cfg.max_len, ax.get_ylim()[1] * 0.95, f" --max-len {cfg.max_len:,}\n"
                f" {s.examples_truncated:,} truncated, {s.examples_split:,} split",
                color=PAD, va="top", ha="right" if ex_len.size and np.median(ex_len) < cfg.max_len * 0.5 else "left",
                fontsize=9, bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"})
    unit = "sequence" if s.paired else "example"  # a pair's chosen and rejected, each its own length
    ax.set_title(f"{unit} lengths (tokens kept in the rows)")
    ax.set_xlabel(f"tokens per {unit}")
    ax.set_ylabel(f"{unit}s")


def _fill_panel(ax, data: PlotData, budget: int) -> None:
    """(b) the fill of every row, sorted."""
    import matplotlib.ticker

    cfg, row_tok = data.config, data.row_tokens
    fill = np.sort(row_tok / budget)[::-1]
    x = np.arange(fill.size)
    ax.fill_between(x, fill, step="mid", color=TOKENS, alpha=0.85, label="tokens")
    ax.fill_between(x, fill, 1.0, step="mid", color=EMPTY, alpha=0.6, label="unused row budget")
    mean = float(row_tok.sum()) / (budget * max(1, row_tok.size))
    ax.axhline(mean, color="black", lw=1, ls=":")
    ax.text(fill.size * 0.98, mean, f" mean fill {mean:.1%} ", ha="right", va="top" if mean > 0.85 else "bottom",
            fontsize=9, bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    ax.set_ylim(0, 1.02)
    ax.set_xlim(-0.5, max(0.5, fill.size - 0.5))
    ax.set_title(f"each row's fill, of {budget:,} tokens" + (" (its largest row)" if cfg.pack == "batch" else ""))
    ax.set_xlabel("rows, fullest first")
    ax.set_ylabel("tokens / row budget")
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.legend(loc="lower left", fontsize=9)


def _examples_panel(ax, data: PlotData) -> None:
    """(c) examples per row; in batch mode that is the batch size, so the modes compared instead."""
    import matplotlib.ticker

    s, cfg, row_ex = data.stats, data.config, data.row_examples
    if cfg.pack == "batch":
        _modes_panel(ax, data.modes, s.epoch_count)
        ax.set_title(f"the same examples under each mode (examples per row: {cfg.batch_size}, the last may hold fewer)",
                     fontsize=10)
    else:
        values, counts = np.unique(row_ex, return_counts=True)
        ax.bar(values, counts, color=TOKENS, alpha=0.85, width=0.8)
        unit = "sequences (two a pair)" if s.paired else "examples"
        ax.set_title(f"{unit} per row (mean {row_ex.mean() if row_ex.size else 0:.1f})")
        ax.set_xlabel("segments in the row")
        ax.set_ylabel("rows")
        ax.set_xlim(max(0, values.min() - 1.5) if values.size else 0, (values.max() + 1.5) if values.size else 2)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))


def _padding_panel(ax, data: PlotData) -> None:
    """(d) padding removed (batch) / the modes compared (bfd, wrap)."""
    row_tok, row_pad = data.row_tokens, data.row_padded
    if data.config.pack == "batch":
        order = np.argsort(-row_pad, kind="stable")
        x = np.arange(order.size)
        ax.bar(x, row_tok[order], width=1.0, color=TOKENS, label="tokens (what packer computes)")
        ax.bar(x, (row_pad - row_tok)[order], bottom=row_tok[order], width=1.0, color=PAD, alpha=0.55,
               label="padding a padded batch would add")
        padded = int(row_pad.sum())
        removed = 1 - row_tok.sum() / max(1, padded)
        ax.set_title(f"padding removed: {padded - int(row_tok.sum()):,} of {padded:,} tokens ({removed:.1%})")
        ax.set_xlabel("rows (= batches), largest padded batch first")
        ax.set_ylabel("tokens")
        ax.set_xlim(-0.5, max(0.5, len(x) - 0.5))
        ax.legend(loc="upper right", fontsize=9)
    else:
        _modes_panel(ax, data.modes, data.stats.epoch_count)


def _modes_panel(ax, modes: tuple[Mode, ...], epochs: int) -> None:
    """Tokens computed (padding included) under each mode, labelled with rows and optimizer steps: of
    all the rows, so of every epoch the build holds."""
    import matplotlib.ticker

    names = [f"{m.mode}{' (this build)' if m.built else ''}\n{m.rows:,} rows = {m.optimizer_steps:,} steps\n"
             f"{m.examples_per_step:.1f} examples/step" for m in modes]
    y = np.arange(len(modes))[::-1]
    tokens = np.array([m.tokens for m in modes])
    computed = np.array([m.computed_tokens for m in modes])
    ax.barh(y, tokens, color=TOKENS, label="tokens")
    ax.barh(y, computed - tokens, left=tokens, color=PAD, alpha=0.55, label="padding")
    for yi, m in zip(y, modes, strict=True):
        # the padded baseline's cost is its padding (the table's fill column leaves it out too)
        cost = f"padding {m.padding:.0%}" if m.computed_tokens > m.tokens else f"fill {m.fill:.0%}"
        ax.text(m.computed_tokens, yi, f"  {m.computed_tokens:,}\n  {cost}", va="center", fontsize=9)
    ax.set_xlim(0, computed.max() * 1.3)
    ax.set_yticks(y, names, fontsize=9)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("tokens computed per epoch" if epochs == 1 else f"tokens computed over the {epochs} epochs the rows hold")
    ax.set_title("the same examples under each mode")
    ax.legend(loc="lower right", fontsize=9)
