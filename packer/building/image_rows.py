"""An image build's image columns for a block of planned rows (the writer appends them to the token columns).

A segment holds the images whose whole span lies in its tokens (the encoder drops an example whose
``--max-len`` cut would fall inside or before an image, so a kept segment holds all its example's images);
a row's images are its segments', in token order. See :mod:`packer.contract.vision` for the columns.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..planning.plan import Plan
from .image_spill import ImageStore


def _arrow(values: np.ndarray) -> pa.Array:
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def segment_images(store: ImageStore, plan: Plan, s_lo: int, s_hi: int) -> np.ndarray:
    """The index rows of the images of segments [s_lo, s_hi), in order, and per segment how many."""
    rows, counts = [], []
    for e, start, length in zip(plan.example[s_lo:s_hi].tolist(), plan.start[s_lo:s_hi].tolist(),
                                plan.length[s_lo:s_hi].tolist()):
        k = np.arange(store.first[e], store.first[e + 1])
        first, extent = store.index[k, 4], store.index[k, 5]
        k = k[(first >= start) & (first + extent <= start + length)]
        rows.append(k)
        counts.append(len(k))
    return (np.concatenate(rows) if rows else np.zeros(0, np.int64)), np.asarray(counts, np.int64)


def image_columns(store: ImageStore, plan: Plan, s_lo: int, s_hi: int, seg_splits: np.ndarray) -> list[pa.Array]:
    """``images``, ``image_tokens``, ``image_sizes`` of the rows whose segments [s_lo, s_hi) ``seg_splits``
    (offsets into those segments, one per row boundary) cut."""
    rows, per_segment = segment_images(store, plan, s_lo, s_hi)
    seg_first = np.zeros(len(per_segment) + 1, np.int64)
    np.cumsum(per_segment, out=seg_first[1:])
    row_off = seg_first[seg_splits].astype(np.int32)
    blobs = store.read(rows)
    sizes = np.fromiter(map(len, blobs), np.int64, count=len(blobs))
    data_off = np.zeros(len(blobs) + 1, np.int64)
    np.cumsum(sizes, out=data_off[1:])
    binary = pa.Array.from_buffers(pa.large_binary(), len(blobs),
                                   [None, pa.py_buffer(data_off), pa.py_buffer(b"".join(blobs))])
    tokens = store.index[rows, 6].astype(np.int32)
    hw = store.index[rows][:, 2:4].astype(np.int32).reshape(-1)
    return [
        pa.ListArray.from_arrays(_arrow(row_off), binary),
        pa.ListArray.from_arrays(_arrow(row_off), _arrow(tokens)),
        pa.ListArray.from_arrays(_arrow(row_off * 2), _arrow(hw)),
    ]


def row_bytes(store: ImageStore, plan: Plan) -> np.ndarray:
    """Each planned row's image bytes (what ``--shard-size`` counts beside its tokens): its segments'
    examples' images (a kept segment holds all of its example's)."""
    per_example = np.zeros(len(store.first) - 1, np.int64)
    if len(store.index):
        sizes = np.concatenate([[0], np.cumsum(store.index[:, 1])])
        per_example = sizes[store.first[1:]] - sizes[store.first[:-1]]
    per_segment = per_example[plan.example]
    if len(per_segment) == 0:
        return np.zeros(plan.num_rows, np.int64)
    return np.add.reduceat(per_segment, plan.row_splits[:-1]) * (np.diff(plan.row_splits) > 0)
