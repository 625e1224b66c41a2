"""The on-disk contract, format version 1, in one place.

A shard directory holds Arrow IPC *stream* files ``shard-00000.arrow``, ... and ``manifest.json``,
written last: its presence means the build is complete. One Arrow row is one pack, one training row::

    input_ids     | BOS p p p c c c EOS | BOS p p c c EOS | ...   concatenated examples
    position_ids  |  0  1 2 3 4 5 6  7  |  0  1 2 3 4  5  | ...   restart at every example
    labels        | -100 ...  c c c EOS | -100 ... c c EOS | ...   -100 at each example's first token
    seq_lens      | [8, 6, ...]                                    cu_seqlens = [0, cumsum(seq_lens)]

Labels are *unshifted* (a model shifts them left), so a label of -100 at every segment start is what
keeps the last token of one example from being trained to predict the first token of the next.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

FORMAT_NAME = "packer"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".arrow"
IGNORE_INDEX = -100

ROW_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("position_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("labels", pa.list_(pa.int32()), nullable=False),
        pa.field("seq_lens", pa.list_(pa.int32()), nullable=False),
        pa.field("example_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("num_loss_tokens", pa.int32(), nullable=False),
        pa.field("max_seqlen", pa.int32(), nullable=False),
    ]
)
COLUMNS = tuple(ROW_SCHEMA.names)


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def dump_manifest(manifest: dict[str, Any]) -> bytes:
    """Canonical bytes: sorted keys and a fixed layout, so equal builds give equal files."""
    return (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """Read and check the manifest of a finished build; raises ShardFormatError if it is not one."""
    from .errors import ShardFormatError

    path = Path(directory) / MANIFEST_NAME
    if not Path(directory).is_dir():
        raise ShardFormatError(f"{directory}: no such directory; build one with `packer build SOURCE --out {directory}`")
    if not path.is_file():
        raise ShardFormatError(
            f"{directory}: no {MANIFEST_NAME}, so this is not a finished packer build "
            f"(an interrupted build or another tool's folder); rerun `packer build ... --out {directory}`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardFormatError(f"{path}: not valid JSON ({e}); the manifest is corrupted, rebuild the folder") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ShardFormatError(f"{path}: not a packer manifest (no \"format\": \"{FORMAT_NAME}\")")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ShardFormatError(
            f"{path}: format version {version!r}, this packer reads version {FORMAT_VERSION}; "
            "rebuild the shards with this packer or use the packer that wrote them"
        )
    return manifest


def open_shard(path: str | os.PathLike) -> pa.Table:
    """Memory-map one shard (zero copy) and check its schema against the contract."""
    from .errors import ShardFormatError

    try:
        with pa.memory_map(str(path), "r") as source:
            table = pa.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowInvalid) as e:
        raise ShardFormatError(f"{path}: cannot be read as an Arrow stream ({e}); the shard is corrupted, rebuild it") from e
    if not table.schema.remove_metadata().equals(ROW_SCHEMA):
        raise ShardFormatError(f"{path}: schema {table.schema} is not packer's row schema (format version {FORMAT_VERSION})")
    return table
