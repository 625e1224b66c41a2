"""Read-side views of a shard folder: the summary of a build and one row taken apart.

Both return plain dicts (the CLI renders them as text or JSON). Reading a row opens one shard,
memory-mapped; nothing else is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from . import schema
from .errors import ConfigError


def summary(directory: str | Path) -> dict[str, Any]:
    manifest = schema.read_manifest(directory)
    stats = manifest["stats"]
    return {
        "directory": str(directory),
        "note": manifest.get("note"),
        "pack": manifest["config"]["pack"],
        "batch_size": manifest["config"].get("batch_size"),
        "max_tokens": manifest["config"].get("max_tokens"),
        "tokenizer": manifest["tokenizer"]["name_or_path"],
        "stats": stats,
        "shards": manifest["shards"],
    }


def _locate(manifest: dict, row: int) -> tuple[str, int]:
    total = sum(s["rows"] for s in manifest["shards"])
    if not 0 <= row < total:
        raise ConfigError(f"--row {row} is out of range: the build has {total} rows (0..{total - 1})")
    for shard in manifest["shards"]:
        if row < shard["rows"]:
            return shard["file"], row
        row -= shard["rows"]
    raise AssertionError("unreachable: row counted in total")


def row(directory: str | Path, index: int, tokenizer=None) -> dict[str, Any]:
    """Row ``index`` segment by segment: example id, length, trained/masked tokens and decoded text."""
    manifest = schema.read_manifest(directory)
    name, local = _locate(manifest, index)
    table = schema.open_shard(Path(directory) / name)
    record = table.slice(local, 1).to_pylist()[0]
    ids = np.asarray(record["input_ids"])
    labels = np.asarray(record["labels"])
    bounds = np.concatenate([[0], np.cumsum(record["seq_lens"])])
    segments = []
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg_ids, trained = ids[lo:hi], labels[lo:hi] != schema.IGNORE_INDEX
        entry = {
            "segment": k,
            "example_id": record["example_ids"][k],
            "offset": int(lo),
            "length": int(hi - lo),
            "trained_tokens": int(trained.sum()),
            "ids": seg_ids.tolist(),
            "trained": trained.tolist(),
        }
        if tokenizer is not None:
            entry["runs"] = _runs(tokenizer, seg_ids, trained)
        segments.append(entry)
    return {
        "row": index,
        "shard": name,
        "tokens": int(len(ids)),
        "num_loss_tokens": record["num_loss_tokens"],
        "max_seqlen": record["max_seqlen"],
        "segments": segments,
    }


def _runs(tokenizer, ids: np.ndarray, trained: np.ndarray) -> list[dict[str, Any]]:
    """The segment as runs of masked and trained tokens, each decoded: [{"trained", "text"}, ...]."""
    cuts = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    runs = []
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(ids)]])):
        text = tokenizer.decode(ids[lo:hi].tolist(), skip_special_tokens=False)
        runs.append({"trained": bool(trained[lo]), "tokens": int(hi - lo), "text": text})
    return runs
