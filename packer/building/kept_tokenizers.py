"""Tokenizers met before, kept in the cache so that a later build does not load them by transformers.

Loading a tokenizer by its transformers class imports transformers: most of a small build's start, and most of a
re-plan's. So a build that loads a tokenizer folder keeps its parts (``Tokenizer.parts``: the Rust tokenizer
transformers built, serialised whole, its special tokens and chat templates) in ``<cache root>/tokenizers/<key>``,
keyed by the content of every file of the folder (transformers reads several) and the versions of packer,
transformers and tokenizers; a later build of a folder whose files hash to that key rebuilds the same tokenizer
from them with the Rust library alone, at the first use of the Rust tokenizer (a build that re-plans from the token
store never tokenizes: it reads only the facts kept with the parts, its special ids, size and added tokens). The
parts' own sha256 is kept beside them and checked on every use.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import __version__, cache
from ..contract.config import ROW_LIMIT
from ..fs import file_sha256

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
            entry = cache.Cache(FACTS).find(name, _parts_problem)
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
        if name is None or tokenizer.top_id() > ROW_LIMIT:
            return
        body = json.dumps(tokenizer.parts()).encode()
        data = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
        with suppress(OSError, cache.CacheError), cache.Cache(FACTS).open(name, lambda tmp: tmp.write_bytes(data),
                                                                           _parts_problem):
            pass


TOKENIZERS = _Tokenizers()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


def clear() -> None:
    """Remove every tokenizer kept, each once no build has it open."""
    facts = cache.Cache(FACTS)
    for path in facts.folder.glob("*.json"):
        with suppress(OSError):
            facts._evict(facts.path(path.name))
