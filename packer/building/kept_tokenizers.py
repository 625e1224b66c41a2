"""Tokenizers and processors met before, kept in the cache so that a later build does not load them by transformers.

Loading a tokenizer by its transformers class imports transformers: most of a small build's start, and most of a
re-plan's. So a build that loads a tokenizer folder keeps its parts (``Tokenizer.parts``: the Rust tokenizer
transformers built, serialised whole, its special tokens and chat templates) in ``<cache root>/tokenizers/<key>``,
keyed by the content of every file of the folder (transformers reads several) and the versions of packer,
transformers and tokenizers; a later build of a folder whose files hash to that key rebuilds the same tokenizer
from them with the Rust library alone, at the first use of the Rust tokenizer (a build that re-plans from the token
store never tokenizes: it reads only the facts kept with the parts, its special ids, size and added tokens). The
parts' own sha256 is kept beside them and checked on every use.

A processor folder's facts (:mod:`packer.building.processor_facts`: what an image build reads of its processor
even when it tokenizes nothing) are kept alike (:class:`Kept`) in ``<cache root>/processors/<key>``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import suppress
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import __version__, cache
from ..contract.config import ROW_LIMIT
from ..fs import file_sha256

FACTS = "tokenizers"  # their kind in the cache root (each a JSON file, evicted as any entry)
PROCESSOR_FACTS = "processors"  # the processors' kind
_HASHED_UP_TO = 64 << 20  # larger files of a tokenizer folder (a model's weights beside it) count by size and mtime


def installed_version(distribution: str) -> str | None:
    """The installed version, read from its metadata (importing the library is what this spares); None: absent."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _read_parts(path: Path) -> dict[str, Any]:
    """The parts kept in ``path``: a first line holding the sha256 of the JSON after it, checked."""
    data = path.read_bytes()
    digest, _, body = data.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise ValueError("its sha256 differs")
    return json.loads(body)


# bump when what a kept value holds or means changes (the facts a tokenizer's parts hold, a processor record's
# fingerprint): values of another version are never found
FACTS_VERSION = 2


class Kept:
    """JSON values kept in the cache's ``kind``, one a folder: keyed by the folder's files as they are now and
    the versions of packer and of ``libraries``; a value's sha256 is checked on every use, and ``sound`` (if
    given) says whether a value is of the shape its reader takes: one that is not is made again."""

    def __init__(self, kind: str, libraries: tuple[str, ...], sound: Callable[[Any], bool] | None = None):
        self.kind, self.libraries, self.sound = kind, libraries, sound

    def _problem(self, path: Path, full: bool) -> str | None:
        try:
            value = _read_parts(path)
        except (OSError, ValueError, KeyError, TypeError):
            return "unreadable or damaged"
        return None if self.sound is None or self.sound(value) else "not of its shape"

    def key(self, base: Path) -> str | None:
        """The key of folder ``base`` as its files are now (None when it cannot be read)."""
        try:
            digest = hashlib.sha256(_canonical([__version__, FACTS_VERSION, *map(installed_version, self.libraries)]).encode())
            for path in sorted(base.rglob("*")):
                if path.is_file():
                    st = path.stat()
                    what = file_sha256(path) if st.st_size <= _HASHED_UP_TO else f"{st.st_size}:{st.st_mtime_ns}"
                    digest.update(_canonical([path.relative_to(base).as_posix(), what]).encode())
        except OSError:
            return None
        return digest.hexdigest()[:32] + ".json"

    def get(self, folder: Path) -> Any:
        """The value kept for ``folder`` as it is now (None: none, or one found damaged)."""
        name = self.key(folder)
        if name is None:
            return None
        try:
            entry = cache.Cache(self.kind).find(name, self._problem)
            if entry is None:
                return None
            with entry:
                return _read_parts(entry.path)
        except (OSError, ValueError, KeyError, TypeError, cache.CacheError):
            return None

    def keep(self, folder: Path, value: Any, before: str | None) -> None:
        """Keep ``value``, read from ``folder`` whose key was ``before`` when the reading began: under that key, and
        only if the folder's files are still what they were (changed meanwhile: not kept, the next build reads them
        again). A failure only means the next build loads it again."""
        name = self.key(folder)
        if name is None or name != before:
            return
        body = json.dumps(value).encode()
        data = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
        with suppress(OSError, cache.CacheError), cache.Cache(self.kind).open(name, lambda tmp: tmp.write_bytes(data),
                                                                               self._problem):
            pass


class _Tokenizers(Kept):
    """The tokenization.Memo of the cache: each tokenizer folder's parts."""

    def put(self, folder: Path, tokenizer, before: str | None) -> None:
        """Keep ``tokenizer``'s parts, loaded from ``folder`` whose key was ``before`` (not one with an id beyond a
        row's int32: serialising it walks every id below it, which the build refuses first)."""
        if tokenizer.top_id() <= ROW_LIMIT:
            self.keep(folder, tokenizer.parts(), before)


TOKENIZERS = _Tokenizers(FACTS, ("transformers", "tokenizers"))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


def clear() -> None:
    """Remove every tokenizer and processor kept, each once no build has it open."""
    for kind in (FACTS, PROCESSOR_FACTS):
        facts = cache.Cache(kind)
        for path in facts.folder.glob("*.json"):
            with suppress(OSError):
                facts._evict(facts.path(path.name))
