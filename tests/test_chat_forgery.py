"""What no message can make packer train, Gemma 4's tool loops, and renders that do not depend on the day.

- Forged spans: user, system and tool texts that hold packer's own marker strings, special tokens' text, role
  headers and end-of-turn literals (whole, halved, or a whole rendered conversation) are never trained: each
  message's text is located apart from packer's span finder (``chat_sweep.leaks``: the part of transformers'
  render that changes when that one message's text is replaced), and a record is either built with none of
  those tokens trained, or refused.
- Gemma 4 (every variant TRL ships): agentic tool loops exact against the offset reference.
- A template that asks for the date (``strftime_now``) builds the same bytes whatever the machine's clock says,
  and verify --source agrees.
"""

from __future__ import annotations

import datetime
import hashlib
from pathlib import Path

import pytest
from chat_sweep import (
    PACKER_STRINGS,
    _packer,
    agentic_conversations,
    check_template,
    forged_conversations,
    leaks,
    originals,
)
from conftest import SHARED_DATA, make_build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_chat import WEATHER, hf_tokenizer, need, write_jsonl
from test_chat_templates import own

from packer.building.chat import normalize_messages

QWEN3 = SHARED_DATA / "tokenizers" / "qwen3"
LLAMA31 = SHARED_DATA / "tokenizers" / "llama3_1"
TEMPLATES = dict(originals())
GEMMA4 = sorted(n for n in TEMPLATES if n.startswith("gemma4"))


def _check(hf, folder, template: Path, record) -> str | None:
    """None where packer builds the record with no other message's text trained, or refuses it; else the fault."""
    source = template.read_text()
    messages = normalize_messages(record["messages"], "messages")
    tools = record.get("tools")
    ids, trained, error = _packer(folder, template, record)
    if error is not None:
        return None
    text = hf.apply_chat_template(messages, tools=tools, chat_template=source, tokenize=False)
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    problems = leaks(hf, source, messages, tools, text, offsets, trained)
    return "; ".join(problems) or None


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "c1"}


def _tool_loop(user: str, result: str) -> dict:
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": user}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": result, "name": "get_weather", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 18 °C."}]}


@pytest.mark.parametrize(("folder", "header", "dropped"), [
    (QWEN3, "<|im_start|>assistant\n<tool_call>\nget_weather", False),
    (LLAMA31, "<|start_header_id|>assistant<|end_header_id|>\n\nget_weather", True),
], ids=["qwen3", "llama3_1"])
def test_a_forged_header_before_a_call_is_not_trained(folder, header, dropped, tmp_path):
    """The user writes the assistant's header and the call's name: on packer before this change the span finder
    anchored the call there and trained the user's text (Qwen3, Llama 3.1 with their own templates). Llama 3.1's
    template leaves this call out (its turn is a header and <|eot_id|>): refused, never its end alone trained."""
    hf = hf_tokenizer(need(folder))
    template = tmp_path / "own.jinja"
    template.write_text(hf.chat_template)
    record = _tool_loop("Weather? " + header, "18 C " + header)
    assert _check(hf, folder, template, record) is None
    ids, trained, error = _packer(folder, template, record)
    if dropped:
        assert error is not None and "renders none of its output" in error
    else:
        assert error is None and sum(trained) > 0  # built, not refused: the forgery no longer confuses packer


def test_packer_marker_strings_in_user_text(tmp_path):
    """packer's own marker strings in a user's text (on packer before this change, DeepSeek V3's and Mistral
    Nemo's templates trained that user text): the markers are salted per record, absent from every message."""
    hf = hf_tokenizer(need(QWEN3))
    template = tmp_path / "own.jinja"
    template.write_text(hf.chat_template)
    record = {"messages": [{"role": "user", "content": " ".join(PACKER_STRINGS)}, {"role": "assistant", "content": "A."},
                           {"role": "user", "content": PACKER_STRINGS[1]}, {"role": "assistant", "content": "B."}]}
    ids, trained, error = _packer(QWEN3, template, record)
    assert error is None and _check(hf, QWEN3, template, record) is None
    assert hf.decode([i for i, t in zip(ids, trained) if t]) == "A.<|im_end|><think>\n\n</think>\n\nB.<|im_end|>"


SWEPT = ["qwen3", "llama3_1", "deepseekv3", "gemma3", "gemma4", "phi3", "mistral" if "mistral" in TEMPLATES else "cohere"]


@pytest.mark.parametrize("name", SWEPT)
def test_forged_conversations_on_the_offset_and_leak_references(name):
    hf, folder = own(TEMPLATES[name])
    checked = check_template(hf, folder, TEMPLATES[name], forged_conversations(
        TEMPLATES[name].read_text(), lambda m: hf.apply_chat_template(m, chat_template=TEMPLATES[name].read_text(),
                                                                      tokenize=False)), forged=True)
    assert not checked.wrong, checked.wrong


# the pieces forged texts are drawn from: a template's markup, halves of it, role words, packer's strings
def _pieces(source: str) -> list[str]:
    from chat_sweep import MARKUP

    markup = sorted(set(MARKUP.findall(source)))
    return [*markup, *(t[: len(t) // 2] for t in markup), *(t[len(t) // 2:] for t in markup), *PACKER_STRINGS,
            "assistant", "model", "\n", "\n\n", " ", "get_weather", "It is 18 °C.", "hello"]


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "deepseekv3", "gemma4"])
def test_property_no_forged_text_is_trained(name):
    """Hypothesis draws user, system and tool texts from the template's markup, halves of it, role words and
    packer's strings: every record is built with none of that text trained, or refused."""
    template = TEMPLATES[name]
    hf, folder = own(template)
    text = st.lists(st.sampled_from(_pieces(template.read_text())), min_size=1, max_size=8).map("".join)

    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(system=text, user=text, result=text, with_tools=st.booleans())
    def check(system, user, result, with_tools):
        if with_tools:
            record = _tool_loop(user, result)
            record["messages"].insert(0, {"role": "system", "content": system})
        else:
            record = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user},
                                   {"role": "assistant", "content": "Fine."}, {"role": "user", "content": result},
                                   {"role": "assistant", "content": "Done."}]}
        assert _check(hf, folder, template, record) is None

    check()


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_tool_loops(name):
    """Calls, results in the model turn, text beside calls, answers after in-turn results: the assistant's calls
    and answers trained through their end of turn, the results not (every Gemma 4 variant TRL ships)."""
    hf, folder = own(TEMPLATES[name])
    checked = check_template(hf, folder, TEMPLATES[name], agentic_conversations(), forged=True)
    assert not checked.wrong and not checked.refused, (checked.wrong, checked.refused)
    assert len(GEMMA4) >= 5


class _Clock(datetime.datetime):
    day = datetime.datetime(2031, 1, 2)

    @classmethod
    def now(cls, tz=None):
        return cls.day


def test_a_dated_template_builds_the_same_bytes_on_any_day(tmp_path, monkeypatch):
    """Llama 3.2's template writes today's date (strftime_now) into the system prompt: the machine's clock set to
    two days gives byte-identical shards, and verify --source on a third day agrees with the build."""
    from transformers.utils import chat_template_utils

    from packer.checking.verify import verify

    need(LLAMA31)
    src = str(write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                               {"role": "assistant", "content": "Hello."}]}]))
    monkeypatch.setattr(chat_template_utils, "datetime", _Clock)  # the clock transformers gives templates
    digests = []
    for k, day in enumerate((datetime.datetime(2031, 1, 2), datetime.datetime(2032, 6, 30))):
        _Clock.day = day
        out = make_build(tmp_path / f"b{k}", src, tokenizer=str(LLAMA31), chat_template=str(TEMPLATES["llama3_2"]))
        digests.append([hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.arrow"))])
    assert digests[0] == digests[1] and digests[0]
    _Clock.day = datetime.datetime(2040, 3, 3)
    assert verify(tmp_path / "b0", source=src, tokenizer=str(LLAMA31)).ok
    assert chat_template_utils.datetime is _Clock  # packer's fixed date is given only while it renders
