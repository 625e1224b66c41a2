"""Planned rows → Arrow IPC stream shards in the staging folder (:mod:`packer.building.output` commits them).

Row assembly works on a block of rows (a record batch of ≤ TOKENS_PER_BATCH tokens): each segment's
ids and loss flags are read from the token spill straight into the batch's columns (``preadv``, one
call per segment and file), and positions, labels and the per-row columns are computed with numpy over
the whole block. The columns take the build's :class:`~packer.contract.schema.RowFormat`: int32 ids,
positions and labels (format version 1), or ids and positions in uint16/uint32 and the loss as a
bit mask (version 2; positions are counted in their own type, whose wrap-around is exact below its
top, so narrowing costs one cast of the ids and a bit-packing of the mask).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .. import fs
from ..contract import schema
from ..planning.context_parallel import padding_positions
from ..planning.plan import Plan
from .image_rows import image_columns, row_bytes
from .spill import TokenStore

ROWS_PER_BATCH = 1024  # Arrow record batch: at most this many rows ...
TOKENS_PER_BATCH = 1 << 20  # ... and this many tokens, which bounds the memory of assembling one


def _version_1(plan: Plan) -> schema.RowFormat:
    """What a caller that names no format gets: the format every packer wrote first."""
    return schema.RowFormat(1, extra=(schema.PAD_COLUMN,) * (plan.pad is not None) + (schema.PAIR_COLUMN,) * _paired(plan))


def _paired(plan: Plan) -> bool:
    """A preference build's plan (packer.planning.pairs): its rows hold whole pairs."""
    return plan.stats.get("pairs") is not None


def assemble(plan: Plan, store: TokenStore, row_lo: int, row_hi: int,
             counts: dict[str, int] | None = None, row_format: schema.RowFormat | None = None) -> pa.RecordBatch:
    """The Arrow record batch of rows [row_lo, row_hi) of the plan in ``row_format`` (version 1 when
    None): the token columns and a one-byte loss flag per token are its only batch-sized arrays. Its
    counts (rows, tokens, loss tokens, segments that hold no trained token) are added into ``counts``."""
    fmt = row_format or _version_1(plan)
    if fmt.padded != (plan.pad is not None):
        raise ValueError(f"row format {fmt} and a plan {'with' if plan.pad is not None else 'without'} padding")
    s_lo, s_hi = int(plan.row_splits[row_lo]), int(plan.row_splits[row_hi])
    seg_len = plan.length[s_lo:s_hi]
    seg_ex = plan.example[s_lo:s_hi]
    seg_src = store.offsets[seg_ex] + plan.start[s_lo:s_hi]
    seg_pad = None if plan.pad is None else plan.pad[s_lo:s_hi]
    seg_out = np.zeros(len(seg_len) + 1, dtype=np.int64)
    np.cumsum(seg_len if seg_pad is None else seg_len + seg_pad, out=seg_out[1:])
    total = int(seg_out[-1])
    input_ids = np.empty(total, dtype=np.int32)  # the spill's type, read into in place
    position = np.empty(total, dtype=np.int32 if fmt.version == 1 else np.dtype(fmt.positions))
    target = np.empty(total, dtype=bool)
    _read_segments(store, seg_src, seg_out, seg_len, input_ids, target)
    if seg_pad is not None:  # padding (packer.planning.context_parallel): after each segment's tokens, trained nowhere
        at = padding_positions(seg_out[1:], seg_pad)
        input_ids[at] = plan.pad_id
        target[at] = False
        seg_len = seg_len + seg_pad
    # positions count up from 0 in each segment: a running sum of ones, knocked back at each start (in
    # an unsigned type the knock-back wraps around, and the sum with it: exact while positions fit)
    position.fill(1)
    if total:
        position[seg_out[1:-1]] = (1 - seg_len[:-1]).astype(position.dtype, casting="unsafe")
        position[0] = 0
        np.cumsum(position, out=position)
    target[seg_out[:-1][seg_len > 0]] = False  # unshifted labels; -100 at every segment start
    if fmt.version == 1:
        loss = input_ids.copy()
        loss[~target] = schema.IGNORE_INDEX
        loss_values, ids_values = _arrow(loss), _arrow(input_ids)
    else:
        loss_values = _bits(target)
        ids_values = _arrow(input_ids.astype(fmt.ids))  # every id is below the type's top (RowFormat.of)

    seg_splits = plan.row_splits[row_lo : row_hi + 1] - s_lo
    token_splits = seg_out[seg_splits]
    num_loss = np.add.reduceat(target, token_splits[:-1]).astype(np.int32) if total else np.zeros(0, np.int32)
    max_seqlen = np.maximum.reduceat(seg_len, seg_splits[:-1]).astype(np.int32)
    if counts is not None:
        counts["rows"] += row_hi - row_lo
        counts["tokens"] += total
        counts["loss_tokens"] += int(num_loss.sum())
        if total:
            counts["segments_without_loss"] += int((np.add.reduceat(target, seg_out[:-1]) == 0).sum())

    tok_off = _arrow(token_splits.astype(np.int32))
    seg_off = _arrow(seg_splits.astype(np.int32))
    columns = [
        pa.ListArray.from_arrays(tok_off, ids_values),
        pa.ListArray.from_arrays(tok_off, _arrow(position)),
        pa.ListArray.from_arrays(tok_off, loss_values),
        pa.ListArray.from_arrays(seg_off, _arrow(seg_len.astype(np.int32))),
        pa.ListArray.from_arrays(seg_off, _arrow(store.example_ids[seg_ex].astype(np.int64))),
        _arrow(num_loss),
        _arrow(max_seqlen),
    ]
    if seg_pad is not None:
        columns.append(pa.ListArray.from_arrays(seg_off, _arrow(seg_pad.astype(np.int32))))
    if schema.PAIR_COLUMN in fmt.extra:  # rows hold whole pairs, so a segment's parity is its role: chosen first
        columns.append(pa.ListArray.from_arrays(seg_off, _arrow((np.arange(s_lo, s_hi) % 2 == 0).astype(np.int8))))
    if fmt.images:  # an image build: its rows' images (packer.building.image_rows)
        columns += image_columns(store.images, plan, s_lo, s_hi, seg_splits)
    return pa.RecordBatch.from_arrays(columns, schema=fmt.schema())


def _bits(flags: np.ndarray) -> pa.Array:
    """A bool array as an Arrow BooleanArray (a bit each, least significant first), no nulls."""
    return pa.Array.from_buffers(pa.bool_(), len(flags), [None, pa.py_buffer(np.packbits(flags, bitorder="little"))])


def _arrow(values: np.ndarray) -> pa.Array:
    """A numpy array of numbers as an Arrow array sharing its memory. Not ``pa.array``: it imports pandas
    (0.2 s of every build) to ask whether its argument is a pandas object."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _read_segments(store: TokenStore, seg_src, seg_out, seg_len, input_ids: np.ndarray, trained: np.ndarray) -> None:
    """Read each segment's ids and trained flags with ``preadv`` straight into the batch's columns.

    Explicit reads copy from the page cache and leave nothing mapped, so the resident set holds only
    the batch; a gather through a memory map faults in (and keeps) pages all over the spill, which
    measured 449 MiB max RSS at 16x the bundled sample against 364 MiB this way, at the same speed. Cost:
    two syscalls per segment, small beside tokenizing the segment in the first place."""
    ids_view = memoryview(input_ids).cast("B")
    trained_view = memoryview(trained.view(np.uint8))
    fd_ids, fd_trained = os.open(store.ids_path, os.O_RDONLY), os.open(store.trained_path, os.O_RDONLY)
    try:
        preadv = os.preadv
        for src, dst, n in zip(seg_src.tolist(), seg_out[:-1].tolist(), seg_len.tolist()):
            if (preadv(fd_ids, [ids_view[dst * 4 : (dst + n) * 4]], src * 4) != n * 4
                    or preadv(fd_trained, [trained_view[dst : dst + n]], src) != n):
                raise OSError(f"{store.ids_path}: short read of the token spill at token {src}")
    finally:
        os.close(fd_ids)
        os.close(fd_trained)


def shard_bounds(plan: Plan, shard_bytes: int, row_format: schema.RowFormat | None = None,
                 extra: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Cut the rows into shards of about ``shard_bytes`` uncompressed (never an empty shard, always ≥ 1 row);
    ``extra``: each row's bytes beside its tokens (an image build's images)."""
    if plan.num_rows == 0:
        return []
    segments = np.diff(plan.row_splits)
    per_token = (row_format or _version_1(plan)).bytes_per_token()  # the token columns; then the two segment columns
    row_bytes = plan.row_lengths() * per_token + segments * 12 + 16
    if extra is not None:
        row_bytes = row_bytes + extra
    ends = np.cumsum(row_bytes)
    bounds, lo, base = [], 0, 0
    while lo < plan.num_rows:
        hi = int(np.searchsorted(ends, base + shard_bytes, side="right"))
        hi = max(hi, lo + 1)
        bounds.append((lo, hi))
        base = int(ends[hi - 1])
        lo = hi
    return bounds


def batch_bounds(plan: Plan, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """Cut rows [lo, hi) into record batches of ≤ ROWS_PER_BATCH rows and ≤ TOKENS_PER_BATCH tokens
    (at least one row each), so the memory of one batch does not grow with the row budget."""
    ends = np.cumsum(plan.row_lengths()[lo:hi])
    first, base = lo, 0
    while first < hi:
        last = lo + int(np.searchsorted(ends, base + TOKENS_PER_BATCH, side="right"))
        last = min(hi, first + ROWS_PER_BATCH, max(last, first + 1))
        yield first, last
        base = int(ends[last - lo - 1])
        first = last


def write_shard(plan: Plan, store: TokenStore, path: Path, lo: int, hi: int,
                on_rows: Callable[[int], None] = lambda n: None, stop: threading.Event | None = None, *,
                row_format: schema.RowFormat | None = None, compression: str | None = None) -> dict:
    """Write rows [lo, hi) as one Arrow stream file in ``row_format`` (version 1 when None), its
    buffers compressed by ``compression`` (None or "zstd"); returns its counts (rows, tokens, loss
    tokens and segments that hold no trained token, which a truncated completion-only example
    becomes) and its ``sha256``, hashed as it is written (not read back once written). When ``stop``
    is set it ends after the batch it is writing (the build failed elsewhere)."""
    counts = {"rows": 0, "tokens": 0, "loss_tokens": 0, "segments_without_loss": 0}
    fmt = row_format or _version_1(plan)
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with (ThreadPoolExecutor(1, thread_name_prefix="packer-assemble") as pool, _Hashed(path) as file,
          pa.PythonFile(file, mode="w") as sink, pa.ipc.new_stream(sink, fmt.schema(), options=options) as writer):
        for batch, rows in _assembled_ahead(pool, plan, store, batch_bounds(plan, lo, hi), counts, fmt):
            if stop is not None and stop.is_set():
                break
            writer.write_batch(batch)
            del batch  # before the one after next is assembled: two batches in memory at most
            on_rows(rows)
    return {**counts, "sha256": file.digest.hexdigest()}


class _Hashed:
    """A file opened for writing that hashes what is written to it: a shard's sha256 without reading the shard
    back (hashlib and the write release the GIL, so it runs beside the thread assembling the next batch)."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")  # noqa: SIM115 (closed with this)
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    @property
    def closed(self) -> bool:
        return self.file.closed

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> _Hashed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _assembled_ahead(pool: ThreadPoolExecutor, plan: Plan, store: TokenStore, bounds: Iterator[tuple[int, int]],
                     counts: dict[str, int], fmt: schema.RowFormat) -> Iterator[tuple[pa.RecordBatch, int]]:
    """(record batch, rows) for each of ``bounds``, the next one assembled in ``pool`` while this one is
    written: the reads and numpy release the GIL, so assembling and writing overlap."""
    ahead: deque = deque()
    for b_lo, b_hi in bounds:
        ahead.append((pool.submit(assemble, plan, store, b_lo, b_hi, counts, fmt), b_hi - b_lo))
        if len(ahead) > 1:
            yield _take(ahead)
    while ahead:
        yield _take(ahead)


def _take(ahead: deque) -> tuple[pa.RecordBatch, int]:
    # no name here outlives the call: a batch handed out is freed as soon as its writer drops it
    future, rows = ahead.popleft()
    return future.result(), rows


def shard_entry(path: Path, counts: dict) -> schema.ShardEntry:
    """The manifest's record of one written shard (its sha256 as :func:`write_shard` hashed it, else read)."""
    return schema.ShardEntry(file=path.name, rows=counts["rows"], tokens=counts["tokens"],
                             bytes=path.stat().st_size, sha256=counts.get("sha256") or fs.file_sha256(path))


@dataclass(frozen=True, slots=True)
class Written:
    """What writing a plan's shards gave: their manifest entries in order, and what the stats count
    from the rows written."""

    shards: tuple[schema.ShardEntry, ...]
    loss_tokens: int
    segments_without_loss: int  # a completion-only example truncated before its completion trains on nothing

    @classmethod
    def of(cls, done: list[tuple[schema.ShardEntry, dict[str, int]]]) -> Written:
        """From each shard's entry and its counts (:func:`write_shard`)."""
        return cls(tuple(entry for entry, _ in done), sum(c["loss_tokens"] for _, c in done),
                   sum(c["segments_without_loss"] for _, c in done))


def write_shards(plan: Plan, store: TokenStore, staging: Path, *, shard_bytes: int,
                 on_rows: Callable[[int], None] = lambda n: None, threads: int = 1,
                 row_format: schema.RowFormat | None = None, compression: str | None = None) -> Written:
    """Write every shard into ``staging``, ``threads`` at a time; their manifest entries, in order, and
    their counts. Threads, not processes: assembling is numpy, and writing
    and hashing are pyarrow's and hashlib's, which release the GIL; each thread writes whole shards, so
    the bytes do not depend on ``threads``."""
    bounds = shard_bounds(plan, shard_bytes, row_format, None if store.images is None else row_bytes(store.images, plan))
    stop = threading.Event()

    def one(index: int) -> tuple[schema.ShardEntry, dict[str, int]]:
        path = staging / schema.shard_name(index)
        counts = write_shard(plan, store, path, *bounds[index], on_rows, stop, row_format=row_format,
                             compression=compression)
        return shard_entry(path, counts) if not stop.is_set() else None, counts

    if threads <= 1 or len(bounds) <= 1:
        done = [one(index) for index in range(len(bounds))]
    else:
        with ThreadPoolExecutor(min(threads, len(bounds)), thread_name_prefix="packer-write") as pool:
            futures = [pool.submit(one, index) for index in range(len(bounds))]
            try:
                done = [future.result() for future in futures]
            except BaseException:  # an error or Ctrl-C: the others end after their current batch
                stop.set()
                for future in futures:
                    future.cancel()
                raise
    return Written.of(done)
