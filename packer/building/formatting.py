"""A record becomes text segments, each flagged trained or not.

Three kinds of data: prompt/completion (str.format templates over the record's fields; the completion
is trained, the prompt is not unless --train-on all), chat (a list of turns rendered whole by the chat
template through transformers' renderer; what is trained is decided in packer/building/chat.py), and plain text
(trained whole).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..errors import ConfigError, RecordError, TokenizerError
from .chat import normalize_messages, normalize_tools

# The key of a record a reader could not make as one (over the size bound, text that is not UTF-8):
# it stays in the stream as a placeholder, {UNREADABLE: (message, reason)}, so later records keep their
# indices, and is refused here as a RecordError, which ``--on-error skip`` skips and counts.
UNREADABLE = "\x00packer:unreadable"

Segments = list[tuple[str, bool]]


def template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


@dataclass(frozen=True, kw_only=True, slots=True)
class FormatSpec:
    kind: str  # "completion", "chat", "text" or "preference" (packer/building/preference.py)
    prompt_template: str = ""
    completion_template: str = ""
    optional: str | None = None
    prompt_if_empty: str | None = None
    messages_field: str | None = None
    text_field: str | None = None
    # prompt/completion named by column (options, recognised pairs): used as they are, so a column
    # named ``q.text`` or ``q!r`` is that column, never a str.format attribute or conversion
    prompt_field: str | None = None
    completion_field: str | None = None
    train_on_prompt: bool = False
    train_on: str = "assistant"  # chat: "assistant", "last" or "all"
    tools_field: str | None = None  # chat: the record's tool definitions, passed to the template

    def fields(self) -> list[str]:
        if self.kind == "preference":
            return [*([self.prompt_field] if self.prompt_field else []), "chosen", "rejected"]
        if self.kind == "chat":
            return [self.messages_field, *([self.tools_field] if self.tools_field else [])]
        if self.kind == "text":
            return [self.text_field]
        if self.prompt_field is not None:
            return list(dict.fromkeys((self.prompt_field, self.completion_field)))
        return list(dict.fromkeys(template_fields(self.prompt_template) + template_fields(self.completion_template)))


# (prompt field, completion field) pairs recognised when neither a recipe nor options say
_KNOWN_PAIRS = (("prompt", "completion"), ("inputs", "targets"), ("question", "answer"), ("instruction", "output"))


def make_spec(*, recipe, config, columns: list[str]) -> FormatSpec:
    """Decide how records are formatted: options first, then the recipe, then the columns."""
    train_on_prompt = config.train_on_prompt
    if config.messages_field:
        spec = FormatSpec(kind="chat", messages_field=config.messages_field)
    elif config.text_field:
        spec = FormatSpec(kind="text", text_field=config.text_field)
    elif config.prompt_field or config.completion_field:
        if not (config.prompt_field and config.completion_field):
            raise ConfigError("give both --prompt-field and --completion-field (or neither)")
        spec = FormatSpec(kind="completion", prompt_field=config.prompt_field, completion_field=config.completion_field)
    elif recipe is not None and recipe.messages_field:
        spec = FormatSpec(kind="chat", messages_field=recipe.messages_field)
    elif recipe is not None and recipe.text_field:
        spec = FormatSpec(kind="text", text_field=recipe.text_field)
    elif recipe is not None:
        spec = FormatSpec(
            kind="completion",
            prompt_template=recipe.prompt_template,
            completion_template=recipe.completion_template,
            optional=recipe.optional,
            prompt_if_empty=recipe.prompt_if_empty,
        )
    elif "chosen" in columns and "rejected" in columns:  # TRL's preference formats, explicit or implicit prompt
        spec = FormatSpec(kind="preference", prompt_field="prompt" if "prompt" in columns else None)
    elif "messages" in columns:
        spec = FormatSpec(kind="chat", messages_field="messages")
    elif "text" in columns and config.pack == "wrap":
        spec = FormatSpec(kind="text", text_field="text")
    else:
        pair = next((p for p in _KNOWN_PAIRS if p[0] in columns and p[1] in columns), None)
        if pair is None:
            if "text" in columns:
                spec = FormatSpec(kind="text", text_field="text")
            else:
                raise ConfigError(
                    f"cannot tell which fields to train on; the columns are {', '.join(columns) or '(none)'}: "
                    "set --prompt-field and --completion-field, --messages-field, or --text-field"
                )
        else:
            spec = FormatSpec(kind="completion", prompt_field=pair[0], completion_field=pair[1])
    if config.pack == "wrap" and spec.kind != "text":  # the one place: options, recipe or columns alike
        kind = {"chat": "chat", "preference": "preference pairs"}.get(spec.kind, "prompt/completion")
        found = ", ".join(f for f in (spec.messages_field, spec.prompt_field, spec.completion_field) if f)
        found = "chosen, rejected" + (f", {found}" if found else "") if spec.kind == "preference" else found
        raise ConfigError(
            f"--pack wrap is for plain text (--text-field); this data is {kind} "
            f"({'fields ' + found if found else 'recipe ' + recipe.name}), "
            f"which trains on whole {'pairs' if spec.kind == 'preference' else 'examples'} that wrap would cut "
            "mid-answer: use --pack batch or bfd"
        )
    if spec.kind == "preference":
        if train_on_prompt or config.train_on != "assistant":
            raise ConfigError("--train-on applies to SFT data; preference pairs train on their completions only")
        return spec
    if spec.kind == "text" and config.pack != "wrap" and train_on_prompt:
        raise ConfigError("--train-on all has no effect on plain text (it is trained whole); drop it")
    train_on = config.train_on
    if spec.kind != "chat" and train_on == "last":
        raise ConfigError("--train-on last applies to chat data (the final assistant turn); this data is not chat")
    tools_field = None
    if spec.kind == "chat":
        tools_field = config.tools_field or ("tools" if "tools" in columns else None)
        spec = FormatSpec(kind="chat", messages_field=spec.messages_field, tools_field=tools_field)
    elif config.tools_field:
        raise ConfigError("--tools-field applies to chat data (--messages-field); this data is not chat")
    missing = [f for f in spec.fields() if f not in columns]
    if missing:
        raise ConfigError(
            f"the data has no field {missing[0]!r}; its columns are {', '.join(columns) or '(none)'}: "
            "set the field options (--prompt-field, --completion-field, --messages-field, --text-field)"
        )
    return FormatSpec(**{**{k: getattr(spec, k) for k in spec.__slots__}, "train_on_prompt": train_on_prompt,
                         "train_on": train_on})


def _text_field(record: dict[str, Any], name: str, *, allow_empty: bool = False) -> str:
    value = record.get(name)
    if value is None:
        raise RecordError(f"field {name!r} is null", "null_field")
    if not isinstance(value, str):
        raise RecordError(f"field {name!r} is {type(value).__name__}, not text", "wrong_type")
    if not allow_empty and _blank(value):
        raise RecordError(f"field {name!r} is empty", "empty_text")
    return value


# Default-ignorable characters (zero-width spaces and joiners, BOM, soft hyphen, variation selectors,
# bidi marks, fillers): a text of only these and whitespace shows nothing and is empty.
_INVISIBLE = frozenset(map(chr, [
    0x00AD, 0x034F, 0x061C, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFEFF, 0xFFA0,
    *range(0x180B, 0x1810), *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2060, 0x2070),
    *range(0xFE00, 0xFE10),
]))


def _blank(text: str) -> bool:
    # stops at the first visible character, most often the first: a whole-text translate cost ~5 µs a
    # 1,500-character field (0.5 µs now)
    return all(c.isspace() or c in _INVISIBLE for c in text)


class Formatter:
    """Turns records into segments; holds the tokenizer only for chat templates."""

    def __init__(self, spec: FormatSpec, tokenizer=None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.fields = spec.fields()  # parsed once, not per record
        if spec.kind == "chat" and not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "the tokenizer")
            raise TokenizerError(
                f"{name} has no chat template, so chat data cannot be formatted; use a tokenizer with one "
                "(e.g. the bundled tokenizer), pass --chat-template FILE, or give --prompt-field/--completion-field"
            )

    @cached_property
    def template(self):
        """The chat template, compiled at first use (a broken one fails then): at the start of tokenizing
        (``Encoder.ready``), before any record is read, and never in a build that re-plans from the token store,
        which reads no record (compiling imports transformers: half a second)."""
        return self.tokenizer.chat() if self.spec.kind == "chat" else None

    def __call__(self, record: dict[str, Any]) -> Segments:
        if record.get(UNREADABLE) is not None:  # a record its reader could not make (readers.unreadable)
            raise RecordError(*record[UNREADABLE])
        kind = self.spec.kind
        if kind == "text":
            return [(_text_field(record, self.spec.text_field), True)]
        if kind == "chat":
            return self._chat(record)
        return self._completion(record)

    def _completion(self, record: dict[str, Any]) -> Segments:
        spec = self.spec
        values = {}
        for name in self.fields:
            values[name] = _text_field(record, name, allow_empty=(name == spec.optional))
        if spec.prompt_field is not None:
            prompt, completion = values[spec.prompt_field] + "\n\n", values[spec.completion_field]
        else:
            prompt_template = spec.prompt_template
            if spec.optional and not values[spec.optional].strip():
                prompt_template = spec.prompt_if_empty or prompt_template
            prompt = prompt_template.format_map(values)
            completion = spec.completion_template.format_map(values)
        if _blank(completion):
            raise RecordError("the completion is empty", "empty_completion")
        return [(prompt, spec.train_on_prompt), (completion, True)]

    def _chat(self, record: dict[str, Any]) -> Segments:
        spec = self.spec
        messages = normalize_messages(record.get(spec.messages_field), spec.messages_field)
        tools = normalize_tools(record.get(spec.tools_field), spec.tools_field) if spec.tools_field else None
        rendered = self.template(messages, tools, spec.train_on)
        segments: Segments = []
        cursor = 0
        for start, end in rendered.spans:
            segments += [(rendered.text[cursor:start], False), (rendered.text[start:end], True)]
            cursor = end
        segments.append((rendered.text[cursor:], False))
        return [s for s in segments if s[0]]
