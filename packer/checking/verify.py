"""``packer verify``: prove a shard folder is intact and obeys the contract, reporting every problem.

Checks, in order (each adds problems to one :class:`Report`; nothing stops at the first):

1. **manifest** — present, valid JSON, ``format`` packer, a known ``format_version``, a config that
   ``BuildConfig`` accepts, stats that add up (examples and tokens accounted for), shard entries
   with file/rows/tokens/bytes/sha256; no file under a name a build writes that the manifest does not
   list (the user's files beside a build, under other names, are noted and left out).
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
   overlap a trained span), so a fault in the encoder's span mapping shows. A preference build's
   segments are compared the same way, each pair's mask recomputed from its prompt's end, and its
   ``pair_roles`` against the plan's (the row invariants check the pairing in step 3, as the loader does).

Cost: one sequential read of every shard byte for the hashes plus O(tokens) numpy for the rows;
``source`` costs a re-tokenize and holds the source's tokens in memory.

Problems are values (a ``Problem`` per finding, in one ``Report``: :mod:`packer.checking.report`); only errors
that stop verify from running at all (no such folder, a tokenizer or source that cannot be loaded)
raise a ``PackerError``. The steps: :mod:`packer.checking.verify_manifest` (1, 2), :mod:`packer.checking.verify_rows`
(3), :mod:`packer.checking.verify_source` (4, 5); this module runs them in order.
"""

from __future__ import annotations

import os

from .. import fs
from ..building.pipeline import tokenizer_path
from ..building.tokenization import load_tokenizer
from ..contract import schema
from ..contract.remote import local_view
from ..remote.fetch import redact
from .report import Problem, Report
from .verify_images import check_images
from .verify_manifest import check_files, check_folder_contents, check_stats_arithmetic, load_manifest
from .verify_rows import check_rows, check_totals
from .verify_source import check_source, check_tokenizer


def verify(directory: str | os.PathLike, *, tokenizer: str | None = None, source: str | None = None,
           quick: bool = False, progress: bool = False) -> Report:
    """Check a shard folder; returns a Report listing every problem (empty when the folder is sound).
    ``progress``: tqdm bars on stderr for the long steps (hashing every byte, the rows, the source).

    Raises ``ShardFormatError`` when ``directory`` is not a folder, and the loaders' ``PackerError``s
    when ``tokenizer`` or ``source`` cannot be loaded: those stop verify from running at all.
    """
    if fs.is_url(directory) and fs.local_path(directory) is None:
        return _verify_remote(str(directory), tokenizer=tokenizer, source=source, quick=quick, progress=progress)
    directory = fs.local_path(directory)
    if not directory.is_dir():
        raise schema.not_a_folder(directory)
    report = Report(str(directory), quick)
    manifest = load_manifest(directory, report)
    check_folder_contents(directory, manifest, report)
    if manifest is None:
        return report
    check_stats_arithmetic(manifest, report)
    tok = None
    if tokenizer is not None or source is not None:
        name = tokenizer or manifest.tokenizer.get("name_or_path") or "bundled"
        tok = load_tokenizer(tokenizer_path(name), manifest.config.chat_template)
        if tokenizer is not None:
            check_tokenizer(manifest, tok, tokenizer, report)
    entries = check_files(directory, manifest, report, progress)
    report.checked["shards"] = len(entries)
    if quick:
        return report
    vocab = manifest.tokenizer.get("vocab_size")
    if tok is not None:
        vocab = min(vocab, len(tok)) if isinstance(vocab, int) else len(tok)
    totals = check_rows(directory, manifest, entries, vocab if isinstance(vocab, int) else None, report,
                        keep_tokens=source is not None, progress=progress)
    if totals is not None:
        report.checked.update(rows=totals.rows, tokens=totals.tokens, segments=totals.segments)
        check_totals(manifest, totals, report)
    if manifest.row_format.images:  # an image build: its image columns (checking/verify_images.py)
        check_images(directory, manifest, entries, report, source, tok)
    if source is not None:
        check_source(manifest, source, tok, totals, report, progress)
    return report


def _verify_remote(url: str, **options) -> Report:
    """A folder in object storage is checked as a local view of it (packer.contract.remote.local_view):
    its shards fetched into the cache once, each checked against the manifest on arrival, then every
    check runs on the same memory-mapped files as a local build's. Paths in the report name the URL."""
    shown = redact(url.rstrip("/"))
    with local_view(url) as (folder, failed):
        report = verify(folder, **options)
    prefix = str(folder)
    report.problems = [Problem(p.check, p.where.replace(prefix, shown), p.message) for p in report.problems
                       if p.where.replace(prefix + "/", "") not in failed]  # a shard not fetched: its reason below
    for name, why in failed.items():
        report.add("files", f"{shown}/{name}", f"cannot be fetched: {why}")
    report.notes = [n.replace(prefix, shown) for n in report.notes]
    report.directory = shown
    return report
