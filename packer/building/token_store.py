"""The token store: a build's tokenized examples kept in the cache, so a build that differs only in what acts
after tokenizing (the pack mode, row sizes, seed, epochs, ranks, padding, format, shards) re-plans from them
instead of reading and tokenizing the source again.

An entry is what a finished token spill holds (:mod:`packer.building.spill`: ids, trained flags, lengths,
example ids, and the records and skips counted) in ``<cache root>/tokens/<key>/``::

    meta.json         the identity the tokens were made from, the counts, each file's size and sha256
    ids.bin trained.bin lengths.bin example_ids.bin

keyed by everything the tokens depend on (:func:`identity`): the source's content (the sha256s, or the
Hub revision, the manifest records), the tokenizer's fingerprint and special tokens, the chat template's
sha256, every config field that acts before planning (fields, recipe, ``--train-on``, tools, ``--limit``,
``--on-error``; a mix's parts and seed, which decide its draws), packer's version and the store's. The key
names a folder; the identity in ``meta.json`` must equal the build's whole, or the entry is not used.

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
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import __version__, cache
from ..contract.config import ROW_LIMIT, BuildConfig
from ..fs import file_sha256
from . import spill
from .mix import MixEncoder

STORE_VERSION = 1  # bump when what an entry holds or means changes: entries of another version are never used
KIND = "tokens"  # the store's folder in the cache root
META = "meta.json"
# the config fields that act after tokenizing: a build differing only in them re-plans from the same tokens
AFTER_TOKENIZING = frozenset({
    "max_len", "pack", "batch_size", "max_tokens", "overlong", "seed", "epochs", "world_size", "balance", "cp_size",
    "cp_layout", "pad_to_multiple_of", "format_version", "compression", "shard_size_mb"})


def identity(config: BuildConfig, tokenizer: dict[str, Any], source: dict[str, Any], encoder: MixEncoder
             ) -> dict[str, Any]:
    """What the tokens of a build depend on: every recorded config field not in ``AFTER_TOKENIZING`` (so a
    field added later counts until it is known not to), the seed for a mix (its draws decide which record
    comes where), each part's format as resolved (``FormatSpec``: the options, the recipe and the columns
    decide it, and so can ``--pack``: wrap reads a ``text`` column where another mode reads a prompt/completion
    pair beside it), the chat template by content (``tokenizer``'s sha256, not the file's path), the tokenizer
    by content (its name is where it lies), the source by content (``source``: the manifest's record of it)."""
    fields = {k: v for k, v in config.identity().items() if k not in AFTER_TOKENIZING and k != "chat_template"}
    if config.mix is not None:
        fields["seed"] = config.seed
    formats = [dataclasses.asdict(getattr(e, "spec", None) or e.formatter.spec) for e in encoder.encoders]
    return {"store_version": STORE_VERSION, "spill_version": spill.STAGE_VERSION, "packer": __version__,
            "config": fields, "formats": formats, "tokenizer": {k: v for k, v in tokenizer.items() if k != "name_or_path"},
            "source": source}


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


def key(ident: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(ident).encode()).hexdigest()[:32]


def folder() -> Path:
    """The store's folder in the cache root."""
    return cache.root() / KIND


class _Missing(Exception):
    """Raised by a lookup's maker: a lookup never makes an entry (only a build's tokens do, in :func:`save`)."""


def _missing(_tmp: Path) -> None:
    raise _Missing


def _open_existing(store: cache.Cache, name: str, check) -> cache.Entry | None:
    """Entry ``name`` opened (shared lock: not evicted while open) if it is there and passes ``check``; None
    otherwise (``Cache.open`` then asks the maker for a new one, and the maker declines)."""
    if not store.path(name).exists():
        return None
    try:
        return store.open(name, _missing, check)
    except _Missing:
        return None


@dataclass(frozen=True, slots=True)
class Restored:
    """How a lookup went: the spill restored from an entry (``hit``), or why not (``note``: damage found)."""

    hit: bool
    note: str | None = None


def restore(ident: dict[str, Any], into: Path, spill_identity: dict[str, Any]) -> Restored:
    """Put the entry of ``ident``, if the store holds a sound one, into ``into`` as a finished spill of
    ``spill_identity`` (the build's own): its files linked (copied across filesystems) under the entry's shared
    lock, then checked there against the entry's sizes and sha256s. A damaged or foreign entry is removed
    (``note`` says what was found) and nothing is restored; ``into`` is then left empty for the build to
    tokenize into."""
    try:
        store = cache.Cache(KIND)
    except cache.CacheError:  # an unusable cache folder: tokenize; saving says why, once
        return Restored(False)
    name = key(ident)
    found: list[str] = []

    def check(path: Path, full: bool) -> str | None:
        problem = _meta_problem(path, ident)
        if problem is not None:
            found.append(problem)
        return problem

    try:
        entry = _open_existing(store, name, check)
        if entry is None:
            if not found:
                return Restored(False)
            _remove(store, name)
            return Restored(False, _damaged(name, found[0]))
        with entry:
            meta = json.loads((entry.path / META).read_text())
            _empty(into)
            for file in spill.FILES:
                _link_or_copy(entry.path / file, into / file)
        problem = _hash_problem(into, meta)
    except OSError as e:
        problem = f"it cannot be read ({e.strerror or e})"
    if problem is not None:
        _remove(store, name)
        _empty(into)
        return Restored(False, _damaged(name, problem))
    spill.mark_finished(into, spill_identity, meta["counts"])
    return Restored(True)


def _damaged(name: str, problem: str) -> str:
    return f"the token store's entry {name} was not used ({problem}); it was removed and the source tokenized again"


def _remove(store: cache.Cache, name: str) -> None:
    """Remove entry ``name`` unless a process has it open (then the next build that keeps these tokens replaces
    it: ``save`` checks an entry in place in full). The cache's own eviction of one entry does exactly this."""
    with suppress(OSError):
        store._evict(store.path(name))


def _meta_problem(path: Path, ident: dict[str, Any]) -> str | None:
    """What is wrong with entry ``path`` as its meta.json and file sizes show (None: nothing). Its hashes are
    checked on the copies a build links (:func:`_hash_problem`), where they cannot change under it."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return "its meta.json is missing or unreadable"
    if not isinstance(meta, dict):
        return "its meta.json is not an entry's"
    if _canonical(meta.get("identity")) != _canonical(ident):
        return "it was made from another source, tokenizer or config"
    files, counts = meta.get("files"), meta.get("counts")
    if (not isinstance(files, dict) or set(files) != set(spill.FILES) or not isinstance(counts, dict)
            or not all(isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("sha256"), str)
                       for f in files.values())):
        return "its meta.json does not list its files and counts"
    for name, (count, width) in {"ids.bin": ("tokens", 4), "trained.bin": ("tokens", 1), "lengths.bin": ("examples", 4),
                                 "example_ids.bin": ("examples", 8)}.items():
        if files[name]["bytes"] != counts.get(count, -1) * width:
            return f"its meta.json's counts do not match {name}"
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != files[name]["bytes"]:
            return f"{name} holds {size:,} bytes, not the {files[name]['bytes']:,} it was written with"
    return None


def _entry_problem(path: Path, ident: dict[str, Any], full: bool) -> str | None:
    """``_meta_problem``, and with ``full`` the sha256s too, but for an entry ``save`` has just made (under the
    cache's temporary name: its hashes were taken from those very files)."""
    problem = _meta_problem(path, ident)
    if problem is not None or not full or path.name.startswith(cache.TMP_PREFIX):
        return problem
    return _hash_problem(path, json.loads((path / META).read_text()))


def _hash_problem(where: Path, meta: dict[str, Any]) -> str | None:
    """Which of the files in ``where`` differs from the size and sha256 ``meta`` lists (None: none)."""
    for name in spill.FILES:
        problem = cache.file_problem(where / name, meta["files"][name]["bytes"], meta["files"][name]["sha256"])
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _empty(into: Path) -> None:
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where ``src`` and ``dst`` share a filesystem (no bytes copied: entries and spills are never
    written in place, only replaced or removed), else a copy."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copyfile(src, dst)


def save(ident: dict[str, Any], tokens: spill.Spill, about: dict[str, Any]) -> str | None:
    """Keep a finished spill as the entry of ``ident`` (nothing to do if a sound one is there; past the cache's
    limit, the least recently used entries are evicted first). Returns None, or the one warning that the store
    was skipped and why (a full disk): the build goes on unharmed either way. A spill larger than the whole
    limit is not kept."""
    name = key(ident)

    def make(temp: Path) -> None:
        temp.mkdir()
        files = {}
        for file in spill.FILES:
            _link_or_copy(tokens.folder / file, temp / file)
            files[file] = {"bytes": (temp / file).stat().st_size, "sha256": file_sha256(temp / file)}
        meta = {"identity": ident, "counts": spill.counts(tokens), "files": files, "about": about,
                "created": time.time()}
        (temp / META).write_text(json.dumps(meta, sort_keys=True, default=str, indent=1))

    try:
        store = cache.Cache(KIND)
        size = sum((tokens.folder / file).stat().st_size for file in spill.FILES)
        if store.limit is not None and size > store.limit:
            return None
        with store.open(name, make, lambda path, full: _entry_problem(path, ident, full), full=True, size_hint=size):
            pass
    except (OSError, cache.CacheError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return (f"the token store was skipped ({why}): the build is complete, but a build that differs only in "
                f"packing will tokenize again; free space in {folder()} or pass --no-cache")
    return None


# -- tokenizers met before -----------------------------------------------------------------------------------
# Loading a tokenizer by its transformers class imports transformers: most of a small build's start, and most of a
# re-plan's. So a build that loads a tokenizer folder keeps its parts (``Tokenizer.parts``: the Rust tokenizer
# transformers built, serialised whole, its special tokens and chat templates) in ``<cache root>/tokenizers/<key>``,
# keyed by the content of every file of the folder (transformers reads several) and the versions of packer,
# transformers and tokenizers; a later build of a folder whose files hash to that key rebuilds the same tokenizer
# from them with the Rust library alone. The parts' own sha256 is kept beside them and checked on every use.

FACTS = "tokenizers"  # their kind in the cache root (each a JSON file, evicted as any entry)
_HASHED_UP_TO = 64 << 20  # larger files of a tokenizer folder (a model's weights beside it) count by size and mtime


def _tokenizer_key(base: Path) -> str | None:
    """The key of tokenizer folder ``base`` as its files are now (None when it cannot be read)."""
    try:
        # the installed versions, read from their metadata: importing transformers is what this spares
        versions = [__version__, *(metadata.version(d) for d in ("transformers", "tokenizers"))]
        digest = hashlib.sha256(_canonical(versions).encode())
        for path in sorted(base.rglob("*")):
            if path.is_file():
                st = path.stat()
                what = file_sha256(path) if st.st_size <= _HASHED_UP_TO else f"{st.st_size}:{st.st_mtime_ns}"
                digest.update(_canonical([path.relative_to(base).as_posix(), what]).encode())
    except (OSError, metadata.PackageNotFoundError):
        return None
    return digest.hexdigest()[:32] + ".json"


def _read_parts(path: Path) -> dict[str, Any]:
    """The parts kept in ``path``: a first line holding the sha256 of the JSON after it, checked."""
    data = path.read_bytes()
    digest, _, body = data.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise ValueError("its sha256 differs")
    return json.loads(body)


def _parts_problem(path: Path, full: bool) -> str | None:
    try:
        _read_parts(path)
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable or damaged"
    return None


class _Tokenizers:
    """The tokenization.Memo of the cache: each tokenizer folder's parts."""

    def get(self, folder: Path) -> dict[str, Any] | None:
        name = _tokenizer_key(folder)
        if name is None:
            return None
        try:
            entry = _open_existing(cache.Cache(FACTS), name, _parts_problem)
            if entry is None:
                return None
            with entry:
                return _read_parts(entry.path)
        except (OSError, ValueError, KeyError, TypeError, cache.CacheError):
            return None

    def put(self, folder: Path, tokenizer) -> None:
        """Keep ``tokenizer``'s parts (not one with an id beyond a row's int32: serialising it walks every id
        below it, which the build refuses first). A failure only means the next build loads it again."""
        name = _tokenizer_key(folder)
        if name is None or max(tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True).values(),
                               default=0) > ROW_LIMIT:
            return
        body = json.dumps(tokenizer.parts()).encode()
        data = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
        with suppress(OSError, cache.CacheError), cache.Cache(FACTS).open(name, lambda tmp: tmp.write_bytes(data),
                                                                           _parts_problem):
            pass


TOKENIZERS = _Tokenizers()


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
            about, sound = {**meta["about"], **meta["counts"]}, True
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
    facts = cache.Cache(FACTS)
    for path in facts.folder.glob("*.json"):
        _remove(facts, path.name)
    return freed
