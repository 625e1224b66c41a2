"""Every record size and count limit holds on the stream, before the input is read whole (issue 29,
class 4): a huge record is refused (or skipped and counted) without being held, a mix by counts under
``--limit`` costs what the records read cost, and inputs a reader cannot decode, or paths that name
no user, are one line."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from conftest import one_line
from test_bad_inputs import GOOD, build_cli, jsonl

from packer.building import mix, readers

# -- a mix by records counts under --limit ------------------------------------------------------------


def test_a_mix_by_counts_under_a_limit_draws_only_what_the_limit_takes():
    parts = [{"source": "a", "records": 50_000_000}, {"source": "b", "records": 3}]
    tracemalloc.start()
    try:
        drawn = mix.positions_sources(parts, 0, 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert drawn.size == 30
    assert peak < 4 << 20, f"{peak:,} bytes drawn for 30 positions"


@pytest.mark.parametrize("counts", [[7, 3000, 10_000], [1] * 5000, [40_000, 1]])
def test_a_mix_by_counts_gives_each_part_exactly_its_count_and_a_limit_is_its_prefix(counts):
    parts = [{"source": f"p{k}", "records": n} for k, n in enumerate(counts)]
    whole = mix.positions_sources(parts, 5, sum(counts))
    assert np.bincount(whole, minlength=len(counts)).tolist() == counts
    for limit in (1, 30, 4097, sum(counts) - 1):
        assert np.array_equal(mix.positions_sources(parts, 5, limit), whole[:limit])
    assert not np.array_equal(whole, mix.positions_sources(parts, 6, sum(counts))), "the seed shuffles"


# -- a ~user of no user ---------------------------------------------------------------------------------

NO_USER = "~no-such-user-packer"


@pytest.mark.parametrize(("option", "needle"), [
    ("source", "source"), ("glob", "source"), ("mix", "source"), ("--out", "--out"), ("--tokenizer", "--tokenizer"),
    ("--chat-template", "--chat-template")])
def test_a_home_of_no_user_is_one_line_for_every_path(tmp_path, option, needle):
    src = str(jsonl(tmp_path / "d.jsonl", GOOD))
    args = {"source": [f"{NO_USER}/d.jsonl"], "glob": [f"{NO_USER}/*.jsonl"], "--out": [src, "--out", f"{NO_USER}/o"],
            "--tokenizer": [src, "--tokenizer", f"{NO_USER}/tok"],
            "--chat-template": [src, "--chat-template", f"{NO_USER}/t.jinja"]}.get(option)
    if option == "mix":
        (tmp_path / "mix.yaml").write_text(f"- {{source: {NO_USER}/d.jsonl, weight: 1}}\n- {{source: {src}, weight: 1}}\n")
        args = ["--mix", str(tmp_path / "mix.yaml")]
    if "--out" not in args:
        args = [*args, "--out", str(tmp_path / "out")]
    line = one_line(build_cli(*args))
    assert line.startswith(f"packer: error: {needle} {NO_USER}/"), line
    assert "no user 'no-such-user-packer'" in line and "give the path in full" in line, line
    assert not (tmp_path / "out").exists()


# -- a record over the size bound, in every format; text that is not UTF-8 ------------------------------

SMALL = 4096  # the bound, lowered for these (in-process) builds: the records stay small
ROWS = [{"prompt": "q0 what", "completion": "a0 yes"}, {"prompt": "q1 " + "x" * 5000, "completion": "a1"},
        {"prompt": "q2 who", "completion": "a2 me"}]


def _write_records(path, rows):
    import gzip

    import pyarrow as pa

    kind = "".join(path.suffixes)
    if kind in (".parquet", ".arrow"):
        table = pa.Table.from_pylist(rows)
        if kind == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, path)
        else:
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
        return
    if kind == ".csv":
        text = "prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in rows)
    elif kind == ".txt":
        text = "".join(f"{r['prompt']} {r['completion']}\n" for r in rows)
    elif kind.startswith(".jsonl"):
        text = "".join(json.dumps(r) + "\n" for r in rows)
    else:
        text = json.dumps(rows, indent=1)
    data = text.encode()
    path.write_bytes(gzip.compress(data) if kind.endswith(".gz") else data)


FORMATS = ["d.jsonl", "d.jsonl.gz", "d.json", "d.json.gz", "d.csv", "d.txt", "d.parquet", "d.arrow"]


@pytest.mark.parametrize("name", FORMATS)
def test_a_record_over_the_size_bound_is_one_line_or_skipped_and_counted(tmp_path, monkeypatch, name):
    monkeypatch.setattr(readers, "MAX_RECORD_BYTES", SMALL)
    _write_records(tmp_path / name, ROWS)
    line = one_line(build_cli(str(tmp_path / name), "--out", str(tmp_path / "out")))
    assert f"{name} record 2: " in line and f"over {SMALL:,}" in line and "--on-error skip" in line, line
    result = build_cli(str(tmp_path / name), "--on-error", "skip", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "out" / "manifest.json").read_text())["stats"]
    assert stats["examples_read"] == 3 and stats["dropped_by_reason"] == {"too_long": 1}, stats


def _not_utf8_table():
    import pyarrow as pa

    def strings(values):
        offsets = np.cumsum([0, *map(len, values)]).astype(np.int32)
        return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets.tobytes()),
                                                               pa.py_buffer(b"".join(values))])
    # pyarrow builds a string column unchecked from its buffers, as a foreign writer may have
    return pa.table({"prompt": strings([b"q0 what", b"q1 caf\xe9", b"q2 who"]),
                     "completion": strings([b"a0", b"a1", b"a2"])})


NOT_UTF8 = {  # the second of three records holds "caf\xe9" (Latin-1): where each format says it is
    "d.parquet": "d.parquet: row 2, column 'prompt': not UTF-8 text",
    "d.arrow": "d.arrow: row 2, column 'prompt': not UTF-8 text", "d.csv": "d.csv: row 2, column 'prompt': not UTF-8",
    "d.jsonl": "d.jsonl:2: not UTF-8 text", "d.jsonl.gz": "d.jsonl.gz:2: not UTF-8 text",
    "d.json": "d.json: item 2 of the array holds text that is not UTF-8", "d.txt": "d.txt:2: not UTF-8 text"}


@pytest.mark.parametrize("name", NOT_UTF8)
def test_text_that_is_not_utf8_is_one_line_or_skipped_and_counted(tmp_path, name):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    path, table = tmp_path / name, _not_utf8_table()
    records = [b'{"prompt": "q0 what", "completion": "a0"}', b'{"prompt": "q1 caf\xe9", "completion": "a1"}',
               b'{"prompt": "q2 who", "completion": "a2"}']
    if name == "d.parquet":
        pq.write_table(table, path)
    elif name == "d.arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    elif name == "d.csv":
        path.write_bytes(b"prompt,completion\nq0 what,a0\nq1 caf\xe9,a1\nq2 who,a2\n")
    elif name == "d.txt":
        path.write_bytes(b"q0 what a0\nq1 caf\xe9 a1\nq2 who a2\n")
    elif name == "d.json":
        path.write_bytes(b"[" + b",\n".join(records) + b"]")
    else:
        data = b"\n".join(records) + b"\n"
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    line = one_line(build_cli(str(path), "--out", str(tmp_path / "out")))
    assert f"{name} record 2: " in line and NOT_UTF8[name] in line and "re-encode" in line, line
    result = build_cli(str(path), "--on-error", "skip", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "out" / "manifest.json").read_text())["stats"]
    assert stats["examples_read"] == 3 and stats["dropped_by_reason"] == {"not_utf8": 1}, stats


def _gzip_run(path, head: bytes, size: int, tail: bytes) -> None:
    """A gzip file of ``head``, ``size`` bytes of "a" and ``tail``: members of one compressed 64 MiB run
    repeated (a gzip reader reads the members as one stream), so it costs one compression."""
    import gzip

    run = gzip.compress(b"a" * (64 << 20), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(size >> 26):
            f.write(run)
        f.write(gzip.compress(tail))


def test_a_gzip_line_of_gigabytes_is_refused_in_bounded_memory(tmp_path):
    """512 MB of characters on one line (2 MB on disk) under a 1.5 GB address-space limit: reading it whole
    (the line, then its text, then the record: 3 times its size and more) is a MemoryError there."""
    good = b'{"prompt": "q", "completion": "a"}\n'
    path = tmp_path / "d.jsonl.gz"
    _gzip_run(path, good + b'{"prompt": "q", "completion": "', 1 << 29, b'"}\n' + good)
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))
from click.testing import CliRunner
from packer.cli import main
result = CliRunner().invoke(main, ["build", {str(path)!r}, "--out", {str(tmp_path / "out")!r}, "-q"])
sys.stdout.write(result.stderr)
sys.exit(result.exit_code)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "d.jsonl.gz record 2: " in proc.stdout and "d.jsonl.gz:2: the line holds over 67,108,864 bytes of JSON" in proc.stdout, proc.stdout


def test_text_files_are_read_as_datasets_text_builder_read_them(tmp_path):
    """Builds from text files read them through `datasets` before: the same records, so every such build
    re-reads (verify --source) as it was made."""
    import datasets

    path = tmp_path / "t.txt"
    path.write_bytes(b"\xef\xbb\xbfone\r\ntwo\rthree\n\n  four  \n\x0cfive\xe2\x80\xa8six\nlast")
    ours = [r["text"] for r in readers.records("text", str(path))]
    theirs = [r["text"] for r in datasets.load_dataset("text", data_files=[str(path)], split="train", streaming=True)]
    assert ours == theirs and len(ours) == 7
