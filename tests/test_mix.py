"""Mixtures: several sources, each formatted by its own recipe or fields, drawn by weight or count for
the seed; per-source counts in the manifest; inspect shows them; verify --source re-reads every source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from packer.building import mix, pipeline, spill
from packer.cli import main
from packer.contract import schema


@pytest.fixture(scope="module")
def srcs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mixsrc")
    with open(d / "qa.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"It is {2 * i}."}) + "\n")
    with open(d / "chat.jsonl", "w") as f:
        for i in range(200):
            turns = [{"role": "user", "content": f"Say {i} in words."}, {"role": "assistant", "content": f"Number {i}!"}]
            f.write(json.dumps({"messages": turns}) + "\n")
    (d / "mix.yaml").write_text(
        f"- {{source: flan, records: 60}}\n"
        f"- {{source: {d / 'qa.jsonl'}, recipe: gsm8k, records: 50}}\n"
        f"- {{source: {d / 'chat.jsonl'}, messages_field: messages, records: 40}}\n")
    return {"dir": d, "qa": d / "qa.jsonl", "chat": d / "chat.jsonl", "file": d / "mix.yaml"}


def cli(*args: str):
    return CliRunner().invoke(main, [*args])


def manifest(out: Path) -> dict:
    return json.loads((out / schema.MANIFEST_NAME).read_text())


def segments(out: Path) -> dict[int, np.ndarray]:
    """example id -> its tokens, from the shards (each example whole in one row here)."""
    got = {}
    for entry in manifest(out)["shards"]:
        with pa.memory_map(str(out / entry["file"])) as f:
            table = pa.ipc.open_stream(f).read_all()
        for ids, lens, exs in zip(table["input_ids"].to_pylist(), table["seq_lens"].to_pylist(),
                                  table["example_ids"].to_pylist()):
            at = 0
            for n, ex in zip(lens, exs):
                got[ex] = np.asarray(ids[at:at + n])
                at += n
    return got


@pytest.fixture(scope="module")
def weighted(srcs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixw") / "out"
    result = cli("build", "flan", str(srcs["qa"]), str(srcs["chat"]), "--mix", "0.5,0.3,0.2", "--limit", "300",
                 "-q", "-j", "1", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_weighted_mix_counts_add_up_and_follow_the_draws(weighted, srcs):
    m = manifest(weighted)
    parts = m["config"]["mix"]
    assert [p["weight"] for p in parts] == [0.5, 0.3, 0.2]
    counts = m["stats"]["sources"]
    assert sum(c["records_read"] for c in counts) == m["stats"]["examples_read"] == 300
    assert sum(c["tokens"] for c in counts) == m["stats"]["tokens"]
    drawn = np.bincount(mix.positions_sources(parts, 0, 300), minlength=3)
    assert [c["records_read"] for c in counts] == drawn.tolist()
    assert all(c > 0 for c in drawn) and drawn[0] > drawn[2]  # the weights show
    assert m["source"]["kind"] == "mix" and [p["source"] for p in m["source"]["parts"]] == ["flan", str(srcs["qa"]),
                                                                                            str(srcs["chat"])]


def test_each_example_is_its_own_sources_tokens(weighted, srcs, tmp_path):
    """Chat and prompt/completion in one build: every segment equals that record built alone."""
    alone = {}
    for k, (src, extra) in enumerate([("flan", ["--limit", "300"]), (str(srcs["qa"]), []), (str(srcs["chat"]), [])]):
        out = tmp_path / f"alone{k}"
        result = cli("build", src, *extra, "-q", "-j", "1", "--out", str(out))
        assert result.exit_code == 0, result.output
        alone[k] = segments(out)
    parts = manifest(weighted)["config"]["mix"]
    src = mix.positions_sources(parts, 0, 300)
    got = segments(weighted)
    assert sorted(got) == list(range(300))
    for position, tokens in got.items():
        k = int(src[position])
        index = int((src[:position] == k).sum())  # the record's index in its own source
        assert np.array_equal(tokens, alone[k][index]), (position, k, index)


def test_a_weighted_mix_says_which_part_ran_out(srcs, tmp_path):
    """No --limit: the mix ends at the first draw of a part with no record left, here the part of 40
    records beside one of 200 at the same weight; the build summary and inspect name it."""
    out, short = tmp_path / "out", tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(40)))
    result = cli("build", str(srcs["qa"]), str(short), "--mix", "0.5,0.5", "-q", "-j", "1", "--out", str(out))
    assert result.exit_code == 0, result.output
    counts = manifest(out)["stats"]["sources"]
    assert counts[1]["records_read"] == 40 and counts[0]["records_read"] < 200  # the first had records left
    said = f"ended when part 2, {short}, ran out after 40 records (its weight 0.5)"
    assert any(line.startswith(f"mix       {said}") for line in result.stdout.splitlines()), result.stdout
    assert any(line.startswith(f"  {said}") for line in cli("inspect", str(out)).output.splitlines())
    assert mix.ran_out([{"source": "a", "weight": 1.0}, {"source": "b", "weight": 1.0}], 0, 300, 300) is None  # --limit


def test_inspect_shows_the_mix_and_verify_checks_every_source(weighted, srcs, tmp_path):
    shown = cli("inspect", str(weighted))
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("mix"))
    assert "w 0.5" in lines[head + 1] and "w 0.3" in lines[head + 2] and "w 0.2" in lines[head + 3]
    ok = cli("verify", str(weighted), "--source", f"flan,{srcs['qa']},{srcs['chat']}")
    assert ok.exit_code == 0, ok.output
    changed = tmp_path / "qa.jsonl"
    changed.write_text(srcs["qa"].read_text().replace("plus 7?", "plus seven?"))
    bad = cli("verify", str(weighted), "--source", f"flan,{changed},{srcs['chat']}")
    assert bad.exit_code == 1 and f"--source {changed}: its files' sha256 differ" in bad.output


def test_mix_is_deterministic_for_the_seed_and_any_j(srcs, weighted, tmp_path):
    args = ["build", "flan", str(srcs["qa"]), str(srcs["chat"]), "--mix", "0.5,0.3,0.2", "--limit", "300", "-q"]
    again = tmp_path / "again"
    assert cli(*args, "-j", "2", "--out", str(again)).exit_code == 0
    for name in ("manifest.json", "shard-00000.arrow"):
        assert (again / name).read_bytes() == (weighted / name).read_bytes(), name
    other = tmp_path / "seed1"
    assert cli(*args, "--seed", "1", "--out", str(other)).exit_code == 0
    assert manifest(other)["stats"]["sources"] != manifest(weighted)["stats"]["sources"]


def test_mix_file_with_record_counts(srcs, tmp_path):
    out = tmp_path / "out"
    result = cli("build", "--mix", str(srcs["file"]), "-q", "--out", str(out))
    assert result.exit_code == 0, result.output
    counts = manifest(out)["stats"]["sources"]
    assert [c["records_read"] for c in counts] == [60, 50, 40]
    assert manifest(out)["config"]["mix"][1]["recipe"] == "gsm8k"
    ok = cli("verify", str(out), "--source", str(srcs["file"]))
    assert ok.exit_code == 0, ok.output


def _file(tmp: Path, text: str, name: str = "m.yaml") -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


@pytest.mark.parametrize(("make", "needle"), [
    (lambda t, s: ["flan", str(s["qa"]), "--mix", "0.5,half"], "weight 'half' is not a number"),
    (lambda t, s: ["flan", str(s["qa"]), "--mix", "0,0"], "the weights sum to zero"),
    (lambda t, s: ["flan", str(s["qa"]), "--mix", "1,1,1"], "gives 3 weights for 2 sources"),
    (lambda t, s: ["flan", str(s["qa"])], "2 sources need --mix"),
    (lambda t, s: ["flan", str(s["qa"]), "--mix", "1,1", "--prompt-field", "q"], "set them per source in a mix file"),
    (lambda t, s: ["--mix", _file(t, "- {source: flan, weight: 1, colour: red}\n")], "unknown keys colour"),
    (lambda t, s: ["--mix", _file(t, f"- {{source: {t / 'nope.jsonl'}, weight: 1}}\n")], "nope.jsonl: no such file"),
    (lambda t, s: ["--mix", _file(t, "- {source: flan, weight: 1}\n- {source: flan, records: 5}\n")],
     "a weight, or every source a records count"),
    (lambda t, s: ["--mix", _file(t, "[{source: flan, weight: 1}")], "not valid YAML"),
    (lambda t, s: ["--mix", _file(t, "{\"sources\": 3}", "m.json")], "must be a list of sources"),
    (lambda t, s: ["--mix", _file(t, f"- {{source: {s['qa']}, records: 500}}\n- {{source: flan, records: 10}}\n")],
     "qa.jsonl: ended after 200 records, the mix asks for 500"),
])
def test_bad_mix_is_one_line_and_writes_nothing(srcs, tmp_path, make, needle):
    out = tmp_path / "out"
    result = cli("build", *make(tmp_path, srcs), "-q", "--out", str(out))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line, = result.stderr.splitlines()
    assert needle in line, line
    assert not (out / schema.MANIFEST_NAME).exists() and not list(out.glob("shard-*"))


def test_skipped_records_are_counted_per_source_and_resumed(srcs, tmp_path, monkeypatch):
    """--on-error skip in a mix: each part's skips by reason in its own counts, their sums in the totals,
    the same after a resume from the spill, and verify --source agrees."""
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in srcs["qa"].read_text().splitlines()[:60]]
    rows[3]["answer"], rows[10]["answer"], rows[20]["question"] = "", None, ""
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixfile = _file(tmp_path, f"- {{source: {bad}, recipe: gsm8k, records: 60}}\n"
                              f"- {{source: {srcs['chat']}, messages_field: messages, records: 40}}\n")
    out = tmp_path / "out"
    args = ["build", "--mix", mixfile, "--on-error", "skip", "-q", "-j", "1", "--out", str(out)]
    assert cli(*args).exit_code == 0
    stats = manifest(out)["stats"]
    first, second = stats["sources"]
    assert first["dropped_by_reason"] == {"empty_text": 2, "null_field": 1} and second["dropped_by_reason"] == {}
    assert stats["dropped_by_reason"] == first["dropped_by_reason"] and stats["records_skipped"] == 3
    assert first["records_read"] == 60 and first["examples"] == 57 and stats["examples_read"] == 100
    ok = cli("verify", str(out), "--source", mixfile)
    assert ok.exit_code == 0, ok.output


    resumed = tmp_path / "resumed"  # killed after tokenizing; the rerun takes the skip counts from the spill
    real_plan = pipeline.make_plan

    def killed(*args, **kwargs):
        raise RuntimeError("killed after tokenizing")

    monkeypatch.setattr(pipeline, "make_plan", killed)
    assert cli(*args[:-1], str(resumed)).exit_code != 0
    assert json.loads((resumed / ".packer-staging" / schema.TOKENS_DIR / spill.PROGRESS).read_text())["finished"]
    monkeypatch.setattr(pipeline, "make_plan", real_plan)
    tokenized = []
    monkeypatch.setattr(spill, "tokenize", lambda *a, t=spill.tokenize, **k: tokenized.append(t(*a, **k)) or tokenized[-1])
    assert cli(*args[:-1], str(resumed)).exit_code == 0
    assert tokenized[0].reused_records == 100
    assert manifest(resumed) == manifest(out)


def test_skipped_is_a_mapping_of_totals_that_keeps_each_part():
    from packer.building.tokenization import Skipped

    a = Skipped(({"empty_text": 2}, {"null_field": 1, "empty_text": 1}))
    assert a == {"empty_text": 3, "null_field": 1} and sum(a.values()) == 4 and list(a) == ["empty_text", "null_field"]
    both = a + Skipped(({}, {"null_field": 2}))
    assert both.by_part == ({"empty_text": 2}, {"empty_text": 1, "null_field": 3}) and dict(both) == {"empty_text": 3,
                                                                                                       "null_field": 3}
    assert Skipped.none(2) == {} and "x" not in a
    with pytest.raises(ValueError):  # counts of another number of parts are not this source's
        a + Skipped.none(3)


@pytest.mark.parametrize("counts", [False, True])
def test_a_mix_read_from_a_position_is_the_whole_reads_tail_and_reads_nothing_before(srcs, tmp_path, counts):
    """A resumed build's mix: from position p (a chunk boundary), the very chunks a read from 0 gives from p on, each
    part's stream opened at its first record after p's draws; what lies before is not parsed (a part's line that is
    no record, before p, fails a read from 0 and is passed over by a read from p)."""
    bad = tmp_path / "qa.jsonl"
    lines = srcs["qa"].read_text().splitlines(keepends=True)
    bad.write_text("7\n" + "".join(lines[1:]))
    parts = ([{"source": "flan", "records": 60}, {"source": str(bad), "recipe": "gsm8k", "records": 150}] if counts else
             [{"source": "flan", "weight": 0.6}, {"source": str(bad), "recipe": "gsm8k", "weight": 0.4}])
    streams = tuple(sources_open(p) for p in parts)
    whole = mix.MixStream(tuple(parts), streams, 3, 190 if not counts else None)
    with pytest.raises(Exception, match="not a record"):
        list(whole.chunks(0, 20))
    first_bad = int(np.flatnonzero(mix.positions_sources(parts, 3, 210) == 1)[0])
    start = (first_bad // 20 + 1) * 20
    got = list(whole.chunks(start, 20))
    assert [lo for lo, _ in got] == list(range(start, 190 if not counts else 210, 20))
    # the reference: a clean copy of the part read from 0, its chunks from `start` on
    clean = tuple(sources_open({**p, "source": str(srcs["qa"])}) if k else s for k, (p, s) in enumerate(zip(parts, streams)))
    want = [(lo, c) for lo, c in mix.MixStream(tuple(parts), clean, 3, whole.limit).chunks(0, 20) if lo >= start]
    assert len(got) == len(want)
    for (lo, a), (lo2, b) in zip(got, want):
        assert lo == lo2 and a.size == b.size
        for (k, f, r, p), (k2, f2, r2, p2) in zip(a.pieces, b.pieces, strict=True):
            assert (k, f, r) == (k2, f2, r2) and np.array_equal(p, p2)


def sources_open(part: dict):
    from packer.building import sources

    return sources.open_stream(sources.resolve(part["source"], recipe=part.get("recipe")), limit=part.get("records"))


def test_a_resume_past_what_the_source_holds_is_refused(srcs, tmp_path):
    """Only a run over the same bytes resumes, so a source holding fewer records than the resumed run read has
    changed: refused in one line, never taken for a mix that ran out there."""
    from packer.building import sources

    short = tmp_path / "qa.jsonl"
    short.write_text("".join(srcs["qa"].read_text().splitlines(keepends=True)[:30]))
    stream = sources.open_stream(sources.resolve(str(short), recipe="gsm8k"), limit=None)
    assert [first for first, _ in stream.chunks(30, 10)] == []  # at its end: nothing more, no error
    with pytest.raises(Exception, match="holds 30 records, fewer than the 40"):
        list(stream.chunks(40, 10))
