"""Rules a source must meet, through the real CLI: one rule however the fields were found, no column
silently lost, and each bound or misuse a one-line error (exit 2) or correct behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import one_line

from packer.cli import main

QA = [{"prompt": f"What is {i} + {i}? " * 3, "completion": f"It is {2 * i}. " * 20} for i in range(30)]


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _build(*args: str):
    return CliRunner().invoke(main, ["build", *args, "-q"])


@pytest.mark.parametrize("fields", [[], ["--prompt-field", "prompt", "--completion-field", "completion"]],
                         ids=["found-from-columns", "given-by-options"])
def test_wrap_is_refused_for_prompt_completion_data_however_its_fields_were_found(tmp_path, fields):
    src = _jsonl(tmp_path / "qa.jsonl", QA)
    line = one_line(_build(str(src), "--out", str(tmp_path / "out"), "--pack", "wrap", "--max-tokens", "64", *fields))
    assert "--pack wrap is for plain text" in line and "prompt/completion" in line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_wrap_is_refused_for_chat_found_from_the_columns_and_for_a_recipe(tmp_path):
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "hello"}]}])
    assert "this data is chat" in one_line(_build(str(src), "--out", str(tmp_path / "a"), "--pack", "wrap"))
    assert "recipe flan" in one_line(_build("flan", "--out", str(tmp_path / "b"), "--pack", "wrap", "--limit", "5"))


def test_wrap_still_packs_plain_text_found_from_the_columns(tmp_path):
    src = _jsonl(tmp_path / "text.jsonl", [{"text": f"document {i} " * 30} for i in range(10)])
    result = _build(str(src), "--out", str(tmp_path / "out"), "--pack", "wrap", "--max-tokens", "64")
    assert result.exit_code == 0, result.output


def _duplicate_sources(tmp: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = tmp / "dup.csv"
    csv.write_text("question,answer,answer\nq1,right,wrong\nq2,right,wrong\n")
    table = pa.table([pa.array(["q1", "q2"]), pa.array(["right"] * 2), pa.array(["wrong"] * 2)],
                     names=["question", "answer", "answer"])
    pq.write_table(table, tmp / "dup.parquet")
    with pa.OSFile(str(tmp / "dup.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp / "dupfile.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    return [csv, tmp / "dup.parquet", tmp / "dup.arrow", tmp / "dupfile.arrow"]


def test_a_column_named_twice_is_refused(tmp_path):
    for src in _duplicate_sources(tmp_path):
        line = one_line(_build(str(src), "--out", str(tmp_path / f"out-{src.name}")))
        assert src.name in line and "'answer' twice" in line, line


def test_a_mix_part_field_typo_names_the_part(tmp_path):
    src = _jsonl(tmp_path / "qa.jsonl", QA)
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"- {{source: flan, weight: 1}}\n"
                   f"- {{source: {src}, weight: 1, prompt_field: promt, completion_field: completion}}\n")
    line = one_line(_build("--mix", str(mix), "--out", str(tmp_path / "out"), "--limit", "20"))
    assert "mix part 2" in line and "'promt'" in line
