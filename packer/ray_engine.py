"""``--engine ray``: the tokenize and write stages as Ray Data tasks, on whatever cluster ``ray.init()`` joins.

The pipeline and its bytes are the local engine's; only where the work runs changes::

    chunk numbers ──ray.data.range──► map_batches(Encoder actors) ──in order──► spill (driver)
    (records read by each task)        one CPU each                  lengths ─► plan (driver, global)
                                                                          plan ──► write_shard × shards
                                                                                   Ray tasks ─► manifest

- **tokenize**: the Ray Dataset is the list of chunk numbers (``CHUNK`` records each); ``map_batches``
  actors read their chunk's records from the `datasets.Dataset` (memory-mapped Arrow cache), run the
  same :class:`packer.tokenization.Encoder` and return one row per chunk holding the flat ids / mask /
  lengths / example ids as bytes. (``ray.data.from_huggingface`` would copy the whole table into the
  object store, and in Ray 2.60 it also needs ``aiohttp``; the chunk list keeps memory bounded.) The driver takes them back *in source order*
  (``preserve_order``) and appends them to the resumable spill of :mod:`packer.spill`, so the
  spill is the local engine's byte for byte (tokens of an example do not depend on its batch).
- **plan**: on the driver, from the lengths alone, exactly as the local engine.
- **write**: one Ray task per shard (the shard bounds of :func:`packer.writer.shard_bounds`), each
  assembling its rows with :func:`packer.writer.assemble` from the memory-mapped spill and writing
  ``shard-NNNNN.arrow`` into the staging folder; the driver then writes the manifest. The spill and the
  output must therefore be on a filesystem every node sees (NFS, Lustre, a FUSE-mounted bucket).

Ray is an optional dependency (``pip install 'packer[ray]'``); this module imports it lazily. If no Ray
runtime is up, ``ray.init()`` starts a local one with every core; on a cluster, call
``ray.init(address="auto")`` (or set ``RAY_ADDRESS``) before ``packer.build``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from . import schema
from .errors import ConfigError
from .plan import Plan
from .schema import ShardEntry
from .spill import Spill, chunk_ranges, open_store
from .tokenization import Encoded, Encoder
from .writer import add_counts, shard_bounds, shard_entry, write_shard


def _ray():
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ConfigError("--engine ray needs Ray Data: pip install 'packer[ray]' (or 'ray[data]')") from e
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)
    return ray


class _EncodeChunks:
    """A Ray Data UDF (one per actor, so the tokenizer loads once): chunk numbers → rows of flat bytes."""

    def __init__(self, encoder: Encoder, dataset, where: str, bounds: list[tuple[int, int]]):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one CPU per actor; Ray runs one actor per CPU
        self.encoder, self.dataset, self.where, self.bounds = encoder, dataset, where, bounds

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, list] = {k: [] for k in ("ids", "trained", "lengths", "example_ids", "skipped")}
        for k in batch["id"]:
            lo, hi = self.bounds[int(k)]
            chunk = self.encoder.encode(self.dataset[lo:hi], lo, where=self.where)
            out["ids"].append(chunk.ids.astype(np.int32).tobytes())
            out["trained"].append(chunk.trained.astype(np.uint8).tobytes())
            out["lengths"].append(chunk.lengths.astype(np.int64).tobytes())
            out["example_ids"].append(chunk.example_ids.astype(np.int64).tobytes())
            out["skipped"].append(json.dumps(chunk.skipped, sort_keys=True))
        return {k: np.array(v, dtype=object) for k, v in out.items()}


class RayEngine:
    """The :class:`packer.engines.Engine` whose steps run as Ray tasks on the cluster ``ray.init()`` joins."""

    def encode_chunks(self, dataset, encoder: Encoder, start: int, *, where: str) -> Iterator[Encoded]:
        """The Encoded chunks of records ``start`` … of ``dataset``, in source order, tokenized by Ray tasks.

        The Ray Dataset is the list of chunk numbers; each task reads its records from ``dataset`` itself
        (a `datasets.Dataset` pickles as a reference to its memory-mapped Arrow cache files, so nothing
        big travels and memory stays bounded; on a cluster that cache must be on the shared filesystem).
        """
        ray = _ray()
        bounds = list(chunk_ranges(start, len(dataset)))
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        ds = ray.data.range(len(bounds), override_num_blocks=min(len(bounds), 4 * cpus) or 1)
        ds = ds.map_batches(_EncodeChunks, fn_constructor_args=(encoder, dataset, where, bounds), batch_size=1,
                            concurrency=(1, cpus), num_cpus=1)
        for row in ds.iter_rows():
            yield Encoded(
                ids=np.frombuffer(row["ids"], dtype=np.int32),
                trained=np.frombuffer(row["trained"], dtype=np.uint8),
                lengths=np.frombuffer(row["lengths"], dtype=np.int64),
                example_ids=np.frombuffer(row["example_ids"], dtype=np.int64),
                skipped=json.loads(row["skipped"]),
            )

    def write_shards(self, plan: Plan, spill: Spill, staging: Path, *, shard_bytes: int, totals: dict[str, int],
                     progress: bool) -> list[ShardEntry]:
        """Write every shard into ``staging`` as parallel Ray tasks; the manifest entries in order (their
        loss counts are added into ``totals``)."""
        ray = _ray()
        task = ray.remote(num_cpus=1)(_write_shard)
        plan_ref, lengths_ref = ray.put(plan), ray.put(np.asarray(spill.lengths))
        bounds = shard_bounds(plan, shard_bytes)
        names = [schema.shard_name(i) for i in range(len(bounds))]
        refs = [task.remote(plan_ref, str(spill.folder), lengths_ref, str(staging / name), lo, hi)
                for name, (lo, hi) in zip(names, bounds, strict=True)]
        entries = []
        for name, counts in zip(names, ray.get(refs), strict=True):
            add_counts(totals, counts)
            entries.append(shard_entry(staging / name, counts))
        return entries


def _write_shard(plan: Plan, folder: str, lengths: np.ndarray, path: str, lo: int, hi: int) -> dict:
    """One shard: rows [lo, hi) of the plan, assembled from the memory-mapped spill in ``folder``."""
    return write_shard(plan, open_store(Path(folder), lengths), Path(path), lo, hi)
