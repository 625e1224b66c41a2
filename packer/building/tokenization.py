"""Batched tokenizing into flat numpy buffers.

An example's tokens are the tokens of its whole formatted text (one call per example, in batches
through the Rust tokenizer), never prompt and completion tokenized apart and glued. Its loss mask marks
every token that holds a character of a trained segment: a token straddling the prompt/completion
boundary is what the model must generate, so it is trained. EOS ends every example.

Cost: one ``encode_batch`` per chunk plus O(segments) Python per example (``char_to_token`` on the
span ends); the ids go into one int32 buffer per chunk.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import RecordError, TokenizerError
from ..fs import expand_user
from . import hub
from .chat import chat_renderer
from .formatting import FormatSpec, Formatter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class Tokenizer:
    """A tokenizer folder loaded as transformers' ``AutoTokenizer`` loads it, so that packer's tokens are
    transformers' tokens: the class its ``tokenizer_config.json`` names builds the Rust tokenizer (transformers
    re-derives some tokenizers' pre-tokenizer and decoder from the config: Llama's ``legacy`` and
    ``add_prefix_space``, Qwen2's byte-level offsets), and packer tokenizes with that class's
    ``backend_tokenizer``. The class is taken from the ``transformers`` namespace, which imports that one
    module: ``AutoTokenizer`` itself imports torch, and `packer build` must not. The chat template(s) and the
    named special tokens a template sees are the class's own (what ``apply_chat_template`` passes).
    """

    def __init__(self, folder: Path, name_or_path: str):
        hf = _tokenizer_class(folder).from_pretrained(str(folder), local_files_only=True)
        self._backend = hf.backend_tokenizer
        self._take(name_or_path, dict(hf.special_tokens_map), hf.chat_template)

    def _take(self, name_or_path: str, special_tokens_map: dict, chat_template, facts: dict | None = None) -> None:
        """The tokenizer's names and ids, from its Rust tokenizer, or from ``facts`` (``parts``' own) without it."""
        self.name_or_path = name_or_path
        self.special_tokens_map = special_tokens_map
        for role in ("bos", "eos", "pad", "unk"):
            token = self.special_tokens_map.get(f"{role}_token")
            setattr(self, f"{role}_token", token)
            token_id = facts["ids"][role] if facts is not None else (
                self._backend.token_to_id(token) if token else None)
            setattr(self, f"{role}_token_id", token_id)
        self.chat_template = chat_template  # a dict when the tokenizer has named ones
        self.chat_template_name = f"{name_or_path}'s chat template"
        self._facts = facts

    @property
    def backend_tokenizer(self):
        """The Rust tokenizer (``tokenizers.Tokenizer``); one rebuilt from kept parts is made at first use: a build
        that re-plans from the token store never tokenizes, and a large vocabulary takes 0.4 s to rebuild."""
        if self._backend is None:
            from tokenizers import Tokenizer as Backend

            self._backend = Backend.from_str(self._serialized)
        return self._backend

    def parts(self) -> dict[str, Any]:
        """What this tokenizer is made of, as JSON: the Rust tokenizer transformers built (serialised whole: its
        fingerprint is this text's sha256), the named special tokens and the chat template(s), and the facts a build
        that does not tokenize reads of it (its special ids, size and control tokens: no Rust tokenizer made)."""
        facts = {"ids": {role: getattr(self, f"{role}_token_id") for role in ("bos", "eos", "pad", "unk")},
                 "size": len(self), "control": self.control_tokens()}
        return {"backend": self.serialized(), "special_tokens_map": self.special_tokens_map,
                "chat_template": self.chat_template, "top_id": self.top_id(), "facts": facts}

    # A large vocabulary's serialisation and id map each take 0.1-0.4 s, and a build asks for each twice or more (its
    # fingerprint and the kept parts; the id range and the kept parts): made once per tokenizer, which packer never
    # changes once loaded.
    def serialized(self) -> str:
        """The Rust tokenizer serialised whole (``tokenizers.Tokenizer.to_str``): its fingerprint is its sha256."""
        if getattr(self, "_serialized", None) is None:
            self._serialized = self.backend_tokenizer.to_str()
        return self._serialized

    def top_id(self) -> int:
        """The largest token id of the vocabulary, added tokens included (0 for an empty one)."""
        if getattr(self, "_top_id", None) is None:
            self._top_id = max(self.backend_tokenizer.get_vocab(with_added_tokens=True).values(), default=0)
        return self._top_id

    @classmethod
    def from_parts(cls, name_or_path: str, parts: dict[str, Any]) -> Tokenizer:
        """The tokenizer ``parts`` describes, rebuilt by the Rust library alone (``tokenizers.Tokenizer.from_str``)
        without importing transformers: the same tokenizer, by its fingerprint."""
        self = cls.__new__(cls)
        self._serialized = parts["backend"]  # what the cold load serialised: the same fingerprint, not made again
        self._top_id = parts.get("top_id")  # likewise (parts kept before it was: found again)
        self._backend = None  # made from _serialized at first use (backend_tokenizer)
        facts = parts.get("facts")
        if facts is None:  # parts kept before they held their facts: the Rust tokenizer is read for them
            self.backend_tokenizer  # noqa: B018
        self._take(name_or_path, dict(parts["special_tokens_map"]), parts["chat_template"], facts)
        return self

    def __len__(self) -> int:
        if self._facts is not None:
            return self._facts["size"]
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def control_tokens(self) -> list[str]:
        """The tokenizer's added tokens that are not whitespace (special or not): what a chat template's
        turn markers are when the tokenizer is the template's own."""
        if self._facts is not None:
            return list(self._facts["control"])
        return [t.content for t in self.backend_tokenizer.get_added_tokens_decoder().values() if t.content.strip()]

    def chat(self):
        """The chat template as a :class:`packer.building.chat.ChatTemplate` (compiled, so a broken one fails here)."""
        return chat_renderer(self.chat_template, self.special_tokens_map, self.chat_template_name,
                             self.control_tokens())


def _tokenizer_class(folder: Path):
    """The class ``AutoTokenizer`` picks for a tokenizer folder: the one ``tokenizer_config.json`` names (a
    byte-level tokenizer.json that names LlamaTokenizer, which would force Metaspace, gets the generic backend,
    as in ``AutoTokenizer``); the generic fast backend where none is named or transformers has no such class."""
    import transformers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    name = _read_json(folder / "tokenizer_config.json").get("tokenizer_class") or "TokenizersBackend"
    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):
        return TokenizersBackend
    if not (isinstance(cls, type) and issubclass(cls, TokenizersBackend)):
        return TokenizersBackend
    if name.removesuffix("Fast") == "LlamaTokenizer" and TokenizersBackend._tokenizer_json_has_byte_level(str(folder)):
        return TokenizersBackend
    return cls


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}  # transformers reports an unreadable config when it loads the folder


class Memo(Protocol):
    """Where the parts of tokenizer folders met before are kept (``packer.building.kept_tokenizers.TOKENIZERS``)."""

    def get(self, folder: Path) -> dict[str, Any] | None: ...

    def key(self, folder: Path) -> str | None: ...

    def put(self, folder: Path, tokenizer: Tokenizer, before: str | None) -> None: ...


def load_tokenizer(name_or_path: str, chat_template: str | None = None, *, memo: Memo | None = None) -> Tokenizer:
    """A fast tokenizer (tokenizer.json) that has an EOS token, or a one-line TokenizerError.

    A folder is read as it is; anything else is taken for a Hub id and looked up in the local Hub
    cache first, then on the Hub. ``chat_template`` is a Jinja file that replaces the tokenizer's own
    template (e.g. a ``{% generation %}``-tagged training twin); the manifest records its hash.
    ``memo``: a folder whose parts it holds is rebuilt from them (no transformers import: most of a small
    build's start), and a folder loaded by transformers leaves its parts there.
    """
    folder = expand_user(name_or_path, "--tokenizer", TokenizerError)
    if not folder.is_dir():
        # owner/name is a Hub id (offline, the Hub lookup says so); a longer or explicit path is a folder
        if name_or_path.startswith((".", "~", os.path.sep)) or name_or_path.count("/") > 1 or folder.exists():
            raise TokenizerError(f"--tokenizer {name_or_path}: no such folder; give a tokenizer folder or a Hub id")
        folder = _from_hub(name_or_path)
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerError(
            f"--tokenizer {name_or_path}: has no tokenizer.json, so it is not a fast (Rust) tokenizer; save it "
            "with a recent transformers (`AutoTokenizer.from_pretrained(...).save_pretrained(dir)`)"
        )
    parts = memo.get(folder) if memo is not None else None
    before = memo.key(folder) if memo is not None and parts is None else None  # the folder as the load begins
    try:
        tokenizer = Tokenizer(folder, name_or_path) if parts is None else Tokenizer.from_parts(name_or_path, parts)
    except Exception as e:  # tokenizers raises bare Exception on a malformed tokenizer.json
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise TokenizerError(f"--tokenizer {name_or_path}: cannot be loaded ({first}); check its files") from e
    if tokenizer.eos_token_id is None:
        raise TokenizerError(
            f"--tokenizer {name_or_path}: has no EOS token, so examples cannot be ended; set eos_token in its "
            "tokenizer_config.json"
        )
    if memo is not None and parts is None:
        memo.put(folder, tokenizer, before)  # before --chat-template: the folder's own tokenizer
    if chat_template is not None:
        try:
            tokenizer.chat_template = expand_user(chat_template, "--chat-template", TokenizerError).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"--chat-template {chat_template}: cannot be read ({getattr(e, 'strerror', None) or e}); "
                                 "give a Jinja template file") from None
        if not tokenizer.chat_template.strip():
            raise TokenizerError(f"--chat-template {chat_template}: the file is empty; give a Jinja chat template")
        tokenizer.chat_template_name = f"--chat-template {chat_template}"
    return tokenizer


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    # With no network, hf_hub_download would retry each file missing from the cache for ~24 s: ask
    # once whether the Hub is there, and if not read only the cache (a miss then fails at once).
    cache_only = constants.HF_HUB_OFFLINE or not hub.reachable()
    folder = None
    for filename in TOKENIZER_FILES:
        try:
            folder = Path(hf_hub_download(repo_id, filename, etag_timeout=5, local_files_only=cache_only)).parent
        except EntryNotFoundError as e:
            if not isinstance(e, LocalEntryNotFoundError):  # its subclass: offline, or not in the cache
                continue
            if filename == "tokenizer.json":
                raise TokenizerError(
                    f"--tokenizer {repo_id}: not a local folder, and not in the Hub cache while offline (or the "
                    f"Hub is unreachable); download it where there is network (`hf download {repo_id} --local-dir DIR`) "
                    "and pass the folder"
                ) from e
        except (HfHubHTTPError, OSError, ValueError) as e:
            if filename == "tokenizer.json":
                raise TokenizerError(
                    f"--tokenizer {repo_id}: not a local folder, and the Hugging Face Hub cannot give it "
                    f"({type(e).__name__}); download it where there is network and pass the folder"
                ) from e
    if folder is None:
        raise TokenizerError(f"--tokenizer {repo_id}: the Hub repository has no tokenizer.json")
    return folder


def tokenizer_info(tokenizer, name_or_path: str) -> dict[str, Any]:
    """What the manifest records: enough to recognise the same tokenizer (fingerprint) later."""
    serialized = tokenizer.serialized() if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer.to_str()
    template = getattr(tokenizer, "chat_template", None)
    return {
        "name_or_path": name_or_path,
        "fingerprint": hashlib.sha256(serialized.encode()).hexdigest(),
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template_sha256": hashlib.sha256((template if isinstance(template, str) else json.dumps(
            template, sort_keys=True)).encode()).hexdigest() if template is not None else None,  # named templates: all of them
    }


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Skipped(Mapping[str, int]):
    """Records skipped under ``--on-error skip``: reason -> count over the whole source, and each part's
    own counts in ``by_part`` (a source that is not a mix is one part)."""

    by_part: tuple[dict[str, int], ...] = ({},)

    @classmethod
    def none(cls, parts: int) -> Skipped:
        return cls(tuple({} for _ in range(parts)))

    def __getitem__(self, reason: str) -> int:
        if not any(reason in part for part in self.by_part):
            raise KeyError(reason)
        return sum(part.get(reason, 0) for part in self.by_part)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set().union(*self.by_part)))

    def __len__(self) -> int:
        return len(set().union(*self.by_part))

    def __add__(self, other: Skipped) -> Skipped:
        return Skipped(tuple({r: a.get(r, 0) + b.get(r, 0) for r in sorted(a.keys() | b.keys())}
                             for a, b in zip(self.by_part, other.by_part, strict=True)))

    def __repr__(self) -> str:
        return repr(dict(self))


@dataclass(slots=True)
class Encoded:
    """One chunk of tokenized examples, flat."""

    ids: np.ndarray  # int32[tokens]
    trained: np.ndarray  # uint8[tokens]: 1 where the token is a target
    lengths: np.ndarray  # int64[examples]
    example_ids: np.ndarray  # int64[examples]: index of the record in the source
    skipped: Skipped = field(default_factory=Skipped)


def each_record(records: dict[str, list], first_index: int, make, skipped: dict[str, int], *,
                skip_errors: bool, where: str):
    """``(i, make(record))`` for each record of a column chunk; a record ``make`` refuses (a RecordError) is
    counted in ``skipped`` by its reason under --on-error skip, else raised naming its place and the fix.
    The one rule every encoder (text, chat, preference pairs) applies to a bad record."""
    names = list(records)
    rows = zip(*(records[name] for name in names)) if names else iter(())
    for i, row in enumerate(rows):
        try:
            value = make(dict(zip(names, row)))
        except RecordError as e:
            if not skip_errors:
                raise RecordError(f"{where} {first_index + i + 1}: {e}; fix the record or pass --on-error skip",
                                  e.reason) from None
            skipped[e.reason] = skipped.get(e.reason, 0) + 1
            continue
        yield i, value


class Encoder:
    """Formats and tokenizes chunks of records. Picklable by construction arguments (for worker pools)."""

    def __init__(self, tokenizer, spec: FormatSpec, *, skip_errors: bool = False):
        self.tokenizer = tokenizer
        self.formatter = Formatter(spec, tokenizer)
        self.eos = tokenizer.eos_token_id
        # Chat templates write their own BOS; other text gets the tokenizer's special tokens.
        self.add_special_tokens = spec.kind != "chat"
        self.skip_errors = skip_errors

    @property
    def backend(self):
        """The Rust tokenizer, made at first use where the tokenizer was rebuilt from kept parts."""
        return self.tokenizer.backend_tokenizer

    def ready(self) -> None:
        """Make now what encoding defers (a build that re-plans from the token store never needs them): the Rust
        tokenizer of one rebuilt from kept parts, and the chat template, compiled (a broken one fails here, before
        any record is read)."""
        self.backend  # noqa: B018
        self.formatter.template  # noqa: B018

    def example(self, record: dict[str, Any]) -> tuple[str, list[tuple[int, int]], bool]:
        """One record as the build tokenizes it: its text, the [start, end) character spans trained, and whether
        the EOS packer appends (where the text's tokens do not end with it) is trained: it takes the flag of the
        text's last segment. Raises the record's ``RecordError``."""
        segments = self.formatter(record)
        _check_size(segments)
        spans, cursor = [], 0
        for piece, trained in segments:
            if trained:
                spans.append((cursor, cursor + len(piece)))
            cursor += len(piece)
        return "".join(piece for piece, _ in segments), spans, segments[-1][1]

    def appends_eos(self, ids) -> bool:
        """EOS ends every example; a text whose tokens already end with it (chat turns ending in EOS) gets none.
        ``ids``: a list or an array."""
        return len(ids) == 0 or ids[-1] != self.eos

    def encode(self, records: dict[str, list], first_index: int, *, where: str = "record") -> Encoded:
        texts: list[str] = []
        span_example: list[int] = []  # per trained span: the kept example it belongs to
        span_chars: list[tuple[int, int]] = []  # per trained span: [start, end) in that example's text
        last_trained: list[bool] = []
        kept: list[int] = []
        skipped: dict[str, int] = {}
        for i, (text, spans, eos_trained) in each_record(records, first_index, self.example, skipped,
                                                          skip_errors=self.skip_errors, where=where):
            span_example += [len(texts)] * len(spans)
            span_chars += spans
            texts.append(text)
            last_trained.append(eos_trained)
            kept.append(first_index + i)
        example_ids = np.asarray(kept, dtype=np.int64)
        if not texts:
            return Encoded(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64), example_ids,
                           Skipped((skipped,)))
        encodings = self.backend.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        # an array per example, then one concatenation: ~40% less CPU than one iterator over every id (each id a
        # Python int either way: `tokenizers` gives ids only as a list)
        arrays = [np.array(enc.ids, dtype=np.int32) for enc in encodings]
        raw = np.concatenate(arrays)
        sizes = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        text_ends = np.cumsum(sizes)  # where each example's own ids end in raw
        add_eos = np.fromiter(map(self.appends_eos, arrays), dtype=bool, count=len(arrays))
        lengths = sizes + add_eos
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        total = int(starts[-1])
        flat = np.insert(raw, text_ends[add_eos], np.int32(self.eos)) if add_eos.any() else raw
        # trained tokens: every token holding a character of a trained span
        trained = np.zeros(total, dtype=np.uint8)
        starts_list = starts.tolist()
        for k, (start, end) in zip(span_example, span_chars):
            enc = encodings[k]
            first = enc.char_to_token(start)
            if first is None:
                first = _token_at(enc, start, forward=True)
            last = enc.char_to_token(end - 1) if end > 0 else None
            if last is None:
                last = _token_at(enc, end - 1, forward=False)
            if last is not None:
                last = _last_token_of_char(enc, last, end)
            if first is not None and last is not None and first <= last:
                base = starts_list[k]
                trained[base + first : base + last + 1] = 1
        ends = starts[1:][add_eos] - 1
        trained[ends] = np.asarray(last_trained, dtype=np.uint8)[add_eos]
        return Encoded(flat, trained, lengths, example_ids, Skipped((skipped,)))

    def offsets_and_spans(self, records: list[dict]) -> list[tuple[np.ndarray, list[tuple[int, int]], bool, bool]]:
        """Per record: its tokens' character offsets (int64 ``[tokens, 2]``), the trained character
        spans of its text, the last segment's flag, and whether ``encode`` appends EOS. What a loss mask
        is recomputed from apart from ``encode``'s span mapping (``packer.checking.verify_source``)."""
        examples = [self.example(record) for record in records]
        encodings = self.backend.encode_batch([text for text, _, _ in examples], add_special_tokens=self.add_special_tokens)
        return [(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans, flag, self.appends_eos(enc.ids))
                for enc, (_, spans, flag) in zip(encodings, examples, strict=True)]


# The Rust tokenizer keeps alignments and offsets for every byte and token of a text: about 140 bytes
# of memory a character (a 10 MB record took 1.4 GB, a 50 MB one 6.9 GB), in every worker at once.
MAX_RECORD_CHARS = 1 << 22  # 4,194,304 characters, about a million tokens and 600 MB to tokenize


def _check_size(segments: list[tuple[str, bool]]) -> None:
    size = sum(len(text) for text, _ in segments)
    if size > MAX_RECORD_CHARS:
        raise RecordError(
            f"holds {size:,} characters, over the {MAX_RECORD_CHARS:,} a record may have (tokenizing takes about "
            "140 bytes of memory a character); split it into several records", "too_long")


def _token_at(enc, char: int, *, forward: bool) -> int | None:
    """The token holding character ``char``; whitespace a tokenizer dropped maps to its neighbour."""
    n = len(enc)
    step = 1 if forward else -1
    for _ in range(64):
        token = enc.char_to_token(char)
        if token is not None:
            return token
        char += step
        if char < 0:
            return None
    return None if n == 0 else (n - 1 if not forward else None)


def _last_token_of_char(enc, token: int, end: int) -> int:
    """The last token holding a character before ``end``, from ``token``, one that does.

    ``char_to_token`` gives a character's *first* token; a character the tokenizer spells in several
    tokens (byte fallback: an emoji is four byte tokens in Llama 2) is trained only if all of them are.
    Special tokens have no characters (``token_to_chars`` is None) and end the walk."""
    n = len(enc)
    while token + 1 < n:
        chars = enc.token_to_chars(token + 1)
        if chars is None or chars[0] >= end or chars[1] <= chars[0]:
            break
        token += 1
    return token

