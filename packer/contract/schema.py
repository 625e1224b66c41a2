"""The on-disk contract, format versions 1 and 2, in one place.

A shard directory holds Arrow IPC *stream* files ``shard-00000.arrow``, ... and ``manifest.json``,
written last: its presence means the build is complete. One Arrow row is one pack, one training row::

    input_ids     | BOS p p p c c c EOS | BOS p p c c EOS | ...   concatenated examples
    position_ids  |  0  1 2 3 4 5 6  7  |  0  1 2 3 4  5  | ...   restart at every example
    labels        | -100 ...  c c c EOS | -100 ... c c EOS | ...   -100 at each example's first token
    seq_lens      | [8, 6, ...]                                    cu_seqlens = [0, cumsum(seq_lens)]

Labels are *unshifted* (a model shifts them left), so a label of -100 at every segment start is what
keeps the last token of one example from being trained to predict the first token of the next.

Two versions, one meaning (:class:`RowFormat`). Version 1 stores the three token columns as int32.
Version 2 (the default) stores each in the narrowest type its values need, decided from the build
and recorded in the manifest's ``columns``: ``input_ids`` uint16 when every id of the tokenizer is
below 65,536, else uint32; ``position_ids`` uint16 when the longest segment the config allows
(``BuildConfig.longest_segment``) is at most 65,536 tokens, else uint32; and the loss as
``loss_mask``, one Arrow boolean (a bit) per token, instead of ``labels``: labels are ``input_ids``
where the mask is set and -100 elsewhere, so the mask is False at every segment start. The
per-segment and per-row columns are the same in both. Readers read both; the loader yields the same
batches from both.

Beside them, ``dataset_info.json`` and ``state.json`` (``DATASETS_FILES``) are what
``datasets.load_from_disk(DIR)`` needs to open the folder as a ``Dataset`` with one row per pack; they
are written before the manifest and derived from it alone (no times), so builds stay byte-identical.

An output folder also holds, while a build runs, ``STAGING`` (the build's flock ``STAGING/LOCK``, shards
being written, and the token spill in ``STAGING/TOKENS_DIR``); :func:`listed_files` says which files of
a folder a manifest proves are packer's. The manifest is read and written only through :class:`Manifest` (typed, frozen;
``from_json``/``to_json`` keep its keys and bytes; ``config`` is the :class:`~packer.contract.config.BuildConfig`,
so a reader never re-derives a default). Readers take a local path or an fsspec URL (:mod:`packer.fs`).

Changing the manifest (docs/design.md says the same):

- *A new field a build does not always use* (a config option, a count that applies to some builds)
  gets a default and is recorded only when set: ``BuildConfig.identity()`` leaves out a field of
  ``config._RECORDED_WHEN_SET`` at its default, :meth:`Stats.to_json` a ``Stats`` field that is None.
  A build that does not use it keeps its bytes, its identity (a rerun reuses it) and the digests
  ``tests/test_digests.py`` pins; a reader of an older manifest gets the default. No version change.
- *Anything else* (a field renamed, removed or meaning something new, the row schema, the file
  layout) is a new ``FORMAT_VERSION``, with the pinned digests updated in the same commit. A reader
  refuses a manifest of another version in one line (rebuild with this packer, or read it with the
  packer that wrote it). Every version packer wrote stays readable (``READ_VERSIONS``).
- Types come from the dataclasses' annotations (``typing.get_type_hints``): a new field is checked
  as it is declared, ``float | None`` included.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .. import fs
from ..errors import ConfigError, ShardFormatError
from .config import _ABSENT_MEANS, BuildConfig
from .vision import IMAGE_FIELDS, PROCESSOR_KEY

FORMAT_NAME = "packer"
FORMAT_VERSION = 2  # what a build writes unless told otherwise (BuildConfig.format_version)
READ_VERSIONS = (1, 2)  # what every reader reads: every version packer ever wrote
MANIFEST_NAME = "manifest.json"
# The manifest's key holding the sha256 of the rest of it (canonical bytes): any edit shows, and the
# shards' own sha256s are in what it hashes.
CONTENT_HASH = "content_sha256"
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".arrow"
IGNORE_INDEX = -100
# What `datasets.load_from_disk` reads beside the shards (names fixed by `datasets`); written before the manifest.
DATASETS_INFO_NAME = "dataset_info.json"
DATASETS_STATE_NAME = "state.json"
DATASETS_FILES = (DATASETS_INFO_NAME, DATASETS_STATE_NAME)

ROW_SCHEMA = pa.schema(  # format version 1
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
# A padded build (--cp-size, --pad-to-multiple-of; packer.planning.context_parallel) has one more column: the
# padding tokens at the end of each segment, which its seq_lens include.
PAD_COLUMN = "pad_lens"
PADDED_ROW_SCHEMA = ROW_SCHEMA.append(pa.field(PAD_COLUMN, pa.list_(pa.int32()), nullable=False))
LOSS_MASK = "loss_mask"  # version 2's loss column: a bit per token, set where the token is trained
# The optional per-segment columns, each present only in builds that use it, appended in this order
# after the fixed columns in every version (a new one is one entry here and its test in RowFormat.of).
# A preference build (packer.planning.pairs) has pair_roles: each segment's role in its pair, 1 chosen, 0
# rejected; a row holds whole pairs, each two adjacent segments (chosen, then rejected) of one example id.
PAIR_COLUMN = "pair_roles"
EXTRA_SEGMENT_COLUMNS: dict[str, pa.DataType] = {PAD_COLUMN: pa.int32(), PAIR_COLUMN: pa.int8()}
# Version 2's choices for the ids and the positions: the narrowest that holds them (RowFormat.of).
NARROW_TYPES = {"uint16": pa.uint16(), "uint32": pa.uint32()}
_UINT16_VALUES = 1 << 16


def row_schema(padded: bool) -> pa.Schema:
    """Format version 1's row schema (see :class:`RowFormat` for every version's)."""
    return PADDED_ROW_SCHEMA if padded else ROW_SCHEMA


@dataclass(frozen=True, slots=True)
class RowFormat:
    """What a build's shards hold: the format version, the value types of ``input_ids`` and
    ``position_ids``, and the optional per-segment columns present (``EXTRA_SEGMENT_COLUMNS``).

    Version 1: int32 ids, positions and ``labels``. Version 2: ids and positions as recorded in the
    manifest's ``columns`` (uint16 or uint32), and ``loss_mask`` (booleans) in place of ``labels``."""

    version: int = 1
    ids: str = "int32"
    positions: str = "int32"
    extra: tuple[str, ...] = ()
    images: bool = False  # an image build: the image columns (packer.contract.vision.IMAGE_FIELDS) last

    @classmethod
    def of(cls, version: int, *, id_bound: int, longest_segment: int, padded: bool, pairs: bool = False,
           images: bool = False) -> RowFormat:
        """The format a build writes: in version 2, ids in uint16 when every id is below 65,536
        (``id_bound``: one past the tokenizer's largest id) and positions in uint16 when every segment
        holds at most 65,536 tokens (``longest_segment``: what the config allows), else uint32."""
        extra = (PAD_COLUMN,) * padded + (PAIR_COLUMN,) * pairs
        if version == 1:
            return cls(1, extra=extra, images=images)
        return cls(version, "uint16" if id_bound <= _UINT16_VALUES else "uint32",
                   "uint16" if longest_segment <= _UINT16_VALUES else "uint32", extra, images)

    @property
    def loss(self) -> str:
        """The loss column's name: ``labels`` (version 1) or ``loss_mask`` (version 2)."""
        return "labels" if self.version == 1 else LOSS_MASK

    @property
    def padded(self) -> bool:
        return PAD_COLUMN in self.extra

    def schema(self) -> pa.Schema:
        if self.version == 1:
            base = ROW_SCHEMA
        else:
            base = pa.schema([
                pa.field("input_ids", pa.list_(NARROW_TYPES[self.ids]), nullable=False),
                pa.field("position_ids", pa.list_(NARROW_TYPES[self.positions]), nullable=False),
                pa.field(LOSS_MASK, pa.list_(pa.bool_()), nullable=False),
                *(ROW_SCHEMA.field(name) for name in COLUMNS[3:]),
            ])
        for name in self.extra:
            base = base.append(pa.field(name, pa.list_(EXTRA_SEGMENT_COLUMNS[name]), nullable=False))
        for image_field in IMAGE_FIELDS if self.images else ():
            base = base.append(image_field)
        return base

    def columns(self) -> dict[str, str] | None:
        """What a version-2 manifest records as ``columns`` (None in version 1: its types are fixed)."""
        if self.version == 1:
            return None
        return {"input_ids": self.ids, "position_ids": self.positions, LOSS_MASK: "bool"}

    def bytes_per_token(self) -> float:
        """The token columns' bytes per token (what a shard holds beside the per-segment columns)."""
        if self.version == 1:
            return 12
        return (NARROW_TYPES[self.ids].bit_width + NARROW_TYPES[self.positions].bit_width + 1) / 8


def _column_problem(version: int, columns: Any) -> str | None:
    """What is wrong with a manifest's ``columns`` for its version (None: nothing)."""
    if version == 1:
        return None if columns is None else "a version-1 manifest records no columns (its types are fixed)"
    if not isinstance(columns, dict) or set(columns) != {"input_ids", "position_ids", LOSS_MASK} \
            or columns.get(LOSS_MASK) != "bool" \
            or any(not isinstance(columns.get(k), str) or columns[k] not in NARROW_TYPES
                   for k in ("input_ids", "position_ids")):
        return (f"missing or not {{input_ids, position_ids: {' or '.join(NARROW_TYPES)}, {LOSS_MASK}: bool}}; "
                "rebuild the folder")
    return None


def row_formats() -> list[RowFormat]:
    """Every row format packer writes (what :func:`open_shard` accepts without a manifest)."""
    extras = [(), (PAD_COLUMN,), (PAIR_COLUMN,), (PAD_COLUMN, PAIR_COLUMN)]
    out = [RowFormat(1, extra=e) for e in extras]
    out += [RowFormat(2, i, p, e) for i in NARROW_TYPES for p in NARROW_TYPES for e in extras]
    return out + [RowFormat(f.version, f.ids, f.positions, f.extra, True) for f in out]  # and with images


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"


# -- what packer owns in an output folder ----------------------------------------------------------
#
# A name proves nothing: packer owns only the files a manifest it wrote lists (:func:`listed_files`,
# proven by the manifest's content hash) and its staging folder, proven by the lock file inside it
# (``LOCK`` holding exactly ``LOCK_BYTES``). Everything else in a folder is someone else's.

STAGING = ".packer-staging"  # the lock, shards being written, the token spill; gone once a build ends
LOCK = "lock"  # inside STAGING: the build's flock, and the proof that the folder is packer's
LOCK_BYTES = b"packer: this folder is a packer build's staging area; packer removes it\n"
TOKENS_DIR = "tokens"  # the token spill, inside STAGING
PENDING = "pending-manifest.json"  # inside STAGING: the manifest being committed (then renamed into place)
PREVIOUS = "previous-manifest.json"  # inside STAGING: the manifest of the build being cleared


def is_shard_name(name: str) -> bool:
    return name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)


def listed_files(data: Any) -> frozenset[str] | None:
    """The files of a folder that the manifest ``data`` (parsed JSON) proves packer wrote: itself, its
    shards and the ``datasets`` files; None when its content hash does not prove packer wrote it (any
    other tool's JSON, an edited or damaged manifest). A version this packer cannot read still proves it."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME or not isinstance(data.get("shards"), list):
        return None
    if data.get(CONTENT_HASH) != content_sha256(data):
        return None
    shards = {e.get("file") for e in data["shards"] if isinstance(e, dict)}
    return frozenset({MANIFEST_NAME, *DATASETS_FILES, *(f for f in shards if isinstance(f, str) and is_shard_name(f)
                                                         and "/" not in f)})


# -- the manifest, typed ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """The manifest's record of one shard."""

    file: str
    rows: int
    tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Stats:
    """What a build counted: the plan's accounting (``packer.planning.plan``) plus the build's own."""

    examples: int  # examples the plan saw (records read minus records skipped)
    examples_packed: int  # placed whole
    examples_split: int
    examples_truncated: int
    examples_dropped: int
    segments: int
    tokens_in: int
    tokens: int  # in rows
    tokens_truncated: int
    tokens_dropped: int
    rows: int
    max_row_tokens: int
    row_budget: int
    lower_bound: int  # ceil(tokens / row_budget): no packing can use fewer rows
    fill: float
    world_size: int
    rank_work_max_over_mean: float
    examples_read: int
    records_skipped: int
    dropped_by_reason: dict  # reason -> examples or records, only the non-zero ones
    loss_tokens: int
    segments_without_loss: int  # segments that hold no trained token (a completion cut away)
    # Optional fields (see "Changing the manifest" above): None, and absent from the JSON, where they do
    # not apply
    padded_tokens: int | None = None  # batch mode only: the tokens padded batches would hold
    epochs: int | None = None  # the epochs the rows hold (--epochs E > 1): rows, tokens, segments, loss
    # tokens and padded_tokens then count all of them; the examples' accounting is one epoch's
    examples_truncated_left: int | None = None  # --overlong truncate-left: of examples_truncated, those
    # cut at the start of the prompt (the answer whole) ...
    examples_answer_too_long: int | None = None  # ... and those whose answer alone exceeds max_len (cut on the right)
    pad_tokens: int | None = None  # a padded build: the padding tokens in the rows (not in tokens; in max_row_tokens)
    pad_token_id: int | None = None  # ... and their id: the tokenizer's pad id, else its eos id
    pairs: int | None = None  # a preference build: the pairs in the rows (one epoch's); examples count pairs

    # a mix only (packer.building.mix.part_counts): per source, records read, examples packed / split / truncated,
    # dropped by reason, tokens
    sources: list | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @property
    def epoch_count(self) -> int:
        return self.epochs or 1

    @property
    def padded(self) -> bool:
        """Whether the shards have the ``pad_lens`` column (``PADDED_ROW_SCHEMA``)."""
        return self.pad_tokens is not None

    @property
    def paired(self) -> bool:
        """Whether the build holds preference pairs (the shards have the ``pair_roles`` column)."""
        return self.pairs is not None


# Types the parser checks each manifest key against (bool is not an int here).
_TOP = {"format": str, "format_version": int, "created_by": str, "config": dict, "tokenizer": dict, "source": dict,
        "stats": dict, "shards": list}


def _typed(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the annotated type: ``X | None`` is either, an int is a float, a bool is
    only a bool, ``dict[str, int]`` is a dict."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return any(_typed(value, h) for h in typing.get_args(hint))
    if hint is None or hint is type(None):
        return value is None
    kind = typing.get_origin(hint) or hint
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


@functools.cache
def _field_types(cls) -> types.MappingProxyType:
    """Each field's type, resolved from its annotation (``typing.get_type_hints``), once a class: resolving
    them took ~1.5 ms a call, four calls a manifest read (the loader, verify, inspect and a rerun read one;
    the suite reads thousands). Read-only, as it is shared."""
    hints = typing.get_type_hints(cls)
    return types.MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(cls)})


def recorded_config(recorded: dict[str, Any]) -> BuildConfig:
    """The :class:`BuildConfig` a manifest records (``BuildConfig.identity()``): a field not recorded
    takes its default, which is what "recorded only when set" means; ``out`` and the fields that do
    not decide the bytes (``num_proc``, ``engine``, ``overwrite``) are not recorded and are left at
    theirs (``out`` empty). A ConfigError names the first key that is mistyped or that BuildConfig
    refuses."""
    types_ = _field_types(BuildConfig)
    values = {**_ABSENT_MEANS, **recorded, "out": ""}
    if isinstance(values.get("mix"), list):
        values["mix"] = tuple(values["mix"])
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ConfigError(f"unknown keys {', '.join(unknown)}")
    bad = [k for k, v in values.items() if not _typed(v, types_[k])]
    if bad:
        raise ConfigError(f"{', '.join(bad)} mistyped")
    return BuildConfig(**values)


@dataclass(frozen=True, slots=True)
class Manifest:
    """``manifest.json``: what was built from what, what it holds, and the shards (written last)."""

    created_by: str
    note: str | None
    config: BuildConfig  # recorded as its identity(): every field that decides the bytes
    tokenizer: dict  # tokenization.tokenizer_info()
    source: dict  # build.source_info(); a mix: {"kind": "mix", "parts": [{"source": name, ...source_info}]}
    stats: Stats
    shards: tuple[ShardEntry, ...]
    format: str = FORMAT_NAME
    # A manifest made without naming its version is version 1's (fixed int32 types, no ``columns``); a
    # build names both (RowFormat.of, RowFormat.columns)
    format_version: int = 1
    columns: dict | None = None  # version 2: the token columns' value types (RowFormat.columns)

    @property
    def row_format(self) -> RowFormat:
        """What the shards hold, from the version, ``columns`` and the stats (a padded build's ``pad_lens``)."""
        extra = (PAD_COLUMN,) * self.stats.padded + (PAIR_COLUMN,) * self.stats.paired
        images = PROCESSOR_KEY in self.tokenizer  # an image build records its processor with its tokenizer
        if self.format_version == 1 or self.columns is None:
            return RowFormat(1, extra=extra, images=images)
        return RowFormat(self.format_version, self.columns["input_ids"], self.columns["position_ids"], extra, images)

    def to_json(self) -> dict[str, Any]:
        content = {
            "format": self.format,
            "format_version": self.format_version,
            **({} if self.columns is None else {"columns": self.columns}),
            "created_by": self.created_by,
            "note": self.note,
            "config": self.config.identity(),
            "tokenizer": self.tokenizer,
            "source": self.source,
            "stats": self.stats.to_json(),
            "shards": [dataclasses.asdict(s) for s in self.shards],
        }
        return {**content, CONTENT_HASH: content_sha256(content)}

    def dumps(self) -> bytes:
        return dump_manifest(self.to_json())

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST_NAME) -> Manifest:
        """The manifest in ``data`` (parsed JSON); a ShardFormatError naming the first problem."""
        manifest, problems = parse_manifest(data)
        if problems:
            key, message = problems[0]
            raise ShardFormatError(f"{where}{' ' + key if key else ''}: {message}")
        return manifest


def content_sha256(content: dict[str, Any]) -> str:
    """The manifest's hash of its own content: sha256 of its canonical bytes without this key."""
    return hashlib.sha256(dump_manifest({k: v for k, v in content.items() if k != CONTENT_HASH})).hexdigest()


def parse_manifest(data: Any) -> tuple[Manifest | None, list[tuple[str, str]]]:
    """``(manifest, problems)``: every problem found as ``(key, message)``, so that verify can report
    them all; :meth:`Manifest.from_json` raises the first. The manifest is None when it cannot be typed;
    an edit that keeps it typed (its content hash no longer matches) gives both, so verify can go on."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        return None, [("", f"not a packer manifest (no \"format\": \"{FORMAT_NAME}\")")]
    version = data.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        return None, [("", f"format version {version!r}, this packer reads versions "
                       f"{', '.join(map(str, READ_VERSIONS))}; rebuild the shards with this packer or use the "
                       "packer that wrote them")]
    recorded = data.get(CONTENT_HASH)
    if not isinstance(recorded, str):
        edited = [(CONTENT_HASH, "missing or not a string: the manifest cannot prove it is unedited (written by "
                   "another tool, or by a packer before this hash); rebuild the folder")]
    elif recorded != content_sha256(data):
        edited = [(CONTENT_HASH, "does not match the manifest's content: it was edited after the build; rebuild "
                   "the folder (an edited manifest can make a loader read wrong data)")]
    else:
        edited = []
    problems = [(key, f"missing or not a {kind.__name__}") for key, kind in _TOP.items() if not _typed(data.get(key), kind)]
    if not _typed(data.get("note"), str | None):
        problems.append(("note", "not a string or null"))
    unknown = sorted(set(data) - {*_TOP, "note", "columns", CONTENT_HASH})
    if unknown:
        problems.append(("", f"unknown keys {', '.join(unknown)}"))
    if (wrong := _column_problem(version, data.get("columns"))) is not None:
        problems.append(("columns", wrong))
    if problems:
        return None, edited + problems
    stat_types = _field_types(Stats)
    bad = [k for k, kind in stat_types.items() if not _typed(data["stats"].get(k), kind)]
    unknown = sorted(set(data["stats"]) - set(stat_types))
    if bad or unknown:
        problems.append(("stats", ", ".join(
            ([f"lacks or mistypes {', '.join(bad)}"] if bad else []) + ([f"unknown keys {', '.join(unknown)}"] if unknown else []))))
    entry_types = _field_types(ShardEntry)
    for i, entry in enumerate(data["shards"]):
        bad = [k for k, kind in entry_types.items() if not isinstance(entry, dict) or not _typed(entry.get(k), kind)]
        if bad:
            problems.append((f"shards[{i}]", f"entry lacks or mistypes {', '.join(bad)}"))
        elif not is_shard_name(entry["file"]) or "/" in entry["file"]:
            problems.append((f"shards[{i}]", f"file {entry['file']!r} is not a shard name in this folder"))
        elif set(entry) - set(entry_types):
            problems.append((f"shards[{i}]", f"unknown keys {', '.join(sorted(set(entry) - set(entry_types)))}"))
    names = [e.get("file") for e in data["shards"] if isinstance(e, dict) and isinstance(e.get("file"), str)]
    if len(set(names)) != len(names):
        problems.append(("shards", "lists a shard twice"))
    try:
        config = recorded_config(data["config"])
    except (ConfigError, TypeError) as e:
        problems.append(("config", f"not a valid build config ({e})"))
    else:
        if config.format_version != version:
            problems.append(("config", f"format_version {config.format_version} differs from the manifest's "
                             f"format_version {version}"))
    if problems:
        return None, edited + problems
    manifest = Manifest(
        created_by=data["created_by"],
        note=data["note"],
        config=config,
        tokenizer=data["tokenizer"],
        source=data["source"],
        stats=Stats(**data["stats"]),
        shards=tuple(ShardEntry(**e) for e in data["shards"]),
        format_version=version,
        columns=data.get("columns"),
    )
    return manifest, edited


def dump_manifest(manifest: dict[str, Any]) -> bytes:
    """Canonical bytes: sorted keys and a fixed layout, so equal builds give equal files."""
    return (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def read_manifest(directory: fs.PathLike) -> Manifest:
    """Read and check the manifest of a finished build (a local path or an fsspec URL); raises
    ShardFormatError if it is not one."""
    path = fs.join(directory, MANIFEST_NAME)
    if not fs.is_dir(directory):
        raise not_a_folder(directory)
    if fs.file_size(path) is None:
        raise ShardFormatError(
            f"{directory}: no {MANIFEST_NAME}, so this is not a finished packer build "
            f"(an interrupted build or another tool's folder); rerun `packer build ... --out {directory}`"
        )
    return Manifest.from_json(load_json(fs.read_bytes(path), str(path)), str(path))


def not_a_folder(directory: fs.PathLike) -> ShardFormatError:
    """The one-line error for a build folder that is not a folder: a file (a data source, likely: say what
    to run on it), or nothing there."""
    if fs.file_size(directory) is not None:
        return ShardFormatError(f"{directory}: a file, not a build's folder (inspect and verify read what `packer build` "
                                f"writes); build it first: `packer build {directory} --out shards/`, then "
                                "`packer inspect shards/`")
    return ShardFormatError(f"{directory}: no such folder; build one with `packer build SOURCE --out {directory}`")


def load_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardFormatError(f"{where}: not valid JSON ({e}); the manifest is corrupted, rebuild the folder") from e


def open_shard(path: fs.PathLike, row_format: RowFormat | None = None) -> pa.Table:
    """Open one shard and check its schema against the contract (``row_format``: the manifest's; None:
    any format packer writes): memory-mapped (zero copy) when local or ``file://``, read whole into
    memory from any other fsspec filesystem. A compressed shard (``--compression``) is decompressed
    into memory whole, wherever it is."""
    local = fs.local_path(path)
    try:
        if local is not None:
            with pa.memory_map(str(local), "r") as source:
                table = pa.ipc.open_stream(source).read_all()
        else:
            table = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(fs.read_bytes(path)))).read_all()
        table.validate(full=True)  # offsets in bounds: a broken row fails here, not mid-epoch (cost: O(rows))
    except (OSError, pa.ArrowInvalid) as e:
        raise ShardFormatError(f"{path}: cannot be read as an Arrow stream ({e}); the shard is corrupted, rebuild it") from e
    found = table.schema.remove_metadata()
    if row_format is not None and not found.equals(row_format.schema()):
        raise ShardFormatError(f"{path}: schema {table.schema} is not the row schema the manifest records (format "
                               f"version {row_format.version}: {row_format.schema()}); the shard is from another "
                               "build, rebuild the folder")
    if row_format is None and not any(found.equals(f.schema()) for f in row_formats()):
        raise ShardFormatError(f"{path}: schema {table.schema} is not packer's row schema (format versions "
                               f"{', '.join(map(str, READ_VERSIONS))})")
    return table


def shard_file_problems(directory: fs.PathLike, entry: ShardEntry, *, sha256: bool = True) -> list[str]:
    """What is wrong with a listed shard's file against its manifest entry (an empty list: nothing):
    missing, another size, other bytes (``sha256``: hash it, which reads every byte). The one check of
    a shard file: a rerun's reuse (``output.damage``), ``verify`` and the loader call it."""
    path = fs.join(directory, entry.file)
    try:
        size = fs.file_size(path)
        if size is None:
            return ["missing, the manifest lists it; copy the whole folder or rebuild it"]
        problems = []
        if size != entry.bytes:
            problems.append(f"{size:,} bytes, the manifest records {entry.bytes:,} (truncated or from another build)")
        if sha256 and fs.file_sha256(path) != entry.sha256:
            problems.append("sha256 differs from the manifest's: the bytes changed")
        return problems
    except OSError as e:
        return [f"unreadable ({e.strerror or e})"]


def _datasets_feature(t: pa.DataType) -> Any:
    if pa.types.is_list(t):  # a JSON list is `datasets`' spelling of a list feature in every version >= 2
        return [_datasets_feature(t.value_type)]
    return {"dtype": str(t), "_type": "Value"}


def datasets_files(manifest: Manifest) -> dict[str, bytes]:
    """The files ``datasets.load_from_disk`` needs beside the shards, from the manifest alone.

    ``dataset_info.json`` gives the features (the row schema); ``state.json`` lists the shards in order
    and a fingerprint derived from their sha256s, so equal builds give equal bytes."""
    shards = manifest.shards
    fingerprint = hashlib.sha256("".join(s.sha256 for s in shards).encode()).hexdigest()[:16]
    info = {
        "citation": "",
        "description": f"packer shards (format version {manifest.format_version}): one row per pack; see {MANIFEST_NAME}",
        "features": {f.name: _datasets_feature(f.type) for f in manifest.row_format.schema()},
        "homepage": "",
        "license": "",
    }
    state = {
        "_data_files": [{"filename": s.file} for s in shards],
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    return {DATASETS_INFO_NAME: dump_manifest(info), DATASETS_STATE_NAME: dump_manifest(state)}


def datasets_file_problems(directory: fs.PathLike, manifest: Manifest) -> list[tuple[str, str]]:
    """``(name, problem)`` for each file ``datasets.load_from_disk`` reads that is missing or differs
    from what the manifest implies (:func:`datasets_files`)."""
    problems = []
    for name, expected in datasets_files(manifest).items():
        path = fs.join(directory, name)
        try:
            if fs.file_size(path) is None:
                problems.append((name, "missing: `datasets.load_from_disk` needs it; rebuild the folder"))
            elif fs.read_bytes(path) != expected:
                problems.append((name, "differs from what the manifest implies; rebuild the folder"))
        except OSError as e:
            problems.append((name, f"unreadable ({e.strerror or e})"))
    return problems
