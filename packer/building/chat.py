"""Chat records: transformers' own template rendering, and the character spans to train on.

A conversation is rendered once, whole, by ``transformers.utils.chat_template_utils.render_jinja_template``
(the function ``apply_chat_template`` calls; it imports without torch), so its text is exactly what the
model is trained and served on, whatever the template does to earlier turns.

The spans to train on (the rules users see are in docs/chat.md):

- a template with ``{% generation %}`` tags: the tagged character spans transformers returns;
- any other template: each assistant turn's output, located in that one render. Probe renders, once per
  template, teach how it writes a turn (``_learn``): the role header (the longest head of the generation
  prompt that every kind of turn writes before its output, so a pre-filled think block is not header), the
  generation prompt's pre-fill, and what may end a turn: the tokenizer's own added tokens that the template
  writes after an assistant turn (whatever their spelling), what it writes after a turn that ends the
  conversation, and the closing it writes after every turn. A second render of the record, with each
  assistant text replaced by a marker (empty text stays empty), tells per turn which header comes before the
  output and which end closes it; the output is found in the real render from that header through that end.
  A later message that the template writes inside the turn (a tool result) is cut out of it; a turn that
  nothing closes ends with its own text, or, last, runs to the end of the render. The span must hold the
  assistant's visible text and tool-call names, else the record is refused.

A template is code: whatever it raises is the record's error, and a render runs under a time limit.
Named templates (``default``, ``tool_use``, ...) are picked per record as transformers picks them, and each
is probed with what it will render (the one records with tools get is probed with a tool).

Cost: one render per record for a tagged template, three for an untagged one (real, guard, marked; see
``chat_guard``), plus string searches; records that differ only in their messages' texts share one marked render
(``ChatTemplate._marked``): two renders a record for most data.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..errors import RecordError, TokenizerError
from .chat_guard import align, salt, sentinel
from .timelimit import TimeLimitExceeded, time_limit

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
TRAIN_ON = ("assistant", "last", "all")
_MEDIA = ("image", "image_url", "input_image", "audio", "input_audio", "video", "video_url", "file")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = "PACKERPROBEX"
# The day a template that asks for the date (``strftime_now``: Llama 3.1's and 3.2's "Today Date") is given: the same
# on every day, so a build's bytes and its verify do not depend on when they run. It is the date Llama 3.1's template
# writes itself when no clock is given.
RENDER_DATE = datetime.datetime(2024, 7, 26)
# Real templates render a conversation in milliseconds; one that runs for seconds loops (a template is code)
RENDER_TIME_LIMIT_S = 5.0


@contextlib.contextmanager
def fixed_clock(dated: bool):
    """transformers' ``strftime_now`` (the template's clock) reads ``datetime.now()`` from its module; a keyword
    argument cannot replace it (the renderer turns arguments into plain data), so for a template that asks for the
    date that module's ``datetime`` says ``RENDER_DATE`` while packer renders (in the one thread that renders)."""
    if not dated:
        yield
        return
    from transformers.utils import chat_template_utils

    real = chat_template_utils.datetime
    chat_template_utils.datetime = _RenderDate
    try:
        yield
    finally:
        chat_template_utils.datetime = real


class _RenderDate(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return RENDER_DATE if tz is None else RENDER_DATE.replace(tzinfo=tz)


def _marker(stem: str, i: int) -> str:
    return f"{stem}MARK{i:05d}X"  # stem: "PACKER", or one that no message of the record holds (chat_guard.salt)


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
    out = []
    for i, message in enumerate(checked_turns(messages, field)):
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = _join_text_parts(content, i)
        elif content is not None and not isinstance(content, str):
            raise RecordError(f"turn {i}'s content is {type(content).__name__}, not text or a list of text parts",
                              "wrong_type")
        out.append(message)
    require_answer(out)
    return out


def checked_turns(messages: Any, field: str) -> Iterator[dict[str, Any]]:
    """Each turn of a record's ``field``, checked to be a {'role': known role, ...} object, with its Nones
    dropped; the text and the image messages (``image_encoder``) both read turns through it."""
    if messages is None:
        raise RecordError(f"field {field!r} is null", "null_field")
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"field {field!r} must be a non-empty list of turns", "wrong_type")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RecordError(f"turn {i} is not a {{'role': str, 'content': ...}} object", "wrong_type")
        message = drop_nones(message)
        if message["role"] not in CHAT_ROLES:
            raise RecordError(f"turn {i} has unknown role {message['role']!r} (known: {', '.join(CHAT_ROLES)})",
                              "unknown_role")
        yield message


def require_answer(messages: list[dict[str, Any]]) -> None:
    """A conversation without an assistant turn trains nothing: refused (``empty_completion``)."""
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("the conversation has no assistant turn, so nothing would be trained", "empty_completion")


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


def chat_renderer(template: str | dict[str, str], special_tokens: dict[str, str], name: str,
                  control_tokens: list[str] = ()):
    """A :class:`ChatTemplate`, or for named templates a :class:`NamedChatTemplates` that picks one per record."""
    if isinstance(template, dict):
        return NamedChatTemplates(template, special_tokens, name, control_tokens)
    return ChatTemplate(template, special_tokens, name, control_tokens)


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # [start, end) character spans to train on, in order


class ChatTemplate:
    """One chat template with the tokenizer's special tokens, rendered by transformers' code."""

    def __init__(self, source: str, special_tokens: dict[str, str], name: str, control_tokens=(), *,
                 probe_tools: bool = False):
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.source = source
        self.special_tokens = special_tokens  # as apply_chat_template passes them: a null one is absent
        self.name = name
        # the tokenizer's own added tokens, longest first: what a turn's end or header token can be
        tokens = sorted({t for t in control_tokens if t.strip()}, key=len, reverse=True)
        self.control = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        self.probe_tools = probe_tools  # a template picked for records with tools is probed with a tool
        self.tagged = bool(_GENERATION_TAG.search(source))
        self.dated = "strftime_now" in source  # it asks for the date: it is rendered with RENDER_DATE
        self.marked_renders: dict[str, str] = {}  # marked conversation -> its render (_marked)
        self._marked_chars = 0  # what they hold
        try:  # a broken template is reported once, naming it, before any record is read
            _compile_jinja_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{name}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, spans: bool = False,
               generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            with time_limit(RENDER_TIME_LIMIT_S), fixed_clock(self.dated):
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
            turns = self._locate(messages, tools, text)
            return Rendered(text, turns[-1] if train_on == "last" else [s for turn in turns for s in turn])
        return Rendered(text, spans[-1:] if train_on == "last" else spans)

    # -- untagged templates: where each assistant turn's output lies in the render

    def _try(self, messages: list[dict], *, generation_prompt: bool = False, tools: list[dict] | None = None) -> str | None:
        """A probe render, or None where the template refuses the probe conversation; a template that does not
        end is not waited for again and again: its time-out stops the probe (and is the record's error)."""
        try:
            return self.render(messages, tools, generation_prompt=generation_prompt)[0]
        except RecordError as e:
            if e.reason == "chat_template_timeout":
                raise
            return None

    @cached_property
    def _probe(self) -> _Probe:
        """How the template writes an assistant turn, learnt from renders of probe conversations: with the probe
        tool given to a template that needs tools (a named ``tool_use`` one is always given it)."""
        user = [{"role": "user", "content": _PROBE}]
        for tools in ((None, [_PROBE_TOOL]) if not self.probe_tools else ([_PROBE_TOOL],)):
            bare, prompted = self._try(user, tools=tools), self._try(user, tools=tools, generation_prompt=True)
            if bare is not None and prompted is not None:
                break
        else:
            raise TokenizerError(f"{self.name}: packer cannot learn how the template writes an assistant turn: it "
                                 "refuses packer's probe conversation (one user turn); give a {% generation %}-tagged "
                                 "template with --chat-template")
        return _learn(self, user, tools, bare, prompted)

    def _scaffold(self, messages: list[dict], tools: list[dict] | None, what: str) -> str:
        try:
            return self.render(messages, tools)[0]
        except RecordError as e:
            if e.reason == "chat_template_timeout":
                raise
            raise RecordError(f"packer's probe render of this conversation ({what}) fails, though the conversation "
                              f"renders ({e}); give a {{% generation %}}-tagged template with --chat-template",
                              "chat_probe_failed") from None

    def _marked(self, marked: list[dict], tools: list[dict] | None) -> str:
        """The marked render, made once per marked conversation: sentinels and markers stand for every message's
        text in it, so records that differ only in their messages' texts share it (every GSM8K record as chat: a
        user turn and an answer), and a render is a pure function of the template, its arguments and packer's fixed
        clock (but for Jinja's ``random`` filter, which no chat template uses: with it, no two of a record's renders
        would agree anyway): one of every three renders of an untagged template's record saved. The conversation is known by its ``repr``, which
        tells any two apart when they hold only strings, numbers, booleans, None, lists, tuples and dicts; one
        holding any other value (a date a Parquet file gives) is rendered every time."""
        key = repr((marked, tools)) if _plain((marked, tools)) else None
        text = self.marked_renders.get(key) if key is not None else None
        if text is None:
            text = self._scaffold(marked, tools, "each assistant text replaced by a marker")
            if key is not None and len(key) + len(text) <= MARKED_CHARS:
                self.marked_renders[key] = text
                self._marked_chars += len(key) + len(text)
                while len(self.marked_renders) > MARKED_RENDERS or self._marked_chars > MARKED_CHARS:
                    oldest = next(iter(self.marked_renders))  # many shapes, or large ones (tools' schemas): the
                    self._marked_chars -= len(oldest) + len(self.marked_renders.pop(oldest))  # first made go first
        return text

    def _locate(self, messages: list[dict], tools: list[dict] | None, text: str) -> list[list[tuple[int, int]]]:
        """Per assistant turn, the character spans of its output in ``text``: found in the guard render, which holds
        no other message's text (see ``chat_guard``), and carried over to ``text`` by the exact alignment."""
        stem = salt(text, json.dumps([messages, tools], ensure_ascii=False, default=str))
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        contents = {j: m["content"] for j, m in enumerate(messages) if j not in turns and _has_text(m)}
        guarded = [{**m, "content": sentinel(stem, j)} if j in contents else m for j, m in enumerate(messages)]
        guard = self._scaffold(guarded, tools, "other messages' text replaced by sentinels") if contents else text
        alignment = align(text, guard, stem, contents)
        # only non-empty text is replaced by a marker: the template sees text where the record has text
        marked = [{**m, "content": _marker(stem, i)} if i in turns and _has_text(m) else m for i, m in enumerate(guarded)]
        scaffold = self._marked(marked, tools)
        finder = _Finder(self, guarded, turns, scaffold, guard, stem)
        out = []
        for k, i in enumerate(turns):
            where = f"assistant turn {i}"
            spans = finder.turn(k, i, where)
            alignment.check(spans, where, messages)
            out.append([(alignment.to_real(a, where), alignment.to_real(b, where)) for a, b in spans])
        return out


class _Finder:
    """Each assistant turn's output in the guard render ``text`` (no other message's text is in it, only
    sentinels), told by the marked render ``scaffold`` (each assistant text replaced by a marker): the header
    before the marker, the end of turn after it. Turns are found in order; ``pos`` and ``cur`` are where the
    last turn ended in the scaffold and in ``text``."""

    def __init__(self, template: ChatTemplate, messages: list[dict], turns: list[int], scaffold: str, text: str,
                 stem: str):
        self.probe, self.messages, self.turns, self.scaffold, self.text = template._probe, messages, turns, scaffold, text
        self.stem = stem
        self.pos = self.cur = 0

    def _next_marker(self, k: int, at: int) -> int:
        return self.scaffold.find(_marker(self.stem, self.turns[k + 1]), at) if k + 1 < len(self.turns) else -1

    def _anchor(self, k: int, i: int, where: str) -> tuple[int, str]:
        """Where the turn's output is in the scaffold: its marker, else (no text, or text a template leaves out
        beside tool calls: gpt-oss) its first call or its reasoning after the turn's header."""
        scaffold, probe, message, pos = self.scaffold, self.probe, self.messages[i], self.pos
        marker = _marker(self.stem, i)
        mark, anchor = (scaffold.find(marker, pos), marker) if _has_text(message) else (-1, "")
        if mark < 0:
            heads = [found for h in probe.headers if (found := scaffold.find(h, pos)) >= 0]
            base = min(heads) if heads else pos
            for anchor in (*_tool_names(message), _reasoning(message)):
                if anchor and (mark := scaffold.find(anchor, base)) >= 0:
                    break
            if mark < 0 and not _has_text(message) and heads and (
                    k + 1 == len(self.turns) or base < self._next_marker(k, pos)):
                # a turn with nothing the template renders: an empty answer is its end of turn (as the template's
                # tagged twins train it); but where the template left out its calls (DeepSeek V3's empty-content call)
                # or reasoning, that end alone would teach the model to stop where it should have called
                anchor, mark = "", base + len(next(h for h in probe.headers if scaffold.startswith(h, base)))
                if _tool_names(message) or _reasoning(message):
                    raise RecordError(f"{where}: the template renders none of its output (it leaves its calls out), "
                                      "so only its end of turn would be trained; give a {% generation %}-tagged "
                                      "template with --chat-template", "chat_turn_dropped")
        if mark < 0:
            raise RecordError(f"{where} is not rendered by the chat template, so it cannot be trained on",
                              "chat_span_not_found")
        return mark, anchor

    def _start(self, i: int, mark: int, where: str) -> int:
        """Where the output starts in ``text``: after the last header before the anchor (the reasoning rendered
        before the content is output), else where the content does."""
        probe, text, message = self.probe, self.text, self.messages[i]
        before = self.scaffold[self.pos:mark]
        header = next((h for h in probe.headers if h in before), None)
        reasoning = _reasoning(message)
        at = before.rfind(reasoning) if reasoning else -1
        if at >= 0 and (header is None or header in before[:at]):
            # the reasoning rendered before the content (gpt-oss's analysis channel, Gemma 4's thought channel
            # in a model turn that goes on after tool results) is part of the turn's output
            before = before[:at]
        if header is not None:  # the output starts after the last such header before the content
            start = self.cur
            for _ in range(before.count(header)):
                found = text.find(header, start)
                start = found + len(header) if found >= 0 else -1
                if start < 0:
                    break
        else:  # no header (DeepSeek's reply after tool outputs): the output starts where the content does, or
            # where its calls do if they come first (Gemma 4 goes on in the same model turn: calls, results, text)
            found = text.find(before, self.cur)
            start = found + len(before) if found >= 0 else -1
            if start >= 0 and any(name in before for name in _tool_names(message)):
                start -= len(before.lstrip())
        if start >= 0 and probe.prefill and text.startswith(probe.prefill, start) and not (
                reasoning and reasoning in text[start:start + len(probe.prefill) + len(reasoning)]):
            start += len(probe.prefill)  # the generation prompt's own pre-fill (an empty think block), not output
        if start < 0:
            raise RecordError(f"{where}: cannot locate its output in the rendered conversation", "chat_span_not_found")
        return start

    def _end(self, k: int, i: int, start: int, mark: int, anchor: str, where: str) -> tuple[int, int]:
        """Where the output ends in ``text`` (its end of turn, else its own text, else the end of the render),
        and where the next turn's search starts in the scaffold."""
        text, message = self.text, self.messages[i]
        after_mark = mark + len(anchor)
        limit = self._next_marker(k, after_mark)
        limit = len(self.scaffold) if limit < 0 else limit
        if k + 1 < len(self.turns) and (names := _tool_names(self.messages[self.turns[k + 1]])):
            # the next turn's calls may come before its text, right after this turn's (Gemma 4 v5 writes text,
            # then the next call, in one model turn): the tail ends where they begin, past this turn's own calls
            at = after_mark
            for name in _tool_names(message):
                if (found := self.scaffold.find(name, at, limit)) >= 0:
                    at = found + len(name)
            if (found := self.scaffold.find(names[0], at, limit)) >= 0:
                limit = found
        tail = self.scaffold[after_mark:limit]
        hits = [(tail.find(e), -len(e), e) for e in self.probe.ends if e in tail]
        if hits:
            # the n-th of its kind since the last turn's end, as in the scaffold: not the first after the start,
            # which may close the turn's calls before its text (Gemma 4's <|tool_response>)
            end_token = min(hits)[2]
            closing = after_mark + tail.find(end_token) + len(end_token)
            n = self.scaffold.count(end_token, self.pos, closing) + (
                (message.get("content") or "").count(end_token) if anchor == _marker(self.stem, i) else 0)
            found = self.cur - len(end_token)
            for _ in range(n):
                found = text.find(end_token, found + len(end_token))
                if found < 0:
                    break
            if found < start:
                raise RecordError(f"{where}: its end-of-turn {end_token!r} is not in the rendered conversation",
                                  "chat_span_not_found")
            return found + len(end_token), closing
        if k + 1 == len(self.turns) and not _rendered_after(self.messages, i, text, start):
            return len(text), len(self.scaffold)  # a final turn that nothing closes: its span runs to the end, the
            # EOS ends it
        # a turn that nothing closes, followed by more: it ends with its own text, written after its calls
        visible = _visible(message)
        found = text.find(visible, start) if visible and anchor == _marker(self.stem, i) else -1
        if found < 0 or any(not 0 <= text.find(name, start) < found for name in _tool_names(message)):
            raise RecordError(f"{where}: cannot tell where its output ends (the template writes no end-of-turn "
                              "token after it); give a {% generation %}-tagged template with --chat-template",
                              "chat_span_not_found")
        return found + len(visible), after_mark

    def turn(self, k: int, i: int, where: str) -> list[tuple[int, int]]:
        """The spans of turn ``i`` (the ``k``-th assistant turn), in ``text``; turns are asked for in order."""
        mark, anchor = self._anchor(k, i, where)
        start = self._start(i, mark, where)
        end, next_pos = self._end(k, i, start, mark, anchor, where)
        _check_span(self.messages[i], self.text, start, end, where, content_rendered=anchor == _marker(self.stem, i))
        nxt = self.turns[k + 1] if k + 1 < len(self.turns) else len(self.messages)
        spans = _without_others(self.probe, self.messages, i, nxt, self.text, start, end, where)
        self.pos, self.cur = next_pos, end
        return spans


def _without_others(probe: _Probe, messages: list[dict], i: int, next_turn: int, text: str, start: int, end: int,
                    where: str) -> list[tuple[int, int]]:
    """The turn's span, less the messages that follow it where the template writes them inside the turn
    (Gemma 4 writes tool results into the model turn, after the calls and before the turn's text): the
    output is the calls through the first end of turn before them, then the turn's own text after them."""
    own = _visible(messages[i])
    own_at = text.rfind(own, start, end) if own else -1
    inside = []
    for j in range(i + 1, next_turn):
        other = messages[j]["content"].strip() if _has_text(messages[j]) else ""
        for form in (other, json.dumps(other)[1:-1]) if other else ():  # as written, or as a JSON string
            at = text.find(form, start, end)
            if at >= 0 and not (own_at >= 0 and own_at <= at and at + len(form) <= own_at + len(own)):
                inside.append((at, at + len(form)))
                break
    if not inside:
        return [(start, end)]
    first, last = min(a for a, _ in inside), max(b for _, b in inside)
    cuts = [(found, e) for e in probe.ends if (found := text.find(e, start, first)) >= 0]
    if not cuts:
        raise RecordError(f"{where}: the template renders a later message inside it and packer finds no end of turn "
                          "before it; give a {% generation %}-tagged template with --chat-template",
                          "chat_span_not_found")
    found, token = min(cuts, key=lambda c: (c[0], -len(c[1])))
    pieces = [(start, found + len(token))]
    if own_at >= last:
        pieces.append((own_at, end))
    return pieces


_PROBE_TOOL = {"type": "function", "function": {"name": "packer_probe", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


@dataclass(frozen=True, slots=True)
class _Probe:
    headers: list[str]  # the assistant header (the role header), then shorter heads of it, longest first
    prefill: str  # what the generation prompt writes after the header (an opened or empty think block)
    ends: list[str]  # what may close a turn


def _common(a: str, b: str, control: re.Pattern | None = None) -> int:
    """The length of the common head of ``a`` and ``b``; where they part inside a token (``<|end|>\n<|im_end|>``
    against ``<|end|>\n<|assistant|>``), cut back to the end of the last line, tag or token of the tokenizer."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    if n < min(len(a), len(b)):
        bounds = [0] + [k + 1 for k in range(n) if a[k] in "\n>]"]
        if control is not None:
            bounds += [m.end() for m in control.finditer(a, 0, n)]
        n = max(bounds)
    return n


def _learn(template: ChatTemplate, user: list[dict], tools, bare: str, prompted: str) -> _Probe:
    """Header, pre-fill and turn ends from probe renders. End-of-turn tokens are the tokenizer's own (its added
    tokens, whatever their spelling); a template written for another tokenizer is read from its renders alone:
    what it writes after an assistant turn that ends the conversation, and the closing it writes after a user
    turn where it writes the same after an assistant turn."""
    control = template.control
    gen = prompted[_common(bare, prompted, control):]
    said = _marker("PACKER", 0)
    turn = {"role": "assistant", "content": said}
    call = {"type": "function", "function": {"name": "packer_probe", "arguments": {"q": _PROBE + "4"}}}
    one = template._try([*user, turn], tools=tools)
    then_user = template._try([*user, turn, {"role": "user", "content": _PROBE + "2"}], tools=tools)
    then_tool = template._try([*user, turn, {"role": "tool", "content": _PROBE + "3"}], tools=tools)
    thinking = template._try([*user, {**turn, "reasoning_content": _PROBE + "R"}], tools=tools)
    calling = template._try([*user, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=tools) or ""
    # the role header: the longest head of the generation prompt that every kind of turn writes before its output
    # (a prompt that opens or pre-fills a think block writes more than a turn with reasoning of its own does)
    header = gen
    for render, piece in ((one, said), (then_user, said), (thinking, _PROBE + "R")):
        if render is not None and piece in render:
            if piece not in render[: render.find(said)] and piece != said:
                piece = said
            lead = render[_common(bare, render, control): render.find(piece)]
            header = header[: _common(header, lead)] if lead else header
    if thinking is not None and _PROBE + "R" in thinking and control:
        # a reasoning block the turn writes is output, even where every turn opens one (Nemotron's <think>): the
        # header ends before the last token that opens the reasoning
        lead = thinking[_common(bare, thinking, control): thinking.find(_PROBE + "R")]
        opens = [m.start() for m in control.finditer(lead) if m.start() > 0]
        if opens and len(header) > opens[-1] and lead.startswith(header[: opens[-1]]):
            header = header[: opens[-1]]
    if header != gen:  # cut back to the end of a token or line, never inside a word
        cuts = [m.end() for m in re.finditer(r"\n", header)] + [m.end() for m in control.finditer(header)] if control \
            else [m.end() for m in re.finditer(r"\n", header)]
        header = header[: max(cuts)] if cuts else header
    if not header.strip():
        header = gen
    cuts = {header} | {header[: m.end()] for m in re.finditer(r"\n", header)}
    if control:
        cuts |= {header[: m.end()] for m in control.finditer(header)}
    headers = sorted((h for h in cuts if h.strip() and h not in bare), key=len, reverse=True)
    prefill = gen[len(header):] if gen.startswith(header) and header in headers else ""
    if prefill and thinking is not None and header in thinking:
        opened = thinking[thinking.find(header, _common(bare, thinking, control)) + len(header):]
        if opened.startswith(prefill):  # the prompt opens the reasoning the model writes (<think>\n): output
            prefill = ""
    ends: list[str] = []
    closing = ""
    if one is not None and said in one:
        closing = one[one.find(said) + len(said):].rstrip()
        if closing:
            ends.append(closing)  # what closes a turn that ends the conversation
        user_end = one.find(_PROBE) + len(_PROBE)
        user_closing = one[user_end: _common(bare, one, control)].rstrip() if _PROBE in one else ""
        if user_closing and then_user is not None and then_user[then_user.find(said) + len(said):].startswith(user_closing):
            ends.append(user_closing)  # the closing every turn gets (<|im_end|>, <turn|>, <|end|>)
    for render in (one, then_user, then_tool):  # the tokenizer's own token that the template writes right after the
        if control and render is not None and said in render:  # turn's text (after it only the next message's own)
            after = render.find(said) + len(said)
            found = control.search(render, after)
            if found and not render[after:found.start()].strip():
                ends.append(found.group())
    # a turn that ends in a tool call may close with a token of its own (gpt-oss's <|call|>): the last of the
    # tokenizer's tokens in a conversation whose last turn is a call, where nothing but whitespace follows it;
    # in a template that closes no turn (GLM-4) that is the call's own closing tag, and the next header ends the turn
    if control and closing and _PROBE + "4" in calling:
        closing = [m for m in control.finditer(calling) if m.start() > calling.find(_PROBE + "4")]
        if closing and not calling[closing[-1].end():].strip():
            ends.append(closing[-1].group())
    if template.special_tokens.get("eos_token"):
        ends.append(template.special_tokens["eos_token"])
    return _Probe(headers, prefill, list(dict.fromkeys(e for e in ends if e.strip())))


_PLAIN = frozenset({str, int, float, bool, type(None)})  # exact types: a subclass may have a repr of its own
# marked conversations remembered per template and process, and the characters they and their renders may hold
# (8 MB as Python strings of ASCII text, up to 4 bytes a character of other text)
MARKED_RENDERS, MARKED_CHARS = 1024, 1 << 23


def _plain(value: Any) -> bool:
    """Whether ``value`` holds only strings, numbers, booleans, None, lists, tuples and dicts of string keys: what
    ``repr`` writes faithfully (distinct values, distinct reprs)."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if kind in (list, tuple):
        return all(_plain(v) for v in value)
    return False


def _has_text(message: dict) -> bool:
    return isinstance(message.get("content"), str) and bool(message["content"].strip())


def _visible(message: dict) -> str:
    return (message.get("content") or "").split("</think>")[-1].strip()


def _rendered_after(messages: list[dict], i: int, text: str, start: int) -> bool:
    """Whether any later message's text is rendered after ``start``."""
    return any(_has_text(m) and m["content"].strip() in text[start:] for m in messages[i + 1:])


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
    visible = _visible(message)
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

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str], name: str, control_tokens=()):
        self.chat_template = templates  # the attribute get_chat_template reads
        # each template is probed with what it will render: the one records with tools get, with a tool
        with_tools, without = self._source([_PROBE_TOOL]), self._source(None)
        self.by_source = {source: ChatTemplate(source, special_tokens, f"{name} {key!r}", control_tokens,
                                               probe_tools=source == with_tools and source != without)
                          for key, source in templates.items()}

    def _source(self, tools: list[dict] | None) -> str | None:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        try:
            return PreTrainedTokenizerBase.get_chat_template(self, None, tools)
        except ValueError:  # several templates and no "default", for a record without tools
            return None

    def pick(self, tools: list[dict] | None) -> ChatTemplate:
        source = self._source(tools)
        if source is None:
            names = ", ".join(map(repr, self.chat_template))
            raise RecordError(f"the tokenizer has several chat templates ({names}) and none named 'default' for a "
                              "conversation without tools", "chat_template_error")
        return self.by_source[source]

    def __call__(self, messages: list[dict], tools: list[dict] | None, train_on: str) -> Rendered:
        return self.pick(tools)(messages, tools, train_on)
