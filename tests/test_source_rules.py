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


# -- a top-level JSON array is streamed ------------------------------------------------------------


def test_a_json_array_is_read_an_item_at_a_time(tmp_path):
    import itertools
    import tracemalloc

    from packer import readers

    path = tmp_path / "big.json"
    item = json.dumps({"prompt": "p" * 500, "completion": "c" * 1500})
    path.write_text("[\n" + ",\n".join([item] * 15_000) + "\n]\n")  # 30 MB
    tracemalloc.start()
    try:
        first = list(itertools.islice(readers.records("json", str(path)), 10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(first) == 10 and first[0] == json.loads(item)
    assert peak < 8e6, f"{peak / 1e6:.1f} MB held to read 10 items of a 30 MB array"


@pytest.mark.parametrize("read", [1, 3, 7, 64])
def test_a_json_array_parses_the_same_whatever_the_read_size(tmp_path, monkeypatch, read):
    from packer import readers

    items = [{"n": 123456789, "x": 1.5e-7, "t": "é猫😀 \"q\" \\u", "l": [1, [2, {"a": None}]]}, "just text",
             {"empty": {}}, {"big": -98765432109876543210}]
    path = tmp_path / "a.json"
    path.write_bytes(b"\xef\xbb\xbf \n[\n" + ",\n\t".join(json.dumps(i, ensure_ascii=False) for i in items).encode()
                     + b"\n]  \n")
    monkeypatch.setattr(readers, "_READ", read)
    expected = [i if isinstance(i, dict) else {"text": i} for i in items]
    assert list(readers.records("json", str(path))) == expected
    assert readers.count("json", str(path), 10) == 4 and readers.count("json", str(path), 2) == 2
    (tmp_path / "e.json").write_text(" [ ] ")
    assert list(readers.records("json", str(tmp_path / "e.json"))) == []


@pytest.mark.parametrize("text, where", [
    ('[{"a": 1},\n{"a": 2},\n{"a": ]', ":3: malformed JSON"),
    ('[{"a": 1}\n{"a": 2}]', ":2: malformed JSON (expecting ',' or ']'"),
    ('[{"a": 1},\n{"a": 2}', ":2: malformed JSON (the array is not closed"),
    ('[{"a": 1}]\n[{"a": 2}]', ":2: malformed JSON (extra data after the array"),
])
def test_a_malformed_json_array_names_its_line(tmp_path, monkeypatch, text, where):
    from packer import readers
    from packer.errors import SourceError

    path = tmp_path / "d.json"
    path.write_text(text)
    monkeypatch.setattr(readers, "_READ", 4)
    with pytest.raises(SourceError, match="d.json" + where.replace("(", r"\(").replace("[", r"\[")):
        list(readers.records("json", str(path)))
