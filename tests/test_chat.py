"""Chat data on real models' templates (Qwen3, Llama 3.1): packer's tokens and trained tokens against
transformers' ``apply_chat_template``, real data shapes (tools, reasoning, text parts, schema-unified
Nones), and the error cases through the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from conftest import SHARED_DATA, files_signature, make_build, need_shared, one_line
from test_build import segments_of

from packer.cli import main
from packer.contract import schema

QWEN3 = SHARED_DATA / "tokenizers" / "qwen3"
LLAMA31 = SHARED_DATA / "tokenizers" / "llama3_1"
TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
AGENT = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Is it warm in Lyon?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should check the weather.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "{\"temp\": 24}"},
        {"role": "assistant", "content": "<think>\n24 °C is warm.\n</think>\n\nYes, 24 °C."},
    ],
}
MULTI = {"messages": [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Colour of the sky?"}, {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Of grass?"}, {"role": "assistant", "content": "Green."},
    {"role": "user", "content": "Of snow? ❄️"}, {"role": "assistant", "content": "White."},
]}


def need(folder: Path) -> Path:
    return need_shared(folder)


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


_LOADED: dict[tuple, object] = {}


def hf_tokenizer(folder: Path):
    """transformers' own tokenizer of ``folder``, the reference; loaded once per folder and its files (the
    tests only read it: its tokens, decodes and renders)."""
    from transformers import AutoTokenizer

    key = (str(Path(folder).resolve()), files_signature(Path(folder)))
    if key not in _LOADED:
        _LOADED[key] = AutoTokenizer.from_pretrained(str(folder))
    return _LOADED[key]


def reference(hf, record, template: str | None = None, *, tagged: bool = False):
    out = hf.apply_chat_template(record["messages"], tools=record.get("tools"), chat_template=template,
                                 tokenize=True, return_dict=True, return_assistant_tokens_mask=tagged)
    return list(out["input_ids"]), out.get("assistant_masks")


def built(out: Path):
    """(ids, trained) per example, in example order; the first token is never trained (no label crosses)."""
    segments = sorted(segments_of(out), key=lambda s: s[0])
    return [(ids.tolist(), (labels != schema.IGNORE_INDEX)) for _, ids, labels, _ in segments]


def trained_text(hf, ids, trained) -> list[str]:
    """The trained runs of tokens, decoded."""
    runs, current = [], []
    for token, flag in zip(ids, trained):
        if flag:
            current.append(token)
        elif current:
            runs.append(hf.decode(current))
            current = []
    if current:
        runs.append(hf.decode(current))
    return runs


def test_rendering_is_transformers_own():
    """transformers' own renderer renders (its name is what ``render`` calls). That rendering imports no torch is
    asserted in a fresh interpreter by test_chat_tokenizer's chat builds (Qwen3's and Llama 3.1's), which render
    each record through this same ``chat().render``."""
    from packer.building.tokenization import load_tokenizer

    t = load_tokenizer(str(need(QWEN3))).chat()
    assert t.render.__func__.__code__.co_names.count("render_jinja_template")
    assert "hi" in t.render([{"role": "user", "content": "hi"}])[0]
    import packer.building.tokenization as tok

    assert not hasattr(tok, "_jinja_env")  # the copied renderer is gone


def test_qwen3_thinking_and_tools(tmp_path):
    hf = hf_tokenizer(need(QWEN3))
    out = make_build(tmp_path / "out", str(write_jsonl(tmp_path / "c.jsonl", [AGENT, MULTI])), tokenizer=str(QWEN3))
    (ids, trained), (ids2, trained2) = built(out)
    ref, _ = reference(hf, AGENT)
    assert ids == ref + [hf.eos_token_id]  # the render ends in "\n", so packer ends the example with EOS
    runs = trained_text(hf, ids, trained)
    # the reasoning of a turn after the last user query is rendered, and trained, with its tool call
    assert runs[0] == ('<think>\nI should check the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                       '"arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>')
    assert runs[1] == "<think>\n24 °C is warm.\n</think>\n\nYes, 24 °C.<|im_end|>"
    assert len(runs) == 2  # nothing of the system, user or tool turns, nor the "<|im_start|>assistant\n" headers
    ref2, _ = reference(hf, MULTI)
    assert ids2 == ref2 + [hf.eos_token_id]
    # Qwen3 writes an empty think block into the last turn only: the model's output, so trained
    assert trained_text(hf, ids2, trained2) == ["Blue.<|im_end|>", "Green.<|im_end|>",
                                                "<think>\n\n</think>\n\nWhite.<|im_end|>"]


def test_qwen3_untagged_mask_equals_the_tagged_twins(tmp_path):
    """Qwen3's own template (not prefix-stable) against TRL's tagged twin, as --chat-template."""
    hf = hf_tokenizer(need(QWEN3))
    twin = TRL_TEMPLATES / "qwen3_training.jinja"
    # (one turn: the twin renders every turn's think block, the original only those after the last query)
    record = {"messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Why blue?"},
                           {"role": "assistant", "content": "Rayleigh scattering.",
                            "reasoning_content": "Short wavelengths scatter more."}]}
    src = str(write_jsonl(tmp_path / "c.jsonl", [record]))
    own = built(make_build(tmp_path / "own", src, tokenizer=str(QWEN3)))[0]
    tagged = built(make_build(tmp_path / "tagged", src, tokenizer=str(QWEN3), chat_template=str(twin)))[0]
    ref_ids, ref_mask = reference(hf, record, twin.read_text(), tagged=True)
    assert tagged[0][: len(ref_ids)] == ref_ids
    assert tagged[1][1: len(ref_ids)].tolist() == [bool(m) for m in ref_mask[1:]]
    assert own[0] == tagged[0]  # the twin renders this conversation to the same tokens
    differ = [hf.decode(ref_ids[i]) for i in range(len(ref_ids)) if own[1][i] != tagged[1][i]]
    assert differ == ["\n"]  # the twin also trains the newline after <|im_end|>: whitespace, allowed to differ
    manifest = schema.read_manifest(tmp_path / "tagged")
    assert manifest.tokenizer["chat_template_sha256"] == hashlib.sha256(twin.read_bytes()).hexdigest()
    assert manifest.config.chat_template == str(twin)


def test_llama31_multi_turn_and_train_on(tmp_path):
    hf = hf_tokenizer(need(LLAMA31))
    src = str(write_jsonl(tmp_path / "c.jsonl", [MULTI]))
    ((ids, trained),) = built(make_build(tmp_path / "a", src, tokenizer=str(LLAMA31)))
    ref, _ = reference(hf, MULTI)
    assert ids == ref  # Llama 3.1's render ends with its EOS <|eot_id|>: none is added
    assert trained_text(hf, ids, trained) == ["Blue.<|eot_id|>", "Green.<|eot_id|>", "White.<|eot_id|>"]
    ((_, last),) = built(make_build(tmp_path / "l", src, tokenizer=str(LLAMA31), train_on="last"))
    assert trained_text(hf, ids, last) == ["White.<|eot_id|>"]
    ((_, every),) = built(make_build(tmp_path / "e", src, tokenizer=str(LLAMA31), train_on="all"))
    assert every[1:].all()


def test_schema_unified_nones_render_as_written(tmp_path):
    """datasets gives every message every key of the column (None where absent), and a dict of tool
    arguments the keys of every record's arguments: packer renders what the file holds."""
    hf = hf_tokenizer(need(QWEN3))
    call = lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}}  # noqa: E731
    records = [
        {"messages": [{"role": "user", "content": "Lyon?"},
                      {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Lyon"})]},
                      {"role": "tool", "name": "get_weather", "content": "24"},
                      {"role": "assistant", "content": "24 °C."}]},
        {"messages": [{"role": "user", "content": "Time in Oslo?"},
                      {"role": "assistant", "content": "", "tool_calls": [call("get_time", {"tz": "Europe/Oslo"})]},
                      {"role": "tool", "tool_call_id": "x", "content": "09:00"},
                      {"role": "assistant", "content": "09:00."}]},
        MULTI,
    ]
    out = make_build(tmp_path / "out", str(write_jsonl(tmp_path / "c.jsonl", records)), tokenizer=str(QWEN3))
    for record, (ids, _) in zip(records, built(out)):
        ref, _ = reference(hf, record)
        assert ids == ref + [hf.eos_token_id]
        assert "None" not in hf.decode(ids)


def test_null_bos_token_renders_nothing(tmp_path):
    """Qwen's bos_token is null: {{ bos_token }} renders nothing (not "None"); bos_token + '' is the
    template's error, reported as a record error naming the record."""
    hf = hf_tokenizer(need(QWEN3))
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                        "{% endfor %}")
    src = str(write_jsonl(tmp_path / "c.jsonl", [MULTI]))
    ((ids, _),) = built(make_build(tmp_path / "out", src, tokenizer=str(QWEN3), chat_template=str(template)))
    assert ids[: len(ref := reference(hf, MULTI, template.read_text())[0])] == ref
    assert not hf.decode(ids).startswith("None")
    template.write_text("{{ bos_token + 'x' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    line = one_line(build_cli(src, "-t", str(QWEN3), "--chat-template", str(template), "--out", str(tmp_path / "o2")))
    assert "record 1" in line and "the chat template refused the conversation" in line and "bos_token" in line


def build_cli(*args: str):
    return CliRunner().invoke(main, ["build", *args, "-q", "-j", "1"])



def test_error_cases_one_line(tmp_path):
    """Through the CLI with the bundled tokenizer (the errors do not depend on the tokenizer; it loads fast)."""
    image = {"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text", "text": "?"}]},
                          {"role": "assistant", "content": "A cat."}]}
    src = str(write_jsonl(tmp_path / "img.jsonl", [MULTI, image]))
    line = one_line(build_cli(src, "--out", str(tmp_path / "o1")))
    assert "record 2" in line and "packer packs text only" in line
    result = CliRunner().invoke(main, ["build", src, "--out", str(tmp_path / "o1"), "-q", "-j", "1",
                                       "--on-error", "skip", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["dropped_by_reason"] == {"not_text": 1}

    # Gemma's template raises for roles that do not alternate: the record, and the template's own words
    gemma = str(TRL_TEMPLATES / "gemma.jinja")
    twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]}
    line = one_line(build_cli(str(write_jsonl(tmp_path / "g.jsonl", [twice])), "--chat-template",
                              gemma, "--out", str(tmp_path / "o2")))
    assert "record 1" in line and "Conversation roles must alternate user/assistant" in line

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    line = one_line(build_cli(src, "--chat-template", str(broken), "--out", str(tmp_path / "o3")))
    assert f"--chat-template {broken}" in line and "not valid Jinja" in line and "record" not in line

    # A {% generation %} template is a template, not an unknown tag
    twin = str(TRL_TEMPLATES / "qwen3_training.jinja")
    result = build_cli(str(write_jsonl(tmp_path / "m.jsonl", [MULTI])), "--chat-template", twin,
                       "--out", str(tmp_path / "o4"))
    assert result.exit_code == 0, result.output


def test_text_parts_and_extra_keys_pass_through(tmp_path):
    hf = hf_tokenizer(need(QWEN3))
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}], "weight": 1}]}
    as_text = {"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!", "weight": 1}]}
    ((ids, trained),) = built(make_build(tmp_path / "o", str(write_jsonl(tmp_path / "p.jsonl", [parts])), tokenizer=str(QWEN3)))
    assert ids == reference(hf, as_text)[0] + [hf.eos_token_id]
    assert trained_text(hf, ids, trained) == ["<think>\n\n</think>\n\nHi!<|im_end|>"]
    assert np.asarray(trained).sum() > 0
