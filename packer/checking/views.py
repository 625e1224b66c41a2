"""What ``packer inspect`` returns: frozen views of a shard folder, computed by :mod:`packer.checking.inspect_`,
turned into lines by :mod:`packer.render` and into JSON by their ``to_json`` (the CLI's ``--json``).

A view holds the manifest's own typed values (``Stats``, ``ShardEntry``, the ``BuildConfig``), so a
reader takes each number one way. ``to_json`` leaves out what does not apply (a segment's ``runs``
without a tokenizer, a piece's ``epoch`` in a one-epoch build).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract.config import BuildConfig
from ..contract.schema import ShardEntry, Stats


def _json(view: Any, *absent_when_none: str) -> dict[str, Any]:
    out = dataclasses.asdict(view)
    for key in absent_when_none:
        if out[key] is None:
            del out[key]
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Mode:
    """One way of batching the build's segments (``inspect_.compare_modes``)."""

    mode: str  # padded, batch, bfd, optimal
    rows: int
    tokens: int
    computed_tokens: int  # what the model runs on: tokens plus padding
    padding: float
    peak_row_tokens: int  # what memory is sized for: the largest row (or padded batch, or budget)
    fill: float
    optimizer_steps: int
    examples_per_step: float  # what a step trains on: examples, or a preference build's pairs (its examples)
    built: bool  # the mode of this build, measured on its rows
    note: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MixPart:
    """One source of a mix: what was asked, and what it gave (``Stats.sources``' entry for it)."""

    source: str
    weight: float | None
    records: int | None
    recipe: str | None
    split: str | None
    counts: dict[str, Any]  # records_read, examples_packed / split / truncated, dropped_by_reason, tokens
    token_share: float

    def to_json(self) -> dict[str, Any]:
        out = _json(self)
        return {**{k: v for k, v in out.items() if k != "counts"}, **self.counts}


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """``packer inspect DIR``: the manifest's numbers, and the modes compared on the build's segments."""

    directory: str
    note: str | None
    config: BuildConfig
    tokenizer: str | None
    stats: Stats
    shards: tuple[ShardEntry, ...]
    mix: tuple[MixPart, ...] | None
    modes: tuple[Mode, ...] | None  # None: not compared
    row_pairs: tuple[int, float, int] | None = None  # a preference build: pairs per row (fewest, mean, most)

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.shards)

    def to_json(self) -> dict[str, Any]:
        epochs = self.stats.epoch_count  # --epochs E holds E times one epoch's rows on disk
        out = {
            "directory": self.directory, "note": self.note, "pack": self.config.pack,
            "batch_size": self.config.batch_size, "max_tokens": self.config.max_tokens,
            "row_budget": self.config.row_budget(), "max_len": self.config.max_len,
            "tokenizer": self.tokenizer, "stats": self.stats.to_json(),
            "shards": [dataclasses.asdict(e) for e in self.shards],
            "mix": None if self.mix is None else [p.to_json() for p in self.mix],
            "disk": {"bytes": self.bytes, "epochs": epochs, "bytes_per_epoch": self.bytes // epochs},
        }
        if self.modes is not None:
            out["modes"] = [dataclasses.asdict(m) for m in self.modes]
            out["modes_unit"] = "pairs" if self.stats.paired else "examples"  # what every mode places whole
        if self.row_pairs is not None:  # stats.pairs is one epoch's; the rows hold every epoch's
            fewest, mean, most = self.row_pairs
            out["pairs"] = {"pairs": self.stats.pairs, "sequences": self.stats.segments,
                            "per_row": {"min": fewest, "mean": mean, "max": most}}
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Consecutive tokens of a segment that are all trained or all masked, decoded."""

    trained: bool
    tokens: int
    ids: list[int]
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Elided:
    """The middle of a long segment, left out of the runs."""

    elided: int  # tokens
    trained: int  # of them, trained


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    segment: int
    example_id: int
    offset: int  # its first token in the row
    length: int
    trained_tokens: int
    ids: list[int]  # always the whole segment
    trained: list[bool]
    runs: tuple[Run | Elided, ...] | None  # None without a tokenizer
    pad_tokens: int | None = None  # a padded build's (--cp-size, --pad-to-multiple-of): padding ending it
    pair: int | None = None  # a preference build: the pair of the row it belongs to (0, 1, ...)
    role: str | None = None  # ... and its role in it: "chosen" (pair_roles 1) or "rejected" (0)
    images: tuple[dict, ...] | None = None  # an image build: each image's offset in the row, tokens, height, width

    def to_json(self) -> dict[str, Any]:
        return _json(self, "runs", "pad_tokens", "pair", "role", "images")


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """``packer inspect DIR --row N``: one row, segment by segment."""

    row: int
    shard: str
    tokens: int
    num_loss_tokens: int
    max_seqlen: int
    segments: tuple[Segment, ...]
    eos_token_id: int | None = None  # the manifest's, so a view can tell the EOS packer appends
    pairs: int | None = None  # a preference build: the row's pairs (two segments each)

    def to_json(self) -> dict[str, Any]:
        return {**_json(self, "pairs"), "segments": [s.to_json() for s in self.segments]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """Where a segment of an example lies."""

    row: int
    shard: str
    segment: int
    offset: int
    length: int
    epoch: int | None = None  # a build of several epochs holds each example once per epoch
    role: str | None = None  # a preference build: "chosen" or "rejected"

    def to_json(self) -> dict[str, Any]:
        return _json(self, "epoch", "role")


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    """``packer inspect DIR --example ID``: where a source example went."""

    example_id: int
    pieces: tuple[Piece, ...]
    tokens: int  # in the first epoch's pieces
    split: bool
    epochs: int
    truncated: bool
    why_missing: str | None
    pack: str
    max_len: int
    overlong: str
    paired: bool = False  # a preference build: a record is a pair, its pieces prompt + chosen and prompt + rejected

    @property
    def found(self) -> bool:
        return bool(self.pieces)

    def to_json(self) -> dict[str, Any]:
        out = _json(self)
        return {**out, "found": self.found, "pieces": [p.to_json() for p in self.pieces]}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PlotData:
    """The numbers behind ``packer inspect --plot`` (numpy arrays, drawn by :mod:`packer.plot`, not JSON)."""

    directory: str
    config: BuildConfig
    stats: Stats
    row_budget: int  # the build's, else its largest row
    example_tokens: np.ndarray  # per example, the tokens it keeps in one epoch's rows
    row_tokens: np.ndarray  # per row
    row_examples: np.ndarray  # segments per row
    row_padded: np.ndarray  # per row, what a padded batch of the same examples would hold
    modes: tuple[Mode, ...]
