"""The torch side of the shards: a zero-collation ``IterableDataset`` and its ``DataLoader``.

A shard row is already a training row, so loading it is slicing memory-mapped Arrow buffers with
numpy and handing them to torch; there is no per-example Python, no padding and no collate step. The
batch one row becomes (docs/design.md, "The read side")::

    input_ids, position_ids, labels   int64 [1, T]
    cu_seq_lens_q, cu_seq_lens_k      int32 [n + 1]     = [0, cumsum(seq_lens)]
    max_length_q, max_length_k        int               Python ints: no host-device sync per layer
    seq_idx                           int32 [1, T]      each token's segment (0, 0, 0, 1, 1, 2, ...)
    num_items_in_batch                int               loss tokens of the whole global step (below)

``model(**batch)`` works for a transformers causal LM prepared with ``packer.prepare``.

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

Resume (docs/loader.md). The loader's one state is its ``Position``: the epoch and the rows of that
epoch's order handed out over all ranks, the same on every rank (so rank 0's state resumes them all).
``state_dict()`` saves it with what the order depends on (manifest fingerprint, seed, shuffle,
remainder, ...); ``load_state_dict`` makes the next pass continue exactly there, refusing a state from
another build or order. At another world size or grad_accum (elastic, as MosaicML streaming does), the
rest of the epoch's order is dealt over the new ranks, each row once; refused inside an optimizer step
and, mid-epoch, on a plan balanced for the saved world size. ``set_epoch(e)`` starts epoch e at its
first row; each pass (``iter()``) starts its epoch over unless a state was loaded for it. The dataset
and ``PackedDataLoader`` share the position: the loader moves it as it hands batches out, so workers
and their prefetching do not matter.

Both format versions give the same batches (packer.contract.schema): version 1's int32 columns are
widened, version 2's uint16/uint32 ids and positions too, and its labels are the ids where the loss
mask's bit is set, -100 elsewhere. A compressed build (``--compression``) is decompressed into memory
when opened, not memory-mapped.

Cost: opening maps the shards (no read) and builds one int64 index per row batch; each step slices
buffers and makes three int64 copies of T tokens (the widening; version 2 reads a third of the bytes
for them and unpacks T bits of mask) and ``seq_idx`` (int32).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .. import fs
from ..contract import rows, schema
from ..contract.remote import remote_build
from ..errors import ConfigError, ShardFormatError
from ..planning.context_parallel import row_view
from ..remote.prefetch import PREFETCH_SHARDS, Prefetcher
from . import decode, vision

STATE_VERSION = 2
PAIR_KEYS = ("pair_roles", "pair_ids")  # a preference build's per-row keys (training/preference.py)

__all__ = ["PackedDataset", "PackedDataLoader", "Position", "make_dataloader", "manifest_fingerprint", "STATE_VERSION"]


def manifest_fingerprint(directory: str | os.PathLike) -> str:
    """sha256 of the manifest's bytes: names one build (its shards carry their own hashes in it)."""
    return hashlib.sha256(fs.read_bytes(fs.join(directory, schema.MANIFEST_NAME))).hexdigest()


def _dist_rank_world() -> tuple[int, int] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


@dataclass(frozen=True, slots=True)
class _Batch:
    """One record batch of a shard: where it is, and its rows as zero-copy views of the memory map."""

    file: str
    first: int  # the global index of its first row
    rows: rows.RowBatch
    roles: rows.Column | None = None  # a preference build's pair_roles (1 chosen, 0 rejected per segment)
    arrow: Any = None  # an image build's record batch: its image columns (training/vision.py)


@dataclass(frozen=True, slots=True)
class _Read:
    """What reading a row batch's rows takes, made once a batch: each row's span and ``max_seqlen`` as
    Python ints, and the columns the kernel reads."""

    spans: list[decode.Span]
    max_len: list[int]
    columns: decode.Columns


class _Shards:
    """The memory-mapped row batches of a shard directory, addressed by global row index.

    ``lazy`` (a remote build): a shard is opened (its cached copy fetched, then mapped) the first time a
    row of it is read, or its rows' loss tokens are counted (``need``), so the first batch waits for the
    shards of its optimizer step, not the whole build (docs/loader.md, "Remote builds")."""

    def __init__(self, directory: str | os.PathLike, shard_entries: tuple[schema.ShardEntry, ...],
                 vocab_size: int, row_format: schema.RowFormat | None = None,
                 limits: rows.Limits | None = None,
                 locate: Callable[[schema.ShardEntry], str] | None = None, lazy: bool = False,
                 images: vision.VisionRows | None = None) -> None:
        self.vision = images
        self.tables = []  # keeps the memory maps alive
        self.batches: list[_Batch] = []
        self.starts: list[int] = []
        self.checked: list[bool] = []  # per batch, in this process: checked on its first row read
        self.bounds: list[np.ndarray | None] = []  # per batch, decode.row_bounds: made on its first numpy read
        self.reads: list[_Read | None] = []  # per batch, what reading its rows takes: made on its first read
        self.vocab_size, self.limits = vocab_size, limits
        self.directory, self.entries, self.row_format, self.locate = directory, shard_entries, row_format, locate
        for entry in shard_entries:  # the counts below are sized from the manifest: bounded before they are made
            if not 0 <= entry.rows <= entry.bytes:
                raise ShardFormatError(f"{fs.join(directory, entry.file)}: the manifest records {entry.rows} rows for "
                                       f"{entry.bytes} bytes; the manifest is damaged, rebuild the folder")
        self.first = np.concatenate([[0], np.cumsum([e.rows for e in shard_entries], dtype=np.int64)])
        self.first_list = self.first.tolist()
        self.opened = [False] * len(shard_entries)
        self.pending = len(shard_entries)  # shards not opened yet (0 once all are: a local build's at once)
        self.num_rows = int(self.first[-1])
        self.num_loss_tokens = np.zeros(self.num_rows, np.int64)
        self.items = self.num_loss_tokens  # per row, what num_items_in_batch counts (pairs: set below)
        self.paired = False
        if not lazy:
            for s in range(len(shard_entries)):
                self.open(s)

    def open(self, s: int) -> None:
        """Map shard ``s`` and index its row batches (once)."""
        if self.opened[s]:
            return
        entry = self.entries[s]
        path = fs.join(self.directory, entry.file)  # what messages name; a remote build's is read from its cached copy
        table = schema.open_shard(path if self.locate is None else self.locate(entry), self.row_format)
        if table.num_rows != entry.rows:
            raise ShardFormatError(
                f"{path}: {table.num_rows} rows, the manifest records {entry.rows}; "
                "the folder mixes builds, rebuild it"
            )
        n = self.first_list[s]
        tokens = 0
        found: list[_Batch] = []
        for batch in table.to_batches():
            if batch.num_rows == 0:
                continue
            nulls = rows.null_problem(batch)  # numpy has no null: refused before any column is read
            if nulls is not None:
                raise ShardFormatError(f"{path} row {n}: {nulls.message}; the shard is damaged, rebuild the "
                                       "folder (`packer verify DIR` lists every problem)")
            # views of the memory map; example ids too, which the row rules check (and name a pair: pair_ids)
            row_batch = rows.RowBatch.from_arrow(batch)
            tokens += int(row_batch.input_ids.offsets[-1])
            found.append(_Batch(str(path), n, row_batch, row_batch.pair_roles,
                                batch if self.vision is not None else None))
            n += batch.num_rows
        if tokens != entry.tokens:
            raise ShardFormatError(
                f"{path}: {tokens} tokens, the manifest records {entry.tokens}; the shard is from another "
                "build or damaged, rebuild the folder"
            )
        self.tables.append(table)
        at = bisect.bisect_left(self.starts, self.first_list[s])  # shards may open in any order: keep starts sorted
        self.batches[at:at] = found
        self.starts[at:at] = [b.first for b in found]
        self.checked[at:at] = [False] * len(found)
        self.bounds[at:at] = [None] * len(found)
        self.reads[at:at] = [None] * len(found)
        lo, hi = self.first_list[s], self.first_list[s + 1]
        if found:
            self.paired = found[0].roles is not None
            self.num_loss_tokens[lo:hi] = np.concatenate([b.rows.num_loss_tokens for b in found])
            if self.paired:  # per row, what num_items_in_batch counts: a preference build's pairs
                if self.items is self.num_loss_tokens:
                    self.items = np.zeros(self.num_rows, np.int64)
                self.items[lo:hi] = np.concatenate([b.rows.seq_lens.lengths // 2 for b in found])
        self.opened[s] = True
        self.pending -= 1

    def shard_of(self, rows_: np.ndarray) -> np.ndarray:
        """The shard index of each global row."""
        return np.searchsorted(self.first, rows_, side="right") - 1

    def need(self, rows_: np.ndarray) -> None:
        """Open the shards that hold ``rows_`` (a lazy build's; a no-op once every shard is open)."""
        if self.pending:
            for s in np.unique(self.shard_of(rows_)).tolist():
                self.open(s)

    def open_all(self) -> None:
        for s in range(len(self.entries)):
            self.open(s)

    def check(self, b: int) -> None:
        """Refuse batch ``b`` at the first problem :func:`packer.contract.rows.check_rows` finds, within the
        build's budget: the row invariants the attention kernel and the loss index with (Arrow's
        validation at open keeps the offsets in bounds; this keeps every ``cu_seq_lens`` inside its row
        and every id inside the embedding) and a preference build's pairing, which a DPO step trusts:
        every check ``verify`` runs on a row. ``benchmarks/bench_loader.py`` measures the cost."""
        batch = self.batches[b]
        problems = rows.check_rows(batch.rows, self.vocab_size, self.limits)
        if problems:
            raise ShardFormatError(
                f"{batch.file} row {batch.first + int(problems[0].rows[0])}: {problems[0].message}; the shard is "
                "damaged, rebuild the folder (`packer verify DIR` lists every problem)"
            )
        self.checked[b] = True

    def segment_pads(self, index: int) -> np.ndarray | None:
        """The padding at the end of each segment of row ``index`` (None: the build has none)."""
        if self.pending:
            self.open(bisect.bisect_right(self.first_list, index) - 1)
        b = bisect.bisect_right(self.starts, index) - 1
        r, j = self.batches[b].rows, index - self.starts[b]
        return None if r.pad_lens is None else r.pad_lens.values[r.pad_lens.offsets[j] : r.pad_lens.offsets[j + 1]]

    def max_segments(self) -> int:
        self.open_all()
        return max(int(b.rows.seq_lens.lengths.max()) for b in self.batches)

    def row(self, index: int, filler: bool, num_items: int) -> dict[str, Any]:
        # the per-row cost is what bench_loader.py measures against the collator: no Python per token or
        # segment, one kernel call a row where it was built (training/decode.py)
        if self.pending:  # a lazy build's shard is opened on its first row read
            self.open(bisect.bisect_right(self.first_list, index) - 1)
        b = bisect.bisect_right(self.starts, index) - 1
        if not self.checked[b]:  # once per row batch and process, on its first row read
            self.check(b)
        r, j = self.batches[b].rows, index - self.starts[b]
        read = self.reads[b]
        if read is None:  # made once a row batch
            read = self.reads[b] = _Read(decode.spans(r), r.max_seqlen.tolist(), decode.kernel_columns(r))
        where, max_len = read.spans[j], read.max_len[j]
        if decode.KERNEL is not None:
            ids, pos, labels, seq_idx, cu = decode.kernel_row(read.columns, where, filler)
        else:
            bounds = self.bounds[b]
            if bounds is None:  # made once a row batch
                bounds = self.bounds[b] = decode.row_bounds(r)
            ids, pos, labels, seq_idx, cu = decode.numpy_row(r, j, where, filler, bounds)
        cu_t = torch.from_numpy(cu)
        out = {
            "input_ids": torch.from_numpy(ids),
            "position_ids": torch.from_numpy(pos),
            "labels": torch.from_numpy(labels),
            "cu_seq_lens_q": cu_t,
            "cu_seq_lens_k": cu_t,
            "max_length_q": max_len,
            "max_length_k": max_len,
            "seq_idx": torch.from_numpy(seq_idx),
            "num_items_in_batch": num_items,
        }
        if self.vision is not None:  # an image build: the row's vision inputs and positions (training/vision.py)
            out = self.vision.row(self.batches[b].arrow, j, out, f"{self.batches[b].file} row {index}")
        roles = self.batches[b].roles
        if roles is not None:  # chosen, rejected in turn: what a DPO step pairs (training/preference.py)
            # a pair's two segments carry its record's example id: one a pair, the key of a stored reference
            s0, s1 = where[2:]
            out = {"pair_roles": torch.from_numpy(roles.values[roles.offsets[j] : roles.offsets[j + 1]].astype(np.int64)),
                   "pair_ids": torch.from_numpy(r.example_ids.values[s0:s1:2].astype(np.int64)), **out}
        return out


class _StepItems:
    """``num_items_in_batch`` per step of a lazy (remote) build's pass, counted an optimizer step at a time
    when the pass reaches it: only the shards of that step's rows (every rank's) are opened for it."""

    def __init__(self, shards: _Shards, index: np.ndarray, filler: np.ndarray, grad_accum: int) -> None:
        self.shards, self.index, self.filler, self.g = shards, index, filler, grad_accum
        self.done: dict[int, int] = {}

    def __getitem__(self, k: int) -> int:
        step = k // self.g
        value = self.done.get(step)
        if value is None:
            rows_ = self.index[step * self.g : (step + 1) * self.g]
            real = rows_[~self.filler[step * self.g : (step + 1) * self.g]]
            self.shards.need(real)
            value = self.done[step] = max(int(self.shards.items[real].sum()), 1)  # as _steps: never 0
        return value


def _need_order(shards: _Shards, index: np.ndarray, filler: np.ndarray) -> list[int]:
    """The shards a pass needs, in the order it first needs them (every rank's rows of each step, which
    its ``num_items_in_batch`` counts)."""
    found = shards.shard_of(index[~filler])
    first = np.unique(found, return_index=True)[1]
    return found[np.sort(first)].tolist()


@dataclass(frozen=True, slots=True)
class Position:
    """Where a loader stands in its epochs: the one state ``state_dict()`` saves, the same on every rank.

    Epoch ``epoch``'s rows are handed out in one order, drawn for ``order`` = (world_size, grad_accum):
    the loader's own, or the setting the epoch started at when it was resumed at another one.
    ``rows`` counts the rows of that order handed out over all ranks (filler rows too), ``micro`` the
    micro-batches each rank has had of the optimizer step under way (which began at row
    ``rows - micro * world_size``)."""

    epoch: int
    rows: int = 0
    micro: int = 0
    order: tuple[int, int] = (1, 1)


def _need_int(name: str, value: Any, low: int, why: str) -> int:
    """``value`` as an int, or a ConfigError unless it is an integer (not a bool) in [low, 2**63)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not low <= value < 2**63:
        raise ConfigError(f"{name} {value!r}: need an integer >= {low} ({why})")
    return int(value)


def _checked_arguments(rank, world_size, grad_accum, seed, shuffle, verify, remainder) -> tuple[int, int, int, int]:
    """PackedDataset's arguments checked (a ConfigError naming the one out of range), rank and world size
    defaulting to ``torch.distributed``'s: (rank, world_size, grad_accum, seed)."""
    dist = _dist_rank_world()
    if world_size is None:
        world_size = dist[1] if dist else 1
    if rank is None:
        rank = dist[0] if dist else 0
    world_size = _need_int("world_size", world_size, 1, "the number of data-parallel ranks")
    rank = _need_int("rank", rank, 0, "this process's data-parallel rank")
    if rank >= world_size:
        raise ConfigError(f"rank {rank} with world size {world_size}: need 0 <= rank < world_size >= 1")
    grad_accum = _need_int("grad_accum", grad_accum, 1, "micro-batches per optimizer step")
    seed = _need_int("seed", seed, 0, "numpy's generators take no negative seed")
    for name, flag in (("shuffle", shuffle), ("verify", verify)):
        if type(flag) is not bool:
            raise ConfigError(f"{name} {flag!r}: need True or False")
    if remainder not in ("pad", "drop"):
        raise ConfigError(f"remainder {remainder!r}: choose 'pad' or 'drop'")
    return rank, world_size, grad_accum, seed


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
        cache_dir, cache_limit: where a remote build's shards are cached and how large that cache may grow
            (``packer.cache``: else ``$PACKER_CACHE`` ... ``~/.cache/packer``, and ``$PACKER_CACHE_LIMIT``).
        cp_rank, cp_size: yield context-parallel rank ``cp_rank``'s share of every row (the build's
            ``--cp-size`` must be a multiple of ``cp_size``); every rank of a CP group gets the same rows.
        static_shapes: every row padded to the build's row budget, ``cu_seq_lens`` to a fixed count and
            ``max_length`` fixed, so a compiled model sees one shape (``packer.planning.context_parallel``).

    Raises ``ShardFormatError`` at construction, before any epoch starts, when the directory is not a
    finished build of this format version, or a shard is missing or has another size than recorded;
    ``ConfigError`` for an argument out of range or of the wrong type. Resume: docs/loader.md.
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
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | str | None = None,
    ) -> None:
        super().__init__()
        self.directory = directory if fs.is_url(directory) else Path(directory)
        # a remote build is read through the local cache (docs/loader.md, "Remote builds"): None for a local one
        self._remote = remote_build(directory, cache_dir, cache_limit)
        self._held: list = []  # the cache entries this process maps (kept from eviction while it reads them)
        if self._remote is None:
            self.manifest = schema.read_manifest(self.directory)
            self.fingerprint = manifest_fingerprint(self.directory)
        else:
            self.manifest, self.fingerprint = self._remote.manifest, self._remote.fingerprint
            if self._remote.build.changed:
                warnings.warn(f"{self._remote.shown}: the build there is not the one this cache read last time (its "
                              "manifest changed); its shards are fetched anew", stacklevel=2)
        rank, world_size, grad_accum, seed = _checked_arguments(rank, world_size, grad_accum, seed, shuffle, verify,
                                                                remainder)
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.grad_accum, self.remainder = grad_accum, remainder
        self._position = Position(0, order=(world_size, grad_accum))
        self._resuming = False  # load_state_dict set _position: the next pass starts there, not at the epoch's start
        self._verify = verify
        if self._remote is None:  # a remote build's shards are checked (size, sha256) as they arrive
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
                f"optimizer step, but an epoch has {self.epoch_rows} rows: every epoch would be empty; use "
                "remainder='pad', fewer ranks or a smaller grad_accum"
            )
        self._open_cached()  # a remote build: what this machine's cache holds is mapped now, as a local build is
        self._view = row_view(self.manifest, cp_rank, cp_size, static_shapes, shards.max_segments)
        vision.check_view(self.manifest, self._view)
        loss_tokens = int(shards.num_loss_tokens.sum())
        if not shards.pending and loss_tokens != self.manifest.stats.loss_tokens:  # a lazy build: sha256 on arrival
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
            problems = schema.shard_file_problems(self.directory, entry, sha256=verify)
            if problems:
                raise ShardFormatError(f"{fs.join(self.directory, entry.file)}: {problems[0]}; rebuild the folder")

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
            locate = None if self._remote is None else self._fetched
            images = vision.VisionRows(self.manifest) if self.manifest.row_format.images else None
            self._shards = _Shards(self.directory, self.manifest.shards, self._vocab_size(), self.manifest.row_format,
                                   rows.build_limits(self.manifest.config, self.manifest.stats.paired), locate,
                                   lazy=self._remote is not None, images=images)
        return self._shards

    def _open_cached(self) -> None:
        """Open the shards of a remote build that the cache holds already (no fetch): done in the DataLoader's
        process before its workers start, so they inherit the maps instead of opening them each pass."""
        shards = self._open()
        if self._remote is None or not shards.pending:
            return
        for s, entry in enumerate(self.manifest.shards):
            if not shards.opened[s] and self._remote.cached(entry):
                shards.open(s)

    def _fetch_shard(self, s: int) -> None:
        """Shard ``s`` into the cache (the prefetcher's thread): fetched unless it is there, then let go."""
        self._remote.shard(self.manifest.shards[s], full=self._verify).close()

    def _fetched(self, entry: schema.ShardEntry) -> str:
        """A remote shard's cached copy, fetched unless the cache holds it; held open while this dataset maps it."""
        held = self._remote.shard(entry, full=self._verify)
        self._held.append(held)
        return str(held.path)

    def __getstate__(self) -> dict[str, Any]:  # workers reopen the memory maps instead of pickling tables
        state = self.__dict__.copy()
        state["_shards"] = None
        state["_held"] = []  # a spawned worker opens its own cache entries
        return state

    # -- order --------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._position.epoch

    @property
    def position(self) -> Position:
        """Where this loader stands; ``state_dict()`` is this plus what the order depends on."""
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first row; a position loaded for this same epoch is kept."""
        epoch = _need_int("epoch", epoch, 0, "epochs count from 0")
        if not (self._resuming and epoch == self._position.epoch):
            self._position, self._resuming = self._start(epoch), False
        if 1 < self.epochs <= epoch and not self._warned_past:  # a one-epoch build replays silently, as ever
            self._warned_past = True
            warnings.warn(f"{self.directory} holds {self.epochs} planned epochs; epoch {epoch} replays planned epoch "
                          f"{epoch % self.epochs} (its groupings of examples repeat); rebuild with a larger --epochs "
                          "to give every epoch its own", stacklevel=2)

    def _start(self, epoch: int) -> Position:
        return Position(epoch, order=(self.world_size, self.grad_accum))

    def _order(self, epoch: int, order: tuple[int, int]) -> np.ndarray:
        """Epoch ``epoch``'s slots in the order drawn for ``order`` = (world_size w, grad_accum g), flat:
        groups of w consecutive slots, whole groups permuted per (seed, epoch); slot s is row s of the
        epoch when s < rows per epoch, else a filler. pad: every group, the last completed by fillers;
        drop: the groups of ``rows // (w * g)`` whole optimizer steps, drawn from all whole groups."""
        n, (w, g) = self.epoch_rows, order
        pool = n // w if self.remainder == "drop" else -(-n // w)
        keep = (n // (w * g)) * g if self.remainder == "drop" else pool
        groups = np.arange(pool * w, dtype=np.int64).reshape(pool, w)
        if self.shuffle:
            groups = groups[np.random.default_rng([self.seed, epoch]).permutation(pool)]
        return groups[:keep].reshape(-1)

    def _steps(self, position: Position) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's steps from the start of ``position``'s optimizer step to the epoch's end: (row
        index, is filler, num_items_in_batch) per step. The rest of the epoch's order is dealt in groups
        of ``world_size`` slots, rank r taking the r-th slot of each; pad completes the last group and
        the last optimizer step with fillers, drop leaves out what does not fill an optimizer step."""
        n, w, g = self.epoch_rows, self.world_size, self.grad_accum
        rest = self._order(position.epoch, position.order)[position.rows - position.micro * w :]
        if self.remainder == "drop":
            steps = rest.size // (w * g) * g
            slots = rest[: steps * w]
        else:
            groups = -(-rest.size // w)
            steps = -(-groups // g) * g
            slots = np.concatenate([rest, np.arange(n, n + steps * w - rest.size, dtype=np.int64)])
        slots = slots.reshape(steps, w)
        filler = slots >= n
        index = slots % n + (position.epoch % self.epochs) * n  # the planned epoch's rows
        shards = self._open()
        if shards.pending:  # a lazy (remote) build: counted per optimizer step as the pass reaches it
            return index[:, self.rank], filler[:, self.rank], _StepItems(shards, index, filler, g)
        loss = np.where(filler, 0, shards.items[index])
        step_items = loss.reshape(-1, g * w).sum(axis=1)
        items = np.maximum(np.repeat(step_items, g), 1)  # max(1): an all-masked step gives 0 loss, not NaN
        return index[:, self.rank], filler[:, self.rank], items

    def __len__(self) -> int:
        """Steps (batches) of a whole epoch on this rank, the same on every rank."""
        n, w, g = self.epoch_rows, self.world_size, self.grad_accum
        if self.remainder == "drop":
            return (n // (w * g)) * g
        groups = -(-n // w)
        return -(-groups // g) * g

    def __iter__(self) -> Iterator[dict[str, Any]]:
        position = self._begin_pass()
        index, filler, items = self._steps(position)
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        shards = self._open()
        ahead = None
        if shards.pending:  # a remote build's next shards are fetched in the background while this one trains
            ahead = Prefetcher(self._fetch_shard, _need_order(shards, index, filler), PREFETCH_SHARDS)
        index, filler = index.tolist(), filler.tolist()  # Python ints: cheaper per row
        items = items.tolist() if isinstance(items, np.ndarray) else items
        try:
            yield from self._rows(shards, position, index, filler, items, info, wid, nw, ahead)
        finally:
            if ahead is not None:
                ahead.close()

    def _rows(self, shards: _Shards, position: Position, index: list[int], filler: list[bool], items: Any, info: Any,
              wid: int, nw: int, ahead: Prefetcher | None) -> Iterator[dict[str, Any]]:
        for k in range(position.micro + wid, len(index), nw):
            if ahead is not None:
                ahead.reached(shards.shard_of(index[k]).item())
            batch = shards.row(index[k], filler[k], items[k])
            if self._view is not None:  # a context-parallel rank's share, or a fixed shape
                pairs = {key: batch[key] for key in PAIR_KEYS if key in batch}  # the row's, on every share of it
                batch = {**pairs, **_torch(self._view(batch, shards.segment_pads(index[k])))}
            if info is None:  # in a worker, the DataLoader's own process counts what it hands out
                self._advance()
            yield batch

    # -- position -----------------------------------------------------------------------------
    def _begin_pass(self) -> Position:
        """Where a pass starts: at a loaded position once, else at the start of the epoch."""
        if not self._resuming:
            self._position = self._start(self._position.epoch)
        self._resuming = False
        return self._position

    def _advance(self) -> None:
        """One more step handed out, on every rank."""
        p = self._position  # Position(...), not dataclasses.replace: this runs once a row
        self._position = Position(p.epoch, p.rows + self.world_size, (p.micro + 1) % self.grad_accum, p.order)

    def _identity(self) -> dict[str, Any]:
        return {
            "manifest_sha256": self.fingerprint,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "remainder": self.remainder,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
        }

    def state_dict(self) -> dict[str, Any]:
        """The position, the same on every rank, and what the order depends on (a JSON-able dict)."""
        p = self._position
        return {"version": STATE_VERSION, "epoch": p.epoch, "rows_done": p.rows, "micro_done": p.micro,
                "order_world_size": p.order[0], "order_grad_accum": p.order[1], **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position with the next pass, at this loader's world size and
        grad_accum (docs/loader.md); refuses another build or order and any state this loader did not
        write (``check_state``)."""
        position, saved_at = check_state(state, self._identity(), str(self.directory))
        self._position, self._resuming = self._resumed(position, saved_at), True

    def _resumed(self, position: Position, saved_at: tuple[int, int]) -> Position:
        """Where a checked state continues here. At the setting it was saved at: there. At another world
        size or grad_accum (elastic): the rest of the epoch's order is dealt over this loader's ranks,
        from an optimizer step's end only, and not mid-epoch on a plan balanced for the saved world size."""
        size = self._order(position.epoch, position.order).size
        (w, g), here = saved_at, (self.world_size, self.grad_accum)
        where = f"loader state at epoch {position.epoch}, row {position.rows}"
        if position.rows > size + w * g - 1 or (position.micro and position.rows - position.micro * w >= size):
            raise ConfigError(f"{where}: past the end of the epoch ({size} rows in its order): it was not written by "
                              "this loader's state_dict()")
        if saved_at == here:
            return position
        if position.micro:
            raise ConfigError(
                f"{where}: {position.micro} micro-batch(es) inside an optimizer step of grad_accum {g} on {w} ranks, "
                f"this loader has world_size {here[0]}, grad_accum {here[1]}: resume inside an optimizer step at "
                f"world_size {w}, grad_accum {g}, or save at an optimizer step's end"
            )
        if position.rows == 0:  # nothing of the epoch handed out: it is dealt in this loader's own order
            return self._start(position.epoch)
        balance = self.manifest.config.balance
        if balance and w != here[0] and position.rows < size:
            raise ConfigError(
                f"{where} of {size}: saved mid-epoch at world size {w}, this loader has world size {here[0]}; the "
                f"build's plan balances each step's rows over {self.manifest.config.world_size} ranks "
                f"(--balance {balance}) and dealing the rest of the epoch over {here[0]} ranks would undo that: "
                f"resume at world size {w}, or start epoch {position.epoch + 1} at world size {here[0]}"
            )
        return position


# The keys of a loader state and their types (bool is not an int here).
_STATE_TYPES = {"version": int, "epoch": int, "rows_done": int, "micro_done": int, "order_world_size": int,
                "order_grad_accum": int, "manifest_sha256": str, "num_rows": int, "seed": int, "shuffle": bool,
                "remainder": str, "world_size": int, "grad_accum": int}


def check_state(state: Any, mine: dict[str, Any], directory: str) -> tuple[Position, tuple[int, int]]:
    """The position a resume state holds and the (world_size, grad_accum) it was saved at, after
    checking it is exactly what ``state_dict`` writes: the version (a version-1 state is read as the
    position it stands for), every key present with its type and nothing else, the same build (manifest
    sha256), the same order (seed, shuffle, remainder) and numbers in range. A tampered or foreign state
    is one ConfigError (ShardFormatError for another build's), never a raw TypeError/KeyError nor a
    silent resume at a wrong place."""
    if not isinstance(state, dict):
        raise ConfigError(f"loader state is a {type(state).__name__}, not the dict state_dict() returns")
    version = state.get("version")
    if type(version) is not int or version not in (1, STATE_VERSION):
        raise ConfigError(f"loader state version {version!r}, this packer reads versions 1 and {STATE_VERSION}")
    if version == 1:
        state = _from_version_1(state)
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
    for key in ("seed", "shuffle", "remainder", "num_rows"):
        if state[key] != mine[key]:
            raise ConfigError(
                f"loader state was saved with {key}={state[key]!r}, this loader has {key}={mine[key]!r}; "
                "the row order depends on it, so resuming would repeat or skip rows: resume with the same setting"
            )
    if not 0 <= state["epoch"] < 2**63:
        raise ConfigError(f"loader state at epoch {state['epoch']}: need 0 <= epoch < 2**63")
    for key in ("world_size", "grad_accum", "order_world_size", "order_grad_accum"):
        if not 1 <= state[key] < 2**63:
            raise ConfigError(f"loader state {key} is {state[key]}: need at least 1")
    rows, micro = state["rows_done"], state["micro_done"]
    if not 0 <= micro < state["grad_accum"] or not micro * state["world_size"] <= rows < 2**63:
        raise ConfigError(f"loader state at row {rows}, micro-batch {micro}: need 0 <= micro_done < grad_accum "
                          f"{state['grad_accum']} and micro_done × world_size <= rows_done")
    position = Position(state["epoch"], rows, micro, (state["order_world_size"], state["order_grad_accum"]))
    return position, (state["world_size"], state["grad_accum"])


def _from_version_1(state: dict[str, Any]) -> dict[str, Any]:
    """The version-2 state a version-1 one stands for: its ``steps_done`` steps on each of its
    ``world_size`` ranks, in the order of the setting it was saved at (its ``rank`` no longer matters)."""
    old = {key: state.get(key) for key in ("steps_done", "world_size", "grad_accum")}
    for key, value in old.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < (key != "steps_done"):
            raise ConfigError(f"loader state (version 1) {key} is {value!r}: it was not written by a loader's "
                              "state_dict()")
    steps, w, g = old.values()
    rest = {key: value for key, value in state.items() if key not in ("steps_done", "rank")}
    return {**rest, "version": STATE_VERSION, "rows_done": steps * w, "micro_done": steps % g,
            "order_world_size": w, "order_grad_accum": g}


def _torch(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def _no_collate(batch: dict[str, Any]) -> dict[str, Any]:
    """A row is already the batch (module level, so workers can pickle it)."""
    return batch


class PackedDataLoader(DataLoader):
    """A ``DataLoader`` over a ``PackedDataset`` (batch_size=None: a row is a batch) that can resume.

    Its position is the dataset's, moved in this process as batches are handed out, so prefetching
    workers do not matter: each worker reads from a copy of the dataset taken when a pass starts.
    """

    dataset: PackedDataset

    def __init__(self, dataset: PackedDataset, **kwargs: Any) -> None:
        if kwargs.get("persistent_workers"):
            raise ConfigError("persistent_workers=True: the workers would keep the epoch and position of their first "
                              "pass, and set_epoch or load_state_dict would not reach them; leave it False")
        if kwargs.get("in_order") is False:
            raise ConfigError("in_order=False: batches would be handed out as workers finish them, not in the epoch's "
                              "order, and no position could name what was handed out; leave it True")
        super().__init__(dataset, batch_size=None, collate_fn=_no_collate, **kwargs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.num_workers == 0:  # the dataset's own iterator moves the position
            # without pinning there is nothing for DataLoader's machinery to do: read directly
            yield from super().__iter__() if self.pin_memory else iter(self.dataset)
            return
        self.dataset._open_cached()  # a remote build's cached shards, mapped once here for every worker
        batches = super().__iter__()  # starts the workers, each with a copy of the dataset as it is now...
        self.dataset._begin_pass()  # ...so this process's copy starts the same pass after them
        for batch in batches:
            self.dataset._advance()
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


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
    _need_int("num_workers", num_workers, 0, "worker processes; 0 reads in this process")
    if prefetch_factor is not None:
        _need_int("prefetch_factor", prefetch_factor, 1, "batches each worker reads ahead")
    dataset = PackedDataset(directory, **dataset_options)
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        kwargs["persistent_workers"] = False
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    return PackedDataLoader(dataset, **kwargs)
