"""The row invariants of the on-disk contract (:mod:`packer.contract.schema`), stated once and checked vectorised.

A row holds segments (examples, or pieces of one) one after another. For every row of a batch:

- **layout** (``LAYOUT_RULES``; a row that breaks one is skipped by every rule after them):
  ``example_ids`` has one entry per ``seq_lens`` entry; the row has a segment, every ``seq_lens``
  entry is > 0, and they sum to the row's length; a preference build's row holds whole pairs (an even
  number of segments, one ``pair_roles`` entry each);
- **row** (``ROW_RULES``, from the list offsets and the small columns only): ``max_seqlen`` is
  ``max(seq_lens)``; example ids are ≥ 0; a pair's roles are 1, 0 (chosen, then rejected) and its two
  segments carry one example id; and, when :class:`Limits` are given, the row keeps to the build's
  budget;
- **tokens** (``TOKEN_RULES``): ``position_ids`` run ``0..len-1`` inside each segment (and a segment
  is no longer than their type can count); ``labels`` are -100 at every segment start (labels are
  unshifted: this is what keeps a label from crossing an example boundary) and elsewhere -100 or the
  input id; ``num_loss_tokens`` counts the labels ≠ -100; token ids are in ``[0, vocab)``; a pair's
  two segments share their prompt (the tokens before the first trained one), unless the build cut
  their starts (``Limits.pair_prompts``).

A trained token is one whose label is not -100: format version 1 stores ``labels``, version 2 a
``loss_mask`` bit per token (:class:`Bits`, read in place: the segment starts' bits alone, the counts
from the bitmap's words; unpacked only where read whole, as the padding rule does), whose labels are
the ids where it is set, so "the input id" holds by construction.

Before all of them, the three token columns (``input_ids``, ``position_ids`` and ``labels`` or
``loss_mask``) must have one length per row, or nothing else can be read.

Each rule is one small function in one of the three tuples; a new rule, or a change to one (padding
segments, say), is made there and every reader follows: the loader raises the first problem
(:func:`packer.training.loader.check_rows`), ``verify`` reports them all, ``inspect`` checks the layout of
what it reads. Nulls, in any column or inside a list, are a problem before all of them
(:func:`null_columns`): the loader refuses a batch with one when it opens it, ``verify`` reports it.
The budget the rules check a build's rows against is its config's (:func:`build_limits`), for the
loader and ``verify`` alike. :func:`packer.building.writer.assemble` is what makes rows this way.

Cost: a few numpy passes over the batch's columns, no Python per row, each rule's common case (no
problem) in as few passes as it takes and the rows that break it found only when some do; the layout
and row rules never touch the token values, so checking them alone (``tokens=False``) reads only
offsets and the small columns. ``benchmarks/bench_loader.py`` measures it ("check_rows alone").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..planning.context_parallel import padding_positions
from .config import BuildConfig
from .schema import EXTRA_SEGMENT_COLUMNS, IGNORE_INDEX, LOSS_MASK

_BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], np.uint8)  # the set bits of each byte value
_BELOW = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64)) - np.uint64(1)  # a word's bits below bit i
_BITS = np.left_shift(np.uint8(1), np.arange(8, dtype=np.uint8))  # a byte's bit i alone
_HAS_BITWISE_COUNT = hasattr(np, "bitwise_count")  # numpy >= 2


def _popcount(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The set bits of each uint64: numpy's bitwise_count, or (numpy < 2) a table of the bytes'."""
    if _HAS_BITWISE_COUNT:
        return np.bitwise_count(words, out=out)
    counts = _BYTE_BITS[words.view(np.uint8)].reshape(words.size, 8).sum(1, dtype=np.uint8)  # uint8 as numpy's
    if out is None:
        return counts
    out[...] = counts
    return out


@dataclass(frozen=True, slots=True)
class Bits:
    """Booleans as Arrow packs them (a bit each, least significant first), read in place: ``bits`` is
    the bitmap's bytes (a view of the memory map), ``start`` the bit of value 0, ``size`` the values."""

    bits: np.ndarray
    start: int
    size: int

    @classmethod
    def of(cls, array: pa.Array) -> Bits:
        """A BooleanArray without nulls, zero copy."""
        buf = array.buffers()[1]
        bits = np.frombuffer(buf, np.uint8) if buf is not None else np.zeros(0, np.uint8)
        return cls(bits, array.offset, len(array))

    def __getitem__(self, part: slice) -> Bits:
        lo, hi, _ = part.indices(self.size)
        return Bits(self.bits, self.start + lo, max(hi - lo, 0))

    def unpack(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Values ``[lo, hi)`` as a bool array (a byte each: 1/8 of what int32 labels take to read)."""
        hi = self.size if hi is None else hi
        a, n = self.start + lo, hi - lo
        if n <= 0:
            return np.zeros(0, bool)
        # positional arguments: numpy's keyword parsing cost more than unpacking a row's bits
        return np.unpackbits(self.bits[a >> 3 : (a + n + 7) >> 3], None, None, "little")[a & 7 : (a & 7) + n].view(bool)

    def at(self, index: np.ndarray) -> np.ndarray:
        """The values at ``index`` (int64, each in ``[0, size)``), read from the bitmap in place: a few
        values (the segment starts, say) need not unpack the others."""
        x = index + self.start if self.start else index
        return (self.bits[x >> 3] & _BITS[x & 7]) != 0

    def count(self, offsets: np.ndarray) -> np.ndarray:
        """Per ``i``, the values set in ``[offsets[i], offsets[i + 1])`` (offsets int64, nondecreasing,
        within ``[0, size]``), int64. Counted from the bitmap by 64-bit words (1/64 of the values to add)
        as running sums, the set bits before each boundary: those of the words before its word, and those
        of its word below it."""
        if offsets.size < 2 or not self.size:
            return np.zeros(max(offsets.size - 1, 0), np.int64)
        first = (int(offsets[0]) + self.start) >> 6  # the word holding the first boundary
        rel = offsets + (self.start - (first << 6))  # the boundaries in bits from that word's first
        word = rel >> 6
        last = int(word[-1])
        # the bitmap from that word on, copied to aligned words (0 past the bitmap's end)
        words = np.zeros(last + 1, np.uint64)
        src = self.bits[first << 3 : (first + last + 1) << 3]
        words.view(np.uint8)[: src.size] = src
        before = np.zeros(last + 1, np.int64)  # per word, the set bits of the words before it
        _popcount(words[:last], out=before[1:])
        np.cumsum(before, out=before)
        upto = before[word] + _popcount(words[word] & _BELOW[rel & 63])
        return upto[1:] - upto[:-1]


@dataclass(frozen=True, slots=True)
class Column:
    """One list column of a batch: its flat values and its offsets (int64, starting at 0)."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray, offsets: np.ndarray) -> Column:
        """From a list array's child values and offsets as Arrow holds them (a slice's offsets need not
        start at 0): zero copy for the values."""
        offsets = np.asarray(offsets, np.int64)
        return cls(values[offsets[0] : offsets[-1]], offsets - offsets[0])

    @property
    def lengths(self) -> np.ndarray:
        return self.offsets[1:] - self.offsets[:-1]  # np.diff's, without its microseconds of argument handling


@dataclass(frozen=True, slots=True)
class RowBatch:
    """A batch of rows as numpy arrays. ``example_ids`` may be None (the loader does not read them).
    One of ``labels`` (format version 1) and ``loss_mask`` (version 2, its values :class:`Bits`) is set."""

    input_ids: Column
    position_ids: Column
    labels: Column | None
    seq_lens: Column
    example_ids: Column | None
    num_loss_tokens: np.ndarray
    max_seqlen: np.ndarray
    pad_lens: Column | None = None  # a padded build's (packer.planning.context_parallel): padding ending each segment
    pair_roles: Column | None = None  # a preference build's (packer.planning.pairs): 1 chosen, 0 rejected a segment
    loss_mask: Column | None = None  # format version 2's, in place of labels

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch, *, example_ids: bool = True) -> RowBatch:
        """Zero copy where Arrow allows; the token values are not read until a token rule needs them.
        ``example_ids=False`` leaves that column out (None), as the loader needs no example ids."""
        present = batch.schema.names
        names = ["input_ids", "position_ids", "seq_lens"] + ["example_ids"] * example_ids
        names += [n for n in ("labels", *EXTRA_SEGMENT_COLUMNS) if n in present]
        lists = {name: Column.of(batch.column(name).values.to_numpy(zero_copy_only=False), batch.column(name).offsets)
                 for name in names}
        if LOSS_MASK in present:
            mask = batch.column(LOSS_MASK)
            lists[LOSS_MASK] = Column.of(Bits.of(mask.values), mask.offsets)
        lists.setdefault("example_ids", None)
        lists.setdefault("labels", None)
        return cls(**lists, num_loss_tokens=batch.column("num_loss_tokens").to_numpy(),
                   max_seqlen=batch.column("max_seqlen").to_numpy())

    @property
    def loss(self) -> Column:
        """The loss column, whichever the format stores (``labels`` or ``loss_mask``)."""
        return self.labels if self.labels is not None else self.loss_mask

    def trained(self) -> np.ndarray:
        """Per token of the batch, whether it is trained (its label is not -100)."""
        if self.labels is not None:
            return self.labels.values != IGNORE_INDEX
        return self.loss_mask.values.unpack()

    def labels_of(self, lo: int, hi: int, ids: np.ndarray) -> np.ndarray:
        """The int64 labels of flat tokens ``[lo, hi)``, whose ids (int64) are ``ids``: the stored labels
        (version 1), or the ids where the mask is set and -100 elsewhere (version 2)."""
        if self.labels is not None:
            return self.labels.values[lo:hi].astype(np.int64)
        # a fill and a masked copy: twice as fast as np.where on long rows, and no slower on short ones
        out = np.empty(hi - lo, np.int64)
        out.fill(IGNORE_INDEX)
        np.copyto(out, ids, where=self.loss_mask.values.unpack(lo, hi))
        return out

    def padding(self) -> np.ndarray | None:
        """Per token, whether it is padding (None: the build has none), in the rows whose layout holds: a
        damaged row's counts mark nothing and shift no other row's padding."""
        return None if self.pad_lens is None else _padding_mask(_sound_layout(self))

    def segment_pads(self) -> np.ndarray | None:
        """Per segment, its pad count (None: the build has none); 0 in a row whose ``pad_lens`` is not one
        count per segment."""
        return None if self.pad_lens is None else _Layout(self, None, None).seg_pads

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.offsets.size - 1)


@dataclass(frozen=True, slots=True)
class Limits:
    """A build's budget, from its config (:func:`build_limits`): ``None`` where the mode sets no such limit."""

    max_segments: int | None = None  # batch: batch_size
    max_row_tokens: int | None = None  # bfd, optimal, wrap: max_tokens
    max_segment_tokens: int | None = None  # not wrap: max_len
    pair_prompts: bool = True  # a pair's two segments share their prompt tokens (not after --overlong truncate-left)


def build_limits(config: BuildConfig, paired: bool = False) -> Limits:
    """The budget a build's rows keep to, by its mode: what ``verify`` and the loader check them against."""
    per_row = None if config.pack != "batch" else config.batch_size * (2 if paired else 1)  # a pair: two segments
    return Limits(max_segments=per_row,
                  max_row_tokens=config.row_budget(),
                  max_segment_tokens=config.max_len if config.pack != "wrap" else None,
                  pair_prompts=config.overlong != "truncate-left")


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
    """One rule broken: the rows of the batch that break it (sorted, at least one) and what is wrong."""

    rows: np.ndarray
    message: str


class _Layout:
    """What the rules share, computed once per batch: row and segment lengths, each segment's row and
    first token, and ``bad``: the rows whose layout is broken (the token rules skip them)."""

    def __init__(self, batch: RowBatch, vocab: int | None, limits: Limits | None) -> None:
        self.batch, self.vocab, self.limits = batch, vocab, limits or Limits()
        self.n = batch.num_rows
        self.row_len = batch.input_ids.lengths
        self.seq = batch.seq_lens.values.astype(np.int64)
        self.nseg = batch.seq_lens.lengths
        self.cs = np.zeros(self.seq.size + 1, np.int64)  # the segment lengths' running sum, from 0
        np.cumsum(self.seq, out=self.cs[1:])
        self.bad = np.zeros(self.n, bool)
        self._seg_row: np.ndarray | None = None
        self._starts: np.ndarray | None = None
        self._trained: np.ndarray | None = None
        self._seg_pads: np.ndarray | None = None

    @property
    def seg_pads(self) -> np.ndarray:
        """Per segment, its pad count (a padded build's ``pad_lens``), each read through its own row's
        offsets; 0 in a row whose ``pad_lens`` is not one count per segment (``_pad_lens`` flags it), so a
        damaged row never shifts another row's counts."""
        if self._seg_pads is None:
            pads = self.batch.pad_lens
            counted = pads.lengths == self.nseg
            if np.count_nonzero(counted) == self.n:  # the common case: the columns line up whole
                self._seg_pads = pads.values.astype(np.int64)
            else:
                self._seg_pads = np.zeros(self.seq.size, np.int64)
                seg = np.flatnonzero(counted[self.seg_row])
                row = self.seg_row[seg]
                self._seg_pads[seg] = pads.values[pads.offsets[row] + seg - self.batch.seq_lens.offsets[row]]
        return self._seg_pads

    @property
    def seg_row(self) -> np.ndarray:
        """Per segment, its row."""
        if self._seg_row is None:
            self._seg_row = np.repeat(np.arange(self.n), self.nseg)
        return self._seg_row

    @property
    def seg_in_row(self) -> np.ndarray:
        """Per segment, its index in its row (0 for a row's first)."""
        return np.arange(self.seq.size) - self.batch.seq_lens.offsets[self.seg_row]

    def good_segments(self) -> np.ndarray:
        """The segments (indices) of the rows whose layout holds."""
        return np.flatnonzero(~self.bad[self.seg_row]) if np.count_nonzero(self.bad) else np.arange(self.seq.size)

    def roles(self, seg: np.ndarray) -> np.ndarray:
        """A preference build's pair role of each segment ``seg`` (rows whose layout holds: one role a
        segment), each through its own row's offsets."""
        roles, row = self.batch.pair_roles, self.seg_row[seg]
        return roles.values[roles.offsets[row] + seg - self.batch.seq_lens.offsets[row]]

    @property
    def trained(self) -> np.ndarray:
        """Per token, whether it is trained (the batch's labels or mask, read once)."""
        if self._trained is None:
            self._trained = self.batch.trained()
        return self._trained

    @property
    def loss_bits(self) -> Bits:
        """Per token, whether it is trained, as bits: format 2's mask as stored, format 1's labels packed
        (a packing and a count by words cost half of summing a byte per token)."""
        if self.batch.labels is None:
            return self.batch.loss_mask.values
        return Bits(np.packbits(self.trained, None, "little"), 0, self.trained.size)

    def rows_of_segments(self, mask: np.ndarray) -> np.ndarray:
        """The rows holding a segment where ``mask`` (one entry per segment) is set."""
        rows = np.zeros(self.n, bool)
        if np.count_nonzero(mask):
            rows[self.seg_row[mask]] = True
        return rows

    def rows_of_tokens(self, mask: np.ndarray) -> np.ndarray:
        """The rows holding a token where ``mask`` (one entry per token) is set, among those whose layout holds."""
        rows = np.zeros(self.n, bool)
        if mask.any():
            rows[np.searchsorted(self.batch.input_ids.offsets, np.flatnonzero(mask), side="right") - 1] = True
        return rows & ~self.bad

    @property
    def starts(self) -> np.ndarray:
        """The flat token index of every segment start of the rows whose layout holds (sorted)."""
        if self._starts is None:
            if not np.count_nonzero(self.bad) and not self.batch.input_ids.offsets[0]:
                # every row's segments sum to its length, so rows and segments tile the tokens alike (from
                # token 0, as Column.of's offsets start)
                self._starts = self.cs[:-1]
            else:
                seg_off, seg_row = self.batch.seq_lens.offsets, self.seg_row
                # a segment's start: its row's first token plus the lengths before it in the row
                start = self.batch.input_ids.offsets[seg_row] + self.cs[:-1] - self.cs[seg_off[seg_row]]
                self._starts = start[~self.bad[seg_row]]
        return self._starts

    @property
    def good_tokens(self) -> np.ndarray | None:
        """Per token, whether its row's layout holds; None when every row's does (the common case)."""
        return None if not np.count_nonzero(self.bad) else np.repeat(~self.bad, self.row_len)


Rule = Callable[[_Layout], Iterator[tuple[np.ndarray, str]]]  # yields (rows broken, message)


# -- layout: offsets and the small columns ------------------------------------------------------------


def _segment_lengths(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    lists = lay.batch.example_ids
    if lists is not None:
        yield lists.lengths != lay.nseg, "example_ids has another length than seq_lens"
    yield lay.nseg == 0, "no segments (an empty row)"
    yield lay.rows_of_segments(lay.seq <= 0), "a segment length ≤ 0 in seq_lens"
    cs, seg_off = lay.cs, lay.batch.seq_lens.offsets
    yield cs[seg_off[1:]] - cs[seg_off[:-1]] != lay.row_len, \
        "seq_lens do not sum to the row's length (len(input_ids)): the segment boundaries are wrong"


def _max_seqlen(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    held = lay.nseg > 0
    if lay.seq.size and np.count_nonzero(held) == lay.n:  # every row has a segment (the common case)
        longest = np.maximum.reduceat(lay.seq, lay.batch.seq_lens.offsets[:-1])
    else:
        longest = np.zeros(lay.n, np.int64)
        if lay.seq.size:
            longest[held] = np.maximum.reduceat(lay.seq, lay.batch.seq_lens.offsets[:-1][held])
    yield ~lay.bad & (longest != lay.batch.max_seqlen), "max_seqlen differs from max(seq_lens)"


def _example_ids(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    lists = lay.batch.example_ids
    if lists is not None and lists.values.size == lay.seq.size:
        yield lay.rows_of_segments(lists.values < 0), "a negative example id"


def _budget(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    limit = lay.limits
    if limit.max_segments is not None:
        yield lay.nseg > limit.max_segments, f"more than batch_size={limit.max_segments} segments"
    if limit.max_row_tokens is not None:
        yield lay.row_len > limit.max_row_tokens, f"more than max_tokens={limit.max_row_tokens:,} tokens"
    if limit.max_segment_tokens is not None:  # max_len counts the examples' tokens, not their padding
        pads = 0 if lay.batch.pad_lens is None else lay.seg_pads
        yield lay.rows_of_segments(lay.seq - pads > limit.max_segment_tokens), \
            f"a segment longer than max_len={limit.max_segment_tokens:,}"


# A padded build (packer.planning.context_parallel): each segment's last pad_lens tokens are padding, which leaves
# at least one real token and is trained nowhere; its positions continue, so the rules above hold as they are.
def _pad_lens(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    pads = lay.batch.pad_lens
    if pads is not None:
        yield (pads.lengths != lay.nseg) | lay.rows_of_segments((lay.seg_pads < 0) | (lay.seg_pads >= lay.seq)), \
            "pad_lens is not one count per segment, each below the segment's length"


# A preference build (packer.planning.pairs): a row holds whole pairs, two adjacent segments each, chosen (role
# 1) then rejected (0), of one record; what a DPO step pairs (packer.training.preference), so never trusted.
def _whole_pairs(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    roles = lay.batch.pair_roles
    if roles is not None:
        yield (roles.lengths != lay.nseg) | (lay.nseg % 2 == 1), \
            "a row holds whole pairs: an even number of segments, one pair_roles entry each"


def _pairs(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    if lay.batch.pair_roles is None or not lay.seq.size:
        return
    seg = lay.good_segments()
    first = (lay.seg_in_row[seg] % 2) == 0  # a pair's chosen segment: even in its row (rows hold whole pairs)
    yield lay.rows_of_segments(_at(seg, lay.roles(seg) != first, lay.seq.size)), \
        "pair roles are not chosen, rejected in turn (1, 0, 1, 0, ...)"
    ids = lay.batch.example_ids
    if ids is not None and ids.values.size == lay.seq.size:
        chosen = seg[first]  # its rejected segment is the next
        yield lay.rows_of_segments(_at(chosen, ids.values[chosen] != ids.values[chosen + 1], lay.seq.size)), \
            "a pair's two segments come from different records (example ids differ)"


def _pair_prompts(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    if lay.batch.pair_roles is None or not lay.limits.pair_prompts or not lay.seq.size:
        return
    # the segments of the rows whose layout holds, pairs adjacent, in the order of lay.starts
    seg = lay.good_segments()
    start = lay.starts
    end = start + lay.seq[seg]
    # a segment's prompt: its tokens before the first trained one (its first token is never trained)
    trained = np.flatnonzero(lay.trained)
    at = np.searchsorted(trained, start + 1)
    first = trained[np.minimum(at, trained.size - 1)] if trained.size else end
    prompt = np.where(at < trained.size, np.minimum(first, end), end) - start
    a, b = slice(0, None, 2), slice(1, None, 2)
    wrong = prompt[a] != prompt[b]
    same = np.flatnonzero(~wrong)
    n = prompt[a][same]
    if n.sum():  # the prompts' tokens side by side, pair by pair
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        ids = lay.batch.input_ids.values
        differ = ids[np.repeat(start[a][same], n) + within] != ids[np.repeat(start[b][same], n) + within]
        if np.count_nonzero(differ):
            wrong[same[np.unique(np.repeat(np.arange(same.size), n)[differ])]] = True
    yield lay.rows_of_segments(_at(seg[a], wrong, lay.seq.size)), "chosen and rejected do not share their prompt tokens"


def _at(index: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """A bool array of ``size`` set at ``index`` where ``values``."""
    out = np.zeros(size, bool)
    out[index[values]] = True
    return out


def _padding(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    if lay.batch.pad_lens is not None:
        yield lay.rows_of_tokens(_padding_mask(lay) & lay.trained), "a padding token is trained"


def _padding_mask(lay: _Layout) -> np.ndarray:
    """Per token, whether it is padding, in the rows whose layout holds (their pad counts sound, as
    _pad_lens has run), each segment's end from its own row's start: a broken row shifts no other's."""
    good = ~lay.bad[lay.seg_row]
    padding = np.zeros(lay.batch.input_ids.values.size, bool)
    padding[padding_positions(lay.starts + lay.seq[good], lay.seg_pads[good])] = True
    return padding


def _sound_layout(batch: RowBatch) -> _Layout:
    """``batch``'s layout with the rows the layout rules break marked bad, as check_rows marks them."""
    lay = _Layout(batch, None, None)
    _mark_layout(lay)
    return lay


def _mark_layout(lay: _Layout) -> list[Problem]:
    """The layout rules' problems; the rows they break marked bad in ``lay`` (every later rule skips them)."""
    problems = []
    for rule in LAYOUT_RULES:
        for broken, message in rule(lay):
            if np.count_nonzero(broken):  # a few rows' booleans, where .any() costs its wrapper's microsecond
                problems.append(Problem(np.flatnonzero(broken), message))
                lay.bad |= broken
    return problems


# -- tokens: the rows whose layout holds ------------------------------------------------------------


def _positions(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    pos, starts = lay.batch.position_ids.values, lay.starts
    if pos.dtype.itemsize < 4 and lay.seq.size:  # narrow positions (format 2): their steps wrap past the type's top
        count = int(np.iinfo(pos.dtype).max) + 1
        if int(lay.seq.max()) > count:
            yield ~lay.bad & lay.rows_of_segments(lay.seq > count), \
                f"a segment longer than its {pos.dtype} position_ids can count ({count:,})"
    # 0 at every segment start and +1 everywhere else. The common case, all of them sound, in two passes
    # in the stored type: each token's step from the one before, a start's from -1 (so 1 means 0 there)
    if pos.size:
        step = np.empty(pos.size, pos.dtype)
        np.subtract(pos[1:], pos[:-1], out=step[1:])
        step[0] = 1  # no token before it: a step of 1, unless it is a start (set next)
        step[starts] = pos[starts] + 1  # wraps at the type's top, to a step other than 1
        if step.min() == 1 == step.max():  # two reductions: no array of booleans to write
            return
    # some step is not 1 (a broken layout's row may be all it is): which tokens, in the rows whose layout
    # holds; the steps into a start are set to 1 first
    step = pos[1:] - pos[:-1]
    step[starts[starts > 0] - 1] = 1
    wrong = np.zeros(pos.size, bool)
    wrong[1:] = step != 1
    wrong[starts] = pos[starts] != 0
    if lay.good_tokens is not None:
        wrong &= lay.good_tokens
    yield lay.rows_of_tokens(wrong), ("position_ids do not run 0..len-1 inside each segment (they must restart "
                                      "at 0 exactly at the seq_lens boundaries)")


def _labels(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    ids, starts, labels = lay.batch.input_ids.values, lay.starts, lay.batch.labels
    # a start's bit read alone (format 2): the mask is not unpacked for it
    at_start = lay.trained[starts] if labels is not None else lay.batch.loss_mask.values.at(starts)
    if np.count_nonzero(at_start):
        wrong = np.zeros(ids.size, bool)
        wrong[starts] = at_start
        yield lay.rows_of_tokens(wrong), ("a label is not -100 at a segment start: a label crosses an example "
                                          "boundary")
    if labels is not None:  # a mask's labels are the ids by construction
        other = labels.values != ids
        other &= lay.trained
        yield lay.rows_of_tokens(other), "a label is neither -100 nor the input id at its position"
    loss = lay.loss_bits.count(lay.batch.input_ids.offsets)
    yield ~lay.bad & (loss != lay.batch.num_loss_tokens), "num_loss_tokens differs from the count of labels ≠ -100"


def _vocab(lay: _Layout) -> Iterator[tuple[np.ndarray, str]]:
    ids = lay.batch.input_ids.values
    if ids.dtype.kind == "i":  # a negative id is huge, so one comparison finds both
        ids = ids.view(np.dtype(f"u{ids.dtype.itemsize}"))
    if lay.vocab is not None and ids.size and int(ids.max()) >= lay.vocab:
        yield lay.rows_of_tokens(ids >= lay.vocab), \
            f"token ids outside [0, {lay.vocab:,}) (the tokenizer's vocab size)"


LAYOUT_RULES: tuple[Rule, ...] = (_segment_lengths, _pad_lens, _whole_pairs)  # a row they break: skipped by the rest
ROW_RULES: tuple[Rule, ...] = (_max_seqlen, _example_ids, _pairs, _budget)
TOKEN_RULES: tuple[Rule, ...] = (_positions, _labels, _vocab, _padding, _pair_prompts)


def check_rows(batch: RowBatch, vocab: int | None, limits: Limits | None = None, *,
               tokens: bool = True) -> list[Problem]:
    """Every rule a batch's rows break, in rule order (an empty list: the rows are sound).

    ``vocab``: token ids must be below it (None: not checked). ``limits``: the build's budget.
    ``tokens=False`` checks the layout and the small columns only, never reading the token values."""
    problems: list[Problem] = []
    ids_off = batch.input_ids.offsets
    for name in ("position_ids", "labels" if batch.labels is not None else LOSS_MASK):
        off = getattr(batch, name).offsets
        # the same offsets, the same lengths (the common case; compared as bytes, a tenth of np.array_equal's time)
        if off.dtype == ids_off.dtype and off.shape == ids_off.shape and off.tobytes() == ids_off.tobytes():
            continue
        ids_len = batch.input_ids.lengths
        wrong = ids_len != np.diff(off) if off.size == ids_len.size + 1 else np.ones(batch.num_rows, bool)
        if wrong.any():  # the flat token columns no longer line up: no other rule can be read
            problems.append(Problem(np.flatnonzero(wrong), f"{name} has another length than input_ids"))
    if problems:
        return problems
    lay = _Layout(batch, vocab, limits)
    problems = _mark_layout(lay)
    for rule in ROW_RULES + (TOKEN_RULES if tokens else ()):
        for broken, message in rule(lay):
            if np.count_nonzero(broken):
                problems.append(Problem(np.flatnonzero(broken), message))
    return problems


def check_arrow(batch: pa.RecordBatch, vocab: int | None, limits: Limits | None = None, *,
                tokens: bool = True) -> list[Problem]:
    """:func:`check_rows` of an Arrow record batch of the row schema; nulls are a problem of their own."""
    nulls = null_problem(batch)
    if nulls is not None:
        return [nulls]
    return check_rows(RowBatch.from_arrow(batch), vocab, limits, tokens=tokens)


def null_columns(batch: pa.RecordBatch) -> list[str]:
    """The columns holding a null, as a row or inside one (a list's values): no rule can read them, numpy
    has no null. Cost: Arrow's counts (an IPC stream records them), no pass over the values."""
    return [name for name in batch.schema.names
            if (col := batch.column(name)).null_count or (isinstance(col, pa.ListArray) and col.values.null_count)]


def null_problem(batch: pa.RecordBatch) -> Problem | None:
    """Nulls in ``batch``, as the one problem that stops every other check, or None."""
    nulls = null_columns(batch)
    return Problem(np.arange(batch.num_rows), f"null values in {', '.join(nulls)}") if nulls else None
