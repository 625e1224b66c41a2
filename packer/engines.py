"""Engines: where the two parallel steps of a build run. The pipeline (:mod:`packer.build`) is the
same whichever runs them, and so are the bytes.

An engine provides

- ``encode_chunks(dataset, encoder, start, where)``: the :class:`~packer.tokenization.Encoded` chunks
  of records ``start`` … of ``dataset``, cut at :func:`packer.spill.chunk_ranges`, *in source order*;
- ``write_shards(plan, spill, staging, shard_bytes, totals, progress)``: every shard of the plan
  written into ``staging``; their :class:`~packer.schema.ShardEntry` in order.

:class:`LocalEngine` runs them on this machine; :class:`packer.ray_engine.RayEngine` as Ray Data tasks.
:func:`for_config` is the one place an engine is picked by name.

Local parallelism: ``num_proc == 1`` tokenizes in this process and lets the Rust tokenizer spread each
``encode_batch`` over every core (rayon threads); ``num_proc > 1`` runs that many worker processes
(fork where the platform has it, so no worker re-imports transformers; spawn elsewhere), each with
``TOKENIZERS_PARALLELISM=false`` so N processes use N cores. Workers read their own record ranges
from the memory-mapped dataset (only two integers travel to a worker) and return flat numpy arrays;
``imap`` keeps source order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from . import spill as spill_
from .config import BuildConfig
from .pages import drop_mapped_pages, mapped_files
from .plan import Plan
from .ray_engine import RayEngine
from .schema import ShardEntry
from .tokenization import Encoded, Encoder
from .writer import write_shards


class Engine(Protocol):
    def encode_chunks(self, dataset, encoder: Encoder, start: int, *, where: str) -> Iterator[Encoded]: ...

    def write_shards(self, plan: Plan, spill: spill_.Spill, staging: Path, *, shard_bytes: int,
                     totals: dict[str, int], progress: bool) -> list[ShardEntry]: ...


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """This machine: ``num_proc`` tokenizing processes, shards written one after another."""

    num_proc: int = 1

    def encode_chunks(self, dataset, encoder: Encoder, start: int, *, where: str) -> Iterator[Encoded]:
        ranges = spill_.chunk_ranges(start, len(dataset))
        if self.num_proc <= 1 or len(dataset) - start <= spill_.CHUNK:  # one chunk: a pool would only add start-up
            return (encoder.encode(dataset[lo:hi], lo, where=where) for lo, hi in ranges)
        return _pool_chunks(dataset, encoder, ranges, self.num_proc, where)

    def write_shards(self, plan: Plan, spill: spill_.Spill, staging: Path, *, shard_bytes: int,
                     totals: dict[str, int], progress: bool) -> list[ShardEntry]:
        with tqdm(total=plan.num_rows, desc="write", unit="row", disable=not progress, dynamic_ncols=True) as bar:
            return write_shards(plan, spill.store(), staging, shard_bytes=shard_bytes, totals=totals,
                                on_rows=bar.update)


def for_config(config: BuildConfig) -> Engine:
    """The engine ``config.engine`` names."""
    return RayEngine() if config.engine == "ray" else LocalEngine(config.num_proc or os.cpu_count() or 1)


_WORKER: dict[str, Any] = {}


def _worker_init(encoder: Encoder, dataset, where: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers use N cores
    _WORKER.update(encoder=encoder, dataset=dataset, where=where, mapped=mapped_files(dataset))


def _worker_encode(bounds: tuple[int, int]) -> Encoded:
    lo, hi = bounds
    encoded = _WORKER["encoder"].encode(_WORKER["dataset"][lo:hi], lo, where=_WORKER["where"])
    drop_mapped_pages(_WORKER["mapped"])
    return encoded


def _pool_chunks(dataset, encoder: Encoder, ranges: Iterator[tuple[int, int]], num_proc: int,
                 where: str) -> Iterator[Encoded]:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    pool = ctx.Pool(num_proc, initializer=_worker_init, initargs=(encoder, dataset, where))
    try:
        # tasks are two integers each; results come back in order and are written at once
        yield from pool.imap(_worker_encode, ranges, chunksize=1)
        pool.close()
        pool.join()
    finally:
        pool.terminate()
