"""Fewer rows than best-fit-decreasing: the rows BFD left with a gap, refilled with items lent by full rows.

Pure numpy and Python integers, no randomness: a function of the sizes alone.

Why BFD misses the lower bound ⌈tokens / budget⌉: it places all items of one size together, so its
rows come in classes of identical rows (1M lengths uniform over [16, 1024) at 2,048 tokens: 8,356
rows with a gap, of 132 compositions, e.g. 515 rows of two 1,020-token items, 8 tokens short), and
the gaps (1-40 tokens) are smaller than any item still unplaced. No exchange among those rows alone
fills them (two items of 1,020 need one of 8, and none exists), and every row of a class needs the
same filler, so a few spare items are soon used up.

The refill. The items of every *loose* row (gap > 0), and of as many *full* rows lent to them
(spread evenly over BFD's rows, which it opens largest item first, so every size class lends
items, small fillers included), are packed again by *minimum bin slack* (Gupta & Ho, MBS'): each
new row takes the largest item left, then items largest first until one item or a pair of items
fills the row exactly (a pair summing to ``room`` is found in one shift and AND of two bitsets of
the sizes left: ``bits`` and its mirror). Where that fails, an exact bounded subset-sum over at
most ``MAX_SIZES`` sizes (bitset over a Python int) fills it as closely as it can. A row filled
exactly is then *repeated* as long as the counts allow: identical rows are built once, so the
work follows the number of distinct compositions (one to five thousand), not of rows (tens to
hundreds of thousands). The refill is kept only when it needs fewer rows than it was given: never
more rows than BFD.

A second refill runs only where the first leaves more than bound + 1 rows (seen at 10M lengths,
not below): its window also borrows the full rows that hold the fillers the gaps want (a row short
of g tokens wants an item of g, or of a + g for each of its sizes a), and its rows take copies of
the smallest size early (MBS leaves them for last, where alone they fill rows of their own with a
gap: 51 x 40 tokens, 8 short).

Bound. At most ``MAX_BUILDS`` rows are built in a refill (each: at most ``GREEDY`` greedy steps,
then at most one subset-sum); past that the refill is abandoned and the rows it was given stay: a
bound on work, not on time, so the result is the same on any machine.

Cost. O(n) numpy to gather the rows' items and map the new rows back, plus the rows built; at 1M
lengths less than BFD's own time, at 10M under a second more (``benchmarks/bench_plan.py``; the
figures: docs/benchmarks.md, Planning).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

__all__ = ["fewer_rows"]

MAX_SIZES = 48  # distinct sizes offered to one row's subset-sum: plenty of ways to hit the budget
GREEDY = 24  # items added largest first to one row before the subset-sum takes over
MAX_BUILDS = 1 << 15  # rows built at most: bounds the work at any input size


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


def _bitset(positions: np.ndarray, cap: int) -> int:
    """A Python int with bit p set for each p in ``positions`` (all in [0, cap]), in O(cap)."""
    flags = np.zeros(cap + 1, bool)
    flags[positions] = True
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")


def _pair(count: list[int], bits: int, mirror: int, cap: int, room: int) -> int:
    """The smaller item b of a pair of sizes left (``count`` > 0) that sums to ``room``, the largest
    such b (both items as large as can be: the small ones stay for later rows); 0 if none.

    ``bits`` has bit s set and ``mirror`` bit cap - s for each size s present when the row began (a
    size used up since is skipped by its count): bit b of ``mirror >> (cap - room)`` is set when
    room - b is present, so one shift and two ANDs list every b that completes a pair.
    """
    y = (mirror >> (cap - room)) & bits & ((1 << (room // 2 + 1)) - 1)
    while y:
        b = y.bit_length() - 1
        if count[b] and count[room - b] > (2 * b == room):
            return b
        y ^= 1 << b
    return 0


def _sand(count: list[int], bits: int, m: int, sand: int, cap: int, room: int) -> int:
    """The most copies j of the smallest size ``m`` such that one more item left fills ``room - j * m``
    exactly; 0 if none. ``sand`` has bit cap - j * m set for j = 1, 2, ...: bit b of
    ``sand >> (cap - room)`` is set when room - b is a multiple of m."""
    most = min(count[m], room // m)
    if not most:
        return 0
    y = (sand >> (cap - room)) & bits & ~((1 << (room - most * m)) - 1)
    while y:
        b = (y & -y).bit_length() - 1  # the lowest: the most copies of m
        j = (room - b) // m
        if count[b] > (j if b == m else 0):
            return j
        y ^= 1 << b
    return 0


def _row(count: list[int], present: list[int], bits: int, mirror: int, cap: int,
         sand: int) -> tuple[dict[int, int], bool]:
    """One MBS row from the items left: {size: copies} (taken from ``count``) and whether it is full.

    The largest item, then items largest first until one item or a pair fills the row exactly, or
    (``sand``, see :func:`_sand`) copies of the smallest size and one item do (at most ``GREEDY``
    steps); otherwise the subset-sum fills it as closely as it can.
    """
    largest = present[-1]
    need = {largest: 1}
    count[largest] -= 1
    room = cap - largest
    for _ in range(GREEDY):
        if not room:
            return need, True
        if (bits >> room) & 1 and count[room]:
            b = room
        else:
            b = _pair(count, bits, mirror, cap, room)
            if b:  # the pair's larger item now; the greedy step below then finds its partner
                need[b] = need.get(b, 0) + 1
                count[b] -= 1
                room -= b
                b = room
            elif sand and (j := _sand(count, bits, present[0], sand, cap, room)):
                need[present[0]] = need.get(present[0], 0) + j
                count[present[0]] -= j
                room -= j * present[0]
                b = room
            else:
                fits = bits & ((1 << (room + 1)) - 1)
                b = fits.bit_length() - 1
                while b > 0 and not count[b]:  # used up in this row
                    fits ^= 1 << b
                    b = fits.bit_length() - 1
                if b <= 0:
                    break
        need[b] = need.get(b, 0) + 1
        count[b] -= 1
        room -= b
    if not room:
        return need, True
    for s, c in need.items():  # put the greedy's items back, all but the largest
        count[s] += c
    count[largest] -= 1
    need = {largest: 1}
    room = cap - largest
    avail = [s for s in present[: bisect_right(present, room)] if count[s]]
    k = len(avail)
    if k > MAX_SIZES:  # spread evenly from the largest that fits down to the smallest
        step = (k - 1) / (MAX_SIZES - 1)
        avail = [avail[round(i * step)] for i in range(MAX_SIZES)]
    offer = avail[::-1]
    for s, c in _best_subset(offer, [count[x] for x in offer], room) if offer else ():
        need[s] = need.get(s, 0) + c
        count[s] -= c
        room -= s * c
    return need, not room


def _refill(counts: np.ndarray, cap: int, sand: bool):
    """MBS rows over the multiset ``counts[size]``: (row, size, copies, repeats) arrays and the row count,
    or None past ``MAX_BUILDS`` rows built. A full row is repeated while the counts allow it."""
    count = counts.tolist()
    sizes = np.flatnonzero(counts)
    present = sizes.tolist()  # sizes left, ascending
    bits, mirror = _bitset(sizes, cap), _bitset(cap - sizes, cap)
    t_row: list[int] = []
    t_size: list[int] = []
    t_count: list[int] = []
    t_rep: list[int] = []
    r = builds = 0
    smallest = multiples = 0
    while present:
        builds += 1
        if builds > MAX_BUILDS:
            return None
        if sand and present[0] != smallest:  # the multiples of the smallest size left, for _sand
            smallest = present[0]
            multiples = _bitset(cap - np.arange(smallest, cap + 1, smallest), cap)
        need, full = _row(count, present, bits, mirror, cap, multiples)
        m = 1 + (min(count[s] // c for s, c in need.items()) if full else 0)
        for s, c in need.items():
            count[s] -= c * (m - 1)
            if not count[s]:  # used up
                del present[bisect_left(present, s)]
                bits ^= 1 << s
                mirror ^= 1 << (cap - s)
            t_row.append(r)
            t_size.append(s)
            t_count.append(c)
            t_rep.append(m)
        r += m
    return (*(np.asarray(t, np.int64) for t in (t_row, t_size, t_count, t_rep)), r)


def _deal(items: np.ndarray, sizes: np.ndarray, cap: int, sand: bool) -> tuple[np.ndarray, int] | None:
    """Refill ``items`` into rows: (local row of each item, number of rows), or None past the bound."""
    out = _refill(np.bincount(sizes[items], minlength=cap + 1), cap, sand)
    if out is None:
        return None
    t_row, t_size, t_count, t_rep, nrows = out
    # one (row, size, copies) triple per row of a repeated composition
    first = np.cumsum(t_rep) - t_rep
    row = np.repeat(t_row, t_rep) + np.arange(int(t_rep.sum())) - np.repeat(first, t_rep)
    size, copies = np.repeat(t_size, t_rep), np.repeat(t_count, t_rep)
    by_size = np.argsort(sizes[items], kind="stable")  # the items by size, then position
    o = np.lexsort((row, size))  # the triples by size, then row: the same order
    local = np.empty(items.size, np.int64)
    local[by_size] = np.repeat(row[o], copies[o])
    return local, nrows


def _wanted(sizes: np.ndarray, bin_of: np.ndarray, loads: np.ndarray, cap: int) -> np.ndarray:
    """Full bins that hold the items the loose bins want: for a bin short of ``g`` tokens, an item of
    ``g`` (it fills the bin) and for each size ``a`` in it one of ``a + g`` (one exchange fills it),
    from as many bins as the loose bins that want it. A class of identical loose bins all short of
    one filler size (a 2,045-token item alone wants a 3) gets too few of it from the even spread."""
    gap = cap - loads[bin_of]
    short = np.flatnonzero(gap > 0)
    pairs = np.unique(bin_of[short] * (cap + 1) + sizes[short])  # (bin, size) once each
    want = pairs % (cap + 1) + cap - loads[pairs // (cap + 1)]  # size + gap
    want = np.concatenate([want, cap - loads[loads < cap]])  # the gaps themselves
    need = np.bincount(want[want <= cap], minlength=cap + 1)
    lend = np.flatnonzero((gap == 0) & (need[sizes] > 0))  # items of full bins with a wanted size
    lend = lend[np.argsort(sizes[lend], kind="stable")]
    first = np.searchsorted(sizes[lend], sizes[lend])  # where each item's size begins
    return np.unique(bin_of[lend[np.arange(lend.size) - first < need[sizes[lend]]]])


def _refill_window(sizes: np.ndarray, bin_of: np.ndarray, nbins: int, cap: int, second: bool):
    """The loose bins and as many full bins, spread evenly over the opening order (BFD opens bins
    largest item first, so every size class lends items, small fillers included), refilled
    together: (bin_of, nbins) renumbered, or None when nothing is won or past the bound. The
    ``second`` refill also borrows the :func:`_wanted` bins and spends the smallest size early."""
    loads = np.bincount(bin_of, weights=sizes, minlength=nbins).astype(np.int64)
    loose = np.flatnonzero(loads < cap)
    full = np.flatnonzero(loads == cap)
    lend = min(full.size, loose.size)
    win = np.union1d(loose, full[(np.arange(lend) * full.size) // max(lend, 1)])
    if second:
        win = np.union1d(win, _wanted(sizes, bin_of, loads, cap))
    inwin = np.zeros(nbins, bool)
    inwin[win] = True
    work = np.flatnonzero(inwin[bin_of])
    dealt = _deal(work, sizes, cap, second)
    if dealt is None or dealt[1] >= win.size:
        return None
    row, nrows = dealt
    bin_of = bin_of.copy()
    bin_of[work] = win[row]  # the new rows take the window's first bin ids; the rest empty
    used = np.zeros(nbins, bool)
    used[bin_of] = True
    return (np.cumsum(used) - 1)[bin_of], nbins - (win.size - nrows)


def fewer_rows(sizes: np.ndarray, bin_of: np.ndarray, nbins: int, cap: int) -> tuple[np.ndarray, int]:
    """Move items between bins so that fewer bins are used, when refilling the loose bins finds how.

    ``bin_of[i]`` is the bin of item ``i`` (size ``sizes[i]`` <= ``cap``) in a feasible packing into
    ``nbins`` bins, numbered in opening order as BFD does. Returns ``(bin_of, nbins)`` with the bins
    renumbered ``0..nbins-1`` (emptied bins removed, the others in their order). Unchanged when
    nothing is won, when the bins are at ⌈sum / cap⌉ already, or past ``MAX_BUILDS``.

    A second refill (:func:`_refill_window`) runs only where the first leaves more than
    ⌈sum / cap⌉ + 1 bins.
    """
    if nbins == 0:
        return bin_of, nbins
    lower = -(-int(sizes.sum()) // cap)
    for second in (False, True):
        if nbins <= lower + second:
            break
        out = _refill_window(sizes, bin_of, nbins, cap, second)
        if out is not None:
            bin_of, nbins = out
    return bin_of, nbins
