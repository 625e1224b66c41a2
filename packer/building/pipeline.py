"""The pipeline, end to end: source → format → tokenize → plan → write → commit.

Tokens go to a flat spill file in the output's staging folder as they are made (:mod:`packer.building.spill`);
only the lengths stay in memory for planning (a few bytes per example). The plan is global (all
lengths at once), then rows are read back from the spill and written shard by shard. An engine
(:mod:`packer.building.engines`) runs the two parallel steps, encoding and writing; the output folder's
lock, checks and commit are :mod:`packer.building.output`'s. ``open_source`` and ``plan_rows`` are the steps
``packer verify --source`` repeats, so it checks a build against exactly what the build did.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..contract import schema
from ..contract.config import ROW_LIMIT, BuildConfig
from ..contract.recipes import BUNDLED_TOKENIZER
from ..errors import ConfigError, OutputError, PackerError, SourceError, TokenizerError
from ..fs import file_sha256
from ..planning.context_parallel import pad_token_id, pad_up
from ..planning.pairs import plan_pairs, prompt_lengths
from ..planning.plan import Plan, answer_lengths
from ..planning.plan import plan_epochs as make_plan
from . import engines, image_build, kept_tokenizers, mix, output, processor_facts, sources, spill, token_store
from .formatting import make_spec
from .preference import PairEncoder
from .tokenization import Encoder, load_tokenizer, tokenizer_info

BUNDLED = "bundled"  # how the manifest names the tokenizer shipped in packer/data/, portable across checkouts


@dataclass(frozen=True, slots=True)
class BuildResult:
    out: Path
    manifest: schema.Manifest
    reused: bool  # the folder already held this exact build; nothing was done
    seconds: float
    resumed: int | None = None  # records an interrupted earlier run had tokenized (its spill reused); None: no such run
    replanned: bool = False  # the tokens came from the token store (but for the records `extended` counts)
    warnings: tuple[str, ...] = ()  # what went wrong beside the build, which is complete (the token store skipped)
    # records read and tokenized beyond the token store's entries, per part (None: none were, or no entry was used)
    extended: tuple[int, ...] | None = None


def tokenizer_path(name: str | None) -> str:
    """Where to load a tokenizer the config or a manifest names ("bundled" is the one in packer/data/)."""
    return str(BUNDLED_TOKENIZER) if name in (None, BUNDLED) else name


def source_info(stream: sources.Stream) -> dict[str, Any]:
    """How the manifest identifies what was read: the local files read (their sha256; under ``--limit``
    only the files that hold the records read), or the Hub dataset and the commit it was read at."""
    source = stream.source
    if source.kind == "hub":
        info = {"kind": "hub", "id": source.hub_id, "config": source.hub_config, "split": source.split}
        if source.data_files is not None:
            info["data_files"] = source.data_files
        return {**info, "revision": stream.revision}
    bundled = source.recipe is not None and source.files == (str(source.recipe.local),)
    files = [
        {"path": Path(f).name if bundled else f, "bytes": Path(f).stat().st_size, "sha256": file_sha256(f)}
        for f in stream.files
    ]
    return {"kind": "local", "builder": source.builder, "files": files}


def source_parts(config: BuildConfig) -> tuple[dict[str, Any], ...]:
    """The config's mix, or its one source as a mix of one part (weight 1: every draw is its)."""
    if config.mix is not None:
        return tuple(config.mix)
    given = {k: getattr(config, k) for k in ("recipe", "split", *mix.FIELDS) if getattr(config, k) is not None}
    return ({"source": config.source, "weight": 1.0, **given},)


@dataclass(frozen=True, slots=True)
class Opened:
    """The config's source (a mix, or one source as a mix of one part) opened and ready to encode."""

    stream: mix.MixStream  # its first config.limit records
    encoder: mix.MixEncoder
    source: dict  # the manifest's source record
    read: dict[str, tuple[int, ...]]  # the local files read, as they were before they were hashed (`_signature`)
    pairs: bool = False  # preference data: two examples a record, planned as pairs (packer.planning.pairs)
    processor: processor_facts.Facts | None = None  # an image build's: what it reads of its processor


def open_source(config: BuildConfig, tokenizer, *, skip_errors: bool, processors: processor_facts.Kept | None = None
                ) -> Opened:
    """Open each part of the config's mix (its one source, for a one-source build) as a stream of its
    first records (under ``--limit``, as far as the draws take it; a part with a records count: that
    many), each with its encoder made from the config and the part's fields (an image build's from its
    processor's facts, kept in ``processors`` for a folder met before)."""
    parts = source_parts(config)
    resolved = [sources.resolve(part["source"], recipe=part.get("recipe"), split=part.get("split"),
                                from_hub=config.from_hub, files=part.get("files")) for part in parts]
    # under --limit, each part is read no further than the records the draws take from it
    drawn = (None if config.limit is None else
             mix.part_limits(list(parts), config.seed, config.limit, lambda k, n: sources.holds(resolved[k], n)))
    streams, encoders, wheres, infos, read = [], [], [], [], {}
    for k, (part, source) in enumerate(zip(parts, resolved, strict=True)):
        stream = sources.open_stream(source, limit=part.get("records") if drawn is None else drawn[k])
        read |= _signatures(stream)
        fields = {f: part.get(f) for f in mix.FIELDS}
        try:
            columns = stream.columns()
            spec = make_spec(recipe=source.recipe, config=image_build.for_columns(config.replace(mix=None, **fields), columns),
                             columns=columns)
        except ConfigError as e:
            if config.mix is None:
                raise
            raise ConfigError(f"mix part {k + 1} ({part['source']}): {e}") from None  # which of the parts it is
        if k and (spec.kind == "preference") != isinstance(encoders[0], PairEncoder):
            raise ConfigError(f"mix part {k + 1} ({part['source']}): a mix of preference pairs and SFT data cannot be "
                              "packed into one build (pairs train with a DPO loss); build them apart")
        streams.append(stream)
        if config.processor is not None:  # image+text records (packer.building.image_build)
            encoders.append(image_build.encoder(config, tokenizer, spec, stream, skip_errors=skip_errors, memo=processors))
        else:
            encoders.append((PairEncoder if spec.kind == "preference" else Encoder)(tokenizer, spec, skip_errors=skip_errors))
        wheres.append(f"{stream.files[0]} record" if len(stream.files) == 1 else f"{source.name} record")
        infos.append(source_info(stream))
    record = infos[0] if config.mix is None else {
        "kind": "mix", "parts": [{"source": part["source"], **info} for part, info in zip(parts, infos, strict=True)]}
    return Opened(mix.MixStream(parts, tuple(streams), config.seed, config.limit), mix.MixEncoder(encoders, wheres),
                  record, read, isinstance(encoders[0], PairEncoder), getattr(encoders[0], "facts", None))


def _signatures(stream: sources.Stream) -> dict[str, tuple[int, ...]]:
    return {f: _signature(f) for f in stream.files} if stream.source.kind == "local" else {}


def _signature(path: str) -> tuple[int, ...]:
    """What changes when a file is written to or replaced (its mtime has nanoseconds)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def check_unchanged(opened: Opened) -> None:
    """Refuse a build whose source files changed between their hashing (the manifest's record) and the
    end of their reading: the manifest would describe other bytes than were read."""
    for path, before in opened.read.items():
        try:
            after = _signature(path)
        except OSError:
            after = None
        if after != before:
            how = "was removed" if after is None else ("was replaced" if after[2:] != before[2:] else
                                                       f"was written to ({before[0]:,} → {after[0]:,} bytes)")
            raise SourceError(
                f"{path}: {how} while the build read it, so the build cannot say what it read; rerun once the "
                "file no longer changes (or build from a copy)"
            )


def _note(config: BuildConfig, opened: Opened) -> str | None:
    """The recipe's note (the bundled sample says it is not FLAN data), for a one-source local build."""
    source = opened.stream.streams[0].source
    if config.mix is None and source.recipe and source.recipe.note and source.kind == "local":
        return source.recipe.note
    return None


def _nothing_packed(config: BuildConfig, sequences: int, pairs: bool) -> str:
    """Why a plan has no row: every example over-long under --overlong drop, or (pairs, --overlong truncate)
    every pair's prompt filling --max-len, which leaves no completion (TRL's filter)."""
    if pairs and config.overlong != "drop":
        return (f"all {sequences // 2:,} pairs have a prompt of --max-len {config.max_len:,} tokens or more, which "
                "leaves no completion to train: nothing to pack; raise --max-len or use --overlong truncate-left")
    what = f"{sequences // 2:,} pairs have a sequence" if pairs else f"{sequences:,} examples are"
    return (f"all {what} longer than --max-len {config.max_len:,} and --overlong drop drops them: nothing to pack; "
            f"raise --max-len or use --overlong truncate{'' if pairs else ' or split'}")


def plan_rows(config: BuildConfig, lengths, trained=None, pad_id: int = 0, *, pairs: bool = False) -> Plan:
    """The rows of the config's pack mode and epochs, from the examples' lengths (and, for
    ``--overlong truncate-left``, the over-long examples' loss flags in ``trained``, every example's
    flags concatenated: where each answer starts); padded as the config asks, with ``pad_id``.
    ``pairs``: preference data, two examples a pair, planned as pairs (``trained`` gives the prompts)."""
    if pairs:
        return plan_pairs(lengths, prompts=prompt_lengths(trained, lengths), mode=config.pack,
                          max_len=config.max_len, max_tokens=config.max_tokens, batch_size=config.batch_size,
                          overlong=config.overlong, seed=config.seed, epochs=config.epochs,
                          world_size=config.world_size, balance=config.balance, layout=config.layout(pad_id))
    answers = None
    if config.overlong == "truncate-left" and config.pack != "wrap":
        answers = answer_lengths(trained, lengths, config.max_len)
    return make_plan(lengths, epochs=config.epochs, mode=config.pack, max_len=config.max_len,
                     max_tokens=config.max_tokens, batch_size=config.batch_size, overlong=config.overlong,
                     seed=config.seed, world_size=config.world_size, balance=config.balance, answers=answers,
                     layout=config.layout(pad_id))


def build(config: BuildConfig, *, progress: bool = False) -> BuildResult:
    """Build ``config.out`` from ``config.source``, holding the output folder's lock throughout.

    Refused before anything is touched: a remote ``--out``, a source inside it, a folder holding what
    packer did not write (:mod:`packer.building.output`). A second build into the same folder meanwhile is
    refused. A build that fails leaves nothing behind (a write that fails, such as a full disk, becomes
    an ``OutputError``); an interrupted one leaves its token spill for the rerun to resume, and one
    interrupted past its commit point (its manifest written) is complete: it returns.
    """
    started = time.time_ns()
    config = image_build.default_processor(config)  # --processor left out: a processor's --tokenizer folder
    out = output.local_folder(config.out)
    try:
        return _locked_build(config, out, progress=progress)
    except KeyboardInterrupt:
        result = _committed(out, started)
        if result is None:
            raise
        return result


def _committed(out: Path, started: int) -> BuildResult | None:
    """After Ctrl-C: the build, if it got past its commit point (its manifest written since ``started``)."""
    try:
        if (out / schema.MANIFEST_NAME).stat().st_mtime_ns < started:
            return None
        manifest = schema.read_manifest(out)
    except (OSError, PackerError):
        return None
    output.remove_stale_staging(out)  # the interrupt may have kept the build from removing it
    return BuildResult(out, manifest, False, (time.time_ns() - started) / 1e9)


def _locked_build(config: BuildConfig, out: Path, *, progress: bool) -> BuildResult:
    if config.epochs > MAX_EPOCHS:
        raise ConfigError(
            f"--epochs {config.epochs:,}: more than {MAX_EPOCHS:,} epochs, each a whole copy of the data on disk; build "
            "fewer and let the loader replay them (set_epoch: epoch e plays planned epoch e mod E, reshuffled)"
        )
    for part in source_parts(config):
        output.refuse_inside(out, part["source"])
    _refuse_sources_inside(config, out)
    output.refuse_foreign(out, config.overwrite)
    engine = engines.for_config(config)
    with output.lock(out) as staging:
        try:
            return _build(config, engine, out, staging, progress=progress)
        except OSError as e:
            failure = output.write_failure(e, out)
            if failure is None:
                raise
            raise failure from e


def _refuse_sources_inside(config: BuildConfig, out: Path) -> None:
    """Every local path the sources name (as given, and the files a folder or glob resolves to) outside ``out``."""
    for part in source_parts(config):
        paths = []
        with suppress(SourceError):  # a source that does not resolve is reported when it is opened
            paths += sources.resolve(part["source"], recipe=part.get("recipe"), split=part.get("split"),
                                     from_hub=config.from_hub, files=part.get("files")).files
        output.refuse_sources_inside(out, part["source"], [*paths, part["source"]])  # the files first: they say more


# What the shards hold at least, per token (the row format's token columns: 12 bytes in format 1, 4⅛
# or 6⅛ in format 2; a compressed shard is taken as no smaller than a quarter of that) and per example
# (its seq_lens int32 and example_ids int64 entries), and what planning holds in memory per example
# and epoch (the plan's three int64 arrays, twice while the epochs are concatenated) and per epoch
# (its Plan and stats objects: a generous allowance).
_SHARD_BYTES_PER_EXAMPLE = 12
_COMPRESSED_AT_MOST = 4
_PLAN_BYTES_PER_EXAMPLE, _PLAN_BYTES_PER_EPOCH = 48, 4096
# Epochs planned and stored: each is a whole copy of the data on disk, so past this many the loader's
# replay of a build's epochs (set_epoch: epoch e plays planned epoch e mod E, reshuffled) is the way.
MAX_EPOCHS = 10_000
_FEWER_EPOCHS = "lower --epochs (the loader can also replay a build's epochs, each reshuffled: set_epoch), "


def check_room(config: BuildConfig, lengths: np.ndarray, out: Path, row_format: schema.RowFormat | None = None
               ) -> None:
    """Refuse, before planning, a build whose shards the disk under ``out`` cannot hold, or whose plan
    memory cannot: ``--epochs E`` writes every example E times (E shuffles), so a large E on small data
    grows without bound. The shard size counted is a floor (no row overhead; each segment's padding, not a
    row's), so what fits is never refused."""
    if config.pack == "wrap" or config.overlong == "split":
        kept = lengths
    elif config.overlong == "drop":  # a dropped example writes nothing
        kept = lengths[lengths <= config.max_len]
    else:
        kept = np.minimum(lengths, config.max_len)
    layout = config.layout()
    if layout is not None and config.pack != "wrap":  # the padding is written as tokens too (a row's own: left out)
        kept = pad_up(kept.astype(np.int64), layout.segment_multiple)
    per_token = (row_format or schema.RowFormat(1)).bytes_per_token()
    per_token /= _COMPRESSED_AT_MOST if config.compression else 1
    epoch = int(per_token * int(kept.sum(dtype=np.int64))) + _SHARD_BYTES_PER_EXAMPLE * len(kept)
    free = shutil.disk_usage(out).free
    if config.epochs * epoch > free:
        what = f"--epochs {config.epochs:,}: the shards" if config.epochs > 1 else "the shards"
        per = f" ({_size(epoch)} an epoch)" if config.epochs > 1 else ""
        raise OutputError(
            f"{what} would take at least {_size(config.epochs * epoch)}{per} and {out} has {_size(free)} free; "
            f"{_FEWER_EPOCHS if config.epochs > 1 else ''}free space, choose an --out on a larger disk or build "
            "fewer records (--limit)"
        )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    plan = config.epochs * (_PLAN_BYTES_PER_EXAMPLE * len(lengths) + _PLAN_BYTES_PER_EPOCH)
    if plan > memory // 2:
        raise ConfigError(
            f"planning {config.epochs:,} epoch(s) of {len(lengths):,} examples needs about {_size(plan)} of memory "
            f"and this machine has {_size(memory)}; {_FEWER_EPOCHS if config.epochs > 1 else ''}build fewer "
            "records (--limit), or split the source into several builds"
        )


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} bytes"


def _check_id_range(tokenizer, name: str) -> int:
    """Refuse token ids the int32 rows cannot hold, before anything costs: serialising a vocab with such
    an id (its fingerprint) walks every id below it (minutes and gigabytes). One pass over the vocab.
    Returns one past the largest id (and at least the vocab's size): what format 2's ids must hold."""
    top = tokenizer.top_id()
    if top > ROW_LIMIT:
        raise TokenizerError(
            f"--tokenizer {name}: has a token id of {top:,}, beyond the {ROW_LIMIT:,} of the int32 ids packer "
            "stores (as every model's embedding table indexes); check its vocab"
        )
    return max(top + 1, len(tokenizer))


@dataclass(frozen=True, slots=True)
class _Tokens:
    spill: spill.Spill
    from_store: bool  # re-drawn from the token store's entries (some records tokenized: ``extended``)
    extended: tuple[int, ...] | None  # records tokenized beyond each part's entry; None: no extension
    warnings: tuple[str, ...]


def _tokens(config: BuildConfig, opened: Opened, identity: dict[str, Any], staging: Path, engine: engines.Engine, *,
            progress: bool) -> _Tokens:
    """The build's finished token spill in ``staging``: an interrupted run's (resumed), the token store's (re-drawn
    from its parts' entries, tokenizing only the records beyond them), or the source tokenized; what was tokenized
    is kept in the store."""
    parts = source_parts(config)
    stored = (token_store.identities(config, identity["tokenizer"], parts, opened.source, opened.encoder)
              if config.cache else None)
    # an interrupted run's finished spill is there already: reused as it is (a resume), else re-drawn from the
    # parts' entries in the store when they hold every record the draws take
    restored = (token_store.restore(stored, opened.stream, staging / schema.TOKENS_DIR, identity)
                if stored is not None and not spill.finished(staging / schema.TOKENS_DIR, identity)
                else token_store.Restored(False))
    # an entry holding fewer records than the draws take from it: only the records beyond it are tokenized
    extended = (None if restored.rest is None else
                token_store.extend(restored.rest, opened.stream, opened.encoder, staging / schema.TOKENS_DIR,
                                   identity, engine=engine, progress=progress))
    # tokens from the store are no resume and no tokenizing: no bar, no "resuming" line (the summary says it)
    tokens = spill.tokenize(opened.stream, opened.encoder, staging / schema.TOKENS_DIR, identity,
                            engine=engine, progress=progress and not restored.hit and extended is None)
    check_unchanged(opened)
    warnings = () if restored.note is None else (restored.note,)
    abouts = [_about(part, identity) for part in parts]
    if extended is not None:  # the source read as the entries' keys say: the extended entries kept
        skipped_store = token_store.keep(extended, stored, abouts, staging / schema.TOKENS_DIR)
        warnings += () if skipped_store is None else (skipped_store,)
    elif stored is not None and not restored.hit and len(tokens.lengths):
        skipped_store = token_store.save(stored, opened.stream, opened.encoder, tokens, abouts)
        warnings += () if skipped_store is None else (skipped_store,)
    from_store = restored.hit or extended is not None
    return _Tokens(tokens, from_store, None if extended is None else extended.more, warnings)


def _build(config: BuildConfig, engine: engines.Engine, out: Path, staging: Path, *, progress: bool = False
           ) -> BuildResult:
    started = time.perf_counter()
    # with the token store on, a tokenizer folder met before is rebuilt from its kept parts, without transformers
    tokenizer = load_tokenizer(tokenizer_path(config.tokenizer), config.chat_template,
                               memo=kept_tokenizers.TOKENIZERS if config.cache else None)
    id_bound = _check_id_range(tokenizer, config.tokenizer or BUNDLED)
    # and a processor folder's facts are kept: an image build loads its processor only if it tokenizes
    opened = open_source(config, tokenizer, skip_errors=config.on_error == "skip",
                         processors=processor_facts.PROCESSORS if config.cache else None)
    config = config.for_pairs() if opened.pairs else config  # a row holds a pair: its budget, before it is recorded
    identity = {"config": config.identity(),
                "tokenizer": image_build.tokenizer_record(tokenizer_info(tokenizer, config.tokenizer or BUNDLED),
                                                          opened.processor),
                "source": opened.source}
    previous = output.check(out, identity, config.overwrite)
    if previous is not None:
        return BuildResult(out, previous, True, time.perf_counter() - started)

    output.prepare(out, staging)  # a matching interrupted spill is resumed
    got = _tokens(config, opened, identity, staging, engine, progress=progress)
    tokens, warnings = got.spill, got.warnings
    lengths, skipped = tokens.lengths, tokens.skipped
    if len(lengths) == 0:
        raise SourceError(f"{opened.stream.name}: every record was skipped ({skipped}); nothing to pack")

    pad_id = None if config.layout() is None else pad_token_id(identity["tokenizer"])
    row_format = schema.RowFormat.of(config.format_version, id_bound=id_bound, longest_segment=config.longest_segment(),
                                     padded=pad_id is not None, pairs=opened.pairs, images=config.processor is not None)
    check_room(config, lengths, out, row_format)
    plan = plan_rows(config, lengths, tokens.trained_flags(), pad_id or 0, pairs=opened.pairs)
    if plan.num_rows == 0:
        raise ConfigError(_nothing_packed(config, len(lengths), opened.pairs))
    written = engine.write_shards(plan, tokens, staging, shard_bytes=config.shard_size_mb << 20, progress=progress,
                                  row_format=row_format, compression=config.compression)
    dropped = {"overlong": plan.stats["examples_dropped"], **skipped}
    stats = schema.Stats(
        **plan.stats,
        pad_token_id=pad_id,
        examples_read=tokens.records,
        records_skipped=sum(skipped.values()),
        dropped_by_reason={k: v for k, v in sorted(dropped.items()) if v},
        loss_tokens=written.loss_tokens,
        segments_without_loss=written.segments_without_loss,
        sources=None if config.mix is None else mix.part_counts(list(config.mix), config.seed, tokens.records,
                                                                tokens.example_ids, lengths, plan, skipped),
    )
    manifest = schema.Manifest(
        created_by=f"packer {__version__}",
        note=_note(config, opened),
        config=config,
        tokenizer=identity["tokenizer"],
        source=identity["source"],
        stats=stats,
        shards=written.shards,
        format_version=row_format.version,
        columns=row_format.columns(),
    )
    output.commit(out, staging, manifest)
    return BuildResult(out, manifest, False, time.perf_counter() - started,
                       None if got.from_store else tokens.reused_records, got.from_store, warnings, got.extended)


def _about(part: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """What ``packer cache`` shows of a part's token store entry: its source and tokenizer."""
    return {"sources": [part["source"]], "tokenizer": identity["tokenizer"]["name_or_path"]}
