"""Engines: where the two parallel steps of a build run. The pipeline (:mod:`packer.build`) is the
same whichever runs them, and so are the bytes.

An engine provides

- ``encode_chunks(stream, encoder, start, where)``: the :class:`~packer.tokenization.Encoded` chunks
  of records ``start`` … of ``stream`` (a :class:`packer.sources.Stream`), ``spill.CHUNK`` records each,
  *in source order*;
- ``write_shards(plan, spill, staging, shard_bytes, totals, progress)``: every shard of the plan
  written into ``staging``; their :class:`~packer.schema.ShardEntry` in order.

:class:`LocalEngine` runs them on this machine; :class:`packer.ray_engine.RayEngine` as Ray Data tasks.
:func:`for_config` is the one place an engine is picked by name.

Local parallelism: ``num_proc == 1`` tokenizes in this process and lets the Rust tokenizer spread each
``encode_batch`` over every core (rayon threads); ``num_proc > 1`` runs that many worker processes
(fork where the platform has it, so no worker re-imports transformers; spawn elsewhere), each with
``TOKENIZERS_PARALLELISM=false`` so N processes use N cores. This process reads the stream (one
reader: a file or Hub stream cannot be split by position) and sends each chunk's records to a worker,
at most ``2 * num_proc`` chunks ahead; workers return flat numpy arrays, taken back in source order.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from . import spill as spill_
from .config import BuildConfig
from .errors import RecordError
from .plan import Plan
from .ray_engine import RayEngine
from .schema import ShardEntry
from .tokenization import Encoded, Encoder
from .writer import write_shards


class Engine(Protocol):
    def encode_chunks(self, stream, encoder: Encoder, start: int, *, where: str) -> Iterator[Encoded]: ...

    def write_shards(self, plan: Plan, spill: spill_.Spill, staging: Path, *, shard_bytes: int,
                     totals: dict[str, int], progress: bool) -> list[ShardEntry]: ...


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """This machine: ``num_proc`` tokenizing processes, shards written one after another."""

    num_proc: int = 1

    def encode_chunks(self, stream, encoder: Encoder, start: int, *, where: str) -> Iterator[Encoded]:
        chunks = stream.chunks(start, spill_.CHUNK)
        if self.num_proc > 1:
            first = list(itertools.islice(chunks, 2))
            chunks = itertools.chain(first, chunks)
            if len(first) > 1:  # more than one chunk: a pool pays for its start-up
                return _pool_chunks(chunks, encoder, self.num_proc, where)
        return (encoder.encode(records, lo, where=where) for lo, records in chunks)

    def write_shards(self, plan: Plan, spill: spill_.Spill, staging: Path, *, shard_bytes: int,
                     totals: dict[str, int], progress: bool) -> list[ShardEntry]:
        with tqdm(total=plan.num_rows, desc="write", unit="row", disable=not progress, dynamic_ncols=True) as bar:
            return write_shards(plan, spill.store(), staging, shard_bytes=shard_bytes, totals=totals,
                                on_rows=bar.update)


def for_config(config: BuildConfig) -> Engine:
    """The engine ``config.engine`` names."""
    return RayEngine() if config.engine == "ray" else LocalEngine(config.num_proc or os.cpu_count() or 1)


_WORKER: dict[str, Any] = {}


def _worker_init(encoder: Encoder, where: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers use N cores
    _WORKER.update(encoder=encoder, where=where)


@dataclass(frozen=True, slots=True)
class _Refused:
    """A RecordError on its way back from a worker (RecordError itself cannot be unpickled, which would
    kill the pool's result thread and leave the build waiting forever)."""

    message: str
    reason: str


def _worker_encode(task: tuple[int, dict]) -> Encoded | _Refused:
    lo, records = task
    try:
        return _WORKER["encoder"].encode(records, lo, where=_WORKER["where"])
    except RecordError as e:
        return _Refused(str(e), e.reason)


def _result(encoded: Encoded | _Refused) -> Encoded:
    if isinstance(encoded, _Refused):
        raise RecordError(encoded.message, encoded.reason)
    return encoded


def _pool_chunks(chunks: Iterator, encoder: Encoder, num_proc: int, where: str) -> Iterator[Encoded]:
    """This process reads the stream and submits each chunk, at most ``2 * num_proc`` ahead of the results
    taken back (so the reader does not pull the whole source into the pool's queue); results in order.
    The stream is read here, not in a pool thread, so an error reading it is raised here as it is."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    pool = ctx.Pool(num_proc, initializer=_worker_init, initargs=(encoder, where))
    pending: deque = deque()
    try:
        for task in chunks:
            pending.append(pool.apply_async(_worker_encode, (task,)))
            if len(pending) >= 2 * num_proc:
                yield _result(pending.popleft().get())
        while pending:
            yield _result(pending.popleft().get())
        pool.close()
        pool.join()
    finally:
        pool.terminate()
