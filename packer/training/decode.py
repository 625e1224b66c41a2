"""A row's values from its stored columns, either format: the numpy arrays the loader hands to torch.

Two implementations give the same arrays. The compiled kernel (``_rowkernel.c``, built where the
install found a C compiler) decodes a row in one call. numpy, the reference, needs a call a column
and, for format 2, an unpack of the mask's bits and a masked copy: numpy has no fused select by a
bitmap, so without the kernel a format-2 row costs more than a format-1 row (docs/loader.md, "Speed";
``benchmarks/bench_loader.py`` measures both). ``tests/test_decode.py`` holds the two equal.
"""

from __future__ import annotations

import numpy as np

from packer.contract import rows, schema

try:
    from packer.training import _rowkernel
except ImportError:  # installed without a C compiler: numpy decodes the same values
    _rowkernel = None

# the implementation rows are decoded with: the kernel where it was built, else None (numpy); tests and
# the benchmark set it to compare the two
KERNEL = _rowkernel

# input_ids, position_ids, labels (int64 [1, T]), seq_idx (int32 [1, T]), cu_seq_lens (int32 [n + 1])
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


Span = tuple[int, int, int, int]  # a row's flat tokens [o0, o1) and segments [s0, s1) in its batch


def spans(r: rows.RowBatch) -> list[Span]:
    """Every row's span, as Python ints: made once a batch, as a numpy scalar costs ~0.1 µs a read."""
    tokens, segments = r.input_ids.offsets.tolist(), r.seq_lens.offsets.tolist()
    return list(zip(tokens[:-1], tokens[1:], segments[:-1], segments[1:], strict=True))


Columns = tuple  # kernel_columns(r): what the kernel reads of a batch, the same for each of its rows


def kernel_columns(r: rows.RowBatch) -> Columns:
    """``r``'s flat columns as the kernel takes them: ids, positions, the stored labels (format 1) or the
    loss mask's bitmap and the bit of its value 0 (format 2; -1 marks labels), the segment lengths."""
    if r.labels is not None:
        stored, bit_start = r.labels.values, -1
    else:
        stored, bit_start = r.loss_mask.values.bits, r.loss_mask.values.start
    return r.input_ids.values, r.position_ids.values, stored, bit_start, r.seq_lens.values


def kernel_row(columns: Columns, where: Span, filler: bool) -> Arrays:
    """The row at ``where`` of the batch whose ``kernel_columns`` are ``columns``, by the compiled
    kernel; ``filler``: its labels all -100."""
    o0, o1, s0, s1 = where
    n = o1 - o0
    ids, pos, labels = np.empty((1, n), np.int64), np.empty((1, n), np.int64), np.empty((1, n), np.int64)
    seq_idx, cu = np.empty((1, n), np.int32), np.empty(s1 - s0 + 1, np.int32)
    token_ids, positions, stored, bit_start, seq_lens = columns
    if filler:
        stored, bit_start = None, -1
    KERNEL.decode(token_ids, positions, stored, bit_start, seq_lens, o0, o1, s0, s1, ids, pos, labels, seq_idx, cu)
    return ids, pos, labels, seq_idx, cu


def numpy_row(r: rows.RowBatch, j: int, where: Span, filler: bool, bounds: np.ndarray) -> Arrays:
    """Row ``j`` of ``r`` (at ``where``) by numpy; ``bounds`` is ``row_bounds(r)``, made once a batch."""
    o0, o1, s0, s1 = where
    ids = r.input_ids.values[o0:o1].astype(np.int64)
    if filler:
        labels = np.full(o1 - o0, schema.IGNORE_INDEX, np.int64)
    else:  # the stored labels (format 1) or the ids where the loss mask is set (format 2)
        labels = r.labels_of(o0, o1, ids)
    pos = r.position_ids.values[o0:o1].astype(np.int64)
    # each token's segment index, as causal-conv1d and the Mamba2 scan take it (docs/loader.md)
    seq_idx = np.arange(s1 - s0, dtype=np.int32).repeat(r.seq_lens.values[s0:s1])
    # [None]: the (1, tokens) shape made in numpy, cheaper than a torch .view; the bounds a copy: the
    # array is the caller's to change, the table is not
    return ids[None], pos[None], labels[None], seq_idx[None], bounds[s0 + j : s1 + j + 1].copy()


def row_bounds(r: rows.RowBatch) -> np.ndarray:
    """Every row's ``cu_seq_lens`` (int32) one after another: row j's are ``[s0 + j, s1 + j]`` of it, where
    ``[s0, s1)`` are its segments; one vectorised pass over a batch's segments, whose layout holds."""
    seg_rows = np.repeat(np.arange(r.num_rows), r.seq_lens.lengths)  # each segment's row
    ends = np.cumsum(r.seq_lens.values.astype(np.int64))  # each segment's end, in the batch's tokens
    bounds = np.zeros(r.seq_lens.values.size + r.num_rows, np.int32)
    bounds[np.arange(seg_rows.size) + seg_rows + 1] = ends - r.input_ids.offsets[seg_rows]
    return bounds
