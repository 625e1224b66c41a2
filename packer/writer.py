"""Rows → Arrow IPC stream shards, then the manifest, atomically.

Shards are written into a staging folder inside the output, moved into place when all are done, and
the manifest is written last (to a temporary name, fsynced, renamed): a folder without manifest.json
is never a finished build, whatever else it holds.

Row assembly works on a block of rows (a record batch of ≤ TOKENS_PER_BATCH tokens): each segment's
ids and loss flags are read from the token spill straight into the batch's columns (``preadv``, one
call per segment and file), and positions, labels and the per-row columns are computed with numpy over
the whole block.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import schema
from .plan import Plan

STAGING = ".packer-staging"
ROWS_PER_BATCH = 1024  # Arrow record batch: at most this many rows ...
TOKENS_PER_BATCH = 1 << 20  # ... and this many tokens, which bounds the memory of assembling one


@dataclass(frozen=True, slots=True)
class TokenStore:
    """All examples' tokens in two flat spill files: example k is tokens offsets[k]:offsets[k+1]."""

    ids_path: Path  # int32 per token
    trained_path: Path  # uint8 per token, 1 where the token is a target
    offsets: np.ndarray  # int64[examples+1]
    example_ids: np.ndarray  # int64[examples]: source record index of each example


def assemble(plan: Plan, store: TokenStore, row_lo: int, row_hi: int) -> pa.RecordBatch:
    """The Arrow record batch of rows [row_lo, row_hi) of the plan: three int32 token columns and a
    one-byte loss flag per token are its only batch-sized arrays."""
    s_lo, s_hi = int(plan.row_splits[row_lo]), int(plan.row_splits[row_hi])
    seg_len = plan.length[s_lo:s_hi]
    seg_ex = plan.example[s_lo:s_hi]
    seg_src = store.offsets[seg_ex] + plan.start[s_lo:s_hi]
    seg_out = np.zeros(len(seg_len) + 1, dtype=np.int64)
    np.cumsum(seg_len, out=seg_out[1:])
    total = int(seg_out[-1])
    input_ids = np.empty(total, dtype=np.int32)
    position = np.empty(total, dtype=np.int32)
    labels = np.empty(total, dtype=np.int32)
    target = np.empty(total, dtype=bool)
    _read_segments(store, seg_src, seg_out, seg_len, input_ids, target)
    # positions count up from 0 in each segment: a running sum of ones, knocked back at each start
    position.fill(1)
    if total:
        position[seg_out[1:-1]] = 1 - seg_len[:-1]
        position[0] = 0
        np.cumsum(position, out=position)
    target[seg_out[:-1][seg_len > 0]] = False  # unshifted labels; -100 at every segment start
    labels[:] = input_ids
    labels[~target] = schema.IGNORE_INDEX

    seg_splits = plan.row_splits[row_lo : row_hi + 1] - s_lo
    token_splits = seg_out[seg_splits]
    num_loss = np.add.reduceat(target, token_splits[:-1]).astype(np.int32) if total else np.zeros(0, np.int32)
    max_seqlen = np.maximum.reduceat(seg_len, seg_splits[:-1]).astype(np.int32)

    tok_off = pa.array(token_splits.astype(np.int32))
    seg_off = pa.array(seg_splits.astype(np.int32))
    columns = [
        pa.ListArray.from_arrays(tok_off, pa.array(input_ids)),
        pa.ListArray.from_arrays(tok_off, pa.array(position)),
        pa.ListArray.from_arrays(tok_off, pa.array(labels)),
        pa.ListArray.from_arrays(seg_off, pa.array(seg_len.astype(np.int32))),
        pa.ListArray.from_arrays(seg_off, pa.array(store.example_ids[seg_ex].astype(np.int64))),
        pa.array(num_loss, pa.int32()),
        pa.array(max_seqlen, pa.int32()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema.ROW_SCHEMA)


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


def shard_bounds(plan: Plan, shard_bytes: int) -> list[tuple[int, int]]:
    """Cut the rows into shards of about ``shard_bytes`` (never an empty shard, always ≥ 1 row)."""
    if plan.num_rows == 0:
        return []
    segments = np.diff(plan.row_splits)
    row_bytes = plan.row_lengths() * 12 + segments * 12 + 16  # three int32 token columns, two seg columns
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
                on_rows: Callable[[int], None] = lambda n: None) -> dict[str, int]:
    """Write rows [lo, hi) as one Arrow stream file; returns its counts (rows, tokens, loss tokens and
    segments that hold no trained token, which a truncated completion-only example becomes)."""
    counts = {"rows": 0, "tokens": 0, "loss_tokens": 0, "segments_without_loss": 0}
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema.ROW_SCHEMA) as writer:
        for b_lo, b_hi in batch_bounds(plan, lo, hi):
            batch = assemble(plan, store, b_lo, b_hi)
            writer.write_batch(batch)
            trained = batch.column(2).values.to_numpy() != schema.IGNORE_INDEX
            seq_lens = batch.column(3).values.to_numpy().astype(np.int64)
            starts = np.cumsum(seq_lens) - seq_lens
            counts["rows"] += b_hi - b_lo
            counts["tokens"] += len(trained)
            counts["loss_tokens"] += int(trained.sum())
            counts["segments_without_loss"] += int((np.add.reduceat(trained, starts) == 0).sum()) if len(trained) else 0
            del batch, trained  # before the next one is assembled: one batch in memory at a time
            on_rows(b_hi - b_lo)
    _fsync(path)
    return counts


def shard_entry(path: Path, counts: dict[str, int]) -> dict:
    """The manifest's record of one written shard."""
    return {"file": path.name, "rows": counts["rows"], "tokens": counts["tokens"],
            "bytes": path.stat().st_size, "sha256": schema.file_sha256(path)}


def write_shards(
    plan: Plan,
    store: TokenStore,
    out: Path,
    *,
    shard_bytes: int,
    totals: dict[str, int],
    on_rows: Callable[[int], None] = lambda n: None,
) -> Iterator[dict]:
    """Write every shard into the staging folder; yields each shard's manifest entry as it finishes
    and adds its loss counts into ``totals``."""
    staging = out / STAGING
    staging.mkdir(parents=True, exist_ok=True)
    for index, (lo, hi) in enumerate(shard_bounds(plan, shard_bytes)):
        path = staging / schema.shard_name(index)
        counts = write_shard(plan, store, path, lo, hi, on_rows)
        for key in ("loss_tokens", "segments_without_loss"):
            totals[key] = totals.get(key, 0) + counts[key]
        yield shard_entry(path, counts)


def commit(out: Path, manifest: dict) -> None:
    """Move the staged shards into place, write what ``datasets.load_from_disk`` reads beside them
    (``schema.DATASETS_FILES``), then the manifest last (the commit point)."""
    staging = out / STAGING
    for entry in manifest["shards"]:
        os.replace(staging / entry["file"], out / entry["file"])
    for name, data in schema.datasets_files(manifest).items():
        (staging / name).write_bytes(data)
        _fsync(staging / name)
        os.replace(staging / name, out / name)
    tmp = out / (schema.MANIFEST_NAME + ".tmp")
    tmp.write_bytes(schema.dump_manifest(manifest))
    _fsync(tmp)
    os.replace(tmp, out / schema.MANIFEST_NAME)
    _fsync_dir(out)
    shutil.rmtree(staging, ignore_errors=True)


def clear_output(out: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove a previous build: the manifest first, so the folder stops looking complete at once.

    ``keep`` names entries of the staging folder to leave there (a resumable stage's folder, which
    checks its own identity)."""
    manifest = out / schema.MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
        _fsync_dir(out)
    for path in out.iterdir():
        if path.name.startswith(schema.SHARD_PREFIX) and path.name.endswith(schema.SHARD_SUFFIX):
            path.unlink()
        elif path.name == STAGING and path.is_dir() and keep:
            for inner in path.iterdir():
                if inner.name not in keep:
                    shutil.rmtree(inner) if inner.is_dir() else inner.unlink()
        elif path.name in (STAGING, schema.MANIFEST_NAME + ".tmp", *schema.DATASETS_FILES):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):  # some filesystems cannot fsync a directory; the rename is still atomic
        _fsync(path)
