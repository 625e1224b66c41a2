"""Fewer rows than best-fit-decreasing: refill the rows BFD left with a gap, each by a subset sum.

Pure numpy and Python integers, no randomness: a function of the sizes alone.

Where BFD misses the lower bound ⌈tokens / budget⌉, its slack is spread thin over many rows (GSM8K
with Llama 2 at 2,048 tokens: 745 rows for a bound of 739, ~45 free tokens in each of 287 rows and
no example under 73 tokens to fill them; 1M FLAN-like lengths: ~5 free tokens in each of ~2,800
rows). The rows BFD filled exactly are kept as they are. The examples of all the other rows (the
*loose* rows, which hold all the slack) are packed again, one row at a time, by *minimum bin slack*
(Gupta & Ho): each row takes the largest example left, then the subset of the rest that fills it
closest to the budget, found by an exact subset-sum over bitsets (Python ints, bit ``t`` set when
``t`` tokens are reachable). Rows filled exactly leave the slack to the last rows, which empty.

Cost. One subset-sum per new row, over at most ``MAX_SIZES`` distinct sizes (spread evenly over the
sizes left, smallest and largest included) with their counts in binary chunks: O(MAX_SIZES * log
(budget) * budget / 64) word operations per row, over the loose rows only. The loose rows are at
most ``MAX_LOOSE_ROWS`` (the largest gaps first), so the phase is bounded for any input size.

The repack is kept only when it needs fewer rows than the loose rows it replaces: never more rows
than BFD.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fewer_rows"]

MAX_SIZES = 48  # distinct sizes offered to one row's subset-sum: plenty of ways to hit the budget
MAX_LOOSE_ROWS = 1 << 15  # bounds the Python work at any input size


def _chunks(sizes: np.ndarray, counts: np.ndarray, room: int) -> tuple[list[int], list[int], list[int]]:
    """Binary splitting of ``counts[i]`` copies of ``sizes[i]`` (at most what fits ``room``)."""
    size_of: list[int] = []
    mult: list[int] = []
    owner: list[int] = []
    for i, (s, c) in enumerate(zip(sizes.tolist(), counts.tolist(), strict=True)):
        c = min(c, room // s)
        j = 1
        while c > 0:
            t = min(j, c)
            size_of.append(s * t)
            mult.append(t)
            owner.append(i)
            c -= t
            j <<= 1
    return size_of, mult, owner


def _best_subset(chunk_size: list[int], room: int) -> tuple[int, list[int]]:
    """The largest total <= ``room`` of a subset of chunks, and which chunks give it."""
    mask = (1 << (room + 1)) - 1
    reach = 1
    history = []
    for v in chunk_size:
        history.append(reach)
        reach |= (reach << v) & mask
        if reach >> room:  # the row is full: no later chunk can do better
            break
    best = reach.bit_length() - 1
    taken = []
    t = best
    for k in range(len(history) - 1, -1, -1):
        if t == 0:
            break
        if not (history[k] >> t) & 1:  # t was reached only with chunk k
            taken.append(k)
            t -= chunk_size[k]
    return best, taken


def _refill(counts: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Minimum-bin-slack rows over the multiset ``counts[size]``: (row, size, count) triples."""
    counts = counts.copy()
    t_row: list[int] = []
    t_size: list[int] = []
    t_count: list[int] = []
    r = 0
    while True:
        present = np.flatnonzero(counts)
        if present.size == 0:
            return np.asarray(t_row, np.int64), np.asarray(t_size, np.int64), np.asarray(t_count, np.int64)
        largest = int(present[-1])
        counts[largest] -= 1
        t_row.append(r)
        t_size.append(largest)
        t_count.append(1)
        room = cap - largest
        offer = present[: np.searchsorted(present, room, side="right")]
        offer = offer[counts[offer] > 0]
        if offer.size:
            if offer.size > MAX_SIZES:
                offer = offer[np.linspace(0, offer.size - 1, MAX_SIZES).round().astype(np.int64)]
            size_of, mult, owner = _chunks(offer, counts[offer], room)
            _, taken = _best_subset(size_of, room)
            for k in taken:
                s = int(offer[owner[k]])
                counts[s] -= mult[k]
                t_row.append(r)
                t_size.append(s)
                t_count.append(mult[k])
        r += 1


def fewer_rows(sizes: np.ndarray, bin_of: np.ndarray, nbins: int, cap: int) -> tuple[np.ndarray, int]:
    """Move items between bins so that fewer bins are used, when refilling the loose bins finds how.

    ``bin_of[i]`` is the bin of item ``i`` (size ``sizes[i]`` <= ``cap``) in a feasible packing into
    ``nbins`` bins. Returns ``(bin_of, nbins)``; the bins kept whole keep their order and come first,
    the refilled ones follow. Unchanged when ``nbins`` is already ⌈sum / cap⌉ or nothing is won.
    """
    if nbins == 0:
        return bin_of, nbins
    loads = np.bincount(bin_of, weights=sizes, minlength=nbins).astype(np.int64)
    lower = -(-int(loads.sum()) // cap)
    if nbins <= lower:
        return bin_of, nbins
    gaps = cap - loads
    loose = np.flatnonzero(gaps > 0)
    if loose.size > MAX_LOOSE_ROWS:
        loose = loose[np.argsort(-gaps[loose], kind="stable")[:MAX_LOOSE_ROWS]]
    is_loose = np.zeros(nbins, bool)
    is_loose[loose] = True
    items = np.flatnonzero(is_loose[bin_of])
    counts = np.bincount(sizes[items], minlength=cap + 1)
    t_row, t_size, t_count = _refill(counts, cap)
    nrows = int(t_row[-1]) + 1
    if nrows >= loose.size:
        return bin_of, nbins

    # the kept bins, renumbered in order; then the new rows, whose items are dealt out by size
    keep = ~is_loose
    new_bin = (np.cumsum(keep) - 1)[bin_of]
    first = int(keep.sum())
    by_size = items[np.argsort(sizes[items], kind="stable")]  # loose items by size, then id
    o = np.lexsort((t_row, t_size))  # the triples by size, then row: the same order
    new_bin[by_size] = first + np.repeat(t_row[o], t_count[o])
    return new_bin, first + nrows
