"""Local JSON, Parquet and Arrow files are read by packer.building.readers, not `datasets`: the records as written
(checked against `datasets`' own reading where that is right, and against the text where it is not),
the same shards whatever the file type, and one clear line for what cannot be read."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import one_line

from packer.building import sources
from packer.cli import main
from packer.contract import schema

RECORDS = [
    {"prompt": f"What is {i} plus {i}?", "completion": f"{2 * i}", "id": i, "score": i / 4,
     "meta": {"tags": ["a", "b"][: i % 3], "source": "test"}}
    for i in range(2500)
]


def _records(path: Path, limit: int | None = None) -> list[dict]:
    stream = sources.open_stream(sources.resolve(str(path)), limit=limit)
    out = []
    for _, columns in stream.chunks():
        names = list(columns)
        out += [dict(zip(names, row)) for row in zip(*columns.values())]
    return out


def _datasets_records(builder: str, path: Path) -> list[dict]:
    import datasets

    ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    return list(ds)


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_parquet_and_arrow_read_as_datasets_reads_them(tmp_path):
    """Files that carry their types: the records equal `datasets`' own streaming reader's, in order."""
    table = pa.Table.from_pylist(RECORDS)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=700)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=600)
    for name, builder in (("d.parquet", "parquet"), ("d.arrow", "arrow")):
        mine = _records(tmp_path / name)
        assert len(mine) == len(RECORDS)
        assert mine == _datasets_records(builder, tmp_path / name), name
    assert _records(tmp_path / "d.parquet", limit=1234) == _records(tmp_path / "d.parquet")[:1234]


def test_arrow_file_format_is_read_too(tmp_path):
    table = pa.Table.from_pylist(RECORDS[:50])
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    assert _records(tmp_path / "d.arrow") == table.to_pylist()


def test_jsonl_reads_each_record_as_written(tmp_path):
    """A JSON line is its record exactly: where `datasets` is right (same keys and types on every line)
    the two agree; where its Arrow inference is not, the text wins: a date stays a string, an int an int,
    and a key a record lacks is absent (None in the columns), not an empty struct field."""
    path = _write_jsonl(tmp_path / "d.jsonl", RECORDS)
    assert _records(path) == _datasets_records("json", path) == RECORDS
    odd = [{"prompt": "2020-01-01", "completion": "x"}, {"prompt": "p", "completion": "y", "n": 3},
           {"prompt": "q", "completion": "z", "n": 2.5}]
    path = _write_jsonl(tmp_path / "odd.jsonl", odd)
    assert _records(path) == [{"prompt": "2020-01-01", "completion": "x", "n": None},
                              {"prompt": "p", "completion": "y", "n": 3}, {"prompt": "q", "completion": "z", "n": 2.5}]
    assert type(_records(path)[1]["n"]) is int


def test_a_date_like_prompt_builds_as_text(tmp_path):
    """`datasets` read "2020-01-02" as a datetime, and the build refused the record as not text."""
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"2020-01-{d:02d}", "completion": "a weekday"}
                                               for d in range(1, 29)])
    result = CliRunner().invoke(main, ["build", str(path), "--prompt-field", "prompt", "--completion-field",
                                       "completion", "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 0, result.output
    row = CliRunner().invoke(main, ["inspect", str(tmp_path / "o"), "--row", "0", "--json"])
    assert "2020-01-" in row.stdout


def test_json_document_gzip_and_bom(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps(RECORDS[:300], indent=2))
    assert _records(array) == RECORDS[:300]
    texts = tmp_path / "t.json"
    texts.write_text(json.dumps(["one", "two"]))
    assert _records(texts) == [{"text": "one"}, {"text": "two"}]
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n\n" for r in RECORDS[:30]).encode()))
    assert _records(gz) == RECORDS[:30]


def test_same_shards_from_jsonl_and_parquet(tmp_path):
    records = [{k: r[k] for k in ("prompt", "completion")} for r in RECORDS]
    _write_jsonl(tmp_path / "d.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        result = CliRunner().invoke(main, ["build", str(tmp_path / name), "--prompt-field", "prompt",
                                           "--completion-field", "completion", "--out", str(tmp_path / f"out-{name}"), "-q",
                                           "--pack", "bfd", "--max-tokens", "512", "--max-len", "512"])
        assert result.exit_code == 0, result.output
    a, b = (sorted((tmp_path / f"out-{n}").glob("*.arrow")) for n in ("d.jsonl", "d.parquet"))
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b] and a


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": "a",\n "completion": "b"}', "holds one JSON object (keys prompt, completion), not records"),
    ('[{"prompt": "a", "completion": "b"}, 3]', "item 2 of the array is a number, not a record"),
])
def test_json_document_errors(tmp_path, content, needle):
    path = tmp_path / "d.json"
    path.write_text(content)
    result = CliRunner().invoke(main, ["build", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert needle in one_line(result) and str(path) in one_line(result)
    assert not (tmp_path / "o" / schema.MANIFEST_NAME).exists()


def test_local_build_imports_neither_datasets_nor_pandas(tmp_path):
    """`import datasets` was a third of the bundled sample's build; pandas came with it, and with
    ``pa.array``/``to_numpy`` on numpy data."""
    code = (
        "import sys; from packer.cli import main\ntry:\n    main(['build', 'flan', '--out', sys.argv[1], '--limit', "
        "'1200', '-q'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print(sorted(m for m in ('datasets', 'pandas', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "o")], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_count_without_reading_records(tmp_path):
    """--limit over several files counts each file's records without making them (and stops at need)."""
    from packer.building import readers

    jsonl = _write_jsonl(tmp_path / "d.jsonl", RECORDS[:700])
    table = pa.Table.from_pylist(RECORDS[:700])
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=100)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=64)
    (tmp_path / "a.json").write_text(json.dumps(RECORDS[:70]))
    assert readers.count("json", str(jsonl), 10_000) == 700
    assert readers.count("json", str(jsonl), 250) == 250
    assert readers.count("json", str(tmp_path / "a.json"), 10_000) == 70
    assert readers.count("parquet", str(tmp_path / "d.parquet"), 10) == 700
    assert readers.count("arrow", str(tmp_path / "d.arrow"), 10_000) == 700


def test_the_tokenize_bar_has_the_sources_record_count(tmp_path, monkeypatch):
    """The total a build's tokenize bar shows without --limit: the records where the file says so cheaply
    (metadata, line breaks), a large file estimated from its first lines, a JSON
    document none; a mix's from its parts; and the bar of a build ends at the records read."""
    from packer.building import mix, readers

    table = pa.Table.from_pylist(RECORDS[:700])
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=100)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=64)
    jsonl = _write_jsonl(tmp_path / "d.jsonl", RECORDS[:700])
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))
    (tmp_path / "d.txt").write_text("one\ntwo\n\nfour")  # blank lines are records of text
    (tmp_path / "d.csv").write_text("prompt,completion\nq,a\nq2,a2\n")
    (tmp_path / "a.json").write_text(json.dumps(RECORDS[:70]))
    totals = {name: readers.total(sources._builder_for(name), [str(tmp_path / name)])
              for name in ("d.parquet", "d.arrow", "d.jsonl", "d.jsonl.gz", "d.txt", "d.csv", "a.json")}
    assert totals == {"d.parquet": 700, "d.arrow": 700, "d.jsonl": 700, "d.jsonl.gz": 700, "d.txt": 4, "d.csv": 2,
                      "a.json": None}
    # a file past the budget: the lines in its first 20 kB (gzip'd: 300 kB, some 40 kB of the file's 80 kB),
    # scaled by the bytes of the file they took
    monkeypatch.setattr(readers, "BUDGET", 0)
    monkeypatch.setattr(readers, "SAMPLED", 20_000)
    assert 600 < readers.total("json", [str(jsonl)]) < 800
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes() * 8))
    monkeypatch.setattr(readers, "SAMPLED", 300_000)
    assert 4800 < readers.total("json", [str(tmp_path / "e.jsonl.gz")]) < 6400
    monkeypatch.undo()

    def stream(name, limit=None):
        return sources.open_stream(sources.resolve(str(tmp_path / name)), limit=limit)

    assert stream("d.jsonl").total() == 700 and stream("d.jsonl", 50).total() == 50 and stream("a.json").total() is None
    assert stream("a.json", 9).total() == 9
    parts = ({"source": "d.jsonl", "weight": 3.0}, {"source": "d.parquet", "weight": 1.0})
    # the mix ends near the first part to run out: 700 records at 3/4 of the draws
    assert mix.MixStream(parts, (stream("d.jsonl"), stream("d.parquet")), 0).total() == 933
    counts = ({"source": "d.jsonl", "records": 30}, {"source": "a.json", "records": 5})
    assert mix.MixStream(counts, (stream("d.jsonl", 30), stream("a.json", 5)), 0).total() == 35
    result = CliRunner().invoke(main, ["build", str(jsonl), "--prompt-field", "prompt", "--completion-field",
                                       "completion", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "tokenize: 100%" in result.stderr and "700/700 [" in result.stderr, result.stderr


class _Reads:
    """How far into each file the readers' ``_open`` got (gzip: its inflated bytes): the bytes of a source
    read, however often its first block is looked at again."""

    def __init__(self, monkeypatch):
        from packer.building import readers

        self.furthest: dict[str, int] = {}
        real = readers._open
        reads = self

        class Counted:
            def __init__(self, path, **how):
                self._f, self._path = real(path, **how), path

            def read(self, *n):
                block = self._f.read(*n)
                reads.furthest[self._path] = max(reads.furthest.get(self._path, 0), self._f.tell())
                return block

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        monkeypatch.setattr(readers, "_open", Counted)

    def plain(self) -> int:
        return sum(n for p, n in self.furthest.items() if not p.endswith(".gz"))

    def inflated(self) -> int:
        return sum(n for p, n in self.furthest.items() if p.endswith(".gz"))


def _folder(folder: Path, files: int, per_file: int, gz: bool = False) -> int:
    """``files`` JSON Lines files of ``per_file`` records each (gzip'd with ``gz``); their bytes on disk."""
    folder.mkdir()
    for k in range(files):
        text = "".join(json.dumps(RECORDS[(k * per_file + i) % len(RECORDS)]) + "\n" for i in range(per_file)).encode()
        if gz:
            (folder / f"part-{k:03}.jsonl.gz").write_bytes(gzip.compress(text))
        else:
            (folder / f"part-{k:03}.jsonl").write_bytes(text)
    return sum(p.stat().st_size for p in folder.iterdir())


def test_the_bar_counts_a_folder_of_many_files_within_one_budget(tmp_path, monkeypatch):
    """Many files each under the size counted whole: the bar's total reads no more than one budget of bytes
    across them (an inflated byte costs GZIP_COST), the rest estimated from their sizes, near the real count."""
    from packer.building import readers

    plain = _folder(tmp_path / "plain", 40, 200)
    _folder(tmp_path / "gz", 40, 200, gz=True)
    budget = plain // 8  # five of the forty files
    monkeypatch.setattr(readers, "BUDGET", budget, raising=False)
    reads = _Reads(monkeypatch)
    total = sources.open_stream(sources.resolve(str(tmp_path / "plain"))).total()
    # (the last file counted is looked at whole, 64 kB, to see whether it is one JSON document)
    assert 0 < reads.plain() <= budget + (1 << 16), (reads.plain(), budget, plain)
    assert abs(total - 8000) < 8000 * 0.05, total
    reads.furthest.clear()
    cost = getattr(readers, "GZIP_COST", 1)
    monkeypatch.setattr(readers, "BUDGET", budget * cost, raising=False)  # five files' text inflated
    total = sources.open_stream(sources.resolve(str(tmp_path / "gz"))).total()
    assert 0 < reads.inflated() * cost <= (budget + (1 << 16)) * cost, (reads.inflated(), cost, budget)
    assert abs(total - 8000) < 8000 * 0.05, total


def test_the_bar_under_a_limit_counts_nothing(tmp_path, monkeypatch):
    """With --limit the total is the limit, no file read to count it (the records it takes are read for the
    build anyway); metadata that says there are fewer is believed."""
    from packer.building import mix

    _folder(tmp_path / "d", 3, 400)
    stream = sources.open_stream(sources.resolve(str(tmp_path / "d")), limit=5)
    more = sources.open_stream(sources.resolve(str(tmp_path / "d")), limit=500)
    whole = sources.open_stream(sources.resolve(str(tmp_path / "d")))
    reads = _Reads(monkeypatch)  # opening them read the files that hold the records taken: the build's reading
    assert stream.total() == 5 and more.total() == 500
    assert mix.MixStream(({"source": "d", "weight": 1.0},), (whole,), 0, 7).total() == 7
    assert reads.furthest == {}
    pq.write_table(pa.Table.from_pylist(RECORDS[:30]), tmp_path / "d.parquet")
    assert sources.open_stream(sources.resolve(str(tmp_path / "d.parquet")), limit=500).total() == 30


def test_a_finished_spill_is_not_counted_again(tmp_path, monkeypatch, capsys):
    """A rerun that finds every record tokenized (a crash in planning or writing) shows the records it has
    on its bar, the source not read once more to count them."""
    from packer import BuildConfig
    from packer.building import mix, spill
    from packer.building.engines import LocalEngine
    from packer.building.formatting import make_spec
    from packer.building.pipeline import tokenizer_path
    from packer.building.tokenization import Encoder, load_tokenizer

    jsonl = _write_jsonl(tmp_path / "d.jsonl", RECORDS[:300])
    stream = sources.open_stream(sources.resolve(str(jsonl)))
    config = BuildConfig(source=str(jsonl), out="-", prompt_field="prompt", completion_field="completion")
    spec = make_spec(recipe=None, config=config, columns=stream.columns())
    both = mix.MixStream(({"source": str(jsonl), "weight": 1.0},), (stream,), 0)
    encoder = mix.MixEncoder([Encoder(load_tokenizer(tokenizer_path(None)), spec)], ["record"])
    spill.tokenize(both, encoder, tmp_path / "t", {"test": 1}, engine=LocalEngine())
    monkeypatch.setattr(mix.MixStream, "total", lambda self: pytest.fail("counted again"))
    capsys.readouterr()
    again = spill.tokenize(both, encoder, tmp_path / "t", {"test": 1}, engine=LocalEngine(), progress=True)
    assert again.reused_records == 300 and "300/300 [" in capsys.readouterr().err

def test_csv_cells_are_the_text_they_hold(tmp_path):
    """Every cell as written (Python's csv module is the reference): numbers stay text ("1.0" is not
    "1"), quoted cells keep their commas and newlines, "NA" is text, and only an empty cell is null."""
    import csv

    rows = [["question", "answer", "note"], ["What is 2+2?", "4", "NA"], ["Say hi, twice", "hi\nhi", ""],
            ["What is 0.5+0.5?", "1.0", "null"]] + [[f"q{i}", str(i), "x"] for i in range(3000)]
    path = tmp_path / "d.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    with open(path, newline="") as f:
        reference = [{k: (v if v != "" else None) for k, v in r.items()} for r in csv.DictReader(f)]
    assert _records(path) == reference
    assert _records(path)[:3] == [{"question": "What is 2+2?", "answer": "4", "note": "NA"},
                                  {"question": "Say hi, twice", "answer": "hi\nhi", "note": None},
                                  {"question": "What is 0.5+0.5?", "answer": "1.0", "note": "null"}]
    result = CliRunner().invoke(main, ["build", str(path), "--prompt-field", "question", "--completion-field",
                                       "answer", "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 0, result.output  # `datasets` read "answer" as floats, refused as not text


def test_csv_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes("prompt,completion\nq,caf\xe9\n".encode("latin-1"))
    result = CliRunner().invoke(main, ["build", str(path), "--out", str(tmp_path / "o")])
    line = one_line(result)  # the row and column, as a Parquet or Arrow file's (tests/test_stream_bounds.py)
    assert "d.csv: row 1, column 'completion': not UTF-8 text" in line and "re-encode" in line, line


@pytest.mark.parametrize("name, content", [("d.csv", "prompt,completion\n"), ("d.jsonl", "\n  \n\n")])
def test_a_file_without_records_says_so(tmp_path, name, content):
    """Not "cannot tell which fields to train on; the columns are (none)", as a header-only CSV said."""
    (tmp_path / name).write_text(content)
    result = CliRunner().invoke(main, ["build", str(tmp_path / name), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and f"{name}: holds no records" in one_line(result)


def _made(builder: str, path: Path, skip: int = 0) -> tuple[list[dict], int]:
    """The records ``readers.records`` gives from ``skip`` on, and what its generator returns (those passed over)."""
    from packer.building import readers

    gen, out = readers.records(builder, str(path), skip=skip), []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as stop:
            return out, stop.value


def test_records_from_a_place_are_the_tail_of_the_whole_read(tmp_path):
    """Every file kind read from record k on gives the whole read's records from k (placeholders of unreadable lines
    and their line numbers included), and returns how many it passed over: k, or all the file holds."""
    rows = RECORDS[:2500]
    lines = [json.dumps(r) for r in rows[:900]]
    lines[5] = "{not json"  # a malformed line: a record, its placeholder names line 6 (after a blank line: 7)
    text = "\ufeff" + "\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n"
    (tmp_path / "d.jsonl").write_text(text)
    with gzip.open(tmp_path / "g.jsonl.gz", "wt") as f:
        f.write(text)
    (tmp_path / "a.json").write_text(json.dumps(rows[:90]))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=700)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=600)
    (tmp_path / "d.csv").write_text("prompt,completion\n" + "".join(f'"q {i}\nline",{i}\n' for i in range(1500)))
    (tmp_path / "d.txt").write_text("".join(f"line {i}\n" if i % 7 else "\n" for i in range(1200)))
    for name, builder in (("d.jsonl", "json"), ("g.jsonl.gz", "json"), ("a.json", "json"), ("d.parquet", "parquet"),
                          ("d.arrow", "arrow"), ("d.csv", "csv"), ("d.txt", "text")):
        whole, passed = _made(builder, tmp_path / name)
        assert passed == 0 and len(whole) > 80, name
        for k in (1, 5, 6, 599, 600, 601, 700, 1400, len(whole) - 1, len(whole), len(whole) + 5):
            tail, passed = _made(builder, tmp_path / name, skip=k)
            assert tail == whole[k:], (name, k)
            assert passed == min(k, len(whole)), (name, k)
    placeholder = _made("json", tmp_path / "d.jsonl", skip=5)[0][0]
    assert ":7: malformed JSON" in str(placeholder)


def test_a_stream_read_from_a_place_passes_over_unparsed(tmp_path):
    """A source of several files read from record k: the whole read's records from k, the --limit kept; the JSON
    lines before k are not parsed (a line that is no record there, which a read from the start refuses, is passed
    over), so a resumed build or a token store's extension does not parse its source again up to where it starts."""
    folder = tmp_path / "src"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", RECORDS[:1300])
    (folder / "b.jsonl").write_text("7\n" + "".join(json.dumps(r) + "\n" for r in RECORDS[1300:2100]))
    stream = sources.open_stream(sources.resolve(str(folder)), limit=None)

    def read(start: int, limit: int | None = None) -> list[dict]:
        s = sources.open_stream(sources.resolve(str(folder)), limit=limit)
        return [dict(zip(c, row)) for _, c in s.chunks(start, 250) for row in zip(*c.values())]

    with pytest.raises(Exception, match="not a record"):
        read(0)
    assert read(1301) == RECORDS[1300:2100]
    assert read(1301, limit=1500) == RECORDS[1300:1499]
    assert read(1500, limit=1400) == []
    firsts = [first for first, _ in stream.chunks(1301, 250)]
    assert firsts == list(range(1301, 2101, 250))
