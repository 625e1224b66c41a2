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
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import RecordError, TokenizerError
from .formatting import Formatter, FormatSpec


def load_tokenizer(name_or_path: str):
    """A fast Hugging Face tokenizer that has an EOS token, or a one-line TokenizerError."""
    from transformers import AutoTokenizer

    if os.path.sep in name_or_path or name_or_path.startswith("."):
        if not os.path.exists(name_or_path):
            raise TokenizerError(f"--tokenizer {name_or_path}: no such folder; give a tokenizer folder or a Hub id")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise TokenizerError(
            f"--tokenizer {name_or_path}: cannot be loaded ({first}); give a folder with tokenizer.json "
            "or a Hub id that is in the local cache"
        ) from e
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizerError(f"--tokenizer {name_or_path}: not a fast (Rust) tokenizer; packer needs tokenizer.json")
    if tokenizer.eos_token_id is None:
        raise TokenizerError(
            f"--tokenizer {name_or_path}: has no EOS token, so examples cannot be ended; set eos_token in its "
            "tokenizer_config.json"
        )
    return tokenizer


def tokenizer_info(tokenizer, name_or_path: str) -> dict[str, Any]:
    """What the manifest records: enough to recognise the same tokenizer (fingerprint) later."""
    serialized = tokenizer.backend_tokenizer.to_str()
    template = getattr(tokenizer, "chat_template", None)
    return {
        "name_or_path": name_or_path,
        "fingerprint": hashlib.sha256(serialized.encode()).hexdigest(),
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None,
    }


@dataclass(slots=True)
class Encoded:
    """One chunk of tokenized examples, flat."""

    ids: np.ndarray  # int32[tokens]
    trained: np.ndarray  # uint8[tokens]: 1 where the token is a target
    lengths: np.ndarray  # int64[examples]
    example_ids: np.ndarray  # int64[examples]: index of the record in the source
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records skipped (--on-error skip)


class Encoder:
    """Formats and tokenizes chunks of records. Picklable by construction arguments (for worker pools)."""

    def __init__(self, tokenizer, spec: FormatSpec, *, skip_errors: bool = False):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.formatter = Formatter(spec, tokenizer)
        self.eos = tokenizer.eos_token_id
        # Chat templates write their own BOS; other text gets the tokenizer's special tokens.
        self.add_special_tokens = spec.kind != "chat"
        self.skip_errors = skip_errors

    def encode(self, records: dict[str, list], first_index: int, *, where: str = "record") -> Encoded:
        names = list(records)
        count = len(records[names[0]]) if names else 0
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        last_trained: list[bool] = []
        kept: list[int] = []
        skipped: dict[str, int] = {}
        for i in range(count):
            record = {name: records[name][i] for name in names}
            try:
                segments = self.formatter(record)
            except RecordError as e:
                if not self.skip_errors:
                    raise RecordError(f"{where} {first_index + i + 1}: {e}; fix the record or pass --on-error skip", e.reason) from None
                skipped[e.reason] = skipped.get(e.reason, 0) + 1
                continue
            text, cursor, trained_spans = [], 0, []
            for piece, trained in segments:
                if trained:
                    trained_spans.append((cursor, cursor + len(piece)))
                text.append(piece)
                cursor += len(piece)
            texts.append("".join(text))
            spans.append(trained_spans)
            last_trained.append(segments[-1][1])
            kept.append(first_index + i)
        encodings = self.backend.encode_batch(texts, add_special_tokens=self.add_special_tokens) if texts else []
        lengths = np.empty(len(texts), dtype=np.int64)
        masks = []
        id_lists = []
        for k, enc in enumerate(encodings):
            ids = enc.ids
            n = len(ids)
            mask = np.zeros(n + 1, dtype=np.uint8)
            for start, end in spans[k]:
                first, last = _token_at(enc, start, forward=True), _token_at(enc, end - 1, forward=False)
                if first is not None and last is not None and first <= last:
                    mask[first : last + 1] = 1
            if n and ids[-1] == self.eos:
                mask = mask[:n]  # the template already ended it (chat turns end in EOS)
            else:
                ids = ids + [self.eos]
                mask[n] = last_trained[k]
            id_lists.append(ids)
            masks.append(mask)
            lengths[k] = len(ids)
        total = int(lengths.sum())
        flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=total)
        trained = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
        return Encoded(flat, trained, lengths, np.asarray(kept, dtype=np.int64), skipped)


def _token_at(enc, char: int, *, forward: bool) -> int | None:
    """The token holding character ``char``; whitespace a tokenizer dropped maps to its neighbour."""
    n = len(enc.ids)
    step = 1 if forward else -1
    for _ in range(64):
        token = enc.char_to_token(char)
        if token is not None:
            return token
        char += step
        if char < 0:
            return None
    return None if n == 0 else (n - 1 if not forward else None)
