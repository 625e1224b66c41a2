"""A record becomes text segments, each flagged trained or not.

Three kinds of data: prompt/completion (str.format templates over the record's fields; the completion
is trained, the prompt is not unless --train-on-prompt), chat (a list of turns rendered by the
tokenizer's chat template; assistant turns are trained), and plain text (trained whole).

For chat, the assistant spans are found by rendering prefixes of the conversation: the text that
rendering ``turns[:i+1]`` adds to ``turns[:i]`` + generation prompt is assistant turn ``i``. That needs
a prefix-stable template, which is checked for every record rather than assumed.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, RecordError, TokenizerError

Segments = list[tuple[str, bool]]
CHAT_ROLES = ("system", "user", "assistant", "tool")


def template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


@dataclass(frozen=True, kw_only=True, slots=True)
class FormatSpec:
    kind: str  # "completion", "chat" or "text"
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

    def fields(self) -> list[str]:
        if self.kind == "chat":
            return [self.messages_field]
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
    if spec.kind == "text" and config.pack != "wrap" and train_on_prompt:
        raise ConfigError("--train-on-prompt has no effect on plain text (it is trained whole); drop it")
    missing = [f for f in spec.fields() if f not in columns]
    if missing:
        raise ConfigError(
            f"the data has no field {missing[0]!r}; its columns are {', '.join(columns) or '(none)'}: "
            "set the field options (--prompt-field, --completion-field, --messages-field, --text-field)"
        )
    return FormatSpec(**{**{k: getattr(spec, k) for k in spec.__slots__}, "train_on_prompt": train_on_prompt})


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
_INVISIBLE = dict.fromkeys(
    [0x00AD, 0x034F, 0x061C, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFEFF, 0xFFA0,
     *range(0x180B, 0x1810), *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2060, 0x2070),
     *range(0xFE00, 0xFE10)]
)


def _blank(text: str) -> bool:
    return not text.strip() or not text.translate(_INVISIBLE).strip()


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
                "(e.g. the bundled data/tokenizer) or give --prompt-field/--completion-field"
            )

    def __call__(self, record: dict[str, Any]) -> Segments:
        kind = self.spec.kind
        if kind == "text":
            return [(_text_field(record, self.spec.text_field), True)]
        if kind == "chat":
            return self._chat(record.get(self.spec.messages_field))
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

    def _render(self, turns, *, generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except jinja2.TemplateError as e:
            raise RecordError(f"the chat template refused the conversation ({e})", "chat_template_error") from e

    def _chat(self, turns) -> Segments:
        if turns is None:
            raise RecordError(f"field {self.spec.messages_field!r} is null", "null_field")
        if not isinstance(turns, list) or not turns:
            raise RecordError(f"field {self.spec.messages_field!r} must be a non-empty list of turns", "wrong_type")
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
                raise RecordError(f"turn {i} is not a {{'role': str, 'content': str}} object", "wrong_type")
            if turn["role"] not in CHAT_ROLES:
                raise RecordError(f"turn {i} has unknown role {turn['role']!r} (known: {', '.join(CHAT_ROLES)})", "unknown_role")
        if not any(t["role"] == "assistant" for t in turns):
            raise RecordError("the conversation has no assistant turn, so nothing would be trained", "empty_completion")
        turns = [{"role": t["role"], "content": t["content"]} for t in turns]
        full = self._render(turns)
        segments: Segments = []
        cursor = 0
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = self._render(turns[:i], generation_prompt=True) if i else ""
            after = self._render(turns[: i + 1])
            if not (after.startswith(before) and full.startswith(after) and len(before) >= cursor):
                raise TokenizerError(
                    "the tokenizer's chat template is not prefix-stable (rendering a conversation's first turns "
                    "is not a prefix of rendering it whole), so assistant turns cannot be located; use a template "
                    "that renders turns independently"
                )
            if not turn["content"].strip():
                raise RecordError(f"assistant turn {i} is empty", "empty_completion")
            segments.append((full[cursor : len(before)], self.spec.train_on_prompt))
            segments.append((full[len(before) : len(after)], True))
            cursor = len(after)
        if cursor < len(full):
            segments.append((full[cursor:], self.spec.train_on_prompt))
        return [s for s in segments if s[0]]
