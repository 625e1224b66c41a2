"""Fewer rows than best-fit-decreasing: refill the rows BFD left with a gap, each by a subset sum.

Pure numpy and Python integers, no randomness: a function of the sizes alone.

Where BFD misses the lower bound ⌈tokens / budget⌉, its slack is spread thin over many rows (GSM8K
with Llama 2 at 2,048 tokens: 745 rows for a bound of 739, 12,893 free tokens over 287 rows and no
example under 73 tokens to fill them; 1M FLAN-like lengths: ~5 free tokens in each of ~2,800 rows).
The rows BFD filled exactly are kept. The examples of the other rows (the *loose* rows, which hold
all the slack) are packed again by *minimum bin slack* (Gupta & Ho, MBS'): each new row takes the
largest example left, then the subset of the rest that fills it closest to the budget, found by an
exact bounded subset-sum over a bitset (a Python int, bit ``t`` set when ``t`` tokens are
reachable). Sizes are offered largest first and the subset is read back preferring them, so a row
is made of big examples and only finished with small ones: the small ones stay for the rows that
need an exact filler. Rows filled exactly push the slack into the last rows, which empty.

Windows. The loose rows are refilled ``WINDOW`` at a time; window k takes every nwin-th of them
in order of gap, from the k-th largest, so that every window holds the whole spread of gaps and
examples (a window of only the largest gaps is the hardest to win a row from). The rows a window
leaves short join the next window. A window's refill is kept only when it needs fewer rows than it
had: never more rows than BFD. The search stops at the lower bound and after ``MAX_REFILLED`` rows.

Where it misses: lengths uniform over [16, budget / 2) at 1M (BFD's loose rows there are triples
and pairs of near-equal examples, each short of one exact filler that no longer exists): BFD's
rows stay. Measured figures: README, Planning; ``benchmarks/bench_plan.py``.

Cost. One subset-sum per new row over at most ``MAX_SIZES`` distinct sizes (spread evenly from the
largest that fits to the smallest), their counts in binary chunks 1, 2, 4, ...; it stops at the
first chunk that fills the row. That is O(MAX_SIZES * log(budget)) shifts of a budget-bit integer
per row, ~20-150 µs here, and at most ``MAX_REFILLED`` rows whatever the input size (1-3 s at
most on this machine; 1M FLAN-like lengths refill ~2-3k rows).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

__all__ = ["fewer_rows"]

MAX_SIZES = 48  # distinct sizes offered to one row's subset-sum: plenty of ways to hit the budget
WINDOW = 8192  # loose rows refilled together: more rows, more ways to fill each one exactly
MAX_REFILLED = 1 << 14  # loose rows refilled at most: bounds the cost at any input size


def _best_subset(sizes: list[int], counts: list[int], room: int) -> list[tuple[int, int]]:
    """Copies of ``sizes`` (at most ``counts`` each) with the largest total <= ``room``: [(size, copies)].

    Bounded subset-sum over a bitset (bit t of ``reach`` set when t tokens are reachable), the counts
    split in binary chunks 1, 2, 4, ...; it stops at the first chunk that makes ``room`` reachable.
    Walking back, a chunk is taken only when the total was not reachable without it, so the sizes
    offered first (the largest) are preferred.
    """
    mask = (1 << (room + 1)) - 1
    reach = 1
    steps: list[tuple[int, int, int]] = []  # (reach before, size, copies) per chunk
    for s, c in zip(sizes, counts, strict=True):
        fit = room // s
        if c > fit:
            c = fit
        j = 1
        while c > 0:
            t = j if j < c else c
            steps.append((reach, s, t))
            reach |= (reach << (s * t)) & mask
            if reach >> room:  # full: nothing offered later does better
                break
            c -= t
            j <<= 1
        else:
            continue
        break
    t = reach.bit_length() - 1
    taken = []
    for before, s, copies in reversed(steps):
        if t == 0:
            break
        if not (before >> t) & 1:  # t was reached only with this chunk
            taken.append((s, copies))
            t -= s * copies
    return taken


def _refill(counts: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Minimum-bin-slack rows over the multiset ``counts[size]``: (row, size, copies) triples."""
    count = counts.tolist()
    present = np.flatnonzero(counts).tolist()  # sizes left, ascending
    t_row: list[int] = []
    t_size: list[int] = []
    t_count: list[int] = []
    r = 0
    while present:
        largest = present[-1]
        t_row.append(r)
        t_size.append(largest)
        t_count.append(1)
        count[largest] -= 1
        if not count[largest]:
            present.pop()
        room = cap - largest
        k = bisect_right(present, room)  # present[:k] fit the room
        if k:
            if k <= MAX_SIZES:
                offer = present[k - 1 :: -1]
            else:  # spread evenly from the largest that fits down to the smallest
                step = (k - 1) / (MAX_SIZES - 1)
                offer = [present[round(k - 1 - i * step)] for i in range(MAX_SIZES)]
            for size, copies in _best_subset(offer, [count[x] for x in offer], room):
                count[size] -= copies
                if not count[size]:
                    del present[bisect_right(present, size) - 1]
                t_row.append(r)
                t_size.append(size)
                t_count.append(copies)
        r += 1
    return np.asarray(t_row, np.int64), np.asarray(t_size, np.int64), np.asarray(t_count, np.int64)


def _deal(items: np.ndarray, sizes: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """Refill ``items`` into rows: (local row of each item, number of rows)."""
    t_row, t_size, t_count = _refill(np.bincount(sizes[items], minlength=cap + 1), cap)
    by_size = np.argsort(sizes[items], kind="stable")  # the items by size, then position
    o = np.lexsort((t_row, t_size))  # the (row, size, count) triples by size, then row: the same order
    row = np.empty(items.size, np.int64)
    row[by_size] = np.repeat(t_row[o], t_count[o])
    return row, int(t_row[-1]) + 1


def fewer_rows(sizes: np.ndarray, bin_of: np.ndarray, nbins: int, cap: int) -> tuple[np.ndarray, int]:
    """Move items between bins so that fewer bins are used, when refilling the loose bins finds how.

    ``bin_of[i]`` is the bin of item ``i`` (size ``sizes[i]`` <= ``cap``) in a feasible packing into
    ``nbins`` bins. Returns ``(bin_of, nbins)`` with the bins renumbered ``0..nbins-1`` (emptied bins
    removed, the others in their order). Unchanged when nothing is won.

    The loose bins are refilled a window of at most ``WINDOW`` bins at a time, the bins a window
    leaves with a gap joining the next window; a window's refill is kept only when it needs fewer
    bins. It stops at ⌈sum / cap⌉ or after ``MAX_REFILLED`` bins.
    """
    if nbins == 0:
        return bin_of, nbins
    loads = np.bincount(bin_of, weights=sizes, minlength=nbins).astype(np.int64)
    lower = -(-int(loads.sum()) // cap)
    if nbins <= lower:
        return bin_of, nbins
    gaps = cap - loads
    loose = np.flatnonzero(gaps > 0)
    # windows alike: window k takes every nwin-th loose bin from the k-th largest gap down, so each
    # holds the whole spread of gaps and examples (a window of only the largest gaps is the hardest)
    nwin = -(-loose.size // WINDOW)
    loose = loose[np.argsort(-gaps[loose], kind="stable")]
    loose = np.concatenate([loose[k::nwin] for k in range(nwin)])
    ends = np.cumsum([loose[k::nwin].size for k in range(nwin)])
    # the items of each loose bin, bin by bin in that order
    rank = np.full(nbins, -1, np.int64)
    rank[loose] = np.arange(loose.size)
    items = np.flatnonzero(rank[bin_of] >= 0)
    items = items[np.argsort(rank[bin_of[items]], kind="stable")]
    splits = np.searchsorted(rank[bin_of[items]], np.arange(loose.size + 1))

    bin_of = bin_of.copy()
    nb = nbins
    carry_bins = carry_items = np.zeros(0, np.int64)
    begin = 0
    for end in ends.tolist():
        if nb <= lower or begin >= MAX_REFILLED:
            break
        win = np.concatenate([carry_bins, loose[begin:end]])
        work = np.concatenate([carry_items, items[splits[begin] : splits[end]]])
        begin = end
        row, nrows = _deal(work, sizes, cap)
        if nrows >= win.size:  # nothing won: keep these bins as they are
            carry_bins = carry_items = np.zeros(0, np.int64)
            continue
        bin_of[work] = win[row]  # the new rows take the first bin ids of the window; the rest empty
        nb -= win.size - nrows
        short = np.bincount(row, weights=sizes[work], minlength=nrows) < cap
        carry_bins, carry_items = win[:nrows][short], work[short[row]]
    if nb == nbins:
        return bin_of, nbins
    used = np.zeros(nbins, bool)
    used[bin_of] = True
    return (np.cumsum(used) - 1)[bin_of], nb
