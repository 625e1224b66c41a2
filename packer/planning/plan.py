"""Planning: which examples go in which row, decided from the lengths alone (never the tokens).

Pure numpy, no I/O, deterministic for a seed. The result is a :class:`Plan`: a flat list of
*segments* (example index, start offset inside that example, length) in row order, cut into rows by
``row_splits``. A row ``r`` is ``segments[row_splits[r]:row_splits[r + 1]]``::

    lengths      [5, 3, 9, 2]        mode="bfd", max_len=8, overlong="split" (rows before the shuffle)
    segments     (2,0,8) | (0,0,5) (1,0,3) | (3,0,2) (2,8,1)       (example, start, length)
    row_splits   [0, 1, 3, 5]

Steps and their cost (n examples, m segments, R rows, T = max_tokens):

1. **Over-long examples** (``length > max_len``; not in ``wrap`` mode) follow ``overlong``:
   ``truncate`` keeps one segment ``[0, max_len)``; ``split`` cuts consecutive pieces
   ``[0, max_len), [max_len, 2*max_len), ...``, each its own segment; ``drop`` places the example
   nowhere; ``truncate-left`` keeps the *last* ``max_len`` tokens ``[length - max_len, length)``
   when the example's answer (``answers``: its tokens from the first trained one to EOS) fits in
   ``max_len``, so only prompt tokens are lost, and otherwise falls back to ``truncate``; both cases
   are counted (``examples_truncated_left``, ``examples_answer_too_long``). Vectorised, O(n + m).
2. **Modes**

   - ``batch``: the segments are shuffled (``np.random.default_rng(seed).permutation``) and every
     ``batch_size`` consecutive segments form a row; *the last row may hold fewer*. A split piece
     counts as one segment. O(m).
   - ``bfd``: best-fit-decreasing over the whole dataset into rows of at most ``max_tokens`` tokens
     (default ``max_len``). Exact BFD semantics (each item, largest first, goes into the open row with
     the least room that still fits it), but simulated in bulk: rows are kept in *capacity buckets*
     (one stack of row ids per remaining capacity, plus a bitset of non-empty buckets held in one
     Python int), and all items of one size are placed together. For size ``s`` the smallest
     non-empty bucket ``c >= s`` is found with one shift and lowest-set-bit; each of its rows then
     takes ``q = c // s`` items (after one item, the row's own room ``c - s`` is the best fit for the
     next, so it keeps taking them until fewer than ``s`` tokens are left), so ``ceil(k / q)`` rows
     move at once; when no bucket fits, ``ceil(k / (T // s))`` rows are opened at once. Rows of equal
     room are interchangeable for every later decision, so the row count (indeed the multiset of row
     loads) is that of per-item BFD. Items over ``T/2`` each open their own row in one step. Cost:
     O(m) radix sort (sizes fit in 16 bits when ``T < 32768``) + one Python iteration per (size,
     bucket emptied) pair, at most distinct_sizes * T but in practice a few per size, + O(m log m)
     grouping of segments by row. 1M lengths take well under a second, 10M a few seconds.
     Rows are numbered in opening order and segments inside a row keep placement order (largest
     first); the order of the rows is then shuffled with the seed (contents unchanged).
   - ``optimal``: ``bfd``, then the rows it left with a gap, with as many full rows lending their
     items, are packed again by minimum bin slack with exact fills (:mod:`packer.planning.repack`), kept only
     where that needs fewer rows: never more rows than ``bfd``, and ⌈tokens / max_tokens⌉ (+ 1 at
     most) on real data (GSM8K with Llama 2 at 2,048 tokens: 739 rows where ``bfd`` needs 745) and
     on synthetic lengths of four shapes from 10k to 10M. Identical rows are built once, so the
     refill costs less than ``bfd`` itself at 1M lengths and about a second at 10M; it is bounded
     by work (rows built), not by time.
     It is a mode of its own, not a change to ``bfd``: ``bfd`` stays exact best-fit-decreasing (the
     textbook algorithm the tests and TRL's ``pack_dataset`` are compared with), and a finished
     build's manifest names its mode, which ``packer verify`` replans to check the rows.
   - ``wrap``: all examples in *source order* (pretraining-style text keeps its order; ``seed`` is
     not used unless ``balance`` is set) are concatenated and cut every ``max_tokens`` tokens; a
     document cut at a row boundary continues in the next row as a new segment with ``start > 0``.
     Every row but the last holds exactly ``max_tokens`` tokens. ``overlong`` does not apply and
     ``max_len`` only sets the default of ``max_tokens``. O(n + m).

3. **Balanced ranks** (``world_size`` W, ``balance`` in ``{"tokens", "attention"}``; the work of a
   segment is its length or its length squared). The loader gives row ``i`` of a global step to rank
   ``i % W``, a step being W consecutive rows.

   - ``batch``: the shuffled segments are cut into steps of ``W * batch_size`` exactly as without
     balancing (so each step's set of examples is unchanged), then each step is partitioned into
     rows of exactly ``batch_size`` segments (the last, partial step keeps its row sizes
     ``batch_size, ..., remainder``) by LPT with a cardinality cap: segments, largest work first, go
     to the least-loaded row of their step that still has room. Vectorised over all steps:
     ``W * batch_size`` numpy rounds over a (steps, W) array, O(m * W) in all.
   - ``bfd`` / ``optimal`` / ``wrap``: rows are sorted by work, consecutive groups of W rows form steps, the full
     steps are shuffled with the seed, and the ``R % W`` lightest rows go last (the partial step).
     In ``wrap`` a short last row stays the last row, so only the last row can be short.

   ``stats["rank_work_max_over_mean"]`` is :func:`rank_work_ratio` of the plan as produced, by
   ``balance`` (``"tokens"`` when ``balance`` is None).

4. **Epochs** (:func:`plan_epochs`): E plans drawn one after another from one generator,
   ``np.random.default_rng(seed)``, concatenated into one :class:`Plan` (epoch ``e`` is rows
   ``[e*R, (e+1)*R)``, every epoch has the same R). In ``batch`` mode epoch ``e`` is cut from the
   ``e``-th permutation that generator draws, as a reshuffling sampler (torch's ``RandomSampler``
   with a ``generator``) draws a fresh permutation from its generator every epoch; epoch 0 is
   exactly :func:`plan`. In ``bfd`` mode (and any mode that packs from the lengths alone) epochs
   ``e >= 1`` first permute the examples, so BFD breaks its ties between equal lengths differently
   and the rows group other examples (same row count, same row loads). ``wrap`` keeps source order,
   so its epochs would be identical: refused. Cost: E times one plan.

5. **Padding** (``layout``, :mod:`packer.planning.context_parallel`): every segment is padded to a multiple
   (and, for the contiguous CP layout, every row); ``bfd``/``optimal`` pack the padded sizes into the
   budget rounded down to that multiple, so rows with their padding still fit. ``Plan.pad`` holds
   each segment's padding, ``stats["pad_tokens"]`` their sum; ``tokens`` stays the examples' own. O(m).

Empty input (0 examples) gives an empty plan (0 rows, ``row_splits == [0]``), not an error.
Bad arguments raise :class:`packer.errors.ConfigError` with the value, the limit and a fix.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from .accounting import account
from .context_parallel import Layout, pad_up
from .repack import fewer_rows

__all__ = ["BALANCE", "MODES", "OVERLONG", "Plan", "answer_lengths", "padded_budget", "plan", "plan_epochs",
           "rank_work_ratio"]

MODES = ("batch", "bfd", "optimal", "wrap")
OVERLONG = ("truncate", "split", "drop", "truncate-left")
BALANCE = ("tokens", "attention")


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """Segments in row order, cut into rows by ``row_splits`` (arrays are read-only int64)."""

    example: np.ndarray  # int64[m] index into `lengths` of the example each segment comes from
    start: np.ndarray  # int64[m] offset of the segment inside that example's tokens
    length: np.ndarray  # int64[m] segment length (> 0)
    row_splits: np.ndarray  # int64[rows + 1] row r holds segments row_splits[r]:row_splits[r+1]
    stats: dict  # plain ints / floats
    # a padded build (packer.planning.context_parallel): int64[m] padding tokens after each segment, and their id
    pad: np.ndarray | None = None
    pad_id: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.row_splits.size - 1)

    def row_lengths(self) -> np.ndarray:
        """int64[rows]: tokens in each row, padding included."""
        return _row_sums(self.length if self.pad is None else self.length + self.pad, self.row_splits)


# --------------------------------------------------------------------------------------------------
# validation


def _as_int(name: str, value: Any, minimum: int, fix: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}; {fix}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r}; {fix}") from None
    if v < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {v}; {fix}")
    return v


def _as_lengths(lengths: Any) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ConfigError(
            f"lengths must be a 1-D array of token counts, got shape {arr.shape}; pass one count per example"
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ConfigError(
            f"lengths must be integers, got dtype {arr.dtype}; pass token counts as an int array"
        )
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"every example needs at least 1 token, but example {i} has length {int(arr[i])} "
            f"({bad.size} such); drop empty examples before planning"
        )
    return arr


def _plain(field: str) -> str:
    return field


def row_size(mode: str, max_len: int, max_tokens: int | None, batch_size: int | None, *,
             default_batch: int | None = None, name: Callable[[str], str] = _plain) -> tuple[int | None, int | None]:
    """How a mode sizes its rows, the one statement of the rule (:func:`plan` and ``BuildConfig`` call it):
    ``batch`` rows hold ``batch_size`` examples (``default_batch`` when it is unset, else it is required)
    and take no ``max_tokens``; the other modes cut rows at ``max_tokens`` tokens (default ``max_len``) and
    take no ``batch_size``; ``bfd``/``optimal`` need ``max_len <= max_tokens``, or an example that long
    could never be placed. Returns ``(batch_size, max_tokens)``, the one that applies filled in; ``name``
    spells a field in messages (the CLI's ``--max-tokens``)."""
    mode_is = f"{name('mode')} {mode}"
    if mode == "batch":
        if max_tokens is not None:
            raise ConfigError(f"{name('max_tokens')} ({max_tokens!r}) is a row budget for the modes that fill rows "
                              f"with tokens; {mode_is} fixes the examples per row ({name('batch_size')}) instead; "
                              "drop one of the two")
        if batch_size is None and default_batch is None:
            raise ConfigError(f"{mode_is} needs {name('batch_size')} (examples per row); set it to 1 or more")
        batch_size = batch_size if batch_size is not None else default_batch
        return _as_int(name("batch_size"), batch_size, 1, "set it to the examples per row"), None
    if batch_size is not None:
        raise ConfigError(f"{name('batch_size')} applies to {name('mode')} batch only; {mode_is} "
                          f"fills rows up to {name('max_tokens')} instead; drop one of the two")
    max_tokens = _as_int(name("max_tokens"), max_len if max_tokens is None else max_tokens, 1,
                         "set it to the tokens per row")
    if mode in ("bfd", "optimal") and max_len > max_tokens:
        raise ConfigError(f"{name('max_len')} {max_len} exceeds the row budget {name('max_tokens')} {max_tokens}: an "
                          f"example that long could never be placed; lower {name('max_len')} to {max_tokens} or "
                          f"raise {name('max_tokens')}")
    return None, max_tokens


def check_epochs(mode: str, epochs: int, *, name: Callable[[str], str] = _plain) -> None:
    """Wrap plans one epoch: it keeps source order, so every epoch would hold the same rows."""
    if epochs > 1 and mode == "wrap":
        raise ConfigError(f"{name('epochs')} {epochs} with {name('mode')} wrap: wrap keeps source order, so every "
                          "epoch would hold the same rows; build one epoch (the loader replays it each epoch, "
                          f"set_epoch) or use {name('mode')} batch or bfd")


# --------------------------------------------------------------------------------------------------
# helpers


def _row_sums(values: np.ndarray, row_splits: np.ndarray) -> np.ndarray:
    cs = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=cs[1:])
    return cs[row_splits[1:]] - cs[row_splits[:-1]]


def _segment_work(length: np.ndarray, by: str) -> np.ndarray:
    if by == "tokens":
        return length
    if by == "attention":
        return length * length
    raise ConfigError(f"balance must be one of {BALANCE}, got {by!r}; pick one (or None for no balancing)")


def _row_gather(row_splits: np.ndarray, new_order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment indices and row_splits that list rows in ``new_order`` (old row ids), contents kept."""
    counts = np.diff(row_splits)[new_order]
    new_splits = np.zeros(new_order.size + 1, dtype=np.int64)
    np.cumsum(counts, out=new_splits[1:])
    idx = np.repeat(row_splits[:-1][new_order] - new_splits[:-1], counts) + np.arange(
        new_splits[-1], dtype=np.int64
    )
    return idx, new_splits


def rank_work_ratio(plan: Plan, world_size: int, by: str = "tokens") -> float:
    """Mean over global steps of max/mean work across the ``world_size`` ranks.

    Row ``i`` of a step of ``world_size`` consecutive rows goes to rank ``i % world_size``; work is a
    row's tokens (``by="tokens"``) or the sum of its segments' squared lengths (``"attention"``).
    Only full steps are measured; with fewer rows than ranks the result is 1.0. 1.0 = perfect.
    """
    w = _as_int("world_size", world_size, 1, "use the number of data-parallel ranks")
    work = _row_sums(_segment_work(plan.length, by), plan.row_splits).astype(np.float64)
    steps = work.size // w
    if steps == 0:
        return 1.0
    per = work[: steps * w].reshape(steps, w)
    mean = per.mean(axis=1)
    ratio = np.divide(per.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
    return float(ratio.mean())


# --------------------------------------------------------------------------------------------------
# over-long policy


def _segments(lengths: np.ndarray, max_len: int, overlong: str, answers: np.ndarray | None = None):
    """Segments (example, start, length) in example order (what became of each: :mod:`packer.planning.accounting`)."""
    if overlong == "truncate-left":
        return _truncate_left(lengths, answers, max_len)
    n = lengths.size
    idx = np.arange(n, dtype=np.int64)
    over = lengths > max_len
    if overlong == "truncate" or not over.any():
        example, start, length = idx, np.zeros(n, np.int64), np.minimum(lengths, max_len)
    elif overlong == "drop":
        keep = ~over
        example = idx[keep]
        start, length = np.zeros(example.size, np.int64), lengths[keep]
    else:  # split
        pieces = (lengths + (max_len - 1)) // max_len
        example = np.repeat(idx, pieces)
        first = np.cumsum(pieces) - pieces
        j = np.arange(example.size, dtype=np.int64) - np.repeat(first, pieces)
        start = j * max_len
        length = np.minimum(max_len, lengths[example] - start)
    return example, start, length


def answer_lengths(trained, lengths: np.ndarray, max_len: int) -> np.ndarray:
    """int64[n]: for each example longer than ``max_len``, its tokens from the first trained one to
    the end (the answer ``truncate-left`` keeps whole; all of it when nothing is trained); 0 for
    the others, which no policy touches. ``trained`` holds every example's 0/1 loss flags,
    concatenated (an array or a memory map of the token spill's flags: only the over-long examples'
    bytes are read, up to their first trained token). Cost: one ``argmax`` per over-long example,
    which stops at the first flag set (a vectorised gather would read every token of them).
    """
    lengths = np.asarray(lengths, np.int64)
    answers = np.zeros(lengths.size, np.int64)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    for k in np.flatnonzero(lengths > max_len).tolist():
        lo, hi = int(offsets[k]), int(offsets[k + 1])
        flags = np.asarray(trained[lo:hi])
        flags = flags.view(np.bool_) if flags.dtype.itemsize == 1 else flags != 0
        first = int(flags.argmax())
        answers[k] = hi - lo - first if flags[first] else hi - lo
    return answers


def _truncate_left(lengths: np.ndarray, answers: np.ndarray | None, max_len: int):
    """``truncate-left``: an over-long example keeps its last ``max_len`` tokens when its answer fits
    (prompt tokens are dropped from the start, BOS included, as TRL's ``keep_end`` truncation does:
    segments stay contiguous); an answer longer than ``max_len`` is cut on the right, as ``truncate``."""
    n = lengths.size
    if answers is None or np.shape(answers) != (n,):
        raise ConfigError(
            f"overlong 'truncate-left' needs answers (int[{n}]: each example's tokens from its first trained "
            "token to the end); compute them with packer.planning.plan.answer_lengths"
        )
    answers = np.asarray(answers, np.int64)
    over = lengths > max_len
    # An answer of exactly max_len fits: the segment then starts at its first token, whose label is -100
    # like every segment start's (nothing before it in the row to predict it from).
    left = over & (answers <= max_len)
    start = np.where(left, lengths - max_len, 0)
    return np.arange(n, dtype=np.int64), start, np.minimum(lengths, max_len)


# --------------------------------------------------------------------------------------------------
# bfd


def _bfd_bins(sizes: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Best-fit-decreasing of ``sizes`` (all in [1, cap]) into bins of ``cap``.

    Returns ``(order, bin_of_sorted, nbins)``: ``order`` lists item indices largest first (ties by
    index), ``bin_of_sorted[i]`` is the bin of item ``order[i]``; bins are numbered in opening order.
    """
    n = sizes.size
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    # A bin never holds more than every item: a larger cap gives the same bins, and the work below
    # (the room bitmask) grows with cap, so a budget far beyond the data would cost gigabytes for nothing.
    cap = min(cap, int(sizes.sum()))
    key = cap - sizes  # ascending key = descending size; 16-bit keys get numpy's O(n) radix sort
    if cap < 2**15:
        key = key.astype(np.int16)
    order = np.argsort(key, kind="stable")
    count = np.bincount(sizes)
    distinct = np.flatnonzero(count)[::-1]
    smallest = int(distinct[-1])

    buckets: dict[int, list[int]] = {}  # remaining room -> stack of bin ids
    mask = 0  # bit c set <=> buckets[c] non-empty
    flat_bins: list[int] = []  # bins, in the order they receive items (sorted item order)
    chunk_len: list[int] = []  # per move: number of bins ...
    chunk_q: list[int] = []  # ... each receiving q items
    fix_pos: list[int] = []  # except the bin at this position of flat_bins ...
    fix_r: list[int] = []  # ... which receives r < q
    nbins = 0

    for s, k in zip(distinct.tolist(), count[distinct].tolist(), strict=True):
        while k:
            m = mask >> s
            if m:
                c = s + (m & -m).bit_length() - 1  # least room that fits s
                stack = buckets[c]
                q = c // s
                need = -(-k // q)
                if need >= len(stack):
                    take = stack
                    del buckets[c]
                    mask ^= 1 << c
                else:
                    take = stack[-need:]
                    del stack[-need:]
            else:  # nothing fits: open new bins, each taking cap // s items
                c = cap
                q = cap // s
                need = -(-k // q)
                take = list(range(nbins, nbins + need))
                nbins += need
            t = len(take)
            if t == need:
                r = k - (t - 1) * q  # the last bin's share, 1..q
                k = 0
            else:
                r = q
                k -= t * q
            base = len(flat_bins)
            flat_bins.extend(take)
            chunk_len.append(t)
            chunk_q.append(q)
            if r != q:
                fix_pos.append(base + t - 1)
                fix_r.append(r)
                dest = c - r * s
                if dest >= smallest:
                    buckets.setdefault(dest, []).append(take[-1])
                    mask |= 1 << dest
                take = take[:-1]
            dest = c - q * s
            if take and dest >= smallest:
                have = buckets.get(dest)
                if have is None:
                    buckets[dest] = take
                else:
                    have.extend(take)
                mask |= 1 << dest

    reps = np.repeat(np.asarray(chunk_q, np.int64), np.asarray(chunk_len, np.int64))
    reps[np.asarray(fix_pos, np.int64)] = np.asarray(fix_r, np.int64)
    bin_of_sorted = np.repeat(np.asarray(flat_bins, np.int64), reps)
    assert bin_of_sorted.size == n, (bin_of_sorted.size, n)
    return order, bin_of_sorted, nbins


def _pack_bfd(example, start, length, cap, rng, world_size, balance, repack, sizes):
    """BFD (then the repack, for mode "optimal") of the segments' ``sizes`` (their lengths, padding
    included), then rows in shuffled order (or balanced steps)."""
    order, bin_of_sorted, nbins = _bfd_bins(sizes, cap)
    if repack:
        bin_of_sorted, nbins = fewer_rows(sizes[order], bin_of_sorted, nbins, cap)
    if balance is None:
        row_order = rng.permutation(nbins)
    else:
        w = _segment_work(sizes, balance)[order]
        # float sums are exact here: row work < 2**53 for any realistic row
        work = np.bincount(bin_of_sorted, weights=w, minlength=nbins).astype(np.int64)
        row_order = _balanced_row_order(work, world_size, rng)
    dtype = np.int32 if nbins < 2**31 else np.int64
    # group by bin (opening order; bin ids are nearly sorted already, so the stable sort is quick),
    # keeping placement order (largest first) inside a bin; then list the bins in row_order
    g = order[np.argsort(bin_of_sorted.astype(dtype, copy=False), kind="stable")]
    splits = np.zeros(nbins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of_sorted, minlength=nbins), out=splits[1:])
    idx, row_splits = _row_gather(splits, row_order)
    g = g[idx]
    return example[g], start[g], length[g], row_splits


# --------------------------------------------------------------------------------------------------
# wrap


def _pack_wrap(lengths: np.ndarray, cap: int):
    n = lengths.size
    end = np.cumsum(lengths)
    begin = end - lengths
    first_row = begin // cap
    pieces = (end - 1) // cap - first_row + 1
    example = np.repeat(np.arange(n, dtype=np.int64), pieces)
    first = np.cumsum(pieces) - pieces
    j = np.arange(example.size, dtype=np.int64) - np.repeat(first, pieces)
    row = np.repeat(first_row, pieces) + j
    b = np.repeat(begin, pieces)
    gstart = np.maximum(b, row * cap)
    gend = np.minimum(np.repeat(end, pieces), (row + 1) * cap)
    rows = int(-(-int(end[-1]) // cap)) if n else 0
    row_splits = np.searchsorted(row, np.arange(rows + 1), side="left").astype(np.int64)
    return example, gstart - b, gend - gstart, row_splits


# --------------------------------------------------------------------------------------------------
# balancing


def _balanced_row_order(row_work: np.ndarray, w: int, rng: np.random.Generator) -> np.ndarray:
    order = np.argsort(row_work, kind="stable")
    rem = order.size % w
    body = order[rem:].reshape(-1, w)
    body = body[rng.permutation(body.shape[0])]
    return np.concatenate([body.ravel(), order[:rem]])


def _lpt_steps(wk: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """LPT with a cardinality cap, vectorised over steps.

    ``wk`` is (steps, n) segment work, ``caps`` the segments each of the R rows must receive
    (``caps.sum() == n``). Returns (steps, n) local row ids: segments, largest first, each go to the
    least-loaded row of their step that still has room (ties: lowest row). n numpy rounds over a
    (steps, R) array.
    """
    steps, n = wk.shape
    srt = np.argsort(-wk, axis=1, kind="stable")
    sw = np.take_along_axis(wk, srt, axis=1).astype(np.float64)  # exact: sums stay far below 2**53
    load = np.zeros((steps, caps.size), np.float64)
    left = np.broadcast_to(caps, load.shape).copy()
    rows_sorted = np.empty((steps, n), np.int64)
    ar = np.arange(steps)
    for j in range(n):
        r = np.where(left > 0, load, np.inf).argmin(axis=1)
        rows_sorted[:, j] = r
        load[ar, r] += sw[:, j]
        left[ar, r] -= 1
    assert not left.any()
    local = np.empty_like(rows_sorted)
    np.put_along_axis(local, srt, rows_sorted, axis=1)
    return local


def _balance_batch(length: np.ndarray, w: int, b: int, by: str):
    """Permutation of the (shuffled) segments and row_splits: same steps, balanced rows."""
    m = length.size
    work = _segment_work(length, by)
    step_size = w * b
    full = m // step_size
    row_of = np.empty(m, np.int64)  # global row of each segment
    if full:
        local = _lpt_steps(work[: full * step_size].reshape(full, step_size), np.full(w, b, np.int64))
        row_of[: full * step_size] = (local + np.arange(full)[:, None] * w).ravel()
    tail = m - full * step_size
    if tail:  # the last, partial step keeps its row sizes: b, b, ..., remainder
        nrows = -(-tail // b)
        caps = np.full(nrows, b, np.int64)
        caps[-1] = tail - (nrows - 1) * b
        row_of[full * step_size :] = _lpt_steps(work[full * step_size :][None, :], caps)[0] + full * w
    perm = np.argsort(row_of, kind="stable")  # inside a row: shuffled order
    row_splits = np.zeros(int(row_of.max()) + 2 if m else 1, np.int64)
    np.cumsum(np.bincount(row_of, minlength=row_splits.size - 1), out=row_splits[1:])
    return perm, row_splits


# --------------------------------------------------------------------------------------------------
# the entry point


def plan(
    lengths,
    *,
    mode: str,
    max_len: int,
    max_tokens: int | None = None,
    batch_size: int | None = None,
    overlong: str = "truncate",
    seed: int = 0,
    world_size: int = 1,
    balance: str | None = None,
    answers=None,
    rng: np.random.Generator | None = None,
    layout: Layout | None = None,
) -> Plan:
    """Plan rows from example lengths; see the module docstring for the algorithms.

    ``answers`` (``overlong="truncate-left"`` only): see :func:`answer_lengths`. ``rng``: draw the
    shuffles from this generator instead of ``np.random.default_rng(seed)`` (:func:`plan_epochs`).
    ``layout``: pad the segments for context parallelism or a kernel multiple
    (:mod:`packer.planning.context_parallel`); rows are packed with their padding inside the budget."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}; use batch, bfd, optimal or wrap")
    if overlong not in OVERLONG:
        raise ConfigError(
            f"overlong must be one of {OVERLONG}, got {overlong!r}; use truncate, split, drop or truncate-left"
        )
    if balance is not None and balance not in BALANCE:
        raise ConfigError(f"balance must be one of {BALANCE} or None, got {balance!r}; pick one")
    max_len = _as_int("max_len", max_len, 1, "set max_len to the longest example (in tokens) to keep")
    seed = _as_int("seed", seed, 0, "use a non-negative integer seed")
    world_size = _as_int("world_size", world_size, 1, "use the number of data-parallel ranks (>= 1)")
    batch_size, budget_cap = row_size(mode, max_len, max_tokens, batch_size)
    if layout is not None:
        budget_cap = padded_budget(layout, mode, max_len, budget_cap)

    lengths = _as_lengths(lengths)
    n = lengths.size
    rng = np.random.default_rng(seed) if rng is None else rng

    if mode == "wrap":
        if n:
            example, start, length, row_splits = _pack_wrap(lengths, budget_cap)
        else:
            example = start = length = np.zeros(0, np.int64)
            row_splits = np.zeros(1, np.int64)
        if balance is not None:
            work = _row_sums(_segment_work(length, balance), row_splits)
            rows = work.size
            short = rows > 0 and int(_row_sums(length, row_splits)[-1]) < budget_cap
            head = rows - 1 if short else rows  # a short last row stays last
            order = _balanced_row_order(work[:head], world_size, rng)
            if short:
                order = np.append(order, rows - 1)
            idx, row_splits = _row_gather(row_splits, order)
            example, start, length = example[idx], start[idx], length[idx]
    else:
        example, start, length = _segments(lengths, max_len, overlong, answers)
        if mode in ("bfd", "optimal"):
            sizes = length if layout is None else pad_up(length, layout.segment_multiple)
            example, start, length, row_splits = _pack_bfd(
                example, start, length, budget_cap, rng, world_size, balance, mode == "optimal", sizes
            )
        else:  # batch
            p = rng.permutation(example.size)
            example, start, length = example[p], start[p], length[p]
            if balance is None:
                m = example.size
                row_splits = (
                    np.append(np.arange(0, m, batch_size, dtype=np.int64), m) if m else np.zeros(1, np.int64)
                )
            else:
                p, row_splits = _balance_batch(length, world_size, batch_size, balance)
                example, start, length = example[p], start[p], length[p]

    pad = None if layout is None else layout.padding(length, row_splits)
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (example, start, length, row_splits)]
    for a in arrays if pad is None else [*arrays, pad]:
        a.flags.writeable = False
    stats = _stats(lengths, Plan(*arrays, stats={}, pad=pad), mode, budget_cap, world_size,
                   overlong == "truncate-left" and mode != "wrap")
    # The ratio is measured on the finished rows; the frozen Plan is then made once, stats complete.
    ratio = rank_work_ratio(Plan(*arrays, stats={}), world_size, balance or "tokens")
    return Plan(*arrays, stats={**stats, "rank_work_max_over_mean": ratio}, pad=pad,
                pad_id=0 if layout is None else layout.pad_id)


def padded_budget(layout: Layout, mode: str, max_len: int, max_tokens: int | None) -> int | None:
    """The one padding rule, the same in every mode (``BuildConfig`` checks it before anything is read,
    :func:`plan` again): a segment of ``max_len`` tokens, padded, must fit what a segment may hold: the row
    budget (``Layout.budget``: ``max_tokens`` rounded down to the padding's multiples) in the modes that fill
    rows with tokens, ``max_len`` itself in ``batch``, whose rows have no token budget (a padding multiple
    past it padded every segment there to that multiple: 5,000,000 tokens for a max_len of 4096); there a
    row's own padding (contiguous CP), which its last segment takes, is less than max_len too. ``wrap``
    cuts rows at the budget, so its budget must hold one row's multiple. Returns the row budget (None in
    ``batch``)."""
    if mode == "wrap" and layout.segment_multiple > 1:
        raise ConfigError("mode 'wrap' cuts rows at the budget, so it cannot pad every segment (--cp-layout zigzag, "
                          "--pad-to-multiple-of); use --cp-layout contiguous, or mode 'bfd'")
    longest = int(pad_up(max_len, layout.segment_multiple))
    if mode == "batch":
        if longest <= max_len and layout.row_multiple > max_len:  # contiguous: the row's padding, on its last segment
            raise ConfigError(f"every row is padded to a multiple of {layout.row_multiple:,} tokens, more than the "
                              f"{max_len} tokens a segment may hold in mode 'batch' (its last segment takes the "
                              "padding); lower --cp-size or --pad-to-multiple-of, or raise --max-len")
        if longest > max_len:
            raise ConfigError(f"a segment of max_len {max_len} tokens pads to {longest:,}, more than the {max_len} "
                              f"tokens a segment may hold in mode 'batch' (every segment is padded to a multiple of "
                              f"{layout.segment_multiple:,}); make --max-len a multiple of it, or lower "
                              "--pad-to-multiple-of or --cp-size")
        return None
    cap = layout.budget(max_tokens)
    if mode == "wrap" and cap < 1:
        raise ConfigError(f"the row budget of max_tokens {max_tokens} rounded down to a multiple of the padding "
                          f"({layout.row_multiple:,}) is 0 tokens; lower --cp-size or --pad-to-multiple-of, or raise "
                          "--max-tokens")
    if mode != "wrap" and longest > cap:
        raise ConfigError(f"a segment of max_len {max_len} tokens pads to {longest:,}, more than the row budget of "
                          f"{cap:,} (max_tokens {max_tokens} rounded down to a multiple of the padding); lower --max-len, "
                          "raise --max-tokens, or lower --pad-to-multiple-of or --cp-size")
    return cap


# --------------------------------------------------------------------------------------------------
# epochs


def plan_epochs(lengths, *, epochs: int = 1, mode: str, seed: int = 0, answers=None, **options: Any) -> Plan:
    """``epochs`` plans one after another (module docstring, step 4), as one :class:`Plan` whose rows
    are epoch 0's, then epoch 1's, ...; ``options`` are :func:`plan`'s. ``epochs=1`` is :func:`plan`.

    Stats: what the rows hold (``segments``, ``tokens``, ``rows``, ``padded_tokens``) is summed over the
    epochs, ``max_row_tokens`` is the largest, ``fill`` and ``lower_bound`` are of all the rows, and
    ``rank_work_max_over_mean`` is the epochs' mean; the accounting of examples (read, truncated,
    split, dropped, ``tokens_in``) is one epoch's, the same in every epoch, and ``epochs`` says E.
    """
    epochs = _as_int("epochs", epochs, 1, "plan at least one epoch")
    check_epochs(mode, epochs)
    if epochs == 1:
        return plan(lengths, mode=mode, seed=seed, answers=answers, **options)
    lengths = _as_lengths(lengths)
    rng = np.random.default_rng(_as_int("seed", seed, 0, "use a non-negative integer seed"))
    plans = []
    for e in range(epochs):
        # A packing mode other than batch is a function of the lengths (only its row order is shuffled), so
        # its later epochs first permute the examples: equal lengths fall in other rows than before.
        if mode != "batch" and e:
            order = rng.permutation(lengths.size)
            p = plan(lengths[order], mode=mode, answers=None if answers is None else np.asarray(answers)[order],
                     rng=rng, **options)
            p = Plan(order[p.example], p.start, p.length, p.row_splits, p.stats, p.pad, p.pad_id)
        else:
            p = plan(lengths, mode=mode, answers=answers, rng=rng, **options)
        plans.append(p)
    return _concat_epochs(plans)


# one epoch's accounting (equal in every epoch) and what the rows of all epochs hold, summed
_PER_EPOCH = ("examples", "examples_packed", "examples_split", "examples_truncated", "examples_dropped", "tokens_in",
              "tokens_truncated", "tokens_dropped", "world_size", "examples_truncated_left", "examples_answer_too_long")
_SUMMED = ("segments", "tokens", "rows", "padded_tokens", "pad_tokens")


def _concat_epochs(plans: list[Plan]) -> Plan:
    first = plans[0]
    for p in plans[1:]:
        assert p.num_rows == first.num_rows, "every epoch plans the same number of rows"
        assert all(p.stats.get(k) == first.stats.get(k) for k in _PER_EPOCH), "every epoch accounts the same"
    arrays = [np.concatenate([getattr(p, name) for p in plans]) for name in ("example", "start", "length")]
    pad = None if first.pad is None else np.concatenate([p.pad for p in plans])
    shift = np.cumsum([0] + [int(p.row_splits[-1]) for p in plans[:-1]])
    row_splits = np.concatenate([first.row_splits[:1]] + [p.row_splits[1:] + s for p, s in zip(plans, shift, strict=True)])
    stats = {k: first.stats[k] for k in _PER_EPOCH if k in first.stats}
    stats.update({k: sum(p.stats[k] for p in plans) for k in _SUMMED if k in first.stats})
    stats["max_row_tokens"] = max(p.stats["max_row_tokens"] for p in plans)
    # batch rows have no budget but their largest row (plan's rule), bfd's budget is the same in every epoch
    stats["row_budget"] = max(p.stats["row_budget"] for p in plans)
    budget, rows = stats["row_budget"], stats["rows"]
    stats["lower_bound"] = -(-stats["tokens"] // budget) if budget else 0
    stats["fill"] = stats["tokens"] / (rows * budget) if rows and budget else 0.0
    stats["rank_work_max_over_mean"] = float(np.mean([p.stats["rank_work_max_over_mean"] for p in plans]))
    stats["epochs"] = len(plans)
    out = [np.ascontiguousarray(a, dtype=np.int64) for a in (*arrays, row_splits)]
    for a in out if pad is None else [*out, pad]:
        a.flags.writeable = False
    return Plan(*out, stats=stats, pad=pad, pad_id=first.pad_id)


def _stats(lengths, plan: Plan, mode, budget_cap, world_size, truncate_left: bool) -> dict:
    c = account(plan, lengths).total
    length, row_splits = plan.length, plan.row_splits
    rows = plan.num_rows
    row_tokens = plan.row_lengths()  # what a row holds, padding included
    max_row = int(row_tokens.max()) if rows else 0
    tokens = int(length.sum())
    budget = int(budget_cap) if budget_cap is not None else max_row
    s: dict[str, Any] = {
        "examples": c.examples,
        "examples_packed": c.whole,
        "examples_split": c.split,
        "examples_truncated": c.truncated,
        "examples_dropped": c.dropped,
        "segments": int(length.size),
        "tokens_in": c.tokens_in,
        "tokens": tokens,
        "tokens_truncated": c.tokens_truncated,
        "tokens_dropped": c.tokens_dropped,
        "rows": rows,
        "max_row_tokens": max_row,
        "row_budget": budget,
        "lower_bound": -(-tokens // budget) if budget else 0,
        "fill": tokens / (rows * budget) if rows and budget else 0.0,
        "world_size": int(world_size),
    }
    if truncate_left:
        s.update(examples_truncated_left=c.truncated_left, examples_answer_too_long=c.truncated - c.truncated_left)
    if plan.pad is not None:  # padding is in the rows and the budget, not in tokens (the examples' own)
        s["pad_tokens"] = int(plan.pad.sum())
    if mode == "batch":
        counts = np.diff(row_splits)
        if rows:
            row_max = np.maximum.reduceat(length, row_splits[:-1]) if length.size else np.zeros(0, np.int64)
            s["padded_tokens"] = int((counts * row_max).sum())
        else:
            s["padded_tokens"] = 0
    assert tokens == c.tokens, (tokens, c)
    assert not math.isnan(s["fill"])
    return s
