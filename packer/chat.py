"""Chat records: transformers' own template rendering, and the character spans to train on.

A conversation is rendered once, whole, by ``transformers.utils.chat_template_utils.render_jinja_template``
(the function ``apply_chat_template`` calls; it imports without torch), so its text is exactly what the
model is trained and served on, whatever the template does to earlier turns.

The spans to train on:

- a template with ``{% generation %}`` tags: the tagged character spans transformers returns;
- any other template: each assistant turn's output, located in that one render. A second render with
  each assistant message's content replaced by a unique marker tells, per turn, which assistant header
  comes before the output (the template's generation prompt, or the longest head of it that the
  template writes there) and which end-of-turn token closes it (the first one after the content). The
  output is the text from that header's end through that end-of-turn token, found in the real render
  (from the header before the turn's reasoning where the template renders it as a message of its own);
  the span must hold the assistant's visible text and tool-call names, else the record is refused.
  End-of-turn tokens are learnt once per template from probe renders (see ``_probe``).

A template is code: whatever it raises is the record's error, and a render runs under a time limit.
Named templates (``default``, ``tool_use``, ...) are picked per record as transformers picks them.

Cost: one render per record for a tagged template, two for an untagged one, plus string searches.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from .errors import RecordError, TokenizerError
from .timelimit import TimeLimitExceeded, time_limit

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
TRAIN_ON = ("assistant", "last", "all")
_MEDIA = ("image", "image_url", "input_image", "audio", "input_audio", "video", "video_url", "file")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# What an end-of-turn token looks like across the templates people use: <|im_end|>, <|eot_id|>,
# <｜end▁of▁sentence｜>, <end_of_turn>, </s>, <|END_OF_TURN_TOKEN|>, ...
_SPECIAL_LOOKING = re.compile(r"<\|[^<>|\s]{1,48}\|>|<｜[^<>]{1,48}｜>|<[A-Za-z_]{2,48}>|</s>")
_PROBE = "PACKERPROBEX"
# Real templates render a conversation in milliseconds; one that runs for seconds loops (a template is code)
RENDER_TIME_LIMIT_S = 5.0


def _marker(i: int) -> str:
    return f"PACKERMARK{i:05d}X"


def drop_nones(value: Any) -> Any:
    """Remove ``None`` values at every depth: ``datasets`` fills keys a record lacks with None when it
    unifies a column's schema, and a template must see the record as it was written."""
    if isinstance(value, dict):
        return {k: drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nones(v) for v in value if v is not None]
    return value


def normalize_messages(messages: Any, field: str) -> list[dict[str, Any]]:
    """Check a record's messages and make them what the template expects: Nones dropped (see
    ``drop_nones``), content given as text parts joined into one string. Every other key is kept."""
    if messages is None:
        raise RecordError(f"field {field!r} is null", "null_field")
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"field {field!r} must be a non-empty list of turns", "wrong_type")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RecordError(f"turn {i} is not a {{'role': str, 'content': ...}} object", "wrong_type")
        message = drop_nones(message)
        if message["role"] not in CHAT_ROLES:
            raise RecordError(f"turn {i} has unknown role {message['role']!r} (known: {', '.join(CHAT_ROLES)})",
                              "unknown_role")
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = _join_text_parts(content, i)
        elif content is not None and not isinstance(content, str):
            raise RecordError(f"turn {i}'s content is {type(content).__name__}, not text or a list of text parts",
                              "wrong_type")
        out.append(message)
    if not any(m["role"] == "assistant" for m in out):
        raise RecordError("the conversation has no assistant turn, so nothing would be trained", "empty_completion")
    return out


def _join_text_parts(parts: list, turn: int) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA or (isinstance(part, dict) and any(k in part for k in _MEDIA)):
            raise RecordError(f"turn {turn} has a {kind or 'media'} part: packer packs text only; drop the record's "
                              "media parts or pass --on-error skip", "not_text")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RecordError(f"turn {turn}'s content parts must be {{'type': 'text', 'text': str}}", "wrong_type")
        texts.append(part["text"])
    return "".join(texts)


def normalize_tools(tools: Any, field: str) -> list[dict] | None:
    """A record's tool definitions: a list of JSON schemas, or a JSON string of one."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise RecordError(f"field {field!r} is not valid JSON ({e.msg})", "wrong_type") from None
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError(f"field {field!r} must be a list of tool definitions (JSON schema objects)", "wrong_type")
    return drop_nones(tools)  # [] stays []: transformers picks a "tool_use" template for any tools but None


def read_chat_templates(folder: Path, config: dict) -> str | dict[str, str] | None:
    """A tokenizer folder's chat template(s), as transformers' ``from_pretrained`` loads them: the config's
    ``chat_template`` (a list of named ones becomes a dict by name), unless the folder has template files
    (``chat_template.jinja`` is "default", ``additional_chat_templates/NAME.jinja`` is NAME), which then
    replace it; a lone "default" is a plain template."""
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        template = {t["name"]: t["template"] for t in template}
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        files[extra.name.removesuffix(".jinja")] = extra.read_text(encoding="utf-8")
    if files:
        template = files["default"] if list(files) == ["default"] else files
    return template


def chat_renderer(template: str | dict[str, str], special_tokens: dict[str, str], name: str):
    """A :class:`ChatTemplate`, or for named templates a :class:`NamedChatTemplates` that picks one per record."""
    if isinstance(template, dict):
        return NamedChatTemplates(template, special_tokens, name)
    return ChatTemplate(template, special_tokens, name)


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # [start, end) character spans to train on, in order


class ChatTemplate:
    """One chat template with the tokenizer's special tokens, rendered by transformers' code."""

    def __init__(self, source: str, special_tokens: dict[str, str], name: str):
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.source = source
        self.special_tokens = special_tokens  # as apply_chat_template passes them: a null one is absent
        self.name = name
        self.tagged = bool(_GENERATION_TAG.search(source))
        try:  # a broken template is reported once, naming it, before any record is read
            _compile_jinja_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{name}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, spans: bool = False,
               generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            with time_limit(RENDER_TIME_LIMIT_S):
                texts, indices = render_jinja_template(
                    conversations=[messages], tools=tools, chat_template=self.source,
                    return_assistant_tokens_mask=spans, add_generation_prompt=generation_prompt, **self.special_tokens,
                )
        except TimeLimitExceeded:
            raise RecordError(f"{self.name} did not finish rendering the conversation within {RENDER_TIME_LIMIT_S:g} s",
                              "chat_template_timeout") from None
        except Exception as e:  # whatever the template raises (raise_exception, a TypeError, 1/0, ...) is the record's
            message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            if not isinstance(e, jinja2.TemplateError):  # a Python error says what it is (ZeroDivisionError: ...)
                message = f"{type(e).__name__}: {message}" if message else type(e).__name__
            raise RecordError(f"the chat template refused the conversation: {message!r}", "chat_template_error") from None
        return texts[0], (indices[0] if spans else [])

    def __call__(self, messages: list[dict], tools: list[dict] | None, train_on: str) -> Rendered:
        if train_on == "all":
            text, _ = self.render(messages, tools)
            return Rendered(text, [(0, len(text))])
        if self.tagged:
            text, spans = self.render(messages, tools, spans=True)
            spans = [(a, b) for a, b in spans if b > a]
            if not spans:
                raise RecordError("the chat template's {% generation %} blocks hold nothing for this conversation",
                                  "empty_completion")
        else:
            text, _ = self.render(messages, tools)
            spans = self._locate(messages, tools, text)
        return Rendered(text, spans[-1:] if train_on == "last" else spans)

    # -- untagged templates: where each assistant turn's output lies in the render

    def _try(self, messages: list[dict], *, generation_prompt: bool = False) -> str | None:
        """A probe render, or None where the template refuses the probe conversation; a template that does not
        end is not waited for again and again: its time-out stops the probe (and is the record's error)."""
        try:
            return self.render(messages, generation_prompt=generation_prompt)[0]
        except RecordError as e:
            if e.reason == "chat_template_timeout":
                raise
            return None

    @cached_property
    def _probe(self) -> tuple[list[str], list[str]]:
        """(assistant header candidates, longest first; end-of-turn candidates) from probe renders."""
        user = [{"role": "user", "content": _PROBE}]
        bare, prompted = self._try(user), self._try(user, generation_prompt=True)
        if bare is None or prompted is None:
            bare = prompted = ""
        header = prompted[len(bare):] if prompted.startswith(bare) else ""
        header = re.sub(r"<think>\s*$", "", header)  # a prompt that opens the reasoning: the model writes it
        # heads of the generation prompt cut after a tag or newline (DeepSeek writes "<｜Assistant｜>" before a
        # turn but prompts with "<｜Assistant｜><think>\n"), never one that a user turn also writes
        cuts = {header} | {header[: m.end()] for m in re.finditer(r">|\n", header)}
        headers = sorted((h for h in cuts if h.strip() and h not in bare), key=len, reverse=True)
        ends: list[str] = []
        # the first special-looking token after an assistant turn, followed by nothing, a user turn or a tool
        # turn: its end-of-turn token, or, for a template that closes no turn (GLM-4), the header of the turn
        # that follows (<|user|>, <|observation|>), which is what the template's tagged twin trains as the end
        for tail in ([], [{"role": "user", "content": _PROBE + "2"}], [{"role": "tool", "content": _PROBE + "3"}]):
            text = self._try([*user, {"role": "assistant", "content": _marker(0)}, *tail])
            if text is None:
                continue
            after = text[text.find(_marker(0)) + len(_marker(0)):] if _marker(0) in text else ""
            if not tail and after.strip() and not _SPECIAL_LOOKING.sub("", after).strip():
                ends.append(after.rstrip())  # a closing run such as <|END_RESPONSE|><|END_OF_TURN_TOKEN|>
            found = _SPECIAL_LOOKING.search(after)
            if found:
                ends.append(found.group())
        # a turn that ends in a tool call may close with a token of its own (gpt-oss's <|call|>): the special-looking
        # token that ends the render of a conversation whose last turn is a call
        call = {"type": "function", "function": {"name": "packer_probe", "arguments": {"q": _PROBE + "4"}}}
        text = self._try([*user, {"role": "assistant", "content": "", "tool_calls": [call]}]) or ""
        closing = [m for m in _SPECIAL_LOOKING.finditer(text) if m.start() > text.find(_PROBE + "4")]
        if _PROBE + "4" in text and closing and not text[closing[-1].end():].strip():
            ends.append(closing[-1].group())
        eos = self.special_tokens.get("eos_token")
        if eos:
            ends.append(eos)
        ends = list(dict.fromkeys(ends))
        return headers, ends

    def _locate(self, messages: list[dict], tools: list[dict] | None, text: str) -> list[tuple[int, int]]:
        headers, ends = self._probe
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        marked = [{**m, "content": _marker(i)} if i in turns else m for i, m in enumerate(messages)]
        scaffold, _ = self.render(marked, tools)
        spans = []
        pos = cur = 0  # in the marked render, in the real one
        for k, i in enumerate(turns):
            where = f"assistant turn {i}"
            mark, anchor = scaffold.find(_marker(i), pos), _marker(i)
            if mark < 0:  # content a template leaves out when there are tool calls (gpt-oss): anchor on the
                # first call after the turn's header (the tool definitions before it name the tools too)
                heads = [found for h in headers if (found := scaffold.find(h, pos)) >= 0]
                names = [n for n in _tool_names(messages[i]) if heads and n in scaffold[min(heads):]]
                if names:
                    anchor = names[0]
                    mark = scaffold.find(anchor, min(heads))
            if mark < 0:
                raise RecordError(f"{where} is not rendered by the chat template, so it cannot be trained on",
                                  "chat_span_not_found")
            before = scaffold[pos:mark]
            header = next((h for h in headers if h in before), None)
            reasoning = _reasoning(messages[i])
            at = before.rfind(reasoning) if reasoning else -1
            if header is not None and at >= 0 and header in before[:at]:
                # the reasoning rendered as a message of its own before the content (gpt-oss's analysis channel)
                # is part of the turn's output: the output starts after the header before the reasoning
                before = before[:at]
            if header is not None:  # the output starts after the last such header before the content
                nth = before.count(header)
                start = cur
                for _ in range(nth):
                    found = text.find(header, start)
                    if found < 0:
                        start = -1
                        break
                    start = found + len(header)
            else:  # no header (DeepSeek's reply after tool outputs): the output starts where the content does
                found = text.find(before, cur)
                start = found + len(before) if found >= 0 else -1
            after_mark = mark + len(anchor)
            limit = scaffold.find(_marker(turns[k + 1]), after_mark) if k + 1 < len(turns) else -1
            limit = len(scaffold) if limit < 0 else limit
            tail = scaffold[after_mark:limit]
            hits = [(tail.find(e), -len(e), e) for e in ends if e in tail]
            if start < 0 or not (hits or not tail.strip()):
                raise RecordError(f"{where}: cannot locate its output in the rendered conversation",
                                  "chat_span_not_found")
            if hits:
                end_token = min(hits)[2]
                found = text.find(end_token, start)
                if found < 0:
                    raise RecordError(f"{where}: its end-of-turn {end_token!r} is not in the rendered conversation",
                                      "chat_span_not_found")
                end = found + len(end_token)
                next_pos = after_mark + tail.find(end_token) + len(end_token)
            else:  # the render ends with this turn and no end-of-turn token (GLM-4): the output runs to the end
                end = len(text.rstrip())
                next_pos = len(scaffold)
            _check_span(messages[i], text, start, end, where, content_rendered=anchor == _marker(i))
            spans.append((start, end))
            pos, cur = next_pos, end
        return spans


def _tool_names(message: dict) -> list[str]:
    names = []
    for call in message.get("tool_calls") or ():
        name = (call.get("function") or call).get("name") if isinstance(call, dict) else None
        if isinstance(name, str) and name:
            names.append(name)
    return names


def _reasoning(message: dict) -> str:
    """The turn's reasoning as a template may render it: under the names transformers aliases (the first of
    ``_REASONING_FIELDS`` given), else a <think> block in the content."""
    from transformers.utils.chat_template_utils import _REASONING_FIELDS

    given = next((message[k] for k in _REASONING_FIELDS if isinstance(message.get(k), str)), None)
    if given is None and "</think>" in (content := message.get("content") or ""):
        given = content.split("</think>")[0].split("<think>")[-1]
    return (given or "").strip()


def _check_span(message: dict, text: str, start: int, end: int, where: str, *, content_rendered: bool) -> None:
    """The located span must hold what the assistant wrote (templates may drop a <think> block and trim), unless
    the template leaves the content out (gpt-oss drops the text beside a tool call when a final answer follows),
    and the names of the tool calls the template renders."""
    span = text[start:end]
    visible = (message.get("content") or "").split("</think>")[-1].strip()
    if content_rendered and visible and visible not in span:
        raise RecordError(f"{where}: the span found does not hold the assistant's text", "chat_span_not_found")
    for name in _tool_names(message):
        if name in text[start:] and name not in span:  # rendered in this turn or later, yet not in its span
            raise RecordError(f"{where}: the span found does not hold its tool call {name!r}", "chat_span_not_found")


class NamedChatTemplates:
    """A tokenizer's named chat templates: each record is rendered by the one transformers'
    ``get_chat_template`` picks (``tool_use`` when the record gives tools and the tokenizer has one, else
    ``default``); transformers' method is called, so the choice is its own. All are compiled up front, so a
    broken one is reported before any record is read."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str], name: str):
        self.chat_template = templates  # the attribute get_chat_template reads
        self.by_source = {source: ChatTemplate(source, special_tokens, f"{name} {key!r}")
                          for key, source in templates.items()}

    def pick(self, tools: list[dict] | None) -> ChatTemplate:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        try:
            return self.by_source[PreTrainedTokenizerBase.get_chat_template(self, None, tools)]
        except ValueError as e:  # several templates and no "default", for a record without tools
            raise RecordError(str(e).split("!")[0], "chat_template_error") from None

    def __call__(self, messages: list[dict], tools: list[dict] | None, train_on: str) -> Rendered:
        return self.pick(tools)(messages, tools, train_on)
