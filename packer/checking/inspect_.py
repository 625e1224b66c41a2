"""Read-side views of a shard folder: the summary of a build, one row taken apart, where a source
example went, and the numbers behind ``packer inspect --plot``.

Every view returns a plain dict (the CLI renders it as text or JSON) and takes a local folder or an
fsspec URL. Costs: ``row`` opens one shard and decodes one row; ``summary``, ``find_example`` and
``plot_data`` read only the small list columns (``seq_lens``, ``example_ids``) of every shard and work
on them with pyarrow.compute / numpy, never per row in Python. ``summary`` re-plans the segment lengths
under each mode (``packer.planning.plan.plan``: lengths only, milliseconds for a million examples) so the modes
can be compared on this very dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..contract import rows, schema
from ..contract.config import BuildConfig
from ..contract.schema import Manifest
from ..errors import ConfigError, ShardFormatError
from ..fs import PathLike, join
from ..planning.context_parallel import pad_up
from ..planning.pairs import CHOSEN, REJECTED
from ..planning.plan import plan
from . import inspect_images
from .views import Elided, Example, MixPart, Mode, Piece, PlotData, Row, Run, Segment, Summary

ELIDE_KEEP = 32  # tokens kept at each end of a segment longer than 3 * ELIDE_KEEP, whose middle is elided
DEFAULT_BATCH = 8  # batch size of the comparison when the build itself is not in batch mode
ROLE_NAMES = {CHOSEN: "chosen", REJECTED: "rejected"}  # a preference build's pair_roles, in words


# -- columns of every shard, vectorised ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Segments:
    """Every segment of a build in row order: its length and example id, and the rows' splits
    (``row_splits[r]:row_splits[r + 1]`` are row ``r``'s segments)."""

    seq_lens: np.ndarray  # int64, padding included
    example_ids: np.ndarray  # int64
    row_splits: np.ndarray  # int64[rows + 1]
    pad_lens: np.ndarray  # int64, the padding ending each segment (zeros: the build has none)


def _segments(directory: PathLike, manifest: Manifest) -> Segments:
    """Every segment of every shard, the layout of each row batch checked first by the row invariants
    (:func:`packer.contract.rows.check_rows`, offsets and small columns only), since the views allocate from the
    lengths (a damaged ``seq_len`` of 10^9 must not become a 10^9-slot plan)."""
    seq_lens, example_ids, counts, pads = [], [], [], []
    for entry in manifest.shards:
        path = join(directory, entry.file)
        first = 0
        for batch in schema.open_shard(path, manifest.row_format).to_batches():
            _check_layout(path, first, batch)
            rb = rows.RowBatch.from_arrow(batch)
            seq_lens.append(rb.seq_lens.values)
            example_ids.append(rb.example_ids.values)
            counts.append(rb.seq_lens.lengths)
            pads.append(np.zeros(rb.seq_lens.values.size, np.int64) if rb.pad_lens is None else rb.pad_lens.values)
            first += batch.num_rows
    count = _concat(counts)
    splits = np.zeros(count.size + 1, np.int64)
    np.cumsum(count, out=splits[1:])
    return Segments(_concat(seq_lens), _concat(example_ids), splits, _concat(pads))


def _check_layout(path: PathLike, first: int, batch) -> None:
    """Refuse a row batch whose layout breaks the row invariants (rows ``first`` … of the shard)."""
    problems = rows.check_arrow(batch, None, tokens=False)
    if problems:
        raise ShardFormatError(f"{path} row {first + int(problems[0].rows[0])}: {problems[0].message}; the shard "
                               "is damaged, run `packer verify` and rebuild the folder")


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


# -- summary ------------------------------------------------------------------------------------


def summary(directory: PathLike, *, compare: bool = True) -> Summary:
    """The manifest's numbers, plus (``compare``) the modes compared on this dataset's lengths."""
    manifest = schema.read_manifest(directory)
    modes = None
    if compare and manifest.shards:
        seg = _segments(directory, manifest)
        modes = tuple(compare_modes(seg.seq_lens, seg.row_splits, manifest.config, paired=manifest.stats.paired,
                                    pad_lens=seg.pad_lens))
    row_pairs = None
    if manifest.stats.paired and manifest.shards:
        per_row = np.diff((seg if compare else _segments(directory, manifest)).row_splits) // 2
        row_pairs = (int(per_row.min()), float(per_row.mean()), int(per_row.max())) if per_row.size else (0, 0.0, 0)
    return Summary(directory=str(directory), note=manifest.note, config=manifest.config,
                   tokenizer=manifest.tokenizer.get("name_or_path"), stats=manifest.stats, shards=manifest.shards,
                   mix=mix_view(manifest), modes=modes, row_pairs=row_pairs)


def mix_view(manifest: Manifest) -> tuple[MixPart, ...] | None:
    """A mix's sources: each one's weight or records count and its counts (None for one source)."""
    parts, counts = manifest.config.mix, manifest.stats.sources
    if not parts or not counts:
        return None
    tokens = max(1, sum(c["tokens"] for c in counts))
    return tuple(MixPart(**{k: part.get(k) for k in ("source", "weight", "records", "recipe", "split")}, counts=c,
                         token_share=c["tokens"] / tokens) for part, c in zip(parts, counts))


def _row_stats(units: np.ndarray, widest: np.ndarray, row_splits: np.ndarray, per: int, multiple: int = 1
               ) -> tuple[int, int, int, int, int]:
    """(rows, largest row's tokens, padded tokens, largest padded batch, the rows' own padding) of rows of
    ``units`` (examples, or pairs): padding pads each of a row's ``per * units`` sequences to the longest of
    them (``widest``: a unit's longest sequence). ``multiple``: every row's length (and a padded batch's
    sequence length) rounded up to it, as a contiguous context-parallel group needs to split it."""
    counts = np.diff(row_splits)
    starts = row_splits[:-1][counts > 0]
    if units.size == 0:
        return int(counts.size), 0, 0, 0, 0
    row_tokens = np.add.reduceat(units, starts)
    row_padding = int((pad_up(row_tokens, multiple) - row_tokens).sum())
    row_padded = per * counts[counts > 0] * pad_up(np.maximum.reduceat(widest, starts), multiple)
    return (int(counts.size), int(pad_up(row_tokens.max(), multiple)), int(row_padded.sum()), int(row_padded.max()),
            row_padding)


def _units(lengths: np.ndarray, row_splits: np.ndarray, paired: bool):
    """What the modes place whole, and the rows in them: (sizes, each one's longest sequence, row splits,
    sequences a unit). A preference build's unit is its pair (packer.planning.pairs): both segments
    travel together, so a mode planned over single segments would split pairs and count rows no build
    could make."""
    if not paired:
        return lengths, lengths, row_splits, 1
    return lengths[0::2] + lengths[1::2], np.maximum(lengths[0::2], lengths[1::2]), row_splits // 2, 2


def compare_modes(seq_lens: np.ndarray, row_splits: np.ndarray, config: BuildConfig, *,
                  paired: bool = False, pad_lens: np.ndarray | None = None) -> list[Mode]:
    """Rows, fill and optimizer steps of padding, ``batch``, ``bfd`` and ``optimal`` for these segment lengths.

    The lengths are the build's segments (after its over-long policy), so every mode holds the same
    tokens. The mode the build used is measured on its actual rows; the others are planned from the
    lengths with ``packer.planning.plan.plan``. ``batch`` and padding group the build's batch size
    (``DEFAULT_BATCH`` for a non-batch build); ``bfd`` and ``optimal`` pack into the build's row budget
    (``max_tokens``, rounded down for a padded build), or for a batch build into its largest row: the
    same peak memory per row as the batch rows. Steps assume one row per rank per micro-batch and no gradient accumulation:
    ``ceil(rows / world_size)``. ``paired`` (a preference build): every mode places pairs (a segment and
    the next, chosen then rejected) whole; ``batch`` is B pairs a row and padding pads a batch's 2B
    sequences to the longest, as padded DPO does.

    A padded build's segments are compared with their padding (``seq_lens``). Where its rows take padding of
    their own (a contiguous CP layout: each row a multiple of the CP size, its last segment padded), that
    padding is the row's, not the segment's: it is taken off the segments (``pad_lens``), and every mode's
    rows are padded to the multiple again, so that each mode plans rows the CP group can split, and
    ``bfd``/``optimal`` pack into the row budget, the multiple included.
    """
    lengths = np.asarray(seq_lens, np.int64)
    if lengths.size == 0:
        return []
    layout = config.layout()
    multiple = layout.row_multiple if layout is not None and layout.row_multiple > layout.segment_multiple else 1
    if multiple > 1 and pad_lens is not None:  # the segments as the layout pads them, without the rows' share
        real = lengths - np.asarray(pad_lens, np.int64)
        lengths = pad_up(real, layout.segment_multiple)
    units, widest, splits, per = _units(lengths, np.asarray(row_splits, np.int64), paired)
    world, seed = config.world_size, config.seed
    longest = int(units.max())
    tokens = int(lengths.sum())
    if config.pack == "batch":
        b = config.batch_size
        batch_rows, row_max, padded, padded_max, batch_pad = _row_stats(units, widest, splits, per, multiple)
    else:
        b = DEFAULT_BATCH
        batch = plan(units, mode="batch", batch_size=b, max_len=longest, seed=seed)
        batch_rows, row_max, padded, padded_max, batch_pad = _row_stats(
            batch.length, widest[batch.example], batch.row_splits, per, multiple)
    if config.pack in ("bfd", "optimal", "wrap"):  # the rows' budget: a padded build's is rounded down
        budget = config.row_budget()
    else:
        budget = row_max
    if config.pack not in ("bfd", "optimal"):
        budget = min(max(budget, longest), tokens)  # no row holds more than all tokens: plan no bigger
    packed, row_pads = {}, {}
    for mode in ("bfd", "optimal"):
        if mode == config.pack:
            rows_of = (units, splits)
        else:
            p = plan(units, mode=mode, max_len=longest, max_tokens=budget, seed=seed)
            rows_of = (p.length, p.row_splits)
        packed[mode] = int(rows_of[1].size - 1)
        row_pads[mode] = _row_stats(rows_of[0], rows_of[0], rows_of[1], 1, multiple)[4]
    unit = "pairs" if paired else "examples"

    def entry(mode: str, rows: int, computed: int, peak: int, note: str) -> Mode:
        steps = math.ceil(rows / world)
        return Mode(mode=mode, rows=rows, tokens=tokens, computed_tokens=computed,
                    padding=1 - tokens / computed if computed else 0.0, peak_row_tokens=peak,
                    fill=tokens / (rows * peak) if rows and peak else 0.0, optimizer_steps=steps,
                    examples_per_step=len(units) / max(1, steps), built=mode == config.pack, note=note)

    seqs = f" ({per * b} sequences)" if paired else ""
    return [
        entry("padded", batch_rows, padded, padded_max, f"{b} {unit} per batch{seqs}, padded to the longest in it"),
        entry("batch", batch_rows, tokens + batch_pad, row_max, f"{b} {unit} per row{seqs}, concatenated: no padding"
              if not batch_pad else f"{b} {unit} per row{seqs}, concatenated, each row to a multiple of {multiple}"),
        entry("bfd", packed["bfd"], tokens + row_pads["bfd"], budget,
              f"{'pairs packed whole into rows' if paired else 'rows filled'} up to {budget:,} tokens"),
        entry("optimal", packed["optimal"], tokens + row_pads["optimal"], budget,
              f"bfd's rows refilled: {packed['bfd'] - packed['optimal']:,} fewer"),
    ]


# -- one row ------------------------------------------------------------------------------------


def _locate(manifest: Manifest, row: int) -> tuple[str, int]:
    total = sum(s.rows for s in manifest.shards)
    if not 0 <= row < total:
        raise ConfigError(f"--row {row} is out of range: the build has {total} rows (0..{total - 1})")
    for shard in manifest.shards:
        if row < shard.rows:
            return shard.file, row
        row -= shard.rows
    raise AssertionError("unreachable: row counted in total")


def row(directory: PathLike, index: int, tokenizer=None, *, elide: int | None = ELIDE_KEEP) -> Row:
    """Row ``index`` segment by segment: example id, offset, length, trained tokens, ids, and (with a
    tokenizer) ``runs``: the segment as decoded runs of masked / trained tokens (a padded build's padding
    left out of them, counted in ``pad_tokens``; a preference build's segments say their pair and role). With ``elide``, a
    segment longer than ``3 * elide`` tokens keeps ``elide`` tokens at each end and the runs hold
    an :class:`~packer.checking.views.Elided` marker between them; ``ids``/``trained`` always hold the whole segment."""
    manifest = schema.read_manifest(directory)
    name, local = _locate(manifest, index)
    path = join(directory, name)
    one = schema.open_shard(path, manifest.row_format).slice(local, 1).combine_chunks().to_batches()[0]
    _check_layout(path, local, one)
    record = one.to_pylist()[0]
    ids = np.asarray(record["input_ids"])
    # format 1 stores labels, format 2 a loss mask (packer.contract.schema)
    trained_all = (np.asarray(record["labels"]) != schema.IGNORE_INDEX if "labels" in record
                   else np.asarray(record[schema.LOSS_MASK], bool))
    bounds = np.concatenate([[0], np.cumsum(record["seq_lens"], dtype=np.int64)])
    pads, roles = record.get(schema.PAD_COLUMN), record.get(schema.PAIR_COLUMN)  # a padded, a preference build's
    token = inspect_images.image_token(manifest)  # an image build's: its images per segment, their spans as markers
    images = None if token is None else inspect_images.segment_images(record, bounds, token)
    if token is not None and tokenizer is not None:
        tokenizer = inspect_images.Marking(tokenizer, token)
    segments = []
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg_ids, trained = ids[lo:hi], trained_all[lo:hi]
        own = int(hi - lo) - (0 if pads is None else int(pads[k]))  # the runs decode the segment's own tokens
        segments.append(Segment(
            segment=k, example_id=record["example_ids"][k], offset=int(lo), length=int(hi - lo),
            trained_tokens=int(trained.sum()), ids=seg_ids.tolist(), trained=trained.tolist(),
            runs=None if tokenizer is None else _elided_runs(tokenizer, seg_ids[:own], trained[:own], elide),
            pad_tokens=None if pads is None else int(pads[k]),
            # the stored role, as stored: a row whose roles are out of turn shows them so (verify says why)
            pair=None if roles is None else k // 2, role=None if roles is None else ROLE_NAMES.get(roles[k], str(roles[k])),
            images=None if images is None else images[k]))
    return Row(row=index, shard=name, tokens=int(len(ids)), num_loss_tokens=record["num_loss_tokens"],
               max_seqlen=record["max_seqlen"], segments=tuple(segments),
               eos_token_id=manifest.tokenizer.get("eos_token_id"), pairs=None if roles is None else len(roles) // 2)


def _elided_runs(tokenizer, ids: np.ndarray, trained: np.ndarray, keep: int | None) -> tuple[Run | Elided, ...]:
    n = len(ids)
    if keep is None or n <= 3 * keep:
        return _runs(tokenizer, ids, trained)
    head = _runs(tokenizer, ids[:keep], trained[:keep])
    tail = _runs(tokenizer, ids[n - keep :], trained[n - keep :])
    middle = trained[keep : n - keep]
    return (*head, Elided(elided=int(n - 2 * keep), trained=int(middle.sum())), *tail)


def _runs(tokenizer, ids: np.ndarray, trained: np.ndarray) -> tuple[Run, ...]:
    """Runs of masked and trained tokens, each decoded."""
    if len(ids) == 0:
        return ()
    cuts = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    return tuple(Run(trained=bool(trained[lo]), tokens=int(hi - lo), ids=ids[lo:hi].tolist(),
                     text=tokenizer.decode(ids[lo:hi].tolist(), skip_special_tokens=False))
                 for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(ids)]]), strict=True))


# -- where did example ID go ----------------------------------------------------------------------


def find_example(directory: PathLike, example_id: int) -> Example:
    """Where source example ``example_id`` went: every segment of it (row, offset, length) and whether
    it was split (several segments) or truncated. Vectorised over all shards' ``example_ids``."""
    manifest = schema.read_manifest(directory)
    stats, config = manifest.stats, manifest.config
    read = stats.examples_read
    if not 0 <= example_id < read:
        raise ConfigError(
            f"--example {example_id} is out of range: the build read {read:,} source examples (0..{read - 1})"
        )
    pieces = _pieces(directory, manifest, example_id)
    first_epoch = [p for p in pieces if not p.epoch]
    paired = stats.paired  # a record is a pair: its two pieces are its two sequences, not a split
    whole = 2 if paired else 1
    truncated = False
    if len(first_epoch) == whole and config.overlong in ("truncate", "truncate-left") and config.pack != "wrap":
        eos, bos = manifest.tokenizer.get("eos_token_id"), manifest.tokenizer.get("bos_token_id")
        # cut at the end: the last token is not EOS; cut at the start (truncate-left): EOS kept, BOS lost
        truncated = any(p.length == config.max_len and (
            not _ends_with(directory, manifest, p, eos)
            or (config.overlong == "truncate-left" and not _starts_with(directory, manifest, p, bos)))
            for p in first_epoch)
    why = None
    if not pieces:
        dropped = stats.dropped_by_reason
        why = (f"it was dropped ({', '.join(f'{k}: {v:,}' for k, v in dropped.items())} in this build)"
               if dropped else "no segment carries this id")
    return Example(example_id=example_id, pieces=tuple(pieces), tokens=sum(p.length for p in first_epoch),
                   split=len(first_epoch) > whole, epochs=stats.epoch_count, truncated=truncated, why_missing=why,
                   pack=config.pack, max_len=config.max_len, overlong=config.overlong, paired=paired)


def _pieces(directory: PathLike, manifest: Manifest, example_id: int) -> list[Piece]:
    """Every segment of the example, in row order (the layout checked first: the lengths are used)."""
    _segments(directory, manifest)
    epoch_rows = manifest.stats.rows // manifest.stats.epoch_count if manifest.stats.epoch_count > 1 else None
    pieces = []
    first_row = 0
    for entry in manifest.shards:
        for batch in schema.open_shard(join(directory, entry.file), manifest.row_format).to_batches():
            rb = rows.RowBatch.from_arrow(batch)
            hits = np.flatnonzero(rb.example_ids.values == example_id)
            if hits.size:
                lens = rb.seq_lens.values.astype(np.int64)  # padding included: where the next segment starts
                own = lens if rb.pad_lens is None else lens - rb.pad_lens.values  # the example's own tokens
                cum = np.concatenate([[0], np.cumsum(lens)])
                parents = np.searchsorted(rb.seq_lens.offsets, hits, side="right") - 1  # each hit's row
                first_seg = rb.seq_lens.offsets[parents]
                roles = None if rb.pair_roles is None else rb.pair_roles.values
                for h, r, s0 in zip(hits.tolist(), parents.tolist(), first_seg.tolist(), strict=True):
                    at = first_row + int(r)
                    pieces.append(Piece(row=at, shard=entry.file, segment=int(h - s0), offset=int(cum[h] - cum[s0]),
                                        length=int(own[h]), epoch=None if epoch_rows is None else at // epoch_rows,
                                        role=None if roles is None else ROLE_NAMES.get(int(roles[h]), str(roles[h]))))
            first_row += batch.num_rows
    return pieces


def _starts_with(directory: PathLike, manifest: Manifest, piece: Piece, token: int | None) -> bool:
    """Whether a piece's first token is ``token`` (a whole example starts with BOS; one cut at its start not)."""
    return token is None or _token(directory, manifest, piece, 0) == token


def _ends_with(directory: PathLike, manifest: Manifest, piece: Piece, token: int | None) -> bool:
    """Whether a piece's last token is ``token`` (a whole example ends in EOS; a truncated one rarely)."""
    return token is not None and _token(directory, manifest, piece, piece.length - 1) == token


def _token(directory: PathLike, manifest: Manifest, piece: Piece, at: int) -> int:
    """The token at offset ``at`` of a piece."""
    shard_start = 0  # the piece's row is global; find it inside its shard
    for entry in manifest.shards:
        if entry.file == piece.shard:
            break
        shard_start += entry.rows
    table = schema.open_shard(join(directory, piece.shard), manifest.row_format)
    ids = table.column("input_ids")[piece.row - shard_start].values
    return ids[piece.offset + at].as_py()


# -- the numbers behind --plot ----------------------------------------------------------------------


def plot_data(directory: PathLike) -> PlotData:
    """Per-example and per-row arrays for the figure."""
    manifest = schema.read_manifest(directory)
    config = manifest.config
    seg = _segments(directory, manifest)
    lens, splits, ex = seg.seq_lens, seg.row_splits, seg.example_ids
    counts = np.diff(splits)
    nonempty = counts > 0
    row_tokens = np.add.reduceat(lens, splits[:-1][nonempty]) if lens.size else np.zeros(0, np.int64)
    row_tokens_all = np.zeros(counts.size, np.int64)
    row_tokens_all[nonempty] = row_tokens
    row_max = np.zeros(counts.size, np.int64)
    if lens.size:
        row_max[nonempty] = np.maximum.reduceat(lens, splits[:-1][nonempty])
    # example lengths: pieces of a split example summed back (tokens kept in the rows)
    _, inverse = np.unique(ex, return_inverse=True)
    example_tokens = np.bincount(inverse, weights=lens - seg.pad_lens).astype(np.int64) if lens.size else np.zeros(0, np.int64)
    stats = manifest.stats
    example_tokens //= stats.epoch_count  # every planned epoch holds each example whole, alike
    return PlotData(directory=str(directory), config=config, stats=stats,
                    row_budget=int(stats.row_budget or (row_tokens_all.max() if row_tokens_all.size else 0)),
                    example_tokens=example_tokens, row_tokens=row_tokens_all, row_examples=counts,
                    row_padded=counts * row_max,
                    modes=tuple(compare_modes(lens, splits, config, paired=stats.paired, pad_lens=seg.pad_lens)))
