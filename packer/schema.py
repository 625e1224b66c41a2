"""The on-disk contract, format version 1, in one place.

A shard directory holds Arrow IPC *stream* files ``shard-00000.arrow``, ... and ``manifest.json``,
written last: its presence means the build is complete. One Arrow row is one pack, one training row::

    input_ids     | BOS p p p c c c EOS | BOS p p c c EOS | ...   concatenated examples
    position_ids  |  0  1 2 3 4 5 6  7  |  0  1 2 3 4  5  | ...   restart at every example
    labels        | -100 ...  c c c EOS | -100 ... c c EOS | ...   -100 at each example's first token
    seq_lens      | [8, 6, ...]                                    cu_seqlens = [0, cumsum(seq_lens)]

Labels are *unshifted* (a model shifts them left), so a label of -100 at every segment start is what
keeps the last token of one example from being trained to predict the first token of the next.

Beside them, ``dataset_info.json`` and ``state.json`` (``DATASETS_FILES``) are what
``datasets.load_from_disk(DIR)`` needs to open the folder as a ``Dataset`` with one row per pack; they
are written before the manifest and derived from it alone (no times), so builds stay byte-identical.

Where a folder lives. Every reader here takes a local path or an fsspec URL (``s3://``, ``gs://``,
``file://``, ``memory://``, ...; the remote protocols need their fsspec package, e.g. ``s3fs``). Local
paths and ``file://`` URLs are memory-mapped (zero copy); other filesystems are read whole into memory,
one shard at a time. Helpers: :func:`join`, :func:`is_dir`, :func:`list_names`, :func:`read_bytes`,
:func:`file_size`, :func:`file_sha256`.
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
# What `datasets.load_from_disk` reads beside the shards (names fixed by `datasets`); written before the manifest.
DATASETS_INFO_NAME = "dataset_info.json"
DATASETS_STATE_NAME = "state.json"
DATASETS_FILES = (DATASETS_INFO_NAME, DATASETS_STATE_NAME)

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


# -- where a folder lives: a local path or an fsspec URL -------------------------------------------

PathLike = str | os.PathLike


def is_url(path: PathLike) -> bool:
    """True for an fsspec URL (``proto://...``); a local path otherwise."""
    return isinstance(path, str) and "://" in path


def local_path(path: PathLike) -> Path | None:
    """The local path of a plain path or a ``file://`` URL; None for any other filesystem."""
    if not is_url(path):
        return Path(path)
    if str(path).startswith(("file://", "local://")):
        return Path(str(path).split("://", 1)[1])
    return None


def _fs(url: str):
    try:
        from fsspec.core import url_to_fs
    except ImportError as e:  # pragma: no cover - datasets depends on fsspec
        raise _format_error(f"{url}: reading an fsspec URL needs fsspec (pip install fsspec)") from e
    try:
        return url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise _format_error(f"{url}: cannot open this filesystem ({e}); install its fsspec package (s3fs, gcsfs, ...)") from e


def join(directory: PathLike, name: str) -> PathLike:
    """``directory / name`` for a local path, ``directory + "/" + name`` for a URL."""
    if is_url(directory):
        return str(directory).rstrip("/") + "/" + name
    return Path(directory) / name


def file_size(path: PathLike) -> int | None:
    """Size in bytes of a file, or None when there is no such file."""
    local = local_path(path)
    if local is not None:
        return local.stat().st_size if local.is_file() else None
    fs, p = _fs(str(path))
    try:
        return int(fs.size(p)) if fs.isfile(p) else None
    except FileNotFoundError:
        return None


def is_dir(path: PathLike) -> bool:
    local = local_path(path)
    if local is not None:
        return local.is_dir()
    fs, p = _fs(str(path))
    return bool(fs.isdir(p))


def list_names(directory: PathLike) -> list[str]:
    """Names of the entries of a folder (files and subfolders), sorted."""
    local = local_path(directory)
    if local is not None:
        return sorted(p.name for p in local.iterdir())
    fs, p = _fs(str(directory))
    return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False))


def read_bytes(path: PathLike) -> bytes:
    local = local_path(path)
    if local is not None:
        return local.read_bytes()
    fs, p = _fs(str(path))
    return fs.cat_file(p)


def file_sha256(path: PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    local = local_path(path)
    if local is not None:
        opened = open(local, "rb")  # noqa: SIM115 - closed by the `with` below, whichever filesystem opened it
    else:
        fs, p = _fs(str(path))
        opened = fs.open(p, "rb")
    with opened as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _format_error(message: str):
    from .errors import ShardFormatError

    return ShardFormatError(message)


def dump_manifest(manifest: dict[str, Any]) -> bytes:
    """Canonical bytes: sorted keys and a fixed layout, so equal builds give equal files."""
    return (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def read_manifest(directory: PathLike) -> dict[str, Any]:
    """Read and check the manifest of a finished build (a local path or an fsspec URL); raises
    ShardFormatError if it is not one."""
    from .errors import ShardFormatError

    path = join(directory, MANIFEST_NAME)
    if not is_dir(directory):
        raise ShardFormatError(f"{directory}: no such directory; build one with `packer build SOURCE --out {directory}`")
    if file_size(path) is None:
        raise ShardFormatError(
            f"{directory}: no {MANIFEST_NAME}, so this is not a finished packer build "
            f"(an interrupted build or another tool's folder); rerun `packer build ... --out {directory}`"
        )
    try:
        manifest = json.loads(read_bytes(path).decode())
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


def open_shard(path: PathLike) -> pa.Table:
    """Open one shard and check its schema against the contract: memory-mapped (zero copy) when local
    or ``file://``, read whole into memory from any other fsspec filesystem."""
    from .errors import ShardFormatError

    local = local_path(path)
    try:
        if local is not None:
            with pa.memory_map(str(local), "r") as source:
                table = pa.ipc.open_stream(source).read_all()
        else:
            table = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(read_bytes(path)))).read_all()
        table.validate(full=True)  # offsets in bounds: a broken row fails here, not mid-epoch (cost: O(rows))
    except (OSError, pa.ArrowInvalid) as e:
        raise ShardFormatError(f"{path}: cannot be read as an Arrow stream ({e}); the shard is corrupted, rebuild it") from e
    if not table.schema.remove_metadata().equals(ROW_SCHEMA):
        raise ShardFormatError(f"{path}: schema {table.schema} is not packer's row schema (format version {FORMAT_VERSION})")
    return table


def _datasets_feature(t: pa.DataType) -> Any:
    if pa.types.is_list(t):  # a JSON list is `datasets`' spelling of a list feature in every version >= 2
        return [_datasets_feature(t.value_type)]
    return {"dtype": str(t), "_type": "Value"}


def datasets_files(manifest: dict[str, Any]) -> dict[str, bytes]:
    """The files ``datasets.load_from_disk`` needs beside the shards, from the manifest alone.

    ``dataset_info.json`` gives the features (the row schema); ``state.json`` lists the shards in order
    and a fingerprint derived from their sha256s, so equal builds give equal bytes."""
    shards = manifest["shards"]
    fingerprint = hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()[:16]
    info = {
        "citation": "",
        "description": f"packer shards (format version {FORMAT_VERSION}): one row per pack; see {MANIFEST_NAME}",
        "features": {f.name: _datasets_feature(f.type) for f in ROW_SCHEMA},
        "homepage": "",
        "license": "",
    }
    state = {
        "_data_files": [{"filename": s["file"]} for s in shards],
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    return {DATASETS_INFO_NAME: dump_manifest(info), DATASETS_STATE_NAME: dump_manifest(state)}
