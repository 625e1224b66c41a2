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

    from packer.building import readers

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
    from packer.building import readers

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
    from packer.building import readers
    from packer.errors import SourceError

    path = tmp_path / "d.json"
    path.write_text(text)
    monkeypatch.setattr(readers, "_READ", 4)
    with pytest.raises(SourceError, match="d.json" + where.replace("(", r"\(").replace("[", r"\[")):
        list(readers.records("json", str(path)))


# -- bounds: each a one-line error or correct behaviour --------------------------------------------


def _manifest_stats(out: Path) -> dict:
    from packer.contract import schema

    return json.loads((out / schema.MANIFEST_NAME).read_text())["stats"]


def test_a_limit_past_what_ids_can_number_and_a_negative_seed_are_one_line(tmp_path):
    assert "--limit 100,000,000,000,000,000,000" in one_line(_build("flan", "--out", str(tmp_path / "a"), "--limit",
                                                                    str(10**20)))
    src = _jsonl(tmp_path / "qa.jsonl", QA)
    for args in (["flan"], ["flan", str(src), "--mix", "1,1"]):
        assert "--seed must be 0 or more" in one_line(_build(*args, "--out", str(tmp_path / "b"), "--seed", "-1"))


def test_a_weighted_mix_with_a_limit_past_its_data_ends_with_the_data(tmp_path):
    src = _jsonl(tmp_path / "qa.jsonl", QA)
    outs = []
    for limit in ([], ["--limit", str(10**12)]):
        outs.append(tmp_path / f"out{len(outs)}")
        result = _build("flan", str(src), "--mix", "1,1", *limit, "--out", str(outs[-1]))
        assert result.exit_code == 0, result.output
    assert _manifest_stats(outs[0]) == _manifest_stats(outs[1])


def test_weights_near_the_float_maximum_mix_by_their_ratio(tmp_path):
    src = _jsonl(tmp_path / "qa.jsonl", QA)
    stats = []
    for weights in ("1,1", "1e308,1e308"):
        out = tmp_path / weights
        result = _build("flan", str(src), "--mix", weights, "--limit", "40", "--out", str(out))
        assert result.exit_code == 0, result.output
        stats.append(_manifest_stats(out))
    assert stats[0] == stats[1]


@pytest.mark.parametrize("records", [10**15, 10**23])
def test_records_counts_past_what_a_mix_can_draw_are_one_line(tmp_path, records):
    src = _jsonl(tmp_path / "qa.jsonl", QA)
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"- {{source: flan, records: {records}}}\n- {{source: {src}, records: 5}}\n")
    line = one_line(_build("--mix", str(mix), "--out", str(tmp_path / "out")))
    assert "more than the 2,147,483,648 a mix by counts can draw" in line


def test_a_mix_of_more_parts_than_int16_numbers_draws_each():
    from packer.building import mix

    parts = [{"source": f"p{k}", "weight": 1.0} for k in range(40_000)]
    drawn = mix.positions_sources(parts, 0, 200_000)
    assert drawn.min() >= 0 and drawn.max() >= 32_768
    records = [{"source": f"p{k}", "records": 1} for k in range(40_000)]
    assert sorted(mix.positions_sources(records, 0, 40_000).tolist()) == list(range(40_000))


def _many_parts(tmp: Path, parts: int, records: int = 12) -> Path:
    lines = []
    for k in range(parts):
        path = _jsonl(tmp / f"p{k}.jsonl", [{"prompt": f"q{k} {i}", "completion": f"a{i}"} for i in range(records)])
        lines.append(f"- {{source: {path}, weight: 1}}")
    mix = tmp / "mix.yaml"
    mix.write_text("\n".join(lines) + "\n")
    return mix


def test_a_mix_of_more_parts_than_open_files_raises_the_soft_limit_or_says_so(tmp_path):
    import subprocess
    import sys

    # parts of more records than a batch: each part's file stays open while the mix reads on (a part whose records
    # under --limit are all read is closed at once, so --limit would not need the files); the mix ends early, when
    # its one small part of weight 20 runs out, every other part opened by then
    mix = _many_parts(tmp_path, 160, records=1001)
    small = _jsonl(tmp_path / "small.jsonl", [{"prompt": f"q {i}", "completion": f"a{i}"} for i in range(40)])
    mix.write_text(mix.read_text() + f"- {{source: {small}, weight: 20}}\n")
    results = {}
    for flag in ("-n", "-Sn"):  # hard and soft limit 128; soft limit 128 only
        out = tmp_path / f"out{flag}"
        command = f"ulimit {flag} 128 && {sys.executable} -m packer build --mix {mix} -q --out {out}"
        results[flag] = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent.parent)
    assert results["-Sn"].returncode == 0, results["-Sn"].stderr
    hard = results["-n"]
    assert hard.returncode == 2 and len(hard.stderr.splitlines()) == 1, hard.stderr
    assert "128 files it may open" in hard.stderr and "ulimit -n" in hard.stderr


# -- messages --------------------------------------------------------------------------------------


def test_plot_to_a_file_matplotlib_cannot_write_is_one_line(flan_batch, tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("x.txt", "x"):
        result = CliRunner().invoke(main, ["inspect", str(flan_batch), "--plot", str(tmp_path / name)])
        assert "name it x.png" in one_line(result)
    assert not list(tmp_path.iterdir())


def test_the_plots_mode_axis_says_it_counts_every_epoch():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from packer.checking.views import Mode
    from packer.plot import _modes_panel

    modes = [Mode(mode="bfd", built=True, rows=4, optimizer_steps=4, examples_per_step=2.0, tokens=100,
                  computed_tokens=100, fill=0.9, padding=0.0, peak_row_tokens=30, note="")]
    fig, ax = plt.subplots()
    try:
        _modes_panel(ax, modes, 3)
        assert ax.get_xlabel() == "tokens computed over the 3 epochs the rows hold"
        _modes_panel(ax, modes, 1)
        assert ax.get_xlabel() == "tokens computed per epoch"
    finally:
        plt.close(fig)


def test_an_empty_chat_template_file_is_blamed_on_the_file(tmp_path):
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "hello"}]}])
    (tmp_path / "empty.jinja").write_text("\n")
    line = one_line(_build(str(src), "--chat-template", str(tmp_path / "empty.jinja"), "--out", str(tmp_path / "o")))
    assert "empty.jinja: the file is empty" in line


def test_plain_text_split_does_not_warn_about_prompts(tmp_path):
    src = _jsonl(tmp_path / "text.jsonl", [{"text": "word " * n} for n in range(55, 75)])
    result = CliRunner().invoke(main, ["build", str(src), "--overlong", "split", "--max-len", "64", "--out",
                                       str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("warning"))
    assert "prompts cut" not in warning and "pieces of cut examples" in warning


@pytest.mark.parametrize("read", [1, 2, 3, 5, 8])
def test_a_number_item_cut_by_a_read_is_still_named_as_a_number(tmp_path, monkeypatch, read):
    from packer.building import readers
    from packer.errors import SourceError

    path = tmp_path / "d.json"
    path.write_text('[{"a": 1}, 1.5e+10]')
    monkeypatch.setattr(readers, "_READ", read)
    with pytest.raises(SourceError, match="item 2 of the array is a number"):
        list(readers.records("json", str(path)))
