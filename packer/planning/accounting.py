"""Accounting: what became of every example, counted from a plan and the examples' lengths alone.

Each example has one fate in an epoch, read off the segments that cover it::

    lengths   [5, 9, 12]     max_len 8, overlong "split" for example 2, "truncate" for example 1
    segments  (0,0,5) (1,0,8) (2,0,8) (2,8,4)
    fates     whole   truncated  split

- **whole**: one segment, all its tokens;
- **split**: several segments (``--overlong split``, or a row cut in ``wrap``), all its tokens;
- **truncated**: one segment, some tokens lost; *left* when the kept tokens start after the first
  (``--overlong truncate-left`` kept the answer), else on the right;
- **dropped**: no segment (``--overlong drop``).

Every count of examples and tokens in a manifest comes from :func:`account`: the plan's totals
(``packer.planning.plan``) and each mix part's (``packer.building.mix``), so the parts add up to the totals by
construction. A plan of E epochs (``plan_epochs``) holds every example E times with the same fate;
the counts are one epoch's (its first ``rows / E`` rows). Cost: O(n + m) for n examples and m
segments of an epoch (a few bincounts).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

WHOLE, SPLIT, TRUNCATED, TRUNCATED_LEFT, DROPPED = range(5)
_FATES = 5


@dataclass(frozen=True, slots=True)
class Counts:
    """One epoch's accounting of a set of examples (a whole plan, or one source of a mix)."""

    examples: int
    whole: int
    split: int
    truncated: int  # on the right or the left ...
    truncated_left: int  # ... of which on the left: the kept tokens start after the first
    dropped: int
    tokens_in: int  # the examples' tokens
    tokens: int  # of them, in rows
    tokens_truncated: int
    tokens_dropped: int


@dataclass(frozen=True, slots=True)
class Accounting:
    total: Counts
    parts: tuple[Counts, ...]  # per source (``source`` of :func:`account`); sums to ``total``
    epochs: int  # the plan holds every example this many times with these counts


def epochs_of(plan) -> int:
    return int(plan.stats.get("epochs") or 1)


def account(plan, lengths, *, source: np.ndarray | None = None, parts: int = 1) -> Accounting:
    """The counts of ``plan`` over examples of ``lengths`` (int[n]); ``source`` (int[n], values in
    ``[0, parts)``) groups them per source of a mix."""
    lengths = np.asarray(lengths, np.int64)
    n = lengths.size
    epochs = epochs_of(plan)
    end = int(plan.row_splits[plan.num_rows // epochs])  # the first epoch's segments
    example, start, length = plan.example[:end], plan.start[:end], plan.length[:end]
    pieces = np.bincount(example, minlength=n)
    # float sums are exact: an example's tokens, and a source's, stay far below 2**53
    covered = np.bincount(example, weights=length, minlength=n).astype(np.int64)
    first = np.zeros(n, np.int64)
    first[example] = start  # read only where one segment covers the example
    fate = np.full(n, WHOLE, np.int8)
    fate[pieces > 1] = SPLIT
    cut = (pieces == 1) & (covered < lengths)
    fate[cut] = TRUNCATED
    fate[cut & (first > 0)] = TRUNCATED_LEFT
    fate[pieces == 0] = DROPPED
    group = np.zeros(n, np.int64) if source is None else np.asarray(source, np.int64)
    by_fate = np.bincount(group * _FATES + fate, minlength=parts * _FATES).reshape(parts, _FATES)
    tokens_in = np.bincount(group, weights=lengths, minlength=parts).astype(np.int64)
    tokens = np.bincount(group, weights=covered, minlength=parts).astype(np.int64)
    dropped = fate == DROPPED
    tokens_dropped = np.bincount(group[dropped], weights=lengths[dropped], minlength=parts).astype(np.int64)
    counts = tuple(
        Counts(
            examples=int(f.sum()), whole=int(f[WHOLE]), split=int(f[SPLIT]),
            truncated=int(f[TRUNCATED] + f[TRUNCATED_LEFT]), truncated_left=int(f[TRUNCATED_LEFT]),
            dropped=int(f[DROPPED]), tokens_in=int(t_in), tokens=int(t), tokens_truncated=int(t_in - t - t_drop),
            tokens_dropped=int(t_drop),
        )
        for f, t_in, t, t_drop in zip(by_fate, tokens_in, tokens, tokens_dropped, strict=True)
    )
    total = Counts(**{f.name: sum(getattr(c, f.name) for c in counts) for f in fields(Counts)})
    return Accounting(total, counts, epochs)
