"""Named chat templates (a tokenizer that ships "default" and "tool_use", as Hermes-2-Pro and Command-R
do): each record is rendered by the template transformers' ``apply_chat_template`` picks, the tool_use one
when the record gives tools; both ways a tokenizer stores them (a list in tokenizer_config.json, or
additional_chat_templates/*.jinja). The reference is transformers' own tokenizer loaded from the folder."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from conftest import make_build
from test_chat import (
    AGENT,
    MULTI,
    QWEN3,
    TRL_TEMPLATES,
    built,
    hf_tokenizer,
    need,
    one_line,
    reference,
    write_jsonl,
)

from packer.cli import main
from packer.contract import schema

TOOL_USE = (TRL_TEMPLATES / "qwen2_5.jinja").read_text()  # a different template that renders tools
NO_TOOLS = {"messages": MULTI["messages"]}
EMPTY_TOOLS = {"messages": MULTI["messages"], "tools": []}  # not None: transformers picks tool_use


def named_folder(parent, how: str, tool_use: str = TOOL_USE):
    folder = parent / f"qwen3-{how}-{len(list(parent.iterdir()))}"
    folder.mkdir()
    shutil.copy(need(QWEN3) / "tokenizer.json", folder)
    config = json.loads((QWEN3 / "tokenizer_config.json").read_text())
    default = config["chat_template"]
    if how == "config":
        config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    else:
        del config["chat_template"]
        (folder / "chat_template.jinja").write_text(default)
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how", ["config", "files"])
def test_tool_use_template_when_tools_are_given(tmp_path, how):
    folder = named_folder(tmp_path, how)
    hf = hf_tokenizer(folder)
    assert isinstance(hf.chat_template, dict) and set(hf.chat_template) == {"default", "tool_use"}
    records = [AGENT, NO_TOOLS, EMPTY_TOOLS]
    src = str(write_jsonl(tmp_path / "c.jsonl", records))
    rows = built(make_build(tmp_path / "out", src, tokenizer=str(folder)))
    for record, (ids, trained) in zip(records, rows, strict=True):
        expected = reference(hf, record)[0]
        assert ids == expected + ([hf.eos_token_id] if expected[-1] != hf.eos_token_id else [])
        assert trained.any()
    # the same messages, two templates: the default (Qwen3's) writes a <think> block, tool_use (Qwen2.5's) not
    assert "<think>" in hf.decode(rows[1][0]) and "<think>" not in hf.decode(rows[2][0])
    # every named template is in the manifest's template hash
    rebuilt = make_build(tmp_path / "out2", src, tokenizer=str(named_folder(tmp_path, how, TOOL_USE + "\n")))
    assert template_hash(tmp_path / "out") != template_hash(rebuilt)


def template_hash(out) -> str:
    return schema.read_manifest(out).tokenizer["chat_template_sha256"]


def test_a_broken_named_template_is_named_before_any_record(tmp_path):
    folder = named_folder(tmp_path, "files", "{% for m in messages %}")
    src = str(write_jsonl(tmp_path / "c.jsonl", [NO_TOOLS]))
    line = one_line(CliRunner().invoke(main, ["build", src, "-t", str(folder), "--out", str(tmp_path / "o"), "-q", "-j", "1"]))
    assert "'tool_use'" in line and "not valid Jinja" in line and "record" not in line

