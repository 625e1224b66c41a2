"""Preference records (TRL's formats) tokenized as TRL's DPO preprocessing tokenizes them.

Detected from the columns: ``chosen`` and ``rejected`` (and ``prompt`` when the prompt is explicit). Each
record is *standard* (strings) or *conversational* (message lists, rendered by the chat template through
:mod:`packer.building.chat`, i.e. transformers' own renderer). A record becomes two examples of the
token spill, ``prompt + chosen`` then ``prompt + rejected``, exactly TRL 1.16's ``DPOTrainer``
``tokenize_fn``:

- implicit prompt: the longest common prefix of ``chosen`` and ``rejected`` (characters, or whole
  messages), less a space that ends it (``trl.extract_prompt``'s rule; TRL's module imports torch, which a
  build must not, so the rule is restated here and tested against TRL's function);
- standard: EOS text appended to a completion that does not end with it; ``prompt``,
  ``prompt + chosen`` and ``prompt + rejected`` tokenized with the special tokens (BOS);
- conversational: the prompt rendered with the generation prompt, ``prompt + chosen`` and
  ``prompt + rejected`` rendered whole, each tokenized without special tokens (``apply_chat_template``);
- the completion starts where the tokenized prompt and each ``prompt + completion`` first differ (the
  smaller of the two), so both sequences share the prompt's tokens; its tokens are the trained ones.

Cost: three tokenizer calls (and for chat three renders) per record.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from ..errors import RecordError
from .chat import normalize_messages, normalize_tools
from .tokenization import Encoded, Skipped, each_record

FIELDS = ("prompt", "chosen", "rejected")


def is_preference(columns: list[str]) -> bool:
    return "chosen" in columns and "rejected" in columns


def extract_prompt(chosen, rejected) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) from a record whose prompt is implicit: TRL's ``extract_prompt``."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space before the completion stays with it
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PairEncoder:
    """Formats and tokenizes chunks of preference records: two examples a record (``Encoder``'s interface)."""

    def __init__(self, tokenizer, spec, *, skip_errors: bool = False):
        self.tokenizer = tokenizer
        self.spec = spec
        self.eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token
        self.skip_errors = skip_errors

    @cached_property
    def template(self):
        """The chat template, compiled at first use (``ready``; never in a re-plan, which reads no record)."""
        return self.tokenizer.chat() if getattr(self.tokenizer, "chat_template", None) else None

    def ready(self) -> None:
        """As ``Encoder.ready``: the Rust tokenizer and the chat template made now, before any record is read."""
        self.backend  # noqa: B018
        self.template  # noqa: B018

    @property
    def backend(self):
        """The Rust tokenizer, made at first use where the tokenizer was rebuilt from kept parts."""
        return self.tokenizer.backend_tokenizer

    def _ids(self, text: str, special: bool) -> list[int]:
        return self.backend.encode(text, add_special_tokens=special).ids

    def pair(self, record: dict[str, Any]) -> tuple[list[int], list[int], int]:
        """(prompt + chosen ids, prompt + rejected ids, prompt tokens) of one record, as TRL tokenizes it."""
        chosen, rejected = record.get("chosen"), record.get("rejected")
        prompt = record.get("prompt") if self.spec.prompt_field else None
        conversational = isinstance(chosen, list)
        if conversational:
            # a prompt alone has no assistant turn, which a conversation must: checked together with each completion
            head = [] if prompt is None else prompt if isinstance(prompt, list) else None
            if head is None:
                raise RecordError(f"field 'prompt' is {type(prompt).__name__}, not a list of turns", "wrong_type")
            chosen = normalize_messages(head + chosen, "prompt + chosen")
            rejected = normalize_messages(head + rejected if isinstance(rejected, list) else rejected, "prompt + rejected")
            if prompt is not None:
                prompt, chosen, rejected = chosen[: len(head)], chosen[len(head):], rejected[len(head):]
        else:
            for name, value in (("chosen", chosen), ("rejected", rejected), ("prompt", prompt)):
                if value is not None and not isinstance(value, str) or value is None and name != "prompt":
                    raise RecordError(f"field {name!r} is {type(value).__name__}, not text or messages", "wrong_type")
        if prompt is None:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if conversational:
            if self.template is None:
                raise RecordError("conversational preference data needs a chat template; pass --chat-template",
                                  "no_chat_template")
            tools = normalize_tools(record.get("tools"), "tools") if "tools" in record else None
            template = self.template.pick(tools) if hasattr(self.template, "pick") else self.template
            p = self._ids(template.render(prompt, tools, generation_prompt=True)[0], False)
            pc = self._ids(template.render(prompt + chosen, tools)[0], False)
            pr = self._ids(template.render(prompt + rejected, tools)[0], False)
        else:
            chosen = chosen if chosen.endswith(self.eos_text) else chosen + self.eos_text
            rejected = rejected if rejected.endswith(self.eos_text) else rejected + self.eos_text
            p, pc, pr = self._ids(prompt, True), self._ids(prompt + chosen, True), self._ids(prompt + rejected, True)
        plen = min(_common(p, pc), _common(p, pr))
        if len(pc) == plen or len(pr) == plen:
            raise RecordError("a completion is empty (chosen or rejected adds no token to the prompt)",
                              "empty_completion")
        return pc, pr, plen

    def encode(self, records: dict[str, list], first_index: int, *, where: str = "record") -> Encoded:
        ids: list[list[int]] = []
        prompts: list[int] = []
        kept: list[int] = []
        skipped: dict[str, int] = {}
        for i, (pc, pr, plen) in each_record(records, first_index, self.pair, skipped,
                                             skip_errors=self.skip_errors, where=where):
            ids += [pc, pr]
            prompts += [plen, plen]
            kept += [first_index + i] * 2
        lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
        flat = np.fromiter((t for seq in ids for t in seq), np.int32, count=int(lengths.sum()))
        trained = np.ones(flat.size, np.uint8)
        starts = np.cumsum(lengths) - lengths
        for s, p in zip(starts.tolist(), prompts, strict=True):
            trained[s : s + p] = 0
        return Encoded(flat, trained, lengths, np.asarray(kept, np.int64), Skipped((skipped,)))
