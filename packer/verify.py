"""``packer verify``: prove a shard folder is intact and obeys the contract, reporting every problem.

Checks, in order (each adds problems to one :class:`Report`; nothing stops at the first):

1. **manifest** — present, valid JSON, ``format`` packer, a known ``format_version``, a config that
   ``BuildConfig`` accepts, stats that add up (examples and tokens accounted for), shard entries
   with file/rows/tokens/bytes/sha256; no file in the folder that the manifest does not list.
2. **files** — every listed shard exists with the recorded size and sha256 (``quick`` stops here).
3. **rows** — every shard is an Arrow IPC stream with ``schema.ROW_SCHEMA``; per row, vectorised over
   whole columns (flat values + offsets, no Python per row): ``sum(seq_lens) == len(input_ids)``,
   the token columns have equal lengths, ``position_ids`` are ``0..len-1`` inside each segment,
   ``labels`` are −100 at every segment start and elsewhere −100 or the input id, ``num_loss_tokens``
   and ``max_seqlen`` are right, lengths are within the recorded budget (batch: ≤ batch_size segments
   of ≤ max_len; bfd: row ≤ max_tokens, segment ≤ max_len; wrap: row ≤ max_tokens), token ids are in
   ``[0, vocab_size)``; then the shards' totals against the manifest's shard entries and stats.
4. **tokenizer** (``tokenizer=``) — its fingerprint, vocab size, special ids and chat template match the
   manifest's.
5. **source** (``source=``) — the source is re-read and re-encoded with the build's config through the
   build's own formatting/tokenizing code, records that fail are counted by reason against
   ``dropped_by_reason``, the plan is recomputed from the lengths and checked to account for every
   record (its pieces tile it, or it is truncated or dropped as the policy says), and every segment of
   the shards is compared token for token with the source: the ids with the build's encoder's, the
   trained mask with one recomputed apart from it (a token is trained when its character offsets
   overlap a trained span), so a fault in the encoder's span mapping shows.

Cost: one sequential read of every shard byte for the hashes plus O(tokens) numpy for the rows;
``source`` costs a re-tokenize and holds the source's tokens in memory.

Problems are values (a ``Problem`` per finding); only errors that stop verify from running at all
(no such folder, a tokenizer or source that cannot be loaded) raise a ``PackerError``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import fs, mix, rows, schema
from .config import BuildConfig
from .engines import LocalEngine
from .errors import ConfigError, ShardFormatError
from .pipeline import open_source, plan_rows, tokenizer_path
from .schema import Manifest
from .spill import CHUNK
from .tokenization import load_tokenizer, tokenizer_info

MAX_ROWS_SHOWN = 5


@dataclass(frozen=True, slots=True)
class Problem:
    check: str  # manifest, files, rows, stats, tokenizer, source
    where: str  # a file, "file row N", or the manifest key
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass(slots=True)
class Report:
    directory: str
    quick: bool
    problems: list[Problem] = field(default_factory=list)
    checked: dict[str, Any] = field(default_factory=dict)  # what was looked at: shards, rows, tokens, ...

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, check: str, where: str, message: str) -> None:
        self.problems.append(Problem(check, where, message))

    def verdict(self) -> str:
        what = ", ".join(f"{v:,} {k}" for k, v in self.checked.items() if isinstance(v, int))
        scope = "quick check (manifest and hashes)" if self.quick else "full check"
        if self.ok:
            return f"{self.directory}: OK, {scope}: {what or 'nothing to check'}"
        n = len(self.problems)
        return f"{self.directory}: {n} problem{'s' * (n != 1)} found ({scope}); rebuild the folder or fix its source"

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "ok": self.ok,
            "quick": self.quick,
            "checked": self.checked,
            "problems": [asdict(p) for p in self.problems],
        }


def _rows_text(rows: np.ndarray) -> str:
    shown = ", ".join(str(int(r)) for r in rows[:MAX_ROWS_SHOWN])
    more = f" … ({len(rows):,} rows)" if len(rows) > MAX_ROWS_SHOWN else ""
    return f"row{'s' * (len(rows) != 1)} {shown}{more}"


# -- manifest ---------------------------------------------------------------------------------------


def _load_manifest(directory: Path, report: Report) -> Manifest | None:
    """The manifest, parsed by the contract's own parser; each problem it finds is reported."""
    path = directory / schema.MANIFEST_NAME
    if not path.is_file():
        report.add("manifest", str(path), "missing, so the folder is not a finished build (interrupted, or not "
                   "packer's); rerun the build")
        return None
    try:
        data = schema.load_json(path.read_bytes(), str(path))
    except ShardFormatError as e:
        report.add("manifest", str(path), str(e).split(": ", 1)[1])
        return None
    manifest, problems = schema.parse_manifest(data)
    for key, message in problems:
        report.add("manifest", f"{path} {key}".rstrip(), message)
    if manifest is None:
        return None
    try:
        BuildConfig(**{**manifest.config, "out": str(directory)})
    except (ConfigError, TypeError) as e:
        report.add("manifest", f"{path} config", f"not a valid build config ({e})")
        return None
    return manifest


def _check_stats_arithmetic(manifest: Manifest, report: Report) -> None:
    s = manifest.stats
    where = f"{schema.MANIFEST_NAME} stats"
    parts = s.examples_packed + s.examples_split + s.examples_truncated + s.examples_dropped
    if parts != s.examples:
        report.add("stats", where, f"packed + split + truncated + dropped = {parts:,}, but examples = {s.examples:,}")
    if s.tokens != s.epoch_count * (s.tokens_in - s.tokens_truncated - s.tokens_dropped):  # every epoch holds them all
        report.add("stats", where, "tokens differs from epochs × (tokens_in − tokens_truncated − tokens_dropped)")
    if s.examples + s.records_skipped != s.examples_read:
        report.add("stats", where, f"examples {s.examples:,} + records_skipped {s.records_skipped:,} differs from "
                   f"examples_read {s.examples_read:,}: records are unaccounted for")
    dropped = s.examples_dropped + s.records_skipped
    if sum(v for v in s.dropped_by_reason.values() if isinstance(v, int)) != dropped:
        report.add("stats", where, f"dropped_by_reason sums to {sum(s.dropped_by_reason.values()):,}, but "
                   f"examples_dropped + records_skipped = {dropped:,}")
    if s.dropped_by_reason.get("overlong", 0) != s.examples_dropped:
        report.add("stats", where, "dropped_by_reason.overlong differs from examples_dropped")
    limit = manifest.config.get("limit")
    if isinstance(limit, int) and s.examples_read > limit:
        report.add("stats", where, f"examples_read {s.examples_read:,} exceeds the config's limit {limit:,}")


def _check_folder_contents(directory: Path, manifest: Manifest | None, report: Report) -> None:
    listed = {e.file for e in manifest.shards} if manifest else set()
    for path in sorted(directory.iterdir()):
        name = path.name
        # of packer's own names, only what a finished build holds is expected here
        if name in listed or name in (schema.MANIFEST_NAME, *schema.DATASETS_FILES):
            continue
        if manifest is None and schema.is_shard_name(name):
            continue  # no manifest: already reported; the shards are not "extra"
        report.add("files", str(path), "not listed in the manifest (a leftover of another build or a foreign "
                   "file); remove it or rebuild the folder")
    if manifest is None:
        return
    for name, problem in schema.datasets_file_problems(directory, manifest):  # what datasets.load_from_disk reads
        report.add("files", str(directory / name), problem)


# -- files --------------------------------------------------------------------------------------------


def _check_files(directory: Path, manifest: Manifest, report: Report) -> list[schema.ShardEntry]:
    """Existence, size and sha256 of every shard; returns the entries whose file exists."""
    present = []
    for entry in manifest.shards:
        problems = schema.shard_file_problems(directory, entry)
        for problem in problems:
            report.add("files", str(directory / entry.file), problem)
        if (directory / entry.file).is_file():
            present.append(entry)
    return present


# -- rows -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Totals:
    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    segments: int = 0
    max_row_tokens: int = 0
    example_ids: list = field(default_factory=list)
    seq_lens: list = field(default_factory=list)
    input_ids: list = field(default_factory=list)
    labels: list = field(default_factory=list)

    def add(self, batch: rows.RowBatch, keep_tokens: bool) -> None:
        self.rows += batch.num_rows
        self.tokens += int(batch.input_ids.values.size)
        self.loss_tokens += int((batch.labels.values != schema.IGNORE_INDEX).sum())
        self.segments += int(batch.seq_lens.values.size)
        if batch.num_rows:
            self.max_row_tokens = max(self.max_row_tokens, int(batch.input_ids.lengths.max()))
        self.example_ids.append(batch.example_ids.values.astype(np.int64))
        self.seq_lens.append(batch.seq_lens.values.astype(np.int64))
        if keep_tokens:
            self.input_ids.append(batch.input_ids.values)
            self.labels.append(batch.labels.values)


def _limits(config: BuildConfig) -> rows.Limits:
    """The budget the build's rows keep to, by its mode."""
    return rows.Limits(max_segments=config.batch_size if config.pack == "batch" else None,
                       max_row_tokens=config.max_tokens if config.pack != "batch" else None,
                       max_segment_tokens=config.max_len if config.pack != "wrap" else None)


def _check_rows(directory: Path, manifest: Manifest, entries: list[schema.ShardEntry], vocab: int | None,
                report: Report, keep_tokens: bool) -> _Totals | None:
    """Every shard's rows against the row invariants (:mod:`packer.rows`) and its manifest entry."""
    limits = _limits(BuildConfig(**{**manifest.config, "out": str(directory)}))
    totals = _Totals()
    complete = len(entries) == len(manifest.shards)
    for entry in entries:
        path = directory / entry.file
        try:
            table = schema.open_shard(path)
        except ShardFormatError as e:
            report.add("rows", str(path), str(e).removeprefix(f"{path}: "))
            complete = False
            continue
        if table.num_rows != entry.rows:
            report.add("rows", str(path), f"{table.num_rows:,} rows, the manifest records {entry.rows:,}")
        tokens_before = totals.tokens
        for batch in table.to_batches():
            problems = rows.check_arrow(batch, vocab, limits)
            for problem in problems:
                report.add("rows", f"{entry.file} {_rows_text(totals.rows + problem.rows)}", problem.message)
            if problems and problems[0].message.startswith("null values"):  # no numbers to count
                complete = False
                totals.rows += batch.num_rows
                continue
            totals.add(rows.RowBatch.from_arrow(batch), keep_tokens)
        if totals.tokens - tokens_before != entry.tokens:
            report.add("rows", str(path), f"{totals.tokens - tokens_before:,} tokens, the manifest records "
                       f"{entry.tokens:,}")
    return totals if complete else None


def _check_totals(manifest: Manifest, totals: _Totals, report: Report) -> None:
    s = manifest.stats
    where = f"{schema.MANIFEST_NAME} stats"
    for key, actual in (("rows", totals.rows), ("tokens", totals.tokens), ("loss_tokens", totals.loss_tokens),
                        ("segments", totals.segments), ("max_row_tokens", totals.max_row_tokens)):
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
    if manifest.config.get("pack") != "wrap":
        split = int((counts > s.epoch_count).sum())  # a whole example appears once per epoch
        if split != s.examples_split:
            report.add("stats", where, f"{split:,} examples appear in pieces, examples_split says "
                       f"{s.examples_split!r}")


# -- tokenizer and source -------------------------------------------------------------------------------


def _load_tok(name: str, chat_template: str | None = None):
    return load_tokenizer(tokenizer_path(name), chat_template)


def _check_tokenizer(manifest: Manifest, tokenizer, name: str, report: Report) -> None:
    info = tokenizer_info(tokenizer, name)
    recorded = manifest.tokenizer
    for key in ("fingerprint", "vocab_size", "bos_token_id", "eos_token_id", "chat_template_sha256"):
        if recorded.get(key) != info[key]:
            what = "fingerprint" if key == "fingerprint" else key
            report.add("tokenizer", f"--tokenizer {name}", f"{what} differs from the build's "
                       f"({recorded.get('name_or_path')!r}): {info[key]!r} here, {recorded.get(key)!r} recorded; these "
                       "shards were made with another tokenizer")


def _mix_parts(cfg: dict, source_name: str) -> tuple | None:
    """The mix to re-read: a mix file's parts, or the build's recorded parts with the sources given in
    order (comma-separated); None for a one-source build."""
    recorded = cfg.get("mix")
    if recorded is None:
        return None
    if source_name == cfg.get("source"):  # the mix the build named (a recipe read as a mix, or the same sources)
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


def _check_source(manifest: Manifest, source_name: str, tokenizer, totals: _Totals | None,
                  report: Report) -> None:
    cfg = manifest.config
    config = BuildConfig(**{**cfg, "source": source_name, "out": os.devnull, "mix": _mix_parts(cfg, source_name)})
    where = f"--source {source_name}"
    opened = open_source(config, tokenizer, skip_errors=True)  # the build's own reading and encoder
    if opened.parts is None:
        _check_source_identity(manifest.source, opened.source, where, report)
    else:  # every source of the mix
        recorded_parts = manifest.source.get("parts") or []
        if len(recorded_parts) != len(opened.source["parts"]):
            report.add("source", where, f"{len(opened.source['parts'])} sources, the build mixed {len(recorded_parts)}")
        for got, recorded in zip(opened.source["parts"], recorded_parts):
            _check_source_identity(recorded, got, f"--source {got['source']}", report)
    s = manifest.stats
    # the build's own chunking, in memory and in this process
    chunks = list(LocalEngine().encode_chunks(opened.stream, opened.encoder, 0, where=opened.where))
    read = sum(len(c.lengths) + sum(c.skipped.values()) for c in chunks)
    if read != s.examples_read:
        report.add("source", where, f"{read:,} records, the build read {s.examples_read!r}")
    skipped: dict[str, int] = {}
    for chunk in chunks:
        for reason, k in chunk.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + k

    def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    ids = cat([c.ids for c in chunks], np.int32)
    lengths = cat([c.lengths for c in chunks], np.int64)
    example_ids = cat([c.example_ids for c in chunks], np.int64)
    if opened.parts is not None:
        skipped = mix.split_skipped(skipped, len(opened.parts))[0]
    if skipped and cfg.get("on_error") != "skip":
        report.add("source", where, f"{sum(skipped.values()):,} records fail to format ({skipped}), yet the build "
                   "ran with --on-error raise")
    recorded_reasons = {k: v for k, v in s.dropped_by_reason.items() if k != "overlong"}
    if recorded_reasons != skipped:
        report.add("source", where, f"skipped records by reason {skipped} here, the manifest records {recorded_reasons}")

    # the plan takes the build's own flags (truncate-left keeps the answer they mark); the mask itself is
    # checked below against a recomputation apart from the encoder
    p = plan_rows(config, lengths, cat([c.trained for c in chunks], np.uint8))
    # Every kept record is accounted for: its pieces tile it, or it is truncated / dropped as the policy says.
    ex, st, ln = np.asarray(p.example), np.asarray(p.start), np.asarray(p.length)
    one = int(p.row_splits[p.num_rows // config.epochs])  # epoch 0's segments (every epoch places them alike)
    order = np.lexsort((st[:one], ex[:one]))
    ex_s, st_s, ln_s = ex[order], st[order], ln[order]
    first = np.ones(ex_s.size, bool)
    first[1:] = ex_s[1:] != ex_s[:-1]
    left = config.overlong == "truncate-left"  # a left-truncated example's one segment ends where it does
    contiguous = np.where(first, (st_s == 0) | (left & (st_s + ln_s == lengths[ex_s])),
                          np.r_[True, st_s[1:] == (st_s + ln_s)[:-1]])
    covered = np.zeros(lengths.size, np.int64)
    np.add.at(covered, ex_s, ln_s)
    placed = np.zeros(lengths.size, bool)
    placed[ex_s] = True
    whole = covered == lengths
    trunc = placed & ~whole
    if not contiguous.all():
        report.add("source", where, f"{int((~contiguous).sum()):,} pieces do not tile their example")
    if config.overlong in ("truncate", "truncate-left") and config.pack != "wrap":
        bad = trunc & (covered != config.max_len)
        if bad.any():
            report.add("source", where, f"{int(bad.sum()):,} examples cut at another length than max_len")
    elif trunc.any():
        report.add("source", where, f"{int(trunc.sum()):,} examples only partly placed under --overlong {config.overlong}")
    dropped = int((~placed).sum())
    if dropped != s.examples_dropped or (dropped and config.overlong != "drop"):
        report.add("source", where, f"{dropped:,} examples placed nowhere, the manifest says examples_dropped "
                   f"{s.examples_dropped!r} under --overlong {config.overlong}")
    for key in ("examples_truncated_left", "examples_answer_too_long"):  # truncate-left's two cases
        if p.stats.get(key) != getattr(s, key):
            report.add("source", where, f"{p.stats.get(key)!r} {key} here, the manifest says {getattr(s, key)!r}")
    if int(trunc.sum()) != s.examples_truncated and config.overlong in ("truncate", "truncate-left"):
        report.add("source", where, f"{int(trunc.sum()):,} examples truncated, the manifest says "
                   f"{s.examples_truncated!r}")

    if totals is None or not totals.input_ids:
        return
    # The shards against the source, segment by segment, in row order.
    got_ex, got_len = np.concatenate(totals.example_ids), np.concatenate(totals.seq_lens)
    want_ex, want_len = example_ids[ex], ln
    if got_ex.size != want_ex.size or not np.array_equal(got_ex, want_ex) or not np.array_equal(got_len, want_len):
        report.add("source", where, "the shards' segments (example_ids, seq_lens) differ from the plan of this "
                   "source with the build's config")
        return
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    seg_out = np.zeros(ln.size + 1, np.int64)
    np.cumsum(ln, out=seg_out[1:])
    position = np.arange(int(seg_out[-1]), dtype=np.int64) - np.repeat(seg_out[:-1], ln)
    index = np.repeat(offsets[ex] + st, ln) + position
    got_ids, got_labels = np.concatenate(totals.input_ids), np.concatenate(totals.labels)
    differ = int((got_ids != ids[index]).sum())
    if differ:
        report.add("source", where, f"{differ:,} tokens differ from the source's tokens at the same place")
    reference = _reference_trained(opened, example_ids, lengths)
    if reference is None:
        report.add("source", where, "re-tokenizing the source's records gives other lengths than the build's encoder")
        return
    want_trained = reference[index] & (position != 0)
    differ = int((want_trained != (got_labels != schema.IGNORE_INDEX)).sum())
    if differ:
        report.add("source", where, f"{differ:,} tokens are trained where the source's loss mask says otherwise (or "
                   "the reverse)")


def _reference_trained(opened, example_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """The loss mask of the kept examples, recomputed apart from the build's encoder (which maps span
    ends with ``char_to_token``): a token is trained when its character offsets overlap a trained
    span, so a character spelled in several byte tokens is trained whole. The EOS packer appends takes
    the last segment's flag. The source is read again as a stream; ``None`` when the token counts
    differ from ``lengths``."""
    wanted = set(example_ids.tolist())
    masks: dict[int, np.ndarray] = {}
    for lo, chunk in opened.stream.chunks(0, CHUNK):
        if isinstance(chunk, mix.MixChunk):  # each part's records by its own encoder, at their mix positions
            pieces = [(opened.encoder.encoders[k], records, positions) for k, _, records, positions in chunk.pieces]
        else:
            n = len(next(iter(chunk.values()))) if chunk else 0
            pieces = [(opened.encoder, chunk, np.arange(lo, lo + n))]
        for encoder, records, positions in pieces:
            names = list(records)
            rows = [(int(p), {name: records[name][i] for name in names})
                    for i, p in enumerate(positions) if int(p) in wanted]
            texts, spans, last_flags = [], [], []
            for _, record in rows:
                segments = encoder.formatter(record)
                texts.append("".join(text for text, _ in segments))
                bounds = np.cumsum([0] + [len(text) for text, _ in segments])
                spans.append([(bounds[j], bounds[j + 1]) for j, (_, flag) in enumerate(segments) if flag])
                last_flags.append(segments[-1][1])
            encodings = encoder.backend.encode_batch(texts, add_special_tokens=encoder.add_special_tokens)
            for (position, _), enc, example_spans, last_flag in zip(rows, encodings, spans, last_flags):
                offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
                mask = np.zeros(len(offsets), bool)
                for start, end in example_spans:
                    mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start) & (offsets[:, 1] > offsets[:, 0])
                if not enc.ids or enc.ids[-1] != encoder.eos:
                    mask = np.append(mask, last_flag)
                masks[position] = mask
    out = [masks.get(int(e), np.zeros(0, bool)) for e in example_ids]
    if [m.size for m in out] != lengths.tolist():
        return None
    return np.concatenate(out) if out else np.zeros(0, bool)


# -- entry point -----------------------------------------------------------------------------------------


def verify(directory: str | os.PathLike, *, tokenizer: str | None = None, source: str | None = None,
           quick: bool = False) -> Report:
    """Check a shard folder; returns a Report listing every problem (empty when the folder is sound).

    Raises ``ShardFormatError`` when ``directory`` is not a folder, and the loaders' ``PackerError``s
    when ``tokenizer`` or ``source`` cannot be loaded: those stop verify from running at all.
    """
    if fs.is_url(directory) and fs.local_path(directory) is None:
        return _verify_remote(str(directory), tokenizer=tokenizer, source=source, quick=quick)
    directory = fs.local_path(directory)
    if not directory.is_dir():
        raise ShardFormatError(f"{directory}: no such folder; give the --out folder of a packer build")
    report = Report(str(directory), quick)
    manifest = _load_manifest(directory, report)
    _check_folder_contents(directory, manifest, report)
    if manifest is None:
        return report
    _check_stats_arithmetic(manifest, report)
    tok = None
    if tokenizer is not None or source is not None:
        name = tokenizer or manifest.tokenizer.get("name_or_path") or "bundled"
        tok = _load_tok(name, manifest.config.get("chat_template"))
        if tokenizer is not None:
            _check_tokenizer(manifest, tok, tokenizer, report)
    entries = _check_files(directory, manifest, report)
    report.checked["shards"] = len(entries)
    if quick:
        return report
    vocab = manifest.tokenizer.get("vocab_size")
    if tok is not None:
        vocab = min(vocab, len(tok)) if isinstance(vocab, int) else len(tok)
    totals = _check_rows(directory, manifest, entries, vocab if isinstance(vocab, int) else None, report,
                         keep_tokens=source is not None)
    if totals is not None:
        report.checked.update(rows=totals.rows, tokens=totals.tokens, segments=totals.segments)
        _check_totals(manifest, totals, report)
    if source is not None:
        _check_source(manifest, source, tok, totals, report)
    return report


def _verify_remote(url: str, **options) -> Report:
    """A folder in object storage is copied to a temporary folder and checked there: every byte has to
    be read for the hashes anyway, and the checks then run on the same memory-mapped path as local."""
    if not fs.is_dir(url):
        raise ShardFormatError(f"{url}: no such folder; give the --out folder of a packer build")
    filesystem, root = fs.filesystem(url)
    with tempfile.TemporaryDirectory(prefix="packer-verify-") as tmp:
        for name in fs.list_names(url):
            filesystem.get(root.rstrip("/") + "/" + name, str(Path(tmp) / name), recursive=True)
        report = verify(tmp, **options)
    report.directory = url
    return report
