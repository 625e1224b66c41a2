"""Every text-only TRL chat template that has a ``_training`` twin, on a varied conversation set:
packer's tokens and trained tokens against transformers' ``apply_chat_template``.

    PYTHONPATH=$PWD python tests/chat_sweep.py [tokenizer folder]   # prints one line per template

For each template pair (original, tagged twin) and conversation:

- tokens: packer's build tokens equal ``apply_chat_template(..., tokenize=True)`` (plus the EOS packer
  appends when the render does not end with it), for both templates;
- twin: packer's trained tokens equal ``return_assistant_tokens_mask`` exactly;
- original: on every conversation the twin renders to the same tokens (or to the same followed by a closing
  of the final turn), packer's trained tokens equal the twin's mask, except on tokens that decode to
  whitespace only;
- a conversation that transformers refuses (the template raises) is refused by packer too, as a record error.

Used whole by tests/test_chat_templates.py.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# PACKER_SHARED_DATA: as in conftest.py (where the tests look for the shared data)
QWEN3 = Path(os.environ.get("PACKER_SHARED_DATA") or ROOT.parent / "shared" / "data") / "tokenizers" / "qwen3"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def _call(name, args, *, as_string=False, cid=None):
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args) if as_string else args}}
    if cid:
        call["id"] = cid
    return call


def conversations() -> list[tuple[str, dict]]:
    """(name, record) pairs: a record has "messages" and maybe "tools", as a jsonl file would hold them."""
    u, a, s = "user", "assistant", "system"
    m = lambda role, content, **kw: {"role": role, "content": content, **kw}  # noqa: E731
    return [
        ("one_turn", {"messages": [m(u, "What is 2+2?"), m(a, "2 + 2 = 4.")]}),
        ("system_three_turns", {"messages": [
            m(s, "You are a terse assistant."), m(u, "Name a prime."), m(a, "7."), m(u, "Another?"), m(a, "11."),
            m(u, "And an even one?"), m(a, "2, the only even prime.")]}),
        ("empty_system", {"messages": [m(s, ""), m(u, "Hello"), m(a, "Hi! How can I help?")]}),
        ("think_in_content", {"messages": [
            m(u, "Is 91 prime?"), m(a, "<think>\n91 = 7 * 13.\n</think>\n\nNo, 91 = 7 × 13."),
            m(u, "Is 97?"), m(a, "<think>\nNo divisor up to 9.\n</think>\n\nYes, 97 is prime.")]}),
        ("reasoning_content", {"messages": [
            m(s, "Think step by step."), m(u, "3*4?"), m(a, "12.", reasoning_content="Three fours are twelve."),
            m(u, "Halve it."), m(a, "6.", reasoning_content="12 / 2 = 6.")]}),
        ("tool_call_object_args", {"tools": [WEATHER], "messages": [
            m(u, "Weather in Paris?"),
            m(a, "", tool_calls=[_call("get_weather", {"city": "Paris"}, cid="call_1")]),
            m("tool", '{"temp": 18, "sky": "clear"}', name="get_weather", tool_call_id="call_1"),
            m(a, "It is 18 °C and clear in Paris.")]}),
        ("tool_call_string_args_null_content", {"tools": [WEATHER, CLOCK], "messages": [
            m(s, "Use tools when needed."), m(u, "Time in Tokyo?"),
            m(a, None, tool_calls=[_call("get_time", {"tz": "Asia/Tokyo"}, as_string=True, cid="c9")]),
            m("tool", "14:05", name="get_time", tool_call_id="c9"), m(a, "It is 14:05 in Tokyo.")]}),
        ("two_calls_two_replies", {"tools": [WEATHER, CLOCK], "messages": [
            m(u, "Weather and time in Oslo?"),
            m(a, "Checking both.", tool_calls=[_call("get_weather", {"city": "Oslo", "unit": "c"}),
                                               _call("get_time", {"tz": "Europe/Oslo"})]),
            m("tool", '{"temp": -3}', name="get_weather"), m("tool", "09:12", name="get_time"),
            m(a, "−3 °C, and it is 09:12.")]}),
        ("unicode", {"messages": [
            m(u, "Traduis « bonjour » en japonais et en arabe 🙂"), m(a, "こんにちは — مرحبا 👋"),
            m(u, "Et en grec ?"), m(a, "Γειά σου.")]}),
        ("six_turns", {"messages": [x for i in range(6) for x in (m(u, f"Count to {i + 1}."),
                                                                   m(a, " ".join(str(k) for k in range(1, i + 2))))]}),
        ("text_parts", {"messages": [
            m(u, [{"type": "text", "text": "Summarise: "}, {"type": "text", "text": "cats sleep a lot."}]),
            m(a, [{"type": "text", "text": "Cats sleep most of the day."}])]}),
        ("tools_no_call", {"tools": [WEATHER], "messages": [m(u, "Say hi."), m(a, "Hi!")]}),
        ("reasoning_tool_call_empty_content", {"tools": [WEATHER], "messages": [
            m(s, "You are a helpful agent."), m(u, "Is it warm in Lyon?"),
            m(a, "", reasoning_content="I should check the weather.",
              tool_calls=[_call("get_weather", {"city": "Lyon"}, cid="c1")]),
            m("tool", '{"temp": 24}', name="get_weather", tool_call_id="c1"),
            m(a, "Yes, 24 °C.", reasoning_content="24 °C is warm.")]}),
    ]



def agentic_conversations() -> list[tuple[str, dict]]:
    """Tool loops as agents write them: calls and results in turn, text beside calls, parallel calls, an answer
    that echoes a result and a result that holds the answer, results without a name, a conversation that ends on
    a result. Gemma 4 writes these into one model turn (call, result, text), which is where span finders slip."""
    u, a, t = "user", "assistant", "tool"
    m = lambda role, content, **kw: {"role": role, "content": content, **kw}  # noqa: E731
    w = lambda city, cid: _call("get_weather", {"city": city}, cid=cid)  # noqa: E731
    return [
        ("agent_two_steps", {"tools": [WEATHER, CLOCK], "messages": [
            m(u, "Weather in Paris and the time?"),  # arguments as JSON strings here (DeepSeek's template needs them)
            m(a, "", tool_calls=[_call("get_weather", {"city": "Paris"}, as_string=True, cid="c1")]),
            m(t, '{"temp": 18}', name="get_weather", tool_call_id="c1"),
            m(a, "", tool_calls=[_call("get_time", {"tz": "Europe/Paris"}, as_string=True, cid="c2")]),
            m(t, "10:00", name="get_time", tool_call_id="c2"), m(a, "18 °C, and it is 10:00.")]}),
        ("agent_text_beside_calls", {"tools": [WEATHER, CLOCK], "messages": [
            m("system", "Be brief."), m(u, "Paris?"), m(a, "Checking weather.", tool_calls=[w("Paris", "c1")]),
            m(t, '{"temp": 18}', name="get_weather", tool_call_id="c1"),
            m(a, "Now the time.", tool_calls=[_call("get_time", {"tz": "Europe/Paris"}, cid="c2")]),
            m(t, "10:00", name="get_time", tool_call_id="c2"), m(a, "18 °C at 10:00."), m(u, "ok"), m(a, "Bye.")]}),
        ("agent_parallel", {"tools": [WEATHER, CLOCK], "messages": [
            m(u, "Oslo weather and time?"),
            m(a, "", tool_calls=[_call("get_weather", {"city": "Oslo"}, as_string=True, cid="c1"),
                                 _call("get_time", {"tz": "Europe/Oslo"}, as_string=True, cid="c2")]),
            m(t, '{"temp": -3}', name="get_weather", tool_call_id="c1"), m(t, "09:12", name="get_time", tool_call_id="c2"),
            m(a, "−3 °C at 09:12.")]}),
        ("agent_reasoning_loops", {"tools": [WEATHER], "messages": [
            m(u, "Weather in Bern?"), m(a, "", reasoning_content="I will call.", tool_calls=[w("Bern", "c1")]),
            m(t, '{"temp": 12}', name="get_weather", tool_call_id="c1"), m(a, "12 °C.", reasoning_content="Done."),
            m(u, "And Basel?"), m(a, "", tool_calls=[w("Basel", "c2")]),
            m(t, '{"temp": 13}', name="get_weather", tool_call_id="c2"), m(a, "13 °C.")]}),
        ("agent_result_without_name", {"tools": [WEATHER], "messages": [
            m(u, "Weather in Bern?"), m(a, "", tool_calls=[w("Bern", "c1")]), m(t, '{"temp": 12}', tool_call_id="c1"),
            m(a, "12 °C.")]}),
        ("agent_answer_echoes_result", {"tools": [WEATHER], "messages": [
            m(u, "Sky in Bern?"), m(a, "", tool_calls=[w("Bern", "c1")]),
            m(t, "sunny", name="get_weather", tool_call_id="c1"), m(a, "sunny")]}),
        ("agent_result_holds_answer", {"tools": [WEATHER], "messages": [
            m(u, "Sky in Bern?"), m(a, "", tool_calls=[w("Bern", "c1")]),
            m(t, "It is sunny in Bern today.", name="get_weather", tool_call_id="c1"), m(a, "It is sunny")]}),
        ("agent_ends_on_result", {"tools": [WEATHER], "messages": [
            m(u, "Weather in Nice?"), m(a, "Let me look.", tool_calls=[w("Nice", "c1")]),
            m(t, '{"temp": 20}', name="get_weather", tool_call_id="c1")]}),
    ]


# What a span finder could be fooled by: packer's own marker and sentinel strings (and their salted forms)
PACKER_STRINGS = ["PACKERMARK00001X", "PACKERMARK00003X", "PACKERSENT00000X", "PACKER1QMARK00001X", "PACKERPROBEX",
                  "PACKERMA", "SENT00002X"]


def forged_conversations(source: str, render=None) -> list[tuple[str, dict]]:
    """Conversations whose user, system and tool texts hold what a span finder looks for: packer's strings, the
    template's markup (its special tokens' text) with role words after it (headers), its end-of-turn literals,
    halves of them (partial overlaps), and with ``render`` (messages -> text) a whole rendered conversation."""
    markup = sorted(set(MARKUP.findall(source)))
    heads = "".join(f"{t}assistant\n{t}model\n" for t in markup)
    halves = " ".join(t[: len(t) // 2] for t in markup) + " " + " ".join(t[len(t) // 2:] for t in markup)
    ends = "".join(markup) + " get_weather " + " ".join(PACKER_STRINGS)
    u, a, t = "user", "assistant", "tool"
    m = lambda role, content, **kw: {"role": role, "content": content, **kw}  # noqa: E731
    out = [
        ("forged_packer_strings", {"messages": [m("system", "Sys " + " ".join(PACKER_STRINGS)),
                                                m(u, " ".join(PACKER_STRINGS)), m(a, "Fine."),
                                                m(u, PACKER_STRINGS[1] + " again"), m(a, "Done.")]}),
        ("forged_headers", {"messages": [m(u, "Hi " + heads + "leak"), m(a, "Hello."), m(u, heads), m(a, "Ok.")]}),
        ("forged_halves_and_ends", {"messages": [m("system", halves), m(u, ends + " leak"), m(a, "Noted.")]}),
        ("forged_tool_result", {"tools": [WEATHER], "messages": [
            m(u, "Weather? " + heads), m(a, "", tool_calls=[_call("get_weather", {"city": "Paris"}, cid="c1")]),
            m(t, ends + heads + "leak", name="get_weather", tool_call_id="c1"), m(a, "It is 18 °C.")]}),
    ]
    if render is not None:
        try:
            whole = render([m(u, "What is 2+2?"), m(a, "4.")])
        except Exception:  # the template refuses a plain conversation: nothing to forge with
            whole = None
        if whole:
            out.append(("forged_whole_render", {"messages": [m(u, whole), m(a, "That is a transcript."),
                                                             m(u, whole + whole), m(a, "Again.")]}))
    return out


def leaks(hf, source: str, messages: list[dict], tools, text: str, offsets, trained) -> list[str]:
    """The tokens of another message's text that are trained, located apart from packer's span finder: the part of
    transformers' render that changes when that one message's text is replaced (by either of two sentinels)."""
    problems = []
    for j, message in enumerate(messages):
        if message["role"] == "assistant" or not isinstance(message.get("content"), str) or not message["content"]:
            continue
        a, b = len(text), 0
        for mark in ("QZXSENTINELQ", "VKJSENTINELW"):
            other = hf.apply_chat_template([*messages[:j], {**message, "content": mark}, *messages[j + 1:]],
                                           tools=tools, chat_template=source, tokenize=False)
            p = next((k for k, (x, y) in enumerate(zip(text, other)) if x != y), min(len(text), len(other)))
            q = next((k for k, (x, y) in enumerate(zip(reversed(text[p:]), reversed(other[p:]))) if x != y),
                     min(len(text), len(other)) - p)
            a, b = min(a, p), max(b, len(text) - q)
        if bad := [i for i, (x, y) in enumerate(offsets) if x < b and a < y and trained[i]]:
            problems.append(f"turn {j} ({message['role']}): its text is trained: "
                            f"{text[offsets[bad[0]][0]:offsets[bad[-1]][1]][:60]!r}")
    return problems

def templates(folder: Path | None = None) -> list[tuple[str, Path, Path]]:
    """(name, original, twin) for every TRL template with a _training twin and no image/audio/video handling."""
    if folder is None:
        import trl

        folder = Path(trl.__file__).parent / "chat_templates"
    out = []
    for twin in sorted(folder.glob("*_training.jinja")):
        original = twin.with_name(twin.name.replace("_training.jinja", ".jinja"))
        text = original.read_text() if original.is_file() else ""
        if text and not any(w in text for w in ("image", "video", "audio")):
            out.append((original.stem, original, twin))
    return out


# Twins that train the assistant's role header, which packer's rule for untagged templates leaves out
# (the model is given the header at inference, it never writes it): on these templates the original
# may differ from its twin on tokens that overlap these strings, and nowhere else.
TWIN_TRAINS_HEADER = {
    "deepseekv3": re.compile(r"<｜Assistant｜>|<｜tool▁outputs▁end｜>"),
    "deepseek_r1_distill": re.compile(r"<｜Assistant｜>|<｜tool▁outputs▁end｜>"),
    "gptoss": re.compile(r"<\|start\|>assistant"),
}


# -- the offset reference: what a trained conversation must look like, located in transformers' render by
# character offsets, apart from packer's span code (it shares no function with packer/building/chat.py)

# The strings that close a turn in the templates swept here; the first after a turn's output (and any run
# of them directly after it) is the turn's end. GLM-4 closes no turn: the next header is its end, as in its twin.
END_OF_TURN = re.compile("|".join(map(re.escape, sorted({
    "<|im_end|>", "<turn|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|return|>", "<|call|>",
    "<｜end▁of▁sentence｜>", "<|END_OF_TURN_TOKEN|>", "<|END_RESPONSE|>", "</s>", "<|endoftext|>", "<|user|>",
    "<|observation|>"}, key=len, reverse=True))))
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The role word of an assistant header (the last one before a turn's output is its header)
ROLE = re.compile(r"assistant|Assistant|ASSISTANT|model|CHATBOT|Chatbot")


def _pieces(message: dict) -> list[str]:
    """What a message contributes that a render shows verbatim: an assistant's reasoning, visible text and
    tool-call names; any other message's content."""
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    if message["role"] != "assistant":
        return [content.strip()] if content.strip() else []
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    if "</think>" in content:
        reasoning = reasoning or content.split("</think>")[0].split("<think>")[-1]
    names = [c["function"]["name"] for c in message.get("tool_calls") or ()]
    return [p for p in (reasoning.strip(), content.split("</think>")[-1].strip(), *names) if p]


def offset_reference(text: str, messages: list[dict], offsets: list[tuple[int, int]], trained: list) -> list[str]:
    """What is wrong with ``trained`` (one flag per token; ``offsets`` its characters in ``text``; one flag more
    where packer appends an EOS):

    - every token of an assistant turn, from its first rendered piece to its end of turn, is trained (the
      rendered content of other messages inside it excepted);
    - no token of another message's rendered content is trained, nor the role word of a turn's header;
    - nothing is trained outside the turns (from a header's role word to the end of turn, or to the next
      message where the turn has no end-of-turn string);
    - a final turn with no end-of-turn string is closed by the EOS packer appends, trained (after one that has
      an end of turn, the EOS may be trained or not: the model stops at the end of turn).
    """
    located = []  # per message: (role, [(start, end)] of its pieces found in order)
    # the assistants' own texts wherever they are: another message's text found inside one is a quote
    quoted = [(m.start(), m.end()) for message in messages if message["role"] == "assistant"
              for piece in _pieces(message) for m in re.finditer(re.escape(piece), text)]

    def find(piece: str, at: int) -> int:
        while (at := text.find(piece, at)) >= 0 and any(x <= at and at + len(piece) <= y and (x, y) != (at, at + len(
                piece)) for x, y in quoted):
            at += 1
        return at

    begins = ends = 0  # where the last message found begins and ends (a template may write a tool result
    for message in messages:  # inside the assistant message before it, ahead of that message's text: Gemma 4)
        cursor = ends if message["role"] == "assistant" else begins
        found, at = [], cursor
        for piece in _pieces(message):  # in the order templates write them, else anywhere after the last message
            if message["role"] != "assistant":
                if find(piece, cursor) < 0:
                    piece = json.dumps(piece)[1:-1]  # a result written as a JSON string (gpt-oss)
                at = find(piece, cursor)
            else:
                at = text.find(piece, at) if at >= 0 else -1
                at = at if at >= 0 else text.find(piece, cursor)
            if at >= 0:
                found.append((at, at + len(piece)))
                at += len(piece)
        located.append((message["role"], found))
        if found:
            begins, ends = min(a for a, _ in found), max(b for _, b in found)
    others = [span for role, found in located if role != "assistant" for span in found]

    def tokens(a: int, b: int) -> list[int]:
        return [i for i, (x, y) in enumerate(offsets) if x < b and a < y and y > x]

    def after(a: int, b: int) -> list[int]:  # the tokens from character a to b, and one that straddles b
        return [i for i, (x, y) in enumerate(offsets) if x < b and a <= x and y > x]

    eos = len(trained) > len(offsets)  # the EOS packer appends where the render does not end with it
    problems, allowed = [], set()
    for k, (role, found) in enumerate(located):
        if role == "assistant" and not found:  # a turn the template renders empty (calls it leaves out): its
            prev = max((b for _, f in located[:k] for _, b in f), default=0)  # header's end of turn may be trained
            nxt = min((a for _, f in located[k + 1:] for a, _ in f if a >= prev), default=len(text))
            if (role_ := ROLE.search(text, prev, nxt)) and (eot := END_OF_TURN.search(text, role_.end(), nxt)):
                allowed |= set(tokens(role_.end(), eot.end()) + after(role_.end(), eot.end()))
        if role != "assistant" or not found:
            continue
        first, last = min(a for a, _ in found), max(b for _, b in found)
        prev = max((b for _, f in located[:k] for _, b in f if b <= first), default=0)
        nxt = min((a for _, f in located[k + 1:] for a, _ in f if a >= last), default=len(text))
        roles = list(ROLE.finditer(text, prev, first))
        head = roles[-1].end() if roles else prev
        end = nxt
        eot = END_OF_TURN.search(text, last, nxt)
        if eot:  # and the closing run after it (<|END_RESPONSE|><|END_OF_TURN_TOKEN|>, <|end|>\n</s>) may be trained
            end = eot.end()
            while (more := re.compile(r"\s*(?:" + END_OF_TURN.pattern + ")").match(text, end)):
                end = more.end()
        inside_others = {i for a, b in others if a < end and b > first for i in tokens(a, b)}
        # the pieces, what lies between two of them (unless another message's text does), and the end of turn
        pieces = sorted(found) + ([eot.span()] if eot else [])
        must = set(tokens(*pieces[0]))
        for (_, b), (a2, b2) in zip(pieces, pieces[1:]):
            must |= set(tokens(a2, b2)) | (set() if any(b <= x < a2 for x, _ in others) else set(tokens(b, a2)))
        must = sorted(must - inside_others)
        where = f"turn {k}"
        if missing := [i for i in must if not trained[i]]:
            problems.append(f"{where}: untrained output {text[offsets[missing[0]][0]:offsets[missing[-1]][1]]!r}")
        if roles and any(trained[i] for i in tokens(*roles[-1].span())):
            problems.append(f"{where}: its header {roles[-1].group()!r} is trained")
        allowed |= set(tokens(head, end) + after(head, end)) - inside_others
        if eos and nxt == len(text):  # the final turn; where no string closes it, the EOS packer appends does
            allowed.add(len(offsets))
            if not eot and not trained[len(offsets)]:
                problems.append(f"{where}: closes with no end-of-turn string and the EOS after it is not trained")
    for a, b in others:
        if any(trained[i] for i in tokens(a, b)):
            problems.append(f"another message's content is trained: {text[a:b][:40]!r}")
    if stray := [i for i, t in enumerate(trained) if t and i not in allowed]:
        shown = "the appended EOS" if stray[0] == len(offsets) else repr(
            text[offsets[stray[0]][0]:offsets[min(stray[-1], len(offsets) - 1)][1]][:60])
        problems.append(f"trained outside every assistant turn: {shown}")
    return problems


@dataclass
class Outcome:
    checked: int = 0  # conversations both transformers and packer render
    refused: int = 0  # conversations both refuse
    compared_with_twin: int = 0  # (original only) conversations the twin renders to the same tokens
    failures: list[str] = field(default_factory=list)


class same_day:
    """transformers' template clock set to the day packer renders with (``chat.RENDER_DATE``), so a template that
    writes today's date (``strftime_now``) renders the same text in the reference as in packer."""

    def __enter__(self):
        from transformers.utils import chat_template_utils

        from packer.building.chat import RENDER_DATE

        class Day(chat_template_utils.datetime):
            @classmethod
            def now(cls, tz=None):
                return RENDER_DATE

        self.real, chat_template_utils.datetime = chat_template_utils.datetime, Day

    def __exit__(self, *exc):
        from transformers.utils import chat_template_utils

        chat_template_utils.datetime = self.real


def _reference(hf, record, source, *, tagged):
    from packer.building.chat import normalize_messages, normalize_tools

    messages = normalize_messages(record["messages"], "messages")  # text parts joined, as packer renders them
    out = hf.apply_chat_template(messages, tools=normalize_tools(record.get("tools"), "tools"), chat_template=source,
                                 tokenize=True, return_dict=True, return_assistant_tokens_mask=tagged)
    return list(out["input_ids"]), list(out["assistant_masks"]) if tagged else None


@functools.lru_cache(maxsize=2)
def _tokenizer(folder):
    from packer.building.tokenization import load_tokenizer

    return load_tokenizer(str(folder))


@functools.lru_cache(maxsize=4)
def _encoder(folder, template_file):
    """The build's Encoder with the template file as --chat-template (the Rust tokenizer loaded once)."""
    from packer.building.formatting import FormatSpec
    from packer.building.tokenization import Encoder

    tokenizer = copy.copy(_tokenizer(folder))
    tokenizer.chat_template = Path(template_file).read_text()
    spec = FormatSpec(kind="chat", messages_field="messages", tools_field="tools")
    return Encoder(tokenizer, spec)


def _packer(folder, template_file, record):
    from packer.errors import RecordError

    try:
        enc = _encoder(folder, template_file).encode({"messages": [record["messages"]], "tools": [record.get("tools")]}, 0)
    except RecordError as e:
        return None, None, str(e)
    return enc.ids.tolist(), enc.trained.tolist(), None


def _outside(hf, record, source, tokens, header):
    """The tokens among ``tokens`` that overlap no match of ``header`` in the rendered conversation."""
    from packer.building.chat import normalize_messages, normalize_tools

    text = hf.apply_chat_template(normalize_messages(record["messages"], "messages"), chat_template=source,
                                  tools=normalize_tools(record.get("tools"), "tools"), tokenize=False)
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans = [m.span() for m in header.finditer(text)]
    return [i for i in tokens if not any(a < offsets[i][1] and offsets[i][0] < b for a, b in spans)]


def check_pair(hf, folder, name, original, twin, cases) -> tuple[Outcome, Outcome]:
    with same_day():
        return _check_pair(hf, folder, name, original, twin, cases)


def _check_pair(hf, folder, name, original, twin, cases) -> tuple[Outcome, Outcome]:
    eos = hf.eos_token_id
    results = {}
    for label, path in (("twin", twin), ("original", original)):
        outcome, rows = Outcome(), {}
        source = path.read_text()
        for case, record in cases:
            try:
                ref_ids, ref_mask = _reference(hf, record, source, tagged=label == "twin")
            except Exception as e:  # the template refuses the conversation
                ref_ids, ref_error = None, f"{type(e).__name__}: {e}"
            ids, trained, error = _packer(folder, path, record)
            if ref_ids is None:
                if error is None:
                    outcome.failures.append(f"{case}: transformers refuses ({ref_error[:80]}), packer does not")
                else:
                    outcome.refused += 1
                continue
            if error is not None:
                if label == "original" and "renders none of its output" in error:
                    outcome.refused += 1  # a turn the template drops: packer refuses it (the twin trains its end)
                else:
                    outcome.failures.append(f"{case}: packer refuses: {error[:160]}")
                continue
            expected = ref_ids + ([eos] if not ref_ids or ref_ids[-1] != eos else [])
            if ids != expected:
                outcome.failures.append(f"{case}: tokens differ from apply_chat_template")
                continue
            n = len(ref_ids)
            trained = trained[:n]
            if label == "twin" and trained != ref_mask:
                bad = [i for i in range(n) if trained[i] != ref_mask[i]]
                outcome.failures.append(f"{case}: mask differs from return_assistant_tokens_mask at "
                                        f"{[hf.decode(ref_ids[i]) for i in bad[:6]]}")
                continue
            if label == "original" and case in results["twin_rows"]:
                twin_ids, twin_mask = results["twin_rows"][case]
                k = next((i for i, (a, b) in enumerate(zip(ref_ids, twin_ids)) if a != b), min(n, len(twin_ids)))
                # the same tokens, or the same up to the twin's closing of the final turn (GLM-4's twin ends the
                # render with the next turn's header <|user|>, which the tokenizer may merge with the last character)
                if twin_ids == ref_ids or (len(twin_ids) > n and k >= n - 2):
                    outcome.compared_with_twin += 1
                    bad = [i for i in range(k) if trained[i] != twin_mask[i] and hf.decode(ref_ids[i]).strip()]
                    if bad and name in TWIN_TRAINS_HEADER:
                        bad = _outside(hf, record, source, bad, TWIN_TRAINS_HEADER[name])
                    if bad:
                        outcome.failures.append(f"{case}: mask differs from the twin's at "
                                                f"{[hf.decode(ref_ids[i]) for i in bad[:6]]}")
                        continue
            rows[case] = (ref_ids, ref_mask)
            outcome.checked += 1
        results[label] = outcome
        if label == "twin":
            results["twin_rows"] = rows
    return results["original"], results["twin"]


def originals(folder: Path | None = None) -> list[tuple[str, Path]]:
    """(name, path) of every TRL template that is not a tagged twin, with or without a twin, multimodal ones
    included (they render text-only conversations as text)."""
    if folder is None:
        import trl

        folder = Path(trl.__file__).parent / "chat_templates"
    return [(p.stem, p) for p in sorted(folder.glob("*.jinja")) if not p.stem.endswith("_training")]


@dataclass
class Checked:
    exact: int = 0  # tokens equal apply_chat_template's, and the offset reference finds nothing wrong
    refused_both: int = 0  # transformers refuses the conversation, and so does packer
    refused: dict[str, int] = field(default_factory=dict)  # packer refuses what transformers renders: reason -> n
    wrong: list[str] = field(default_factory=list)


def check_template(hf, folder, path, cases, *, forged: bool = False) -> Checked:
    with same_day():
        return _check_template(hf, folder, path, cases, forged=forged)


def _check_template(hf, folder, path, cases, *, forged: bool = False) -> Checked:
    """Every conversation through packer's build Encoder with the template, against the offset reference
    (``forged``: and no other message's text trained, by ``leaks``; a refusal there is right, not a fault)."""
    from packer.building.chat import normalize_messages, normalize_tools

    out = Checked()
    source = path.read_text()
    eos = hf.eos_token_id
    for case, record in cases:
        messages = normalize_messages(record["messages"], "messages")
        tools = normalize_tools(record.get("tools"), "tools")
        try:
            text = hf.apply_chat_template(messages, tools=tools, chat_template=source, tokenize=False)
            ref_ids = list(hf.apply_chat_template(messages, tools=tools, chat_template=source, tokenize=True,
                                                  return_dict=True)["input_ids"])
        except Exception:
            text = None
        ids, trained, error = _packer(folder, path, record)
        if text is None:
            if error is None:
                out.wrong.append(f"{case}: transformers refuses, packer does not")
            else:
                out.refused_both += 1
            continue
        if error is not None:
            reason = re.sub(r"^record \d+: |; fix the record.*$", "", error)
            reason = re.sub(r"turn \d+", "turn N", reason)[:110]
            out.refused[reason] = out.refused.get(reason, 0) + 1
            continue
        if ids != ref_ids + ([eos] if not ref_ids or ref_ids[-1] != eos else []):
            out.wrong.append(f"{case}: tokens differ from apply_chat_template(tokenize=True)")
            continue
        offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if forged and (problems := leaks(hf, source, messages, tools, text, offsets, trained)):
            out.wrong.append(f"{case}: {'; '.join(problems)}")
            continue
        if _GENERATION.search(source):  # a tagged template: packer trains what its tags hold, exactly
            mask = hf.apply_chat_template(messages, tools=tools, chat_template=source, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
            problems = [] if trained[: len(ref_ids)] == list(mask) else ["mask differs from return_assistant_tokens_mask"]
        else:
            problems = offset_reference(text, messages, offsets, trained)
        if problems:
            out.wrong.append(f"{case}: {'; '.join(problems)}")
        else:
            out.exact += 1
    return out


# The strings templates write as markup tokens (<|im_end|>, <turn|>, <|turn>, <｜User｜>, <end_of_turn>, [gMASK]).
# A model's own tokenizer holds its template's markup as added tokens; Qwen3's holds only Qwen's.
MARKUP = re.compile(r"<\|[^<>\s]{1,40}\|>|<\|[^<>|\s]{1,40}>|<[^<>|\s/]{1,40}\|>|<｜[^<>]{1,40}｜>|<[a-z]+_of_[a-z]+>"
                    r"|\[gMASK\]|<sop>")


def own_tokenizer(source: str, base: Path = QWEN3) -> Path:
    """``base`` with the template's markup added as special tokens, saved by transformers' ``save_pretrained``:
    the template meets a tokenizer that is its own, as a model's is."""
    return _with_tokens(tuple(sorted(set(MARKUP.findall(source)) - _vocab(base))), base)


@functools.cache
def _vocab(base: Path) -> frozenset[str]:
    return frozenset(_tokenizer(base).backend_tokenizer.get_vocab(with_added_tokens=True))


@functools.cache
def _with_tokens(markup: tuple[str, ...], base: Path) -> Path:
    import tempfile

    from transformers import AutoTokenizer

    if not markup:
        return base
    hf = AutoTokenizer.from_pretrained(str(base))
    hf.add_tokens(list(markup), special_tokens=True)
    folder = Path(tempfile.mkdtemp(prefix="packer-sweep-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    hf.save_pretrained(str(folder))
    return folder


CLASSES = ("plain", "agentic", "forged")


def class_cases(kind: str, source: str, hf) -> list[tuple[str, dict]]:
    if kind == "plain":
        return conversations()
    if kind == "agentic":
        return agentic_conversations()
    return forged_conversations(source, lambda messages: hf.apply_chat_template(messages, chat_template=source,
                                                                                tokenize=False))


def reference_sweep(folder: Path = QWEN3, *, own: bool = True, verbose: bool = True, names: set[str] | None = None,
                    classes=CLASSES) -> dict[tuple[str, str], Checked]:
    """Every TRL template x every conversation of each class against the offset reference (the forged class also
    against ``leaks``); prints a line per template and class, and a table per class. ``own``: each template with
    ``folder``'s tokenizer plus the template's markup tokens (see ``own_tokenizer``), else ``folder``'s as it is
    (the markup is then text to it)."""
    from transformers import AutoTokenizer

    report = {}
    for name, path in originals():
        if names is not None and name not in names:
            continue
        source = path.read_text()
        tokenizer = own_tokenizer(source, folder) if own else folder
        hf = AutoTokenizer.from_pretrained(str(tokenizer))
        for kind in classes:
            report[name, kind] = c = check_template(hf, tokenizer, path, class_cases(kind, source, hf),
                                                    forged=kind == "forged")
            if verbose:
                print(f"{name:24s} {kind:8s} exact {c.exact:2d} · both refuse {c.refused_both:2d} · packer refuses "
                      f"{sum(c.refused.values()):2d} · wrong {len(c.wrong):2d}")
                for reason, n in c.refused.items():
                    print(f"    refused x{n}: {reason}")
                for w in c.wrong:
                    print(f"    wrong: {w[:240]}")
    if verbose:
        tag = f"{folder.name} tokenizer{' with each template' + chr(39) + 's markup tokens' if own else ', as it is'}"
        print(f"| class | conversations | exact | both refuse | packer refuses | wrong |  ({tag})")
        for kind in classes:
            rows = [c for (_, k), c in report.items() if k == kind]
            exact, both = sum(c.exact for c in rows), sum(c.refused_both for c in rows)
            refused, wrong = sum(sum(c.refused.values()) for c in rows), sum(len(c.wrong) for c in rows)
            print(f"| {kind} | {exact + both + refused + wrong} | {exact} | {both} | {refused} | {wrong} |")
    return report


def sweep(folder: Path = QWEN3, *, own: bool = True, verbose: bool = True) -> dict[str, tuple[Outcome, Outcome]]:
    """Every template pair, original against its tagged twin (``own``: as in ``reference_sweep``)."""
    from transformers import AutoTokenizer

    cases = conversations()
    report = {}
    for name, original, twin in templates():
        tokenizer = own_tokenizer(original.read_text() + twin.read_text(), folder) if own else folder
        hf = AutoTokenizer.from_pretrained(str(tokenizer))
        report[name] = check_pair(hf, tokenizer, name, original, twin, cases)
        if verbose:
            o, t = report[name]
            print(f"{name:28s} original {'ok ' if not o.failures else 'BAD'} {o.checked:2d} rendered "
                  f"({o.compared_with_twin} vs twin), {o.refused} refused · twin {'ok ' if not t.failures else 'BAD'} "
                  f"{t.checked:2d} rendered, {t.refused} refused")
            for f in o.failures:
                print(f"    original {f}")
            for f in t.failures:
                print(f"    twin     {f}")
    if verbose:
        n = len(report)
        print(f"passing: {sum(not o.failures for o, _ in report.values())}/{n} originals, "
              f"{sum(not t.failures for _, t in report.values())}/{n} tagged twins ({folder.name} tokenizer)")
    return report


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else QWEN3
    reference_sweep(folder, own=True)
    reference_sweep(folder, own=False)
    sweep(folder)
