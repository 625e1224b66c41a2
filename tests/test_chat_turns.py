"""Where an untagged template's turns begin and end, learnt from the tokenizer's own tokens and the template's
renders: Gemma 4's turns (<|turn>model … <turn|>, tool results written inside the model turn), a template that
closes no turn, Qwen3.5's pre-filled think block, gpt-oss's empty content beside a call, a template that refuses
packer's probe, and a named tool_use template that needs tools (the probe gives it one)."""

from __future__ import annotations

import copy
import json

import pytest
from chat_sweep import QWEN3, _call, conversations, own_tokenizer
from click.testing import CliRunner
from conftest import make_build, one_line
from test_chat import TRL_TEMPLATES, built, need, trained_text, write_jsonl
from test_chat_named import named_folder

from packer.building.formatting import FormatSpec
from packer.building.tokenization import Encoder, load_tokenizer
from packer.cli import main
from packer.errors import TokenizerError

CASES = dict(conversations())
SPEC = FormatSpec(kind="chat", messages_field="messages", tools_field="tools")


def encoder(folder, template: str) -> Encoder:
    tokenizer = copy.copy(load_tokenizer(str(need(folder))))
    tokenizer.chat_template = template
    return Encoder(tokenizer, SPEC)


def trained(enc: Encoder, record: dict) -> list[str]:
    out = enc.encode({"messages": [record["messages"]], "tools": [record.get("tools")]}, 0)
    return trained_text(enc.tokenizer, out.ids.tolist(), out.trained.astype(bool).tolist())


@pytest.fixture(scope="module")
def gemma4():
    source = (TRL_TEMPLATES / "gemma4.jinja").read_text()
    return encoder(own_tokenizer(source, need(QWEN3)), source)


def test_gemma4_turns_and_the_tool_result_inside_the_model_turn(gemma4):
    """<turn|> ends a turn because it is one of the tokenizer's tokens; the tool result Gemma 4 writes inside the
    model turn, between the call and the reply, is not trained (the old span finder refused every conversation)."""
    runs = trained(gemma4, CASES["tool_call_object_args"])
    assert runs == ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
                    "It is 18 °C and clear in Paris.<turn|>"]
    assert trained(gemma4, CASES["system_three_turns"]) == ["7.<turn|>", "11.<turn|>", "2, the only even prime.<turn|>"]
    # a turn's own text written after the results (two calls, then "Checking both."): the calls and the text
    runs = trained(gemma4, CASES["two_calls_two_replies"])
    assert not any("-3}" in r or "09:12<|" in r for r in runs) and "Checking both.<turn|>" in runs


def test_gemma4_with_its_end_of_turn_as_eos_never_trains_the_tool_result(tmp_path):
    """The issue's case: with EOS <turn|>, the span of a call ran to the <turn|> after the tool result."""
    from transformers import AutoTokenizer

    source = (TRL_TEMPLATES / "gemma4.jinja").read_text()
    hf = AutoTokenizer.from_pretrained(str(own_tokenizer(source, need(QWEN3))))
    hf.eos_token = "<turn|>"
    hf.save_pretrained(str(tmp_path))
    enc = encoder(tmp_path, source)
    for case in ("tool_call_object_args", "tool_call_string_args_null_content", "two_calls_two_replies",
                 "reasoning_tool_call_empty_content"):
        runs = trained(enc, CASES[case])
        # a result is written as response:NAME{value:...}<tool_response|> inside the model turn: never trained
        assert runs[0].endswith("<|tool_response>") and not any("response:" in run for run in runs), (case, runs)
        assert runs[-1].endswith("<turn|>")


# A community template that closes no turn: a turn ends where the next header begins
NO_CLOSE = ("{% for m in messages %}{% if m.role == 'user' %}### User:\n{{ m.content }}\n\n{% else %}### Assistant:\n"
            "{{ m.content }}\n\n{% endif %}{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}")


def test_a_template_that_closes_no_turn_builds_multi_turn_and_trains_the_final_eos():
    enc = encoder(QWEN3, NO_CLOSE)
    record = CASES["system_three_turns"]
    record = {"messages": [m for m in record["messages"] if m["role"] != "system"]}
    out = enc.encode({"messages": [record["messages"]], "tools": [None]}, 0)
    runs = trained_text(enc.tokenizer, out.ids.tolist(), out.trained.astype(bool).tolist())
    # each turn's text; the last one runs to the end of the render and the EOS packer appends closes it, trained
    # (Qwen's tokenizer spells ".\n\n" as one token, which holds trained text, so it is trained)
    assert runs == ["7.\n\n", "11.\n\n", "2, the only even prime.\n\n<|im_end|>"]
    assert out.ids[-1] == enc.eos and out.trained[-1] == 1


def test_qwen3_5_nothink_reasoning_is_output_and_the_prompts_empty_think_block_is_not():
    enc = encoder(QWEN3, (TRL_TEMPLATES / "qwen3_5_nothink.jinja").read_text())
    runs = trained(enc, CASES["reasoning_content"])
    # (the template drops the first turn's reasoning; the last turn renders its own, which the model writes)
    assert runs == ["12.<|im_end|>", "<think>\n12 / 2 = 6.\n</think>\n\n6.<|im_end|>"]
    # no reasoning: the empty think block is the generation prompt's pre-fill, not the model's output
    assert trained(enc, CASES["one_turn"]) == ["2 + 2 = 4.<|im_end|>"]


def test_gptoss_reasoning_and_a_call_with_empty_content_builds():
    """The marker render keeps empty content empty (gpt-oss refuses content beside reasoning and a call)."""
    source = (TRL_TEMPLATES / "gptoss.jinja").read_text()
    runs = trained(encoder(own_tokenizer(source, need(QWEN3)), source), CASES["reasoning_tool_call_empty_content"])
    # (the template leaves out the reasoning of a turn before the final one; the render ends with the final
    # turn's <|return|>, so the EOS packer appends after it is trained with it)
    assert runs == [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Lyon"}<|call|>',
                    "<|channel|>analysis<|message|>24 °C is warm.<|end|><|start|>assistant<|channel|>final<|message|>"
                    "Yes, 24 °C.<|return|><|im_end|>"]


def test_a_template_that_refuses_packers_probe_says_so(tmp_path):
    template = ("{% if messages[0].role != 'system' %}{{ raise_exception('a system turn comes first') }}{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    enc = encoder(QWEN3, template)
    with pytest.raises(TokenizerError, match="refuses packer's probe conversation"):
        enc.encode({"messages": [CASES["system_three_turns"]["messages"]], "tools": [None]}, 0)
    (tmp_path / "t.jinja").write_text(template)
    src = write_jsonl(tmp_path / "c.jsonl", [CASES["system_three_turns"]])
    result = CliRunner().invoke(main, ["build", str(src), "-t", str(QWEN3), "--chat-template", str(tmp_path / "t.jinja"),
                                       "--out", str(tmp_path / "o"), "-q", "-j", "1"])
    line = one_line(result)
    assert "packer's probe" in line and "the chat template refused the conversation" not in line


def test_a_tool_use_template_that_needs_tools_is_probed_with_a_tool(tmp_path):
    """Issue 19: a named tool_use template that raises without tools was probed without them; the failed probe
    left no header, and its records trained the wrong span."""
    needs_tools = ("{% if not tools %}{{ raise_exception('this template needs tools') }}{% endif %}"
                   "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder = named_folder(tmp_path, "files", needs_tools)
    weather = {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}
    record = {"messages": CASES["system_three_turns"]["messages"], "tools": [weather]}
    ((ids, flags),) = built(make_build(tmp_path / "out", str(write_jsonl(tmp_path / "c.jsonl", [record])),
                                       tokenizer=str(folder)))
    hf = load_tokenizer(str(folder))
    assert trained_text(hf, ids, flags) == ["7.<|im_end|>", "11.<|im_end|>", "2, the only even prime.<|im_end|>"]


def test_a_call_alone_is_anchored_on_its_name_not_a_marker():
    """An assistant turn with no text keeps no text in the marker render (Qwen3 renders a call after it)."""
    enc = encoder(QWEN3, (TRL_TEMPLATES / "qwen3.jinja").read_text())
    record = {"tools": [], "messages": [
        {"role": "user", "content": "Lyon?"}, {"role": "assistant", "content": "", "tool_calls": [_call("w", {"c": 1})]},
        {"role": "tool", "content": "24"}, {"role": "assistant", "content": "24."}]}
    runs = trained(enc, record)
    assert runs[0].startswith("<tool_call>") and runs[0].endswith("</tool_call><|im_end|>") and "24" not in runs[0]
    # a turn with nothing rendered but its header and end: those, as the template's tagged twin trains them
    assert trained(enc, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}) == [
        "<think>\n\n</think>\n\n<|im_end|>"]
    assert json.dumps(record)  # the record itself is untouched (no marker written into it)


def test_records_that_differ_only_in_text_share_one_marked_render():
    """An untagged template renders a record three times (real, guard, marked); the marked render holds sentinels and
    markers for every message's text, so records that differ only in their texts share it: the second such record
    renders twice. Every record's text and spans equal those of a template that remembers nothing (a fresh one), a
    record holding a value repr cannot tell apart (a date) is rendered every time, and the memory is bounded."""
    import copy
    import datetime
    from pathlib import Path

    import trl
    from chat_sweep import conversations

    from packer.building import chat

    source = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    special = {"eos_token": "<|im_end|>"}
    control = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    shared = chat.ChatTemplate(source, special, "qwen3.jinja", control)
    assert shared._probe.headers  # its probe renders made first: not counted below
    renders = []
    real_render = shared.render
    shared.render = lambda *a, **k: renders.append(1) or real_render(*a, **k)

    def fresh(messages, tools):
        return chat.ChatTemplate(source, special, "qwen3.jinja", control)(messages, tools, "assistant")

    records = []
    for name, record in conversations():
        if name == "text_parts":
            continue
        for i in range(3):  # the same shape, other texts (the stem too: a text holding PACKERMARK moves it)
            messages = copy.deepcopy(record["messages"])
            for m in messages:
                if isinstance(m.get("content"), str) and m["content"]:
                    m["content"] = m["content"] + (" PACKERMARK" if i == 2 else f" ({i})")
            records.append((messages, record.get("tools")))
    for messages, tools in records:
        before = len(renders)
        got = shared(copy.deepcopy(messages), copy.deepcopy(tools), "assistant")
        assert got == fresh(copy.deepcopy(messages), copy.deepcopy(tools)), messages
        assert len(renders) - before <= 3
    calls_shared = len(renders)
    assert calls_shared < 3 * len(records) - len(records) // 3  # most records of a repeated shape rendered twice
    one = [{"role": "user", "content": "When?"}, {"role": "assistant", "content": "Then.", "when": datetime.date(2020, 1, 1)}]
    for _ in range(2):
        before = len(renders)
        assert shared(copy.deepcopy(one), None, "assistant") == fresh(copy.deepcopy(one), None)
        assert len(renders) - before == 3  # not remembered: its repr would not tell it apart from another
    for i in range(chat.MARKED_RENDERS + 5):  # as many shapes as that: remembered no more than the bound
        shared([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "n": i}], None, "assistant")
    assert len(shared.marked_renders) <= chat.MARKED_RENDERS
    big = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "note": "x" * (chat.MARKED_CHARS // 3)}]
    for i in range(4):  # large shapes: remembered no more than the characters' bound either, the first made go first
        shared([*big[:1], {**big[1], "n": i}], None, "assistant")
        assert sum(len(k) + len(v) for k, v in shared.marked_renders.items()) <= chat.MARKED_CHARS
        assert "'n': " + str(i) in list(shared.marked_renders)[-1]
    huge = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "note": "x" * chat.MARKED_CHARS}]
    before = len(shared.marked_renders)
    assert shared(huge, None, "assistant") == fresh(copy.deepcopy(huge), None)
    assert len(shared.marked_renders) == before  # one larger than the whole bound is not remembered
