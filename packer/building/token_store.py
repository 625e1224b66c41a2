"""The token store: a build's tokenized examples kept in the cache, so a build that differs only in what acts
after tokenizing (the pack mode, row sizes, seed, epochs, ranks, padding, format, shards), or in how many of
each source's records it draws (``--limit``, a mix's weights, counts and seed) within those kept, re-plans
from them instead of reading and tokenizing the source again.

An entry is one mix part's tokens (a one-source build is a mix of one part): what the part's first records
tokenize to alone, in the part's order, as a finished token spill holds them (:mod:`packer.building.spill`:
ids, trained flags, lengths, example ids, here the records' indices in the part), in
``<cache root>/tokens/<key>/``::

    meta.json         the identity the tokens were made from; the records, examples and tokens held, whether
                      the records are all the part has (``complete``), each skipped record's index and reason,
                      each file's size and sha256 (an image part's: and each image file its records read, with
                      the size and sha256 of the bytes held), and its own sha256 (of the rest of it)
    ids.bin trained.bin lengths.bin example_ids.bin
    images.bin image_index.bin example_images.bin    an image part's images (:mod:`packer.building.image_spill`)

keyed by everything the part's tokens depend on (:func:`identities`): its source's content (the sha256s, or
the Hub revision, the manifest records), the tokenizer's fingerprint and special tokens, the chat template's
sha256, the part's format and every config field that acts before planning (fields, recipe, ``--train-on``,
tools, ``--on-error``), packer's version and the store's; not the weights, seed or ``--limit``, which decide
only how many of the part's records a build takes (:mod:`packer.building.redraw` re-draws a build from its
parts' entries when each holds those records). The key names a folder; the identity in ``meta.json`` must
equal the part's whole, or the entry is not used. A build that tokenized keeps each part's records as its
entry unless the entry there holds as many already (one of fewer records is replaced).

When a part has an entry but the draws take more of some part than its entry holds (another seed, more
weight, a larger ``--limit``; a part without an entry holds none), only the records beyond the entries are
read and tokenized
(:mod:`packer.building.extension`), each such entry replaced by one holding its records and those after
them, and the build re-drawn from the entries as before. The key covers what that reads: a local source's
record names the files the build reads and their sha256s (under ``--limit``, the files that hold the records
it reads), so an entry is found only by a build reading the very files it was made from, and reading on
from its end stays in them; a build reading another file (a larger ``--limit`` reaching a source's next
file) has another key and tokenizes.

An image build's part keeps its images too (each example's carried with its tokens wherever they are re-drawn,
split or extended: :func:`packer.building.image_spill.gather`, :func:`packer.building.image_entry.append`), and
its identity holds what its image tokens depend on (:mod:`packer.building.image_entry`: the processor, the
images field and folder, ``--max-len`` where the encoder drops an example whose cut falls in an image); the
image files its records read are re-hashed before a re-plan, and an entry whose files changed is removed and the
source tokenized. An image part with records skipped for another reason than an image cut is not kept.

Never trusted blindly: an entry is written under a temporary name and renamed into place whole (a rename
cannot half-happen; of two builds writing the same entry at once, the second's rename fails and it keeps
the first's); it is used by linking its files into the build's staging folder and checking those links'
sizes and sha256s against ``meta.json`` (what was linked cannot change under the build, even if the
entry is evicted meanwhile); a damaged, partial or foreign entry is removed and the source tokenized
again. Writing the store is an optimisation: any failure (a full disk) leaves the build as it was and is
reported in one warning. The cache root, its locks, size limit and least-recently-used eviction are
:mod:`packer.cache`'s (``Cache("tokens")``): an entry is opened under its shared lock while its files are linked,
so it is never evicted under a build that is taking it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__, cache
from ..contract.config import BuildConfig
from ..fs import file_sha256
from . import extension, image_entry, kept_tokenizers, mix, redraw, spill
from .mix import MixEncoder, MixStream

# bump when what an entry holds or means changes: entries of another version are never used (4: a local source keyed
# by its files' content and order, not their paths)
STORE_VERSION = 4
KIND = "tokens"  # the store's folder in the cache root
META = "meta.json"
PARTS = ".parts"  # in a build's spill folder: the parts' files while they are linked in, re-drawn or split out
# the config fields that act after tokenizing: a build differing only in them re-plans from the same tokens
AFTER_TOKENIZING = frozenset({
    "max_len", "pack", "batch_size", "max_tokens", "overlong", "seed", "epochs", "world_size", "balance", "cp_size",
    "cp_layout", "pad_to_multiple_of", "format_version", "compression", "shard_size_mb"})
# the config fields a part's own record replaces (its source, recipe, split, files, fields), or that decide only
# how many of a part's records a build takes (the mix's weights and counts, --limit): not a part's identity
_NOT_A_PARTS = frozenset({"source", "recipe", "split", "mix", "limit", "chat_template", *mix.FIELDS})


def identities(config: BuildConfig, tokenizer: dict[str, Any], parts: tuple[dict[str, Any], ...],
               source: dict[str, Any], encoder: MixEncoder) -> list[dict[str, Any]] | None:
    """What each part's tokens depend on (one part for a one-source build): every recorded config field
    that acts before planning and is no part's own (so a field added later counts until it is known not
    to), the part as the config gives it but for its weight or count (its source, recipe, split, files,
    fields), its format as resolved (``FormatSpec``: the options, the recipe and the columns decide it, and so
    can ``--pack``: wrap reads a ``text`` column where another mode reads a prompt/completion pair beside it),
    the chat template by content (``tokenizer``'s sha256, not the file's path), the tokenizer by content (its
    name is where it lies), the part's source by content (its record in the manifest's ``source``; a local one
    without its path, as given or as its files lie: the same files read from another place are the same tokens). Not the
    weights, seed, ``--limit`` nor the other parts: those decide how many of the part's records a build takes,
    which the entry's counts answer (:mod:`packer.building.redraw`). The versions of the libraries that make the
    tokens (tokenizers, transformers' chat renderer, jinja2) count too.

    None when a part's content cannot be pinned: a Hub source read offline has no revision, so a refreshed local
    copy would reuse (or extend) tokens of an older version of it. Such a build neither uses nor keeps entries."""
    fields = {k: v for k, v in config.identity().items() if k not in AFTER_TOKENIZING | _NOT_A_PARTS}
    libraries = {name: kept_tokenizers.installed_version(name) for name in ("tokenizers", "transformers", "jinja2")}
    out = []
    for k, (part, enc) in enumerate(zip(parts, encoder.encoders, strict=True)):
        record = source if config.mix is None else {f: v for f, v in source["parts"][k].items() if f != "source"}
        if record.get("kind") == "hub" and record.get("revision") is None:
            return None
        images = image_entry.identity(enc)
        given = {f: v for f, v in part.items() if f not in ("weight", "records")}
        if record.get("kind") == "local":
            # by content alone: the same bytes read by another path (relative or absolute, from another folder, a
            # copy) are the same tokens (an image part's relative image paths are read from its source's folder,
            # which image_entry's identity holds)
            given.pop("source", None)
            record = {**record, "files": [{f: v for f, v in file.items() if f != "path"} for file in record["files"]]}
        out.append({"store_version": STORE_VERSION, "spill_version": spill.STAGE_VERSION, "packer": __version__,
                    "libraries": libraries,
                    "config": fields, "part": given,
                    "format": dataclasses.asdict(getattr(enc, "spec", None) or enc.formatter.spec),
                    "tokenizer": {f: v for f, v in tokenizer.items() if f != "name_or_path"}, "source": record,
                    **({} if images is None else {image_entry.KEY: images})})
    return out


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


def key(ident: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(ident).encode()).hexdigest()[:32]


def folder() -> Path:
    """The store's folder in the cache root."""
    return cache.root() / KIND


@dataclass(frozen=True, slots=True)
class Restored:
    """How a lookup went: the spill restored from the parts' entries (``hit``); or the entries linked in and
    some part's records to be read beyond its entry's (``rest``: :func:`extend` does it); or neither, and why
    (``note``: damage found)."""

    hit: bool
    note: str | None = None
    rest: Rest | None = None


@dataclass(frozen=True, slots=True)
class Rest:
    """Every part's sound entry (or, for a part without one, empty files), linked into ``into / PARTS / name``
    and checked, one of them holding fewer records than the draws take from it: what :func:`extend` starts
    from."""

    names: list[str]
    metas: dict[str, dict[str, Any]]


REST = ".rest"  # in a build's spill folder: the spill of the records read beyond the parts' entries
# what a part without an entry holds: nothing (its records are all read and tokenized, its entry made)
_NONE = {"counts": {"records": 0, "examples": 0, "tokens": 0}, "complete": False, "skips": {"at": [], "reasons": []}}


def restore(idents: list[dict[str, Any]], stream: MixStream, into: Path, spill_identity: dict[str, Any]) -> Restored:
    """Put the build's spill into ``into`` as a finished spill of ``spill_identity`` (the build's own), re-drawn
    from its parts' entries (``idents[k]``: that of ``stream``'s part k), when the store holds a sound one for
    every part and each covers the records the build's draws take from it (:func:`packer.building.redraw.drawn`;
    their skips are counted from each entry's list): the entries' files linked (copied across filesystems) under their shared locks, checked there
    against the entries' sizes and sha256s, then assembled in mix order (one part taken whole: its files are
    the spill as they are). When an entry holds fewer records than the draws take (and they are not all its
    part has), or a part has none (another part has one), the entries are linked and checked all the same and
    ``rest`` says so: :func:`extend` reads and tokenizes the records beyond them (not for a source given as two
    parts: tokenized whole). A damaged or foreign entry is removed (``note`` says what was found) and nothing is
    restored; ``into`` is then left empty for the build to tokenize into."""
    try:
        store = cache.Cache(KIND)
    except cache.CacheError:  # an unusable cache folder: tokenize; saving says why, once
        return Restored(False)
    parts = stream.parts
    names = [key(ident) for ident in idents]
    metas: dict[str, dict[str, Any]] = {}
    held: dict[str, cache.Entry] = {}
    try:
        for name, ident in zip(names, idents, strict=True):
            if name in metas:  # two parts of one identity: one entry
                continue
            found: list[str] = []

            def check(path: Path, full: bool, ident=ident, found=found) -> str | None:
                problem = _meta_problem(path, ident)
                if problem is not None:
                    found.append(problem)
                return problem

            entry = store.find(name, check)
            if entry is None:
                if found:
                    _remove(store, name)
                    return Restored(False, _damaged(name, found[0]))
                metas[name] = _NONE  # a part without an entry: its records are all beyond it
                continue
            held[name] = entry
            metas[name] = json.loads((entry.path / META).read_text())
        if not held:  # no part has an entry: the build tokenizes, as a first one
            return Restored(False)
        held_records = [redraw.Held(metas[n]["counts"]["records"], metas[n]["complete"]) for n in names]
        src = redraw.drawn(list(parts), stream.seed, stream.limit, held_records)
        if src is None and len(set(names)) < len(names):  # a source given twice would be read twice beyond its entry
            return Restored(False)
        whole = src is not None and len(parts) == 1 and int(src.size) == metas[names[0]]["counts"]["records"]
        _empty(into, keep=REST if src is None else None)  # an interrupted extension's spill is resumed
        for name, entry in held.items():
            where = into if whole else into / PARTS / name
            where.mkdir(parents=True, exist_ok=True)
            for file in metas[name]["files"]:
                _link_or_copy(entry.path / file, where / file)
        for name in set(metas) - set(held):  # a part without an entry holds no records
            (into / PARTS / name).mkdir(parents=True, exist_ok=True)
            for file in image_entry.files(idents[names.index(name)], spill.FILES):
                (into / PARTS / name / file).write_bytes(b"")
    except (OSError, ValueError, KeyError) as e:  # an entry replaced meanwhile by a build keeping more records
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return _undo(store, into, next(iter(held), names[0]), f"it cannot be read ({why})")
    finally:
        for entry in held.values():
            entry.close()
    for name in held:
        problem = _hash_problem(into if whole else into / PARTS / name, metas[name])
        if problem is not None:
            return _undo(store, into, name, problem)
        if image_entry.LISTED in metas[name] and image_entry.changed(metas[name]) is not None:
            _remove(store, name)  # an image file changed since: no damage (no warning), but never of use again
            _empty(into)
            return Restored(False)
    if src is None:
        return Restored(False, rest=Rest(names, {n: dict(m) for n, m in metas.items()}))
    _finish(into, spill_identity, src, names, metas, whole)
    _clear(into / PARTS)
    return Restored(True)


def _finish(into: Path, spill_identity: dict[str, Any], src: np.ndarray, names: list[str],
            metas: dict[str, dict[str, Any]], whole: bool) -> None:
    """The spill of the mix whose positions' parts are ``src`` made in ``into`` from the parts' files in
    ``into / PARTS / name`` (``whole``: one part's files, in ``into`` already, are the spill), and marked finished."""
    taken = np.bincount(src, minlength=len(names))
    skipped = [redraw.skipped(metas[n]["skips"], int(m)) for n, m in zip(names, taken, strict=True)]
    if whole:
        counts = metas[names[0]]["counts"]
        examples, tokens = counts["examples"], counts["tokens"]
    else:
        examples, tokens = redraw.assemble(src, [(into / PARTS / n, metas[n]["counts"]["examples"],
                                                  metas[n]["counts"]["tokens"]) for n in names], into)
    # an image entry's image counts too: the spill's images are truncated to what its marker counts when it is opened
    images = image_entry.progress(into)
    spill.mark_finished(into, spill_identity, {"records": int(src.size), "examples": examples, "tokens": tokens,
                                               "skipped": skipped, **images})


@dataclass(frozen=True, slots=True)
class Extended:
    """What :func:`extend` did: the records it tokenized of each part (``more``), and each part's files (its
    entry's and those records', in ``folders[k]``) with what its new entry says (``parts[k]``), or None for a
    part whose entry stays as it is. :func:`keep` makes them the parts' entries."""

    more: tuple[int, ...]
    folders: tuple[Path | None, ...]
    parts: tuple[_Part | None, ...]
    extras: tuple  # what else each new entry's meta.json says, by its folder (None: not kept): _image_meta


def extend(rest: Rest, stream: MixStream, encoder: MixEncoder, into: Path, spill_identity: dict[str, Any], *,
           engine, progress: bool) -> Extended:
    """Tokenize the records the build's draws take beyond what its parts' entries hold (``rest``, linked into
    ``into`` by :func:`restore`), and only those (:class:`packer.building.extension.Rest`: each part's stream
    read from where its entry ends, the records encoded by the build's encoders through ``engine``, in a spill
    of their own in ``into / REST``, resumed after an interrupt), each extended part's files then its entry's
    followed by its new records (copies: the entries' own files are never written), and the build's spill
    re-drawn from them in ``into`` as :func:`restore` does, marked finished. A part whose stream ends while it
    is read has all its records: its new entry says ``complete``, and a weighted mix ends at that draw, as a
    cold build's does. The new entries are kept by :func:`keep`, once the build has checked that the source did
    not change while it was read."""
    parts, n = list(stream.parts), len(stream.parts)
    metas = [rest.metas[name] for name in rest.names]
    held = [m["counts"]["records"] for m in metas]
    complete = [m["complete"] for m in metas]
    ident = {"rest of": spill_identity, "held": [[name, h, c] for name, h, c in zip(rest.names, held, complete,
                                                                                     strict=True)]}
    tokens = spill.tokenize(extension.Rest(stream, tuple(held), tuple(complete)), encoder, into / REST, ident,
                            engine=engine, progress=progress)
    records, gone = extension.end(parts, stream.seed, stream.limit, held, tokens.records)
    src = mix.positions_sources(parts, stream.seed, records)
    more = [max(0, int(t) - h) for t, h in zip(np.bincount(src, minlength=n), held, strict=True)]
    news = [into / PARTS / f"{k}.new" if more[k] else None for k in range(n)]
    if any(news):  # each part's new records, their ids the records' indices in the part
        redraw.split(into / REST, tokens.lengths, np.asarray(tokens.example_ids), src, news)
    folders: list[Path | None] = [None] * n
    kept: list[_Part | None] = [None] * n
    for k, name in enumerate(rest.names):
        if not more[k] and not (gone == k and not complete[k]):
            continue  # its entry holds every record the draws take, and says whether that is all
        where = into / PARTS / name
        at: list[int] = []
        reasons: list[str] = []
        sure = True  # each new skipped record's reason known (else the part's entry is not kept)
        if more[k]:
            ids = np.fromfile(news[k] / "example_ids.bin", np.int64)
            at = (redraw.skipped_at(ids - held[k], more[k]) + held[k]).tolist()
            counted = sorted(r for r, c in tokens.skipped.by_part[k].items() for _ in range(c))
            # one reason: every skipped record's; several: each record read again and encoded alone
            reasons = (counted if len(set(counted)) < 2 else
                       _reasons(stream.streams[k], encoder.encoders[k], encoder.wheres[k], at))
            if sorted(reasons) != counted:  # this build counts its skips all the same: it takes every one
                reasons, sure = counted, False
            for file in spill.FILES:  # a copy of the entry's file (never written: linked), the new records after it
                with open(where / f"{file}.tmp", "wb") as out:
                    with open(where / file, "rb") as old:
                        shutil.copyfileobj(old, out, 1 << 20)
                    with open(news[k] / file, "rb") as new:
                        shutil.copyfileobj(new, out, 1 << 20)
                os.replace(where / f"{file}.tmp", where / file)
            image_entry.append(where, news[k])  # an image part's images too
        meta = metas[k]
        skips = {"at": meta["skips"]["at"] + at, "reasons": meta["skips"]["reasons"] + reasons}
        kept[k] = (_Part(held[k] + more[k], complete[k] or gone == k, skips["at"], skips["reasons"])
                   if sure and held[k] + more[k] else None)
        meta["counts"] = {"records": held[k] + more[k], "examples": (where / "lengths.bin").stat().st_size // 4,
                          "tokens": (where / "ids.bin").stat().st_size // 4}
        meta["skips"] = skips
        folders[k] = where
    whole = n == 1 and int(src.size) == metas[0]["counts"]["records"]
    if whole:  # one part taken whole: its files are the spill
        for file in (*spill.FILES, *image_entry.held(into / PARTS / rest.names[0])):
            os.replace(into / PARTS / rest.names[0] / file, into / file)
        folders[0] = into if folders[0] is not None else None
    _finish(into, spill_identity, src, rest.names, rest.metas, whole)
    shutil.rmtree(into / REST, ignore_errors=True)
    extras = tuple(None if part is None else _image_meta(where is not None and bool(image_entry.held(where)), k,
                                                         stream, encoder, part)
                   for k, (part, where) in enumerate(zip(kept, folders, strict=True)))
    return Extended(tuple(more), tuple(folders), tuple(kept), extras)


def keep(extended: Extended, idents: list[dict[str, Any]], abouts: list[dict[str, Any]], into: Path) -> str | None:
    """Keep each part :func:`extend` extended as its entry, replacing the one of fewer records (unless another
    build has meanwhile kept as many); then the parts' files in ``into`` are removed. Returns None, or the one
    warning that the store was skipped and why, as :func:`save` does."""
    try:
        store = cache.Cache(KIND)
        for k, (part, where) in enumerate(zip(extended.parts, extended.folders, strict=True)):
            if part is None or where is None or extended.extras[k] is None:
                continue
            _keep(store, key(idents[k]), idents[k], where, part, abouts[k], _bytes(where), extra=extended.extras[k])
    except (OSError, cache.CacheError) as e:
        return _skipped(e)
    finally:
        _clear(into / PARTS)
    return None


def _undo(store: cache.Cache, into: Path, name: str, problem: str) -> Restored:
    _remove(store, name)
    _empty(into)
    return Restored(False, _damaged(name, problem))


def _damaged(name: str, problem: str) -> str:
    return f"the token store's entry {name} was not used ({problem}); it was removed and the source tokenized again"


def _remove(store: cache.Cache, name: str) -> None:
    """Remove entry ``name`` unless a process has it open (then the next build that keeps these tokens replaces
    it: ``save`` checks an entry in place in full). The cache's own eviction of one entry does exactly this."""
    with suppress(OSError):
        store._evict(store.path(name))


_WIDTHS = {"ids.bin": ("tokens", 4), "trained.bin": ("tokens", 1), "lengths.bin": ("examples", 4),
           "example_ids.bin": ("examples", 8)}


def _meta_problem(path: Path, ident: dict[str, Any]) -> str | None:
    """What is wrong with entry ``path`` as its meta.json and file sizes show (None: nothing). Its hashes are
    checked on the copies a build links (:func:`_hash_problem`), where they cannot change under it."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return "its meta.json is missing or unreadable"
    if not isinstance(meta, dict):
        return "its meta.json is not an entry's"
    if meta.get("sha256") != _meta_sha256(meta):  # what it says of the files (counts, skips, image files) is checked too
        return "its meta.json was changed since it was written (its sha256 differs)"
    if _canonical(meta.get("identity")) != _canonical(ident):
        return "it was made from another source, tokenizer or config"
    files, counts, skips = meta.get("files"), meta.get("counts"), meta.get("skips")
    if (not isinstance(files, dict) or set(files) != set(image_entry.files(ident, spill.FILES))
            or not isinstance(counts, dict)
            or not all(isinstance(counts.get(c), int) for c in ("records", "examples", "tokens"))
            or not isinstance(meta.get("complete"), bool) or not isinstance(skips, dict)
            or not isinstance(skips.get("at"), list) or not isinstance(skips.get("reasons"), list)
            or len(skips["reasons"]) != len(skips["at"])
            or not all(isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("sha256"), str)
                       for f in files.values())):
        return "its meta.json does not list its files, counts and skips"
    for name, (count, width) in _WIDTHS.items():
        if files[name]["bytes"] != counts[count] * width:
            return f"its meta.json's counts do not match {name}"
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != files[name]["bytes"]:
            return f"{name} holds {size:,} bytes, not the {files[name]['bytes']:,} it was written with"
    return image_entry.size_problem(path, meta) if image_entry.KEY in ident else None


def _meta_sha256(meta: dict[str, Any]) -> str:
    """The sha256 a meta.json holds of the rest of itself."""
    return hashlib.sha256(_canonical({k: v for k, v in meta.items() if k != "sha256"}).encode()).hexdigest()


def _entry_problem(path: Path, ident: dict[str, Any], full: bool) -> str | None:
    """``_meta_problem``, and with ``full`` the sha256s too, but for an entry ``save`` has just made (under the
    cache's temporary name: its hashes were taken from those very files)."""
    problem = _meta_problem(path, ident)
    if problem is not None or not full or path.name.startswith(cache.TMP_PREFIX):
        return problem
    return _hash_problem(path, json.loads((path / META).read_text()))


def _hash_problem(where: Path, meta: dict[str, Any]) -> str | None:
    """Which of the files in ``where`` differs from the size and sha256 ``meta`` lists (None: none)."""
    for name in meta["files"]:
        problem = cache.file_problem(where / name, meta["files"][name]["bytes"], meta["files"][name]["sha256"])
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _empty(into: Path, keep: str | None = None) -> None:
    """``into`` made empty, but for its file or folder ``keep``."""
    if keep is None or not (into / keep).exists():
        shutil.rmtree(into, ignore_errors=True)
    else:
        for path in into.iterdir():
            if path.name != keep:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink()
    into.mkdir(parents=True, exist_ok=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where ``src`` and ``dst`` share a filesystem (no bytes copied: entries and spills are never
    written in place, only replaced or removed), else a copy."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copyfile(src, dst)


@dataclass(frozen=True, slots=True)
class _Part:
    """What a build's spill holds of one part: its first ``records`` records (all it has: ``complete``) and
    the indices of those skipped, each with its reason (None: not known yet, :func:`_reasons`)."""

    records: int
    complete: bool
    skipped_at: list[int]
    reasons: list[str] | None


def _covers(path: Path, part: _Part) -> bool:
    """Whether the entry at ``path`` (sound) holds at least what ``part`` would: then it is kept as it is."""
    meta = json.loads((path / META).read_text())
    return meta["complete"] or (meta["counts"]["records"] >= part.records and not part.complete)


def save(idents: list[dict[str, Any]], stream: MixStream, encoder: MixEncoder, tokens: spill.Spill,
         abouts: list[dict[str, Any]]) -> str | None:
    """Keep what a build's finished spill holds of each part of ``stream`` as that part's entry (``idents[k]``), unless a
    sound entry there holds as much already (an entry holding fewer records is replaced; past the cache's
    limit, the least recently used entries are evicted first). One part: the spill's files are its entry
    (linked, no copy); several: each part's examples are split out of the spill (:func:`redraw.split`).
    Returns None, or the one warning that the store was skipped and why (a full disk): the build goes on
    unharmed either way. A part larger than the whole limit is not kept."""
    parts, seed, limit = list(stream.parts), stream.seed, stream.limit
    src = mix.positions_sources(parts, seed, tokens.records)
    taken = np.bincount(src, minlength=len(parts))
    if len(parts) == 1:  # a one-part mix read to the end, unless it stopped at its limit
        # (a part read by a records count stopped at its count: never all of the source, which its key names)
        complete = ["records" not in parts[0] and (limit is None or tokens.records < limit)]
    else:
        gone = mix.ran_out(parts, seed, limit, tokens.records)  # the part that ended a weighted mix: all read
        complete = [k == gone for k in range(len(parts))]
    ex = np.asarray(tokens.example_ids)
    part_ids = [ex] if len(parts) == 1 else None
    if part_ids is None:
        rank = redraw.rank(src, len(parts))  # the record index in its part of each position
        part_ids = [rank[ex[src[ex] == k]] for k in range(len(parts))]
    mine = []
    for k in range(len(parts)):
        at = redraw.skipped_at(part_ids[k], int(taken[k])).tolist()
        by_reason = tokens.skipped.by_part[k]
        # one reason: every skipped record's; several: each record's is found when the part is kept (_reasons)
        mine.append(_Part(int(taken[k]), complete[k], at, [next(iter(by_reason))] * len(at) if len(by_reason) == 1
                          else None if at else []))
    names = [key(ident) for ident in idents]
    # of parts of one identity (a source given twice), the one that read furthest is kept
    kept = {name: max((k for k in range(len(parts)) if names[k] == name), key=lambda k: (mine[k].complete,
                                                                                         mine[k].records))
            for name in names}
    split_at = tokens.folder / PARTS
    _clear(split_at)  # what a build killed while splitting left: never taken for a part
    try:
        store = cache.Cache(KIND)
        for k, (name, ident) in enumerate(zip(names, idents, strict=True)):
            if kept[name] != k or not mine[k].records:
                continue
            where = tokens.folder if len(parts) == 1 else split_at / str(k)
            extra = _image_meta(image_entry.KEY in ident, k, stream, encoder, mine[k])  # an image part's files read
            if extra is None:
                continue

            def prepare(k=k, where=where) -> list[str]:  # done only when the part is kept
                reasons = mine[k].reasons
                if reasons is None:
                    reasons = _reasons(stream.streams[k], encoder.encoders[k], encoder.wheres[k], mine[k].skipped_at)
                    if sorted(reasons) != sorted(r for r, n in tokens.skipped.by_part[k].items() for _ in range(n)):
                        raise cache.CacheError(f"part {k + 1}'s skipped records read again give other reasons")
                if not where.is_dir():  # split out once a part needs keeping
                    redraw.split(tokens.folder, tokens.lengths, ex, src,
                                 [split_at / str(j) if kept[names[j]] == j else None for j in range(len(parts))])
                return reasons

            size = (sum((tokens.folder / file).stat().st_size for file in image_entry.files(ident, spill.FILES))
                    if len(parts) == 1 else _part_bytes(tokens, ex, src, k))
            _keep(store, name, ident, where, mine[k], abouts[k], size, prepare, extra)
    except (OSError, cache.CacheError) as e:
        return _skipped(e)
    finally:
        _clear(split_at)
    return None


def _keep(store: cache.Cache, name: str, ident: dict[str, Any], where: Path, part: _Part, about: dict[str, Any],
          size: int, prepare=None, extra=None) -> None:
    """Make the files in ``where`` (``size`` bytes) entry ``name`` of identity ``ident``, holding ``part``'s
    records, unless a sound entry there holds as many already (one of fewer records is replaced) or the entry
    is larger than the cache's whole limit. ``prepare()``, when given, runs first and only if the entry is
    made: it puts the files in ``where`` and returns the skipped records' reasons (else ``part.reasons``).
    ``extra(where)``, when given: what else its meta.json says (an image entry's image files read)."""
    if store.limit is not None and size > store.limit:
        return

    def make(temp: Path) -> None:
        reasons = part.reasons if prepare is None else prepare()
        more = {} if extra is None else extra(where)  # before any file is hashed: it may decline the entry
        temp.mkdir()
        files = {}
        for file in image_entry.files(ident, spill.FILES):
            _link_or_copy(where / file, temp / file)
            files[file] = {"bytes": (temp / file).stat().st_size, "sha256": file_sha256(temp / file)}
        counts = {"records": part.records, "examples": files["lengths.bin"]["bytes"] // 4,
                  "tokens": files["ids.bin"]["bytes"] // 4}
        meta = {"identity": ident, "counts": counts, "complete": part.complete,
                "skips": {"at": part.skipped_at, "reasons": reasons}, "files": files,
                "about": about, "created": time.time(), **more}
        meta = json.loads(json.dumps(meta, default=str))  # as it is read back: its sha256 is of that
        (temp / META).write_text(json.dumps({**meta, "sha256": _meta_sha256(meta)}, sort_keys=True, indent=1))

    def check(path: Path, full: bool) -> str | None:
        problem = _entry_problem(path, ident, full)
        if problem is None and not _covers(path, part):
            return "it holds fewer records than this build's"
        return problem

    with suppress(image_entry.Unpinned), store.open(name, make, check, full=True, size_hint=size):
        pass  # an image part whose files cannot be pinned keeps no entry


def _image_meta(images: bool, k: int, stream: MixStream, encoder: MixEncoder, part: _Part):
    """What else part ``k``'s entry's meta.json says, as a function of the folder of its finished files (called
    when the entry is made: a mix's part is split out only then): nothing for a text part; for an image part, the
    image files its records read (:func:`packer.building.image_entry.read_files`: it raises ``Unpinned`` for a
    part that is not kept). None: an image part with records known to be skipped for another reason than an
    image cut (the entry would not be kept)."""
    if not images:
        return lambda folder: {}
    if part.reasons is not None and any(reason != image_entry.CUT_IMAGE for reason in part.reasons):
        return None
    return lambda folder: {image_entry.LISTED: image_entry.read_files(
        folder, stream.streams[k], encoder.encoders[k], part.records, np.fromfile(folder / "example_ids.bin", np.int64))}


def _skipped(e: Exception) -> str:
    """The one warning of a store that could not be written (a full disk): the build is whole all the same."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return (f"the token store was skipped ({why}): the build is complete, but a build that differs only in "
            f"packing will tokenize again; free space in {folder()} or pass --no-cache")


def _bytes(where: Path) -> int:
    return sum((where / file).stat().st_size for file in (*spill.FILES, *image_entry.held(where)))


def _clear(folder: Path) -> None:
    if folder.exists():  # a one-part build never makes it
        shutil.rmtree(folder, ignore_errors=True)


def _reasons(stream, encoder, where: str, at: list[int]) -> list[str]:
    """The reason each record of ``stream`` at indices ``at`` (ascending) is skipped for: those records read
    again and each encoded alone by the part's ``encoder``, which says why it skips it (the spill counts a
    part's skips by reason only). Reads the part from its first skipped record to its last; tokenizes none."""
    found: dict[int, str] = {}
    want = set(at)
    for first, batch in stream.chunks(at[0], spill.CHUNK):  # the records before it passed over
        n = len(next(iter(batch.values()))) if batch else 0
        for i in sorted(want.intersection(range(first, first + n))):
            encoded = encoder.encode({c: v[i - first:i - first + 1] for c, v in batch.items()}, i, where=where)
            found[i] = next(iter(encoded.skipped), "")
        if first + n > at[-1]:
            break
    return [found.get(i, "") for i in at]


def _part_bytes(tokens: spill.Spill, example_ids: np.ndarray, src: np.ndarray, k: int) -> int:
    """The bytes part ``k``'s entry takes: 5 a token, 12 an example, and an image build's its examples' images."""
    mine = src[example_ids] == k
    return (5 * int(tokens.lengths[mine].sum(dtype=np.int64)) + 12 * int(mine.sum())
            + image_entry.examples_bytes(tokens.folder, mine))


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry as ``packer cache`` lists it."""

    path: Path
    bytes: int
    about: dict[str, Any]  # source, tokenizer, counts (what meta.json says; {} for a damaged entry)
    last_used: float
    sound: bool  # meta.json readable (its hashes are checked when it is used)


def entries() -> list[Entry]:
    """The store's entries, most recently used first."""
    root = folder()
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if not path.is_dir() or path.name.startswith("."):  # the locks, entries being written or evicted
            continue
        try:
            meta = json.loads((path / META).read_text())
            # an entry of an earlier store version (never used, evicted as any) is listed as it says
            about, sound = {**meta["about"], **meta["counts"], "complete": meta.get("complete", False)}, True
        except (OSError, ValueError, KeyError, TypeError):
            about, sound = {}, False
        try:
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            found.append(Entry(path, size, about, path.stat().st_mtime, sound))
        except OSError:  # evicted meanwhile
            continue
    return sorted(found, key=lambda e: -e.last_used)


def clear() -> int:
    """Remove every entry, each once no build has it open, and the tokenizers' facts. Returns the bytes freed."""
    freed = 0
    store = cache.Cache(KIND)
    for e in entries():
        _remove(store, e.path.name)
        if not e.path.exists():
            freed += e.bytes
    kept_tokenizers.clear()
    return freed
