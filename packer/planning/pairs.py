"""Preference pairs planned as units: a pair's two segments travel together, chosen then rejected.

A preference build stores each pair as two adjacent examples of the token spill (example ``2k`` is
``prompt + chosen``, ``2k + 1`` is ``prompt + rejected``). Planning works on the pairs::

    segment lengths  [6, 4 | 9, 3]        two pairs
    pair sizes       [10, 12]             planned by plan.plan (bfd / optimal / batch)
    unit plan        row 0: pair 1 | row 1: pair 0
    segments         (2,0,9) (3,0,3) | (0,0,6) (1,0,4)

1. **Over-long** (``max_len`` is per sequence, TRL's ``DPOConfig.max_length``): ``truncate`` keeps each
   sequence's first ``max_len`` tokens and drops a pair whose prompt alone fills ``max_len`` (TRL's
   ``keep_start`` collator and its filter of fully truncated examples); ``truncate-left`` keeps each
   sequence's last ``max_len`` tokens (TRL's ``keep_end``; nothing is dropped); ``drop`` drops a pair with
   a sequence over ``max_len``; ``split`` would cut a sequence from its pair and is refused.
2. **Rows**: the pairs' sizes (both segments, padded where the layout pads each) go to
   :func:`packer.planning.plan.plan_epochs` as whole examples, so ``bfd``/``optimal`` pack pairs into
   ``max_tokens`` and ``batch`` puts ``batch_size`` pairs in a row (padded DPO's batch of B pairs); each
   planned pair is then expanded into its two segments, in place.
3. **Accounting** counts pairs (:func:`packer.planning.accounting.account` over the pairs' sizes):
   ``examples`` are pairs, ``segments`` are sequences (two a pair), ``padded_tokens`` (``batch``) the
   tokens of padded DPO batches (2B sequences padded to the longest).

Cost: O(pairs) numpy beyond the plan itself.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError
from .accounting import account
from .context_parallel import Layout, pad_up
from .plan import Plan, padded_budget, plan_epochs, row_size

CHOSEN, REJECTED = 1, 0  # the roles a preference build stores per segment (schema.PAIR_COLUMN)


def prompt_lengths(trained, lengths: np.ndarray) -> np.ndarray:
    """int64[n]: each sequence's tokens before its first trained one (its prompt, as tokenized with it)."""
    lengths = np.asarray(lengths, np.int64)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flags = np.asarray(trained[: int(offsets[-1])]).astype(bool)
    # the first trained token of each sequence: a cumulative count of flags, read at the sequences' bounds
    seen = np.zeros(flags.size + 1, np.int64)
    np.cumsum(flags, out=seen[1:])
    out = lengths.copy()
    has = seen[offsets[1:]] > seen[offsets[:-1]]
    idx = np.flatnonzero(has)
    if idx.size:
        # first index i >= start with flags[i]: searchsorted on the running count
        first = np.searchsorted(seen, seen[offsets[idx]] + 1, side="left") - 1
        out[idx] = first - offsets[idx]
    return out


def pair_budget(max_len: int, layout: Layout | None = None) -> int:
    """The least ``max_tokens`` whose row budget holds a pair of two ``max_len`` sequences, each padded as
    ``layout`` pads a segment: a pair build's default (the SFT default, ``max_len``, doubled)."""
    if layout is None:
        return 2 * max_len
    pair = 2 * int(pad_up(max_len, layout.segment_multiple))
    return int(pad_up(pair, math.lcm(layout.segment_multiple, layout.row_multiple)))  # Layout.budget keeps it whole


def check_pair_budget(max_len: int, max_tokens: int, layout: Layout | None = None) -> None:
    """Refuse, in one line saying what to pass, a ``max_tokens`` whose rows cannot hold a longest pair."""
    cap = max_tokens if layout is None else layout.budget(max_tokens)
    need = pair_budget(max_len, layout)
    if cap >= need:
        return
    multiple = 1 if layout is None else layout.segment_multiple
    fits = cap // 2 // multiple * multiple
    padded = "" if layout is None else f", each padded to a multiple of {multiple}"
    lower = f", or lower --max-len to {fits}" if fits >= 2 else ""
    raise ConfigError(f"--max-tokens {max_tokens:,} cannot hold a preference pair (two sequences of up to --max-len "
                      f"{max_len:,} tokens{padded}: {need:,}); pass --max-tokens {need} or more, or leave it out "
                      f"(a pair build's default is {need}){lower}")


def plan_pairs(lengths, *, prompts, mode: str, max_len: int, max_tokens: int | None = None,
               batch_size: int | None = None, overlong: str = "truncate", seed: int = 0, epochs: int = 1,
               world_size: int = 1, balance: str | None = None, layout: Layout | None = None) -> Plan:
    """The rows of a preference build; ``lengths`` are the sequences' (two a pair, chosen first) and
    ``prompts`` each sequence's prompt tokens (:func:`prompt_lengths`)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size % 2:
        raise ConfigError(f"a preference build has two sequences a pair, got {lengths.size}; this is a packer bug")
    if mode == "wrap" or overlong == "split":
        what = "--pack wrap" if mode == "wrap" else "--overlong split"
        raise ConfigError(f"{what} would cut a preference pair apart; use --pack bfd, optimal or batch and "
                          "--overlong truncate, truncate-left or drop")
    prompts = np.asarray(prompts, np.int64)
    n = lengths.size // 2
    kept_len = np.minimum(lengths, max_len)
    start = np.zeros_like(lengths)
    if overlong == "truncate":
        # TRL's keep_start filter: a pair whose prompt alone fills max_len has no completion left
        keep = prompts[0::2] < max_len
    elif overlong == "truncate-left":
        keep = np.ones(n, bool)
        start = lengths - kept_len
    else:  # drop
        keep = (lengths[0::2] <= max_len) & (lengths[1::2] <= max_len)
    multiple = 1 if layout is None else layout.segment_multiple
    sizes = pad_up(kept_len[0::2], multiple) + pad_up(kept_len[1::2], multiple)
    kept = np.flatnonzero(keep)
    if mode in ("bfd", "optimal") and max_tokens is None:
        max_tokens = pair_budget(max_len, layout)
    # a given max_tokens too small for a longest pair is refused where a build starts (BuildConfig.for_pairs),
    # not here: verify --source re-plans builds made before that rule, whose rows are what they are
    _, cap = row_size(mode, 2 * max_len, max_tokens if mode != "batch" else None, batch_size,
                      name=lambda f: {"max_len": "2 x --max-len (a pair)"}.get(f, f"--{f.replace('_', '-')}"))
    if cap is not None and layout is not None:
        cap = padded_budget(layout, mode, max_len, cap)
    units = plan_epochs(sizes[kept] if kept.size else np.zeros(0, np.int64), epochs=epochs, mode=mode, seed=seed,
                        max_len=int(sizes.max()) if kept.size else 1, max_tokens=cap, batch_size=batch_size,
                        overlong="truncate", world_size=world_size, balance=balance)
    pair = kept[units.example]
    example = np.stack([2 * pair, 2 * pair + 1], axis=1).ravel()
    arrays = [example, start[example], kept_len[example], units.row_splits * 2]
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
    pad = None if layout is None else layout.padding(arrays[2], arrays[3])
    for a in arrays if pad is None else [*arrays, pad]:
        a.flags.writeable = False
    plan = Plan(*arrays, stats={}, pad=pad, pad_id=0 if layout is None else layout.pad_id)
    return Plan(*arrays, stats=_stats(plan, units, lengths, kept_len, kept, mode), pad=plan.pad, pad_id=plan.pad_id)


def _stats(plan: Plan, units: Plan, lengths: np.ndarray, kept_len: np.ndarray, kept: np.ndarray, mode: str
           ) -> dict[str, Any]:
    """The unit plan's stats, with the accounting of pairs (their whole sizes against what the rows hold)."""
    totals = lengths[0::2] + lengths[1::2]
    pair = kept[units.example]
    held = (kept_len[0::2] + kept_len[1::2])[pair]
    per_pair = Plan(pair, units.start, held, units.row_splits,
                    {"epochs": units.stats.get("epochs")})
    c = account(per_pair, totals).total
    stats = dict(units.stats)
    stats.update(examples=c.examples, examples_packed=c.whole, examples_split=0, examples_truncated=c.truncated,
                 examples_dropped=c.dropped, tokens_in=c.tokens_in, tokens_truncated=c.tokens_truncated,
                 tokens_dropped=c.tokens_dropped, segments=int(plan.length.size), tokens=int(plan.length.sum()),
                 pairs=c.examples - c.dropped)
    budget = stats["row_budget"]
    rows = plan.num_rows
    stats["lower_bound"] = -(-stats["tokens"] // budget) if budget else 0
    stats["fill"] = stats["tokens"] / (rows * budget) if rows and budget else 0.0
    if plan.pad is not None:
        stats["pad_tokens"] = int(plan.pad.sum())
    if mode == "batch":  # padded DPO: the row's 2B sequences padded to the longest of them
        counts = np.diff(plan.row_splits)
        row_max = np.maximum.reduceat(plan.length, plan.row_splits[:-1]) if rows else np.zeros(0, np.int64)
        stats["padded_tokens"] = int((counts * row_max).sum()) if rows else 0
    return stats
