"""The torch side of the shards: a zero-collation ``IterableDataset`` and its ``DataLoader``.

A shard row is already a training row, so loading it is slicing memory-mapped Arrow buffers with
numpy and handing them to torch; there is no per-example Python, no padding and no collate step. The
batch one row becomes (docs/design.md, "The read side")::

    input_ids, position_ids, labels   int64 [1, T]
    cu_seq_lens_q, cu_seq_lens_k      int32 [n + 1]     = [0, cumsum(seq_lens)]
    max_length_q, max_length_k        int               Python ints: no host-device sync per layer
    num_items_in_batch                int               loss tokens of the whole global step (below)

``model(**batch)`` works for a transformers causal LM prepared with ``packer.attention.prepare``.

Order, ranks and the remainder. The manifest's row order is the planner's: consecutive groups of
``world_size`` rows form one global micro-step and rank ``r`` takes the ``r``-th row of each group
(the planner can balance the ranks of a group). ``grad_accum`` consecutive groups form one optimizer
step. Shuffling permutes whole groups, deterministically per ``(seed, epoch)``::

    rows      0 1 2 3 | 4 5 6 7 | 8 9 F F      world_size = 4, 10 rows, F = filler
    rank 1    1         5         9

When the rows do not fill a whole optimizer step (``world_size * grad_accum`` rows), the policy is
``remainder="pad"`` (default): the last group is completed, and the last optimizer step filled up with
whole groups, by *filler* rows: copies of real rows whose labels are all -100, so they add zero loss
and zero loss tokens. One epoch then yields every real row exactly once over all ranks, every rank
makes the same number of steps, and every optimizer step has ``grad_accum`` micro-batches. With
``remainder="drop"`` the rows of an incomplete optimizer step are left out of the epoch instead: with
shuffling, the kept groups are drawn afresh every epoch from all whole groups, so what is dropped
changes from epoch to epoch; without shuffling the same last groups are dropped every epoch. The last
``num_rows % world_size`` rows (an incomplete group) are never in a dropped epoch. A setting that
leaves no whole optimizer step is refused (ConfigError), not an empty loop. DataLoader workers take a rank's steps round-robin, which
is the order in which the DataLoader hands them out, so the stream does not depend on the number of
workers.

Epochs. A build made with ``--epochs E`` holds E planned epochs one after another (rows
``[e*R, (e+1)*R)`` are epoch ``e``'s, each its own shuffle of the examples): epoch ``e`` plays
epoch ``e``'s rows, shuffled as above inside that epoch. Past the planned epochs, epoch ``e`` replays
planned epoch ``e % E``: a one-epoch build replays its rows every epoch, as it always did; a build of
E > 1 epochs warns once (``set_epoch``) that the groupings now repeat.

Loss normalisation. Every micro-batch carries ``num_items_in_batch``: the loss tokens of its whole
optimizer step, ``grad_accum`` micro-batches on ``world_size`` ranks, summed from the rows'
``num_loss_tokens`` column (no communication: every rank knows the whole order). A transformers
causal LM then returns ``sum of token losses / num_items_in_batch``, and the gradients summed over
the micro-batches equal those of the one big batch. Under DDP, which *averages* gradients over ranks,
multiply each loss by ``world_size`` (as transformers' Trainer does).

Resume. ``PackedDataLoader.state_dict()`` records the epoch and the number of batches handed out in
it, plus what the order depends on (manifest fingerprint, world size, rank, seed, grad_accum, ...);
``load_state_dict`` continues exactly there, refusing a state from another shard directory, world
size or order. The dataset has the same two methods (counting what it yielded itself, which is exact
with ``num_workers=0``), following the torchdata ``StatefulDataLoader`` protocol.

Cost: opening maps the shards (no read) and builds one int64 index per row batch; each step slices
buffers and makes three int64 copies of T tokens (the int32 → int64 widening).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from . import fs, schema
from .context_parallel import row_view
from .errors import ConfigError, ShardFormatError

STATE_VERSION = 1

__all__ = ["PackedDataset", "PackedDataLoader", "make_dataloader", "manifest_fingerprint", "STATE_VERSION"]


def manifest_fingerprint(directory: str | os.PathLike) -> str:
    """sha256 of the manifest's bytes: names one build (its shards carry their own hashes in it)."""
    return hashlib.sha256(fs.read_bytes(fs.join(directory, schema.MANIFEST_NAME))).hexdigest()


def _dist_rank_world() -> tuple[int, int] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


class _Shards:
    """The memory-mapped row batches of a shard directory, addressed by global row index."""

    def __init__(self, directory: str | os.PathLike, shard_entries: tuple[schema.ShardEntry, ...],
                 vocab_size: int) -> None:
        self.tables = []  # keeps the memory maps alive
        self.batches: list[dict[str, Any]] = []
        self.starts: list[int] = []
        self.vocab_size = vocab_size
        n = 0
        for entry in shard_entries:
            path = fs.join(directory, entry.file)
            table = schema.open_shard(path)
            if table.num_rows != entry.rows:
                raise ShardFormatError(
                    f"{path}: {table.num_rows} rows, the manifest records {entry.rows}; "
                    "the folder mixes builds, rebuild it"
                )
            self.tables.append(table)
            tokens = 0
            for batch in table.to_batches():
                if batch.num_rows == 0:
                    continue
                cols: dict[str, Any] = {"file": str(path), "first": n, "checked": False}
                for name in ("input_ids", "position_ids", "labels", "seq_lens"):
                    arr = batch.column(name)
                    cols[name] = arr.values.to_numpy(zero_copy_only=True)
                    cols[name + ".offsets"] = arr.offsets.to_numpy(zero_copy_only=True)
                if schema.PAD_COLUMN in batch.schema.names:  # a padded build (packer.context_parallel)
                    cols[schema.PAD_COLUMN] = batch.column(schema.PAD_COLUMN).values.to_numpy(zero_copy_only=True)
                cols["num_loss_tokens"] = batch.column("num_loss_tokens").to_numpy(zero_copy_only=True)
                cols["max_seqlen"] = batch.column("max_seqlen").to_numpy(zero_copy_only=True)
                off = cols["input_ids.offsets"]
                tokens += int(off[-1]) - int(off[0])
                self.batches.append(cols)
                self.starts.append(n)
                n += batch.num_rows
            if tokens != entry.tokens:
                raise ShardFormatError(
                    f"{path}: {tokens} tokens, the manifest records {entry.tokens}; the shard is from another "
                    "build or damaged, rebuild the folder"
                )
        self.num_rows = n
        self.num_loss_tokens = (
            np.concatenate([b["num_loss_tokens"] for b in self.batches]).astype(np.int64)
            if self.batches
            else np.zeros(0, np.int64)
        )

    def segment_pads(self, index: int) -> np.ndarray | None:
        """The padding at the end of each segment of row ``index`` (None: the build has none)."""
        b = bisect.bisect_right(self.starts, index) - 1
        cols, j = self.batches[b], index - self.starts[b]
        if schema.PAD_COLUMN not in cols:
            return None
        return cols[schema.PAD_COLUMN][cols["seq_lens.offsets"][j] : cols["seq_lens.offsets"][j + 1]]

    def max_segments(self) -> int:
        return max(int(np.diff(b["seq_lens.offsets"]).max()) for b in self.batches)

    def row(self, index: int, filler: bool, num_items: int) -> dict[str, Any]:
        b = bisect.bisect_right(self.starts, index) - 1
        cols, j = self.batches[b], index - self.starts[b]
        if not cols["checked"]:  # once per row batch and process, on its first row read
            problem = check_rows(cols, self.vocab_size)
            if problem is not None:
                row, what = problem
                raise ShardFormatError(
                    f"{cols['file']} row {cols['first'] + row}: {what}; the shard is damaged, rebuild the folder "
                    "(`packer verify DIR` lists every problem)"
                )
            cols["checked"] = True
        o0, o1 = cols["input_ids.offsets"][j], cols["input_ids.offsets"][j + 1]
        s0, s1 = cols["seq_lens.offsets"][j], cols["seq_lens.offsets"][j + 1]
        cu = np.zeros(s1 - s0 + 1, dtype=np.int32)
        cols["seq_lens"][s0:s1].cumsum(out=cu[1:])
        cu_t = torch.from_numpy(cu)
        # [None] makes the (1, tokens) shape in numpy: a torch .view per column cost ~2 µs of a ~40 µs row
        if filler:
            labels = torch.full((1, o1 - o0), schema.IGNORE_INDEX, dtype=torch.int64)
        else:
            labels = torch.from_numpy(cols["labels"][o0:o1].astype(np.int64)[None])
        max_len = int(cols["max_seqlen"][j])
        return {
            "input_ids": torch.from_numpy(cols["input_ids"][o0:o1].astype(np.int64)[None]),
            "position_ids": torch.from_numpy(cols["position_ids"][o0:o1].astype(np.int64)[None]),
            "labels": labels,
            "cu_seq_lens_q": cu_t,
            "cu_seq_lens_k": cu_t,
            "max_length_q": max_len,
            "max_length_k": max_len,
            "num_items_in_batch": num_items,
        }


def check_rows(cols: dict[str, Any], vocab_size: int) -> tuple[int, str] | None:
    """The first damaged row of a row batch and what is wrong with it, or None.

    The structure that the attention kernel and the loss index with, in a few vectorised passes over
    the batch's tokens: Arrow's validation at open keeps the offsets in bounds, this keeps every
    ``cu_seq_lens`` inside its row and every id inside the embedding. Rows are contiguous, so once each
    row's ``seq_lens`` sum to its length the batch's cumulative ``seq_lens`` are the segment starts.
    (``benchmarks/bench_loader.py`` measures the cost.)"""
    off = cols["input_ids.offsets"].astype(np.int64)
    for name in ("position_ids", "labels"):
        bad = cols[name + ".offsets"] != cols["input_ids.offsets"]
        if bad.any():
            return max(int(np.argmax(bad)) - 1, 0), f"{name} is not aligned with input_ids"
    soff = cols["seq_lens.offsets"].astype(np.int64)
    seq = cols["seq_lens"][soff[0] : soff[-1]].astype(np.int64)
    soff -= soff[0]
    nseg = np.diff(soff)
    if (nseg == 0).any():
        return int(np.argmax(nseg == 0)), "no segments in seq_lens"
    if (seq <= 0).any():
        return _row_of(np.argmax(seq <= 0), soff), "a segment length ≤ 0 in seq_lens"
    cs = np.zeros(seq.size + 1, np.int64)
    np.cumsum(seq, out=cs[1:])
    row_len = np.diff(off)
    sums = cs[soff[1:]] - cs[soff[:-1]]
    if (sums != row_len).any():
        r = int(np.argmax(sums != row_len))
        return r, f"seq_lens sum to {int(sums[r])}, the row holds {int(row_len[r])} tokens"
    true_max = np.maximum.reduceat(seq, soff[:-1])
    if (true_max != cols["max_seqlen"]).any():
        r = int(np.argmax(true_max != cols["max_seqlen"]))
        return r, f"max_seqlen {int(cols['max_seqlen'][r])} is not max(seq_lens) = {int(true_max[r])}"
    lo, hi = int(off[0]), int(off[-1])
    rel = off - lo
    ids, pos, labels = cols["input_ids"][lo:hi], cols["position_ids"][lo:hi], cols["labels"][lo:hi]
    if int(ids.view(np.uint32).max()) >= vocab_size:  # as unsigned, a negative id is huge too
        bad = ids.view(np.uint32) >= vocab_size
        return _row_of(np.argmax(bad), rel), f"a token id outside [0, {vocab_size}) (the tokenizer's vocab size)"
    starts = cs[:-1]
    # positions: 0 at every segment start, +1 everywhere else
    step = np.subtract(pos[1:], pos[:-1])
    step[starts[1:] - 1] = 1
    if pos[starts].any() or not (step == 1).all():
        at = np.argmax(pos != np.arange(hi - lo) - np.repeat(starts, seq))  # the rare path: say where
        return _row_of(at, rel), "position_ids do not restart at 0 at each segment start and count up"
    ignored = labels == schema.IGNORE_INDEX
    if not ignored[starts].all():
        return _row_of(starts[np.argmin(ignored[starts])], rel), \
            "a label is not -100 at a segment start (it would cross an example boundary)"
    ok = labels == ids
    ok |= ignored
    if not ok.all():
        return _row_of(np.argmin(ok), rel), "a label is neither -100 nor the input id at its position"
    loss = row_len - np.add.reduceat(ignored, rel[:-1], dtype=np.int64)
    if (loss != cols["num_loss_tokens"]).any():
        r = int(np.argmax(loss != cols["num_loss_tokens"]))
        return r, f"num_loss_tokens {int(cols['num_loss_tokens'][r])} is not the count of trained labels {int(loss[r])}"
    return None


def _row_of(index, offsets: np.ndarray) -> int:
    """The row holding flat element ``index``, from the batch's offsets (starting at 0)."""
    return int(np.searchsorted(offsets, int(index), side="right")) - 1


class PackedDataset(IterableDataset):
    """Rows of a packer shard directory as model-ready batch dicts, one row per batch.

    Args:
        directory: a finished ``packer build`` output (``manifest.json`` present): a local path
            (memory-mapped) or an fsspec URL (each shard read into memory).
        shuffle, seed: permute whole groups of ``world_size`` rows, deterministically per (seed, epoch).
        rank, world_size: default to ``torch.distributed`` when initialised, else 0 and 1.
        grad_accum: micro-batches per optimizer step (sets ``num_items_in_batch``).
        remainder: ``"pad"`` (filler rows with no loss) or ``"drop"``; see the module docstring.
        verify: also check every shard's sha256 against the manifest (reads every byte once).
        cp_rank, cp_size: yield context-parallel rank ``cp_rank``'s share of every row (the build's
            ``--cp-size`` must be a multiple of ``cp_size``); every rank of a CP group gets the same rows.
        static_shapes: every row padded to the build's row budget, ``cu_seq_lens`` to a fixed count and
            ``max_length`` fixed, so a compiled model sees one shape (``packer.context_parallel``).

    Raises ``ShardFormatError`` at construction, before any epoch starts, when the directory is not a
    finished build of this format version, or a shard is missing or has another size than recorded.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        grad_accum: int = 1,
        remainder: Literal["pad", "drop"] = "pad",
        verify: bool = False,
        cp_rank: int = 0,
        cp_size: int = 1,
        static_shapes: bool = False,
    ) -> None:
        super().__init__()
        self.directory = directory if fs.is_url(directory) else Path(directory)
        self.manifest = schema.read_manifest(self.directory)
        self.fingerprint = manifest_fingerprint(self.directory)
        dist = _dist_rank_world()
        if world_size is None:
            world_size = dist[1] if dist else 1
        if rank is None:
            rank = dist[0] if dist else 0
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} with world size {world_size}: need 0 <= rank < world_size >= 1")
        if grad_accum < 1:
            raise ConfigError(f"grad_accum {grad_accum}: need at least 1 micro-batch per optimizer step")
        if remainder not in ("pad", "drop"):
            raise ConfigError(f"remainder {remainder!r}: choose 'pad' or 'drop'")
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.grad_accum, self.remainder = grad_accum, remainder
        self.epoch = 0
        self._resume_at = 0  # steps of self.epoch already consumed (set by load_state_dict)
        self._yielded = 0  # steps this process yielded in the current iteration (num_workers=0)
        self._check_files(verify)
        self._shards: _Shards | None = None
        shards = self._open()
        self.num_rows = shards.num_rows
        if self.num_rows != self.manifest.stats.rows:
            raise ShardFormatError(
                f"{self.directory}: shards hold {self.num_rows} rows, the manifest's stats say "
                f"{self.manifest.stats.rows}; rebuild the folder"
            )
        if self.num_rows == 0:
            raise ShardFormatError(f"{self.directory}: the build has no rows, nothing to train on")
        self.epochs = self.manifest.stats.epoch_count  # planned epochs the rows hold, in order
        self.epoch_rows = self.num_rows // self.epochs
        if self.epoch_rows * self.epochs != self.num_rows:
            raise ShardFormatError(f"{self.directory}: {self.num_rows} rows do not split into {self.epochs} equal "
                                   "epochs; rebuild the folder")
        self._warned_past = False
        if len(self) == 0:  # only remainder="drop" can leave an epoch empty
            step = world_size * grad_accum
            raise ConfigError(
                f"remainder='drop' with world_size {world_size} × grad_accum {grad_accum} = {step} rows per "
                f"optimizer step, but the build has {self.num_rows} rows: every epoch would be empty; use "
                "remainder='pad', fewer ranks or a smaller grad_accum"
            )
        self._view = row_view(self.manifest, cp_rank, cp_size, static_shapes, shards.max_segments)
        loss_tokens = int(shards.num_loss_tokens.sum())
        if loss_tokens != self.manifest.stats.loss_tokens:
            raise ShardFormatError(
                f"{self.directory}: the rows' num_loss_tokens sum to {loss_tokens}, the manifest's stats say "
                f"{self.manifest.stats.loss_tokens}; rebuild the folder"
            )

    # -- opening ------------------------------------------------------------------------------
    def _check_files(self, verify: bool) -> None:
        shards = self.manifest.shards
        if not shards:
            raise ShardFormatError(
                f"{fs.join(self.directory, schema.MANIFEST_NAME)}: lists no shards; rebuild the folder"
            )
        for entry in shards:
            path = fs.join(self.directory, entry.file)
            size = fs.file_size(path)
            if size is None:
                raise ShardFormatError(
                    f"{path}: missing, the manifest lists it; copy the whole folder or rebuild it"
                )
            if size != entry.bytes:
                raise ShardFormatError(
                    f"{path}: {size} bytes, the manifest records {entry.bytes}; the shard is truncated or "
                    "from another build, rebuild the folder"
                )
            if verify and fs.file_sha256(path) != entry.sha256:
                raise ShardFormatError(
                    f"{path}: sha256 differs from the manifest's; the shard is corrupted, rebuild it"
                )

    def _vocab_size(self) -> int:
        vocab = self.manifest.tokenizer.get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ShardFormatError(
                f"{fs.join(self.directory, schema.MANIFEST_NAME)} tokenizer.vocab_size: {vocab!r} is not a positive "
                "integer; the manifest is damaged, rebuild the folder"
            )
        return vocab

    def _open(self) -> _Shards:
        if self._shards is None:
            self._shards = _Shards(self.directory, self.manifest.shards, self._vocab_size())
        return self._shards

    def __getstate__(self) -> dict[str, Any]:  # workers reopen the memory maps instead of pickling tables
        state = self.__dict__.copy()
        state["_shards"] = None
        return state

    # -- order --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of ``epoch``; a pending resume position is kept only for its own epoch."""
        if epoch != self.epoch:
            self._resume_at = 0
        self.epoch = epoch
        if 1 < self.epochs <= epoch and not self._warned_past:  # a one-epoch build replays silently, as ever
            self._warned_past = True
            warnings.warn(f"{self.directory} holds {self.epochs} planned epochs; epoch {epoch} replays planned epoch "
                          f"{epoch % self.epochs} (its groupings of examples repeat); rebuild with a larger --epochs "
                          "to give every epoch its own", stacklevel=2)

    def _epoch_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's rows of the epoch: (row index, is filler, num_items_in_batch) per step."""
        n, w, g = self.epoch_rows, self.world_size, self.grad_accum
        n_groups = (n // (w * g)) * g if self.remainder == "drop" else -(-n // w)
        # drop: the kept groups are drawn from all whole groups, so what is dropped changes every epoch
        pool = n // w if self.remainder == "drop" else n_groups
        slots = np.arange(pool * w, dtype=np.int64).reshape(pool, w)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch])
            slots = slots[rng.permutation(pool)]
        slots = slots[:n_groups]
        if self.remainder == "pad" and n_groups % g:
            extra = g - n_groups % g  # whole filler groups so the last optimizer step has g micro-batches
            slots = np.concatenate([slots, np.arange(n, n + extra * w, dtype=np.int64).reshape(extra, w)])
        filler = slots >= n
        rows = slots % n + (self.epoch % self.epochs) * n  # the planned epoch's rows
        loss = np.where(filler, 0, self._open().num_loss_tokens[rows])
        step_items = loss.reshape(-1, g * w).sum(axis=1)
        items = np.maximum(np.repeat(step_items, g), 1)  # max(1): an all-masked step gives 0 loss, not NaN
        return rows[:, self.rank], filler[:, self.rank], items

    def __len__(self) -> int:
        """Steps (batches) per epoch on this rank, the same on every rank."""
        n, w, g = self.epoch_rows, self.world_size, self.grad_accum
        if self.remainder == "drop":
            return (n // (w * g)) * g
        groups = -(-n // w)
        return -(-groups // g) * g

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rows, filler, items = self._epoch_order()
        start = self._resume_at
        self._resume_at = 0
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        shards = self._open()
        self._yielded = start
        for k in range(start + wid, len(rows), nw):
            batch = shards.row(int(rows[k]), bool(filler[k]), int(items[k]))
            if self._view is not None:  # a context-parallel rank's share, or a fixed shape
                batch = _torch(self._view(batch, shards.segment_pads(int(rows[k]))))
            self._yielded = k + 1
            yield batch

    # -- resume -------------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            "manifest_sha256": self.fingerprint,
            "num_rows": self.num_rows,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "grad_accum": self.grad_accum,
            "remainder": self.remainder,
        }

    @property
    def resume_at(self) -> int:
        """Steps of the current epoch the next ``iter()`` skips (set by ``load_state_dict``)."""
        return self._resume_at

    def state_at(self, steps_done: int) -> dict[str, Any]:
        """The resumable state after ``steps_done`` steps of the current epoch."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "steps_done": steps_done, **self._identity()}

    def state_dict(self) -> dict[str, Any]:
        """Position after what this dataset's own iterator yielded (exact with ``num_workers=0``)."""
        return self.state_at(self._yielded)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position with the next ``iter()``; refuses another build or order,
        and any state that is not one this loader wrote (``check_state``)."""
        epoch, steps = check_state(state, self._identity(), len(self), str(self.directory))
        self.epoch = epoch
        self._resume_at = steps
        self._yielded = steps


# The keys of a loader state and their types (bool is not an int here).
_STATE_TYPES = {"version": int, "epoch": int, "steps_done": int, "manifest_sha256": str, "num_rows": int,
                "world_size": int, "rank": int, "seed": int, "shuffle": bool, "grad_accum": int, "remainder": str}


def check_state(state: Any, mine: dict[str, Any], steps_per_epoch: int, directory: str) -> tuple[int, int]:
    """``(epoch, steps_done)`` of a resume state, after checking it is exactly what ``state_at`` writes
    for this loader: the version, every key present with its type and nothing else, the same build
    (manifest sha256), the same order (world size, rank, seed, ...) and a position inside an epoch.
    A tampered or foreign state is one ConfigError (ShardFormatError for another build's), never a
    raw TypeError/KeyError nor a silent resume at a wrong place."""
    if not isinstance(state, dict):
        raise ConfigError(f"loader state is a {type(state).__name__}, not the dict state_dict() returns")
    version = state.get("version")
    if type(version) is not int or version != STATE_VERSION:
        raise ConfigError(f"loader state version {version!r}, this packer reads version {STATE_VERSION}")
    missing = sorted(set(_STATE_TYPES) - set(state))
    unknown = sorted(map(str, set(state) - set(_STATE_TYPES)))
    if missing or unknown:
        raise ConfigError(f"loader state {'lacks ' + ', '.join(missing) if missing else ''}"
                          f"{'; ' if missing and unknown else ''}{'has unknown keys ' + ', '.join(unknown) if unknown else ''}: "
                          "it was not written by this loader's state_dict()")
    for key, kind in _STATE_TYPES.items():
        if type(state[key]) is not kind:
            raise ConfigError(f"loader state {key} is {state[key]!r}, not a {kind.__name__}: it was not written by "
                              "this loader's state_dict()")
    if state["manifest_sha256"] != mine["manifest_sha256"]:
        raise ShardFormatError(
            f"{directory}: the loader state was saved on another shard directory (manifest sha256 "
            f"{state['manifest_sha256'][:12]}…, this one {mine['manifest_sha256'][:12]}…); resume on the same build"
        )
    for key in ("world_size", "rank", "seed", "shuffle", "grad_accum", "remainder", "num_rows"):
        if state[key] != mine[key]:
            raise ConfigError(
                f"loader state was saved with {key}={state[key]!r}, this loader has {key}={mine[key]!r}; "
                "the row order depends on it, so resuming would repeat or skip rows: resume with the same setting"
            )
    epoch, steps = state["epoch"], state["steps_done"]
    if not 0 <= epoch < 2**63:
        raise ConfigError(f"loader state at epoch {epoch}: need 0 <= epoch < 2**63")
    if not 0 <= steps <= steps_per_epoch:
        raise ConfigError(f"loader state at step {steps}, but an epoch has {steps_per_epoch} steps")
    return epoch, steps


def _torch(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def _no_collate(batch: dict[str, Any]) -> dict[str, Any]:
    """A row is already the batch (module level, so workers can pickle it)."""
    return batch


class PackedDataLoader(DataLoader):
    """A ``DataLoader`` over a ``PackedDataset`` (batch_size=None: a row is a batch) that can resume.

    ``state_dict()`` counts the batches handed out in the current epoch, so prefetching workers do not
    matter; ``load_state_dict()`` makes the next ``iter()`` continue right after them.
    """

    dataset: PackedDataset

    def __init__(self, dataset: PackedDataset, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=None, collate_fn=_no_collate, **kwargs)
        self._delivered = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._delivered = self.dataset.resume_at
        # In-process without pinning there is nothing for DataLoader's machinery to do: read directly.
        direct = self.num_workers == 0 and not self.pin_memory
        for batch in iter(self.dataset) if direct else super().__iter__():
            self._delivered += 1
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_at(self._delivered)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._delivered = self.dataset.resume_at


def make_dataloader(
    directory: str | os.PathLike,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    **dataset_options: Any,
) -> PackedDataLoader:
    """A resumable DataLoader yielding one packed row per batch; ``dataset_options`` are
    ``PackedDataset``'s (shuffle, seed, rank, world_size, grad_accum, remainder, verify)."""
    dataset = PackedDataset(directory, **dataset_options)
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        kwargs["persistent_workers"] = False
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    return PackedDataLoader(dataset, **kwargs)
