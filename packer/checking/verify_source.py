"""``packer verify``'s last two steps, on request: the tokenizer, and the source re-read.

- **tokenizer** (``--tokenizer``): its fingerprint, vocab size, special ids and chat template are the
  ones the manifest records.
- **source** (``--source``), in named steps that call the build's own functions
  (``pipeline.open_source``, ``LocalEngine.encode_chunks``, ``pipeline.plan_rows``,
  ``accounting.account``), so the folder is checked against what the build does, not against a copy:
  :func:`_reread` the source (the same files or Hub commit the build read; records that fail are
  counted by reason); :func:`_check_plan`: the plan recomputed from the lengths accounts for every
  record as the manifest says (its pieces tile it, or it is truncated or dropped as the policy says);
  :func:`_check_segments`: every segment of the shards equals the source's, token for token: the ids
  the build's encoder's, the trained mask one recomputed apart from it (:func:`reference_trained`: a
  token is trained when its character offsets overlap a trained span), so a fault in the encoder's
  span mapping shows. A preference build's segments likewise, against each pair tokenized again
  (:func:`reference_pairs`: the mask from the prompt's end), and each segment's stored role against
  the plan's (:func:`_check_roles`: chosen, then rejected).

Cost: a re-tokenize of the source, whose tokens are held in memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ..building import mix
from ..building.engines import LocalEngine
from ..building.pipeline import Opened, open_source, plan_rows
from ..building.spill import CHUNK
from ..building.tokenization import Skipped, tokenizer_info
from ..contract.config import BuildConfig
from ..contract.schema import Manifest
from ..errors import ConfigError
from ..planning.accounting import account
from ..planning.pairs import CHOSEN, REJECTED
from ..planning.plan import Plan
from .report import Report
from .verify_rows import Totals


def check_tokenizer(manifest: Manifest, tokenizer, name: str, report: Report) -> None:
    info = tokenizer_info(tokenizer, name)
    recorded = manifest.tokenizer
    for key in ("fingerprint", "vocab_size", "bos_token_id", "eos_token_id", "chat_template_sha256"):
        if recorded.get(key) != info[key]:
            report.add("tokenizer", f"--tokenizer {name}", f"{key} differs from the build's "
                       f"({recorded.get('name_or_path')!r}): {info[key]!r} here, {recorded.get(key)!r} recorded; these "
                       "shards were made with another tokenizer")


def _mix_parts(config: BuildConfig, source_name: str) -> tuple | None:
    """The mix to re-read: a mix file's parts, or the build's recorded parts with the sources given in
    order (comma-separated); None for a one-source build."""
    recorded = config.mix
    if recorded is None:
        return None
    if source_name == config.source:  # the mix the build named (a recipe read as a mix, or the same sources)
        return tuple(recorded)
    if source_name.lower().endswith((".yaml", ".yml", ".json")) and os.path.isfile(source_name):
        return tuple(mix.read_mix_file(source_name))
    names = source_name.split(",")
    if len(names) != len(recorded):
        raise ConfigError(f"--source {source_name}: the build mixed {len(recorded)} sources; give its mix file or "
                          f"all {len(recorded)} sources, comma-separated, in the build's order")
    return tuple({**part, "source": name} for part, name in zip(recorded, names, strict=True))


def _check_source_identity(recorded: dict, info: dict, where: str, report: Report) -> None:
    """The source read now is the one the build recorded: the same files' sha256, or the same Hub commit."""
    if recorded.get("kind") == "local" and info.get("kind") == "local":
        if [f.get("sha256") for f in recorded.get("files", [])] != [f["sha256"] for f in info["files"]]:
            report.add("source", where, "its files' sha256 differ from the ones the build recorded: another or a "
                       "changed source")
    elif recorded.get("kind") == "hub" and info.get("kind") == "hub":
        if recorded.get("revision") and info.get("revision") and recorded["revision"] != info["revision"]:
            report.add("source", where, f"the Hub dataset is at commit {info['revision']}, the build read commit "
                       f"{recorded['revision']}: it has changed since")
    elif recorded.get("kind") != info.get("kind"):
        report.add("source", where, f"a {info.get('kind')} source, the build read a {recorded.get('kind')} one")


@dataclass(frozen=True, slots=True)
class _Reread:
    """The source encoded again by the build's own chunking, in memory and in this process."""

    ids: np.ndarray  # every kept record's tokens, concatenated
    trained: np.ndarray  # the encoder's loss flags, per token
    lengths: np.ndarray  # per kept record
    example_ids: np.ndarray  # per kept record: its position in the source
    read: int  # records read, kept or not
    skipped: Skipped  # records that failed to format, by reason


def _reread(opened: Opened, total: int, progress: bool) -> _Reread:
    """``total``: the records the build read (the bar's length: the source is read as the build read it)."""
    chunks = []
    with tqdm(total=total, desc="re-tokenize", unit="rec", disable=not progress, dynamic_ncols=True) as bar:
        for chunk in LocalEngine().encode_chunks(opened.stream, opened.encoder, 0):
            chunks.append(chunk)
            bar.update(np.unique(chunk.example_ids).size + sum(chunk.skipped.values()))
    skipped = Skipped.none(len(opened.stream.parts))
    for chunk in chunks:
        skipped += chunk.skipped

    def cat(name: str, dtype) -> np.ndarray:
        return np.concatenate([getattr(c, name) for c in chunks]) if chunks else np.zeros(0, dtype)

    return _Reread(cat("ids", np.int32), cat("trained", np.uint8), cat("lengths", np.int64),
                   cat("example_ids", np.int64),
                   sum(np.unique(c.example_ids).size + sum(c.skipped.values()) for c in chunks), skipped)


def _check_identity(manifest: Manifest, opened: Opened, where: str, report: Report) -> None:
    recorded, read = _parts(manifest.source), _parts(opened.source)
    if len(recorded) != len(read):
        report.add("source", where, f"{len(read)} sources, the build mixed {len(recorded)}")
    for got, want in zip(read, recorded):
        _check_source_identity(want, got, f"--source {got['source']}" if "source" in got else where, report)


def _parts(record: dict) -> list[dict]:
    """A manifest's source record as its parts: a mix's, or the one source's own record."""
    return record.get("parts", []) if record.get("kind") == "mix" else [record]


def _check_records(manifest: Manifest, reread: _Reread, where: str, report: Report) -> None:
    """Records read and skipped by reason, as the manifest counts them."""
    s = manifest.stats
    if reread.read != s.examples_read:
        report.add("source", where, f"{reread.read:,} records, the build read {s.examples_read!r}")
    if reread.skipped and manifest.config.on_error != "skip":
        report.add("source", where, f"{sum(reread.skipped.values()):,} records fail to format ({reread.skipped}), yet "
                   "the build ran with --on-error raise")
    recorded = {k: v for k, v in s.dropped_by_reason.items() if k != "overlong"}
    if recorded != reread.skipped:
        report.add("source", where, f"skipped records by reason {reread.skipped} here, the manifest records {recorded}")


def _check_plan(manifest: Manifest, config: BuildConfig, p: Plan, lengths: np.ndarray, where: str,
                report: Report) -> None:
    """Every kept record is accounted for: its pieces tile it, or it is truncated (at max_len) or dropped
    as the policy says; the counts (``accounting.account``, as the build counts) are the manifest's."""
    one = int(p.row_splits[p.num_rows // config.epochs])  # epoch 0's segments (every epoch places them alike)
    ex, st, ln = p.example[:one], p.start[:one], p.length[:one]
    order = np.lexsort((st, ex))
    ex_s, st_s, ln_s = ex[order], st[order], ln[order]
    first = np.ones(ex_s.size, bool)
    first[1:] = ex_s[1:] != ex_s[:-1]
    left = config.overlong == "truncate-left"  # a left-truncated example's one segment ends where it does
    tiles = np.where(first, (st_s == 0) | (left & (st_s + ln_s == lengths[ex_s])),
                     np.r_[True, st_s[1:] == (st_s + ln_s)[:-1]])
    if not tiles.all():
        report.add("source", where, f"{int((~tiles).sum()):,} pieces do not tile their example")
    covered = np.bincount(ex_s, weights=ln_s, minlength=lengths.size).astype(np.int64)
    cut = (covered > 0) & (covered != lengths)
    truncating = config.overlong in ("truncate", "truncate-left") and config.pack != "wrap"
    if truncating and (cut & (covered != config.max_len)).any():
        report.add("source", where, f"{int((cut & (covered != config.max_len)).sum()):,} examples cut at another "
                   "length than max_len")
    elif not truncating and cut.any():
        report.add("source", where, f"{int(cut.sum()):,} examples only partly placed under --overlong {config.overlong}")
    counts, s = account(p, lengths).total, manifest.stats
    if s.paired:  # pairs are accounted as pairs (packer.planning.pairs), the plan's own count
        keys = ("examples_packed", "examples_split", "examples_truncated", "examples_dropped", "tokens_truncated",
                "tokens_dropped", "pairs")
        for key in keys:
            if p.stats.get(key) != getattr(s, key):
                report.add("source", where, f"{p.stats.get(key)!r} {key} here, the manifest says {getattr(s, key)!r}")
        return
    if counts.dropped and config.overlong != "drop":
        report.add("source", where, f"{counts.dropped:,} examples placed nowhere under --overlong {config.overlong}")
    found = {"examples_packed": counts.whole, "examples_split": counts.split, "examples_truncated": counts.truncated,
             "examples_dropped": counts.dropped, "tokens_truncated": counts.tokens_truncated,
             "tokens_dropped": counts.tokens_dropped}
    if left:
        found.update(examples_truncated_left=counts.truncated_left,
                     examples_answer_too_long=counts.truncated - counts.truncated_left)
    for key, value in found.items():
        if value != getattr(s, key):
            report.add("source", where, f"{value:,} {key} here, the manifest says {getattr(s, key)!r}")


def _check_segments(opened: Opened, reread: _Reread, p: Plan, totals: Totals, where: str, report: Report,
                    progress: bool = False) -> None:
    """The shards' segments, in row order, against the plan of the source: ids, then the trained mask (the
    source read a second time, with its own bar: as long again as the first)."""
    got_ex, got_len = np.concatenate(totals.example_ids), np.concatenate(totals.seq_lens)
    want_ex, want_len = reread.example_ids[p.example], p.length
    if got_ex.size != want_ex.size or not np.array_equal(got_ex, want_ex) or not np.array_equal(got_len, want_len):
        report.add("source", where, "the shards' segments (example_ids, seq_lens) differ from the plan of this "
                   "source with the build's config")
        return
    offsets = np.zeros(reread.lengths.size + 1, np.int64)
    np.cumsum(reread.lengths, out=offsets[1:])
    seg_out = np.zeros(p.length.size + 1, np.int64)
    np.cumsum(p.length, out=seg_out[1:])
    position = np.arange(int(seg_out[-1]), dtype=np.int64) - np.repeat(seg_out[:-1], p.length)
    index = np.repeat(offsets[p.example] + p.start, p.length) + position
    got_ids, got_trained = np.concatenate(totals.input_ids), np.concatenate(totals.trained)
    differ = int((got_ids != reread.ids[index]).sum())
    if differ:
        report.add("source", where, f"{differ:,} tokens differ from the source's tokens at the same place")
    if opened.pairs:
        _check_roles(p, totals, where, report)
    with tqdm(total=reread.read, desc="loss mask", unit="rec", disable=not progress, dynamic_ncols=True) as bar:
        reference = (reference_pairs if opened.pairs else reference_trained)(opened, reread.example_ids,
                                                                             reread.lengths, bar.update)
    if reference is None:
        report.add("source", where, "re-tokenizing the source's records gives other lengths than the build's encoder")
        return
    want_trained = reference[index] & (position != 0)
    differ = int((want_trained != got_trained).sum())
    if differ:
        report.add("source", where, f"{differ:,} tokens are trained where the source's loss mask says otherwise (or "
                   "the reverse)")


def check_source(manifest: Manifest, source_name: str, tokenizer, totals: Totals | None, report: Report,
                 progress: bool = False) -> None:
    """The source re-read with the build's config, against the manifest and (with ``totals``) the rows."""
    config = manifest.config.replace(source=source_name, out=os.devnull, mix=_mix_parts(manifest.config, source_name))
    where = f"--source {source_name}"
    opened = open_source(config, tokenizer, skip_errors=True)  # the build's own reading and encoder
    _check_identity(manifest, opened, where, report)
    reread = _reread(opened, manifest.stats.examples_read, progress)
    _check_records(manifest, reread, where, report)
    # the plan takes the build's own flags (truncate-left keeps the answer they mark); the mask itself is
    # checked against a recomputation apart from the encoder
    p = plan_rows(config, reread.lengths, reread.trained, pairs=opened.pairs)
    _check_plan(manifest, config, p, reread.lengths, where, report)
    if totals is not None and totals.input_ids:
        _check_segments(opened, reread, p, totals, where, report, progress)


def _check_roles(p: Plan, totals: Totals, where: str, report: Report) -> None:
    """A preference build's stored roles against the plan's: the spill holds each pair as sequences ``2k``
    (prompt + chosen) and ``2k + 1`` (prompt + rejected), so a segment's role is its sequence's parity."""
    got = np.concatenate(totals.roles) if totals.roles else np.zeros(0, np.int64)
    want = np.where(p.example % 2 == 0, CHOSEN, REJECTED)
    if got.size != want.size:
        report.add("source", where, f"{got.size:,} pair roles in the rows, the source's pairs have {want.size:,} "
                   "sequences")
        return
    differ = int((got != want).sum())
    if differ:
        report.add("source", where, f"{differ:,} segments carry another pair role than the source's (chosen and "
                   "rejected swapped)")


def reference_trained(opened: Opened, example_ids: np.ndarray, lengths: np.ndarray,
                      on_records=lambda n: None) -> np.ndarray | None:
    """The loss mask of the kept examples, recomputed apart from the build's encoder (which maps span
    ends with ``char_to_token``): a token is trained when its character offsets overlap a trained
    span, so a character spelled in several byte tokens is trained whole. The EOS packer appends takes
    the last segment's flag. The source is read again as a stream; ``None`` when the token counts
    differ from ``lengths``."""
    wanted = set(example_ids.tolist())
    masks: dict[int, np.ndarray] = {}
    for _, chunk in opened.stream.chunks(0, CHUNK):
        # each part's records by its own encoder, at their positions in the mix
        for k, _, records, positions in chunk.pieces:
            encoder = opened.encoder.encoders[k]
            keep = [(i, int(p)) for i, p in enumerate(positions) if int(p) in wanted]
            views = encoder.offsets_and_spans([{name: records[name][i] for name in records} for i, _ in keep])
            for (_, position), (offsets, spans, last_flag, eos_added) in zip(keep, views, strict=True):
                mask = np.zeros(len(offsets), bool)
                for start, end in spans:
                    mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start) & (offsets[:, 1] > offsets[:, 0])
                masks[position] = np.append(mask, last_flag) if eos_added else mask
            on_records(len(positions))
    out = [masks.get(int(e), np.zeros(0, bool)) for e in example_ids]
    if [m.size for m in out] != lengths.tolist():
        return None
    return np.concatenate(out) if out else np.zeros(0, bool)


def reference_pairs(opened: Opened, example_ids: np.ndarray, lengths: np.ndarray,
                    on_records=lambda n: None) -> np.ndarray | None:
    """A preference build's loss mask of the kept sequences, recomputed from the build's own tokenizing of
    each pair (:meth:`packer.building.preference.PairEncoder.pair`: TRL's, tested against TRL), apart from
    the encoder's flat buffers: a sequence's tokens from its prompt's end on are trained. ``example_ids``
    names each sequence's record, a record's two in turn (chosen, then rejected). ``None`` when the token
    counts differ from ``lengths``."""
    wanted = set(example_ids.tolist())
    masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for _, chunk in opened.stream.chunks(0, CHUNK):
        for k, _, records, positions in chunk.pieces:
            encoder = opened.encoder.encoders[k]
            for i, position in enumerate(positions):
                if int(position) not in wanted:
                    continue
                chosen, rejected, prompt = encoder.pair({name: records[name][i] for name in records})
                masks[int(position)] = tuple(np.arange(len(seq)) >= prompt for seq in (chosen, rejected))
            on_records(len(positions))
    empty = (np.zeros(0, bool), np.zeros(0, bool))
    out = [masks.get(int(e), empty)[j % 2] for j, e in enumerate(example_ids.tolist())]
    if [m.size for m in out] != lengths.tolist():
        return None
    return np.concatenate(out) if out else np.zeros(0, bool)
