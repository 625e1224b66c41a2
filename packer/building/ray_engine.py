"""``--engine ray``: the tokenize and write stages as Ray Data tasks, on whatever cluster ``ray.init()`` joins.

The pipeline and its bytes are the local engine's; only where the work runs changes::

    stream (driver) ──chunk records──► encode tasks (one CPU each) ──in order──► spill (driver)
                                                                  lengths ─► plan (driver, global)
                                                                          plan ──► write_shard × shards
                                                                                   Ray tasks ─► manifest

- **tokenize**: the driver reads the source's stream (one reader: a file or Hub stream cannot be split
  by position) and submits each chunk's records (``CHUNK`` records) as a Ray task running the same
  :class:`packer.building.mix.MixEncoder`, at most ``2 × CPUs`` tasks ahead, so memory stays bounded. The
  driver takes the results back *in source order* and appends them to the resumable spill of
  :mod:`packer.building.spill`, so the spill is the local engine's byte for byte (tokens of an example do not
  depend on its batch).
- **plan**: on the driver, from the lengths alone, exactly as the local engine.
- **write**: one Ray task per shard (the shard bounds of :func:`packer.building.writer.shard_bounds`), each
  assembling its rows with :func:`packer.building.writer.assemble` from the memory-mapped spill and writing
  ``shard-NNNNN.arrow`` into the staging folder; the driver then writes the manifest. The spill and the
  output must therefore be on a filesystem every node sees (NFS, Lustre, a FUSE-mounted bucket).

Ray is an optional dependency (``pip install 'packer[ray]'``); this module imports it lazily. If no Ray
runtime is up, ``ray.init()`` starts a local one with every core; on a cluster, call
``ray.init(address="auto")`` (or set ``RAY_ADDRESS``) before ``packer.build``.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..contract import schema
from ..errors import ConfigError
from ..planning.plan import Plan
from . import spill as spill_
from .mix import MixChunk, MixEncoder, MixStream
from .spill import Spill, open_store
from .tokenization import Encoded
from .writer import Written, shard_bounds, shard_entry, write_shard


def _ray():
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ConfigError("--engine ray needs Ray Data: pip install 'packer[ray]' (or 'ray[data]')") from e
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)
    return ray


def _encode(encoder: MixEncoder, chunk: MixChunk) -> Encoded:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one CPU per task; Ray runs one task per CPU
    return encoder.encode(chunk)


class RayEngine:
    """The :class:`packer.building.engines.Engine` whose steps run as Ray tasks on the cluster ``ray.init()`` joins."""

    def encode_chunks(self, stream: MixStream, encoder: MixEncoder, start: int) -> Iterator[Encoded]:
        """The Encoded chunks of records ``start`` … of ``stream``, in source order, tokenized by Ray tasks."""
        ray = _ray()
        task = ray.remote(num_cpus=1)(_encode)
        encoder_ref = ray.put(encoder)
        window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
        pending: deque = deque()
        for _, chunk in stream.chunks(start, spill_.CHUNK):
            pending.append(task.remote(encoder_ref, chunk))
            if len(pending) >= window:
                yield ray.get(pending.popleft())
        while pending:
            yield ray.get(pending.popleft())

    def write_shards(self, plan: Plan, spill: Spill, staging: Path, *, shard_bytes: int, progress: bool,
                     row_format: schema.RowFormat | None = None, compression: str | None = None) -> Written:
        """Write every shard into ``staging`` as parallel Ray tasks, in ``row_format`` and
        ``compression`` as the local engine writes them; the manifest entries in order, and their counts."""
        ray = _ray()
        task = ray.remote(num_cpus=1)(_write_shard)
        plan_ref, lengths_ref = ray.put(plan), ray.put(np.asarray(spill.lengths))
        bounds = shard_bounds(plan, shard_bytes, row_format)
        names = [schema.shard_name(i) for i in range(len(bounds))]
        refs = [task.remote(plan_ref, str(spill.folder), lengths_ref, str(staging / name), lo, hi, row_format,
                            compression)
                for name, (lo, hi) in zip(names, bounds, strict=True)]
        return Written.of([(shard_entry(staging / name, counts), counts)
                           for name, counts in zip(names, ray.get(refs), strict=True)])


def _write_shard(plan: Plan, folder: str, lengths: np.ndarray, path: str, lo: int, hi: int,
                 row_format: schema.RowFormat | None, compression: str | None) -> dict:
    """One shard: rows [lo, hi) of the plan, assembled from the memory-mapped spill in ``folder``."""
    return write_shard(plan, open_store(Path(folder), lengths), Path(path), lo, hi, row_format=row_format,
                       compression=compression)
