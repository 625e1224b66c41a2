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

import copy
import functools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"

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
    ]


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


@dataclass
class Outcome:
    checked: int = 0  # conversations both transformers and packer render
    refused: int = 0  # conversations both refuse
    compared_with_twin: int = 0  # (original only) conversations the twin renders to the same tokens
    failures: list[str] = field(default_factory=list)


def _reference(hf, record, source, *, tagged):
    from packer.chat import normalize_messages, normalize_tools

    messages = normalize_messages(record["messages"], "messages")  # text parts joined, as packer renders them
    out = hf.apply_chat_template(messages, tools=normalize_tools(record.get("tools"), "tools"), chat_template=source,
                                 tokenize=True, return_dict=True, return_assistant_tokens_mask=tagged)
    return list(out["input_ids"]), list(out["assistant_masks"]) if tagged else None


@functools.lru_cache(maxsize=2)
def _tokenizer(folder):
    from packer.tokenization import load_tokenizer

    return load_tokenizer(str(folder))


@functools.lru_cache(maxsize=4)
def _encoder(folder, template_file):
    """The build's Encoder with the template file as --chat-template (the Rust tokenizer loaded once)."""
    from packer.formatting import FormatSpec
    from packer.tokenization import Encoder

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
    from packer.chat import normalize_messages, normalize_tools

    text = hf.apply_chat_template(normalize_messages(record["messages"], "messages"), chat_template=source,
                                  tools=normalize_tools(record.get("tools"), "tools"), tokenize=False)
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans = [m.span() for m in header.finditer(text)]
    return [i for i in tokens if not any(a < offsets[i][1] and offsets[i][0] < b for a, b in spans)]


def check_pair(hf, folder, name, original, twin, cases) -> tuple[Outcome, Outcome]:
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


def sweep(folder: Path = QWEN3, *, verbose: bool = True) -> dict[str, tuple[Outcome, Outcome]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    cases = conversations()
    report = {}
    for name, original, twin in templates():
        report[name] = check_pair(hf, folder, name, original, twin, cases)
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
    sweep(Path(sys.argv[1]) if len(sys.argv) > 1 else QWEN3)
