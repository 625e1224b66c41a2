"""``packer verify``'s third step: every shard's rows, then their totals against the manifest.

Each shard is opened by the contract (:func:`packer.contract.schema.open_shard`: an Arrow IPC stream of the
row schema), each record batch checked by the row invariants (:func:`packer.contract.rows.check_rows`, every
problem reported; a preference build's pairing among them) within the build's budget
(:func:`packer.contract.rows.build_limits`), the loader's checks, and the counts the rows hold (rows,
tokens, loss tokens, segments, the longest row, the distinct and split examples) compared with the
shard entries and the stats. Cost: O(tokens) numpy, no Python per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..contract import rows, schema
from ..contract.schema import Manifest
from ..errors import ShardFormatError
from .report import Report, rows_text


@dataclass(slots=True)
class Totals:
    """What the rows hold, summed over every batch read; the per-segment arrays in row order."""

    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    pad_tokens: int = 0  # a padded build's (packer.planning.context_parallel); tokens counts them too
    segments: int = 0
    max_row_tokens: int = 0
    example_ids: list[np.ndarray] = field(default_factory=list)
    seq_lens: list[np.ndarray] = field(default_factory=list)
    input_ids: list[np.ndarray] = field(default_factory=list)  # only when the source check needs them
    trained: list[np.ndarray] = field(default_factory=list)  # ... and per token whether it is trained
    roles: list[np.ndarray] = field(default_factory=list)  # ... and a preference build's pair_roles per segment

    def add(self, batch: rows.RowBatch, keep_tokens: bool) -> None:
        self.rows += batch.num_rows
        self.tokens += int(batch.input_ids.values.size)
        trained = batch.trained()  # labels ≠ -100 (format 1) or the loss mask (format 2)
        self.loss_tokens += int(trained.sum())
        self.segments += int(batch.seq_lens.values.size)
        if batch.num_rows:
            self.max_row_tokens = max(self.max_row_tokens, int(batch.input_ids.lengths.max()))
        self.example_ids.append(batch.example_ids.values.astype(np.int64))
        # a padded build: the examples' own tokens and lengths, which the source speaks of
        # (of the rows whose layout holds: a damaged shard is reported, never a numpy error)
        padding, pads = batch.padding(), 0 if batch.pad_lens is None else batch.segment_pads()
        self.pad_tokens += int(np.sum(pads))
        self.seq_lens.append((batch.seq_lens.values - pads).astype(np.int64))
        if keep_tokens:
            self.input_ids.append(batch.input_ids.values if padding is None else batch.input_ids.values[~padding])
            self.trained.append(trained if padding is None else trained[~padding])
            if batch.pair_roles is not None:
                self.roles.append(batch.pair_roles.values.astype(np.int64))


def check_rows(directory: Path, manifest: Manifest, entries: list[schema.ShardEntry], vocab: int | None,
               report: Report, keep_tokens: bool, progress: bool = False) -> Totals | None:
    """Every shard's rows against the row invariants and its manifest entry; the totals, or None when
    a shard could not be read whole (its totals would be wrong)."""
    with tqdm(total=sum(e.rows for e in entries), desc="rows", unit="row", disable=not progress,
              dynamic_ncols=True) as bar:
        return _check_rows(directory, manifest, entries, vocab, report, keep_tokens, bar.update)


def _check_rows(directory: Path, manifest: Manifest, entries: list[schema.ShardEntry], vocab: int | None,
                report: Report, keep_tokens: bool, on_rows) -> Totals | None:
    budget = rows.build_limits(manifest.config, manifest.stats.paired)  # the loader's, the same
    totals = Totals()
    complete = len(entries) == len(manifest.shards)
    for entry in entries:
        path = directory / entry.file
        try:
            table = schema.open_shard(path, manifest.row_format)
        except ShardFormatError as e:
            report.add("rows", str(path), str(e).removeprefix(f"{path}: "))
            complete = False
            continue
        if table.num_rows != entry.rows:
            report.add("rows", str(path), f"{table.num_rows:,} rows, the manifest records {entry.rows:,}")
        tokens_before = totals.tokens
        for batch in table.to_batches():
            problems = rows.check_arrow(batch, vocab, budget)
            for problem in problems:
                report.add("rows", f"{entry.file} {rows_text(totals.rows + problem.rows)}", problem.message)
            if problems and problems[0].message.startswith("null values"):  # no numbers to count
                complete = False
                totals.rows += batch.num_rows
                continue
            totals.add(rows.RowBatch.from_arrow(batch), keep_tokens)
            on_rows(batch.num_rows)
        if totals.tokens - tokens_before != entry.tokens:
            report.add("rows", str(path), f"{totals.tokens - tokens_before:,} tokens, the manifest records "
                       f"{entry.tokens:,}")
    return totals if complete else None


def check_totals(manifest: Manifest, totals: Totals, report: Report) -> None:
    """The rows' totals against the stats and the shard entries; the examples they hold against the
    examples the stats account for."""
    s = manifest.stats
    where = f"{schema.MANIFEST_NAME} stats"
    for key, actual in (("rows", totals.rows), ("tokens", totals.tokens - totals.pad_tokens),
                        ("loss_tokens", totals.loss_tokens), ("segments", totals.segments),
                        ("max_row_tokens", totals.max_row_tokens),
                        ("pad_tokens", totals.pad_tokens if s.padded else None)):
        if getattr(s, key) != actual:
            report.add("stats", where, f"{key} = {getattr(s, key)!r}, the shards hold {actual:,}")
    for key, actual in (("rows", totals.rows), ("tokens", totals.tokens)):
        listed = sum(getattr(e, key) for e in manifest.shards)
        if listed != actual:
            report.add("stats", f"{schema.MANIFEST_NAME} shards", f"{key} of the shard entries sum to {listed:,}, "
                       f"the shards hold {actual:,}")
    if not totals.example_ids:
        return
    exid = np.concatenate(totals.example_ids)
    if exid.size and int(exid.max()) >= s.examples_read:
        report.add("stats", where, f"example id {int(exid.max()):,} is beyond examples_read {s.examples_read:,}")
    unique, counts = np.unique(exid, return_counts=True)
    expected = s.examples - s.examples_dropped
    if unique.size != expected:
        report.add("stats", where, f"the rows hold {unique.size:,} distinct examples, the stats account for "
                   f"{expected:,} (examples − examples_dropped)")
    if manifest.config.pack != "wrap":
        # a whole example appears once per epoch (a preference pair: its two sequences)
        split = int((counts > s.epoch_count * (2 if s.paired else 1)).sum())
        if split != s.examples_split:
            report.add("stats", where, f"{split:,} examples appear in pieces, examples_split says "
                       f"{s.examples_split!r}")
