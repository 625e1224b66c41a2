"""A mix re-planned from its parts' entries in the token store (packer.building.token_store, .redraw,
.extension): another weight, seed or --limit re-plans when every part has an entry, tokenizing only the records
the draws take beyond an entry's (which then holds them too), byte-identical to a ``--no-cache`` build, with
its skips counted exactly. Never a wrong build.

The property test runs sequences of mix builds with changed weights, seeds, limits and packing, damaged entries
and what kills leave, each build checked against a ``--no-cache`` build of the same config, and whether it
re-planned, and how many records of each part it tokenized, against a model of what the store holds (each
part's records held, and whether they are all it has).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_tools import damage_entry, entry_dirs, killed_writer, own_cache

from packer import BuildConfig, build
from packer.building import extension, mix, redraw, token_store
from packer.checking.verify import verify
from packer.cli import main
from packer.contract.schema import LOCK, LOCK_BYTES, STAGING
from packer.errors import SourceError

A_BAD = {7: None, 30: None}  # part A's records with a null completion (skipped: null_field)
B_BAD = {3: None, 11: []}  # part B's: null messages (null_field), no turns (wrong_type): two reasons
A_RECORDS, B_RECORDS = 48, 20


def _chat(i: int) -> dict:
    if i in B_BAD:
        return {"messages": B_BAD[i]}
    return {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i} " * (i % 4 + 1)}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Part A: prompt/completion, part B: chat, each with records --on-error skip drops; E: prompt/completion; C and
    D: preference pairs."""
    d = tmp_path_factory.mktemp("mixdata")
    (d / "a.jsonl").write_text("".join(json.dumps({"prompt": f"q{i} " * (i % 5 + 1), "completion": A_BAD.get(i, f"a{i}")})
                                       + "\n" for i in range(A_RECORDS)))
    (d / "b.jsonl").write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(B_RECORDS)))
    (d / "e.jsonl").write_text("".join(json.dumps({"prompt": f"e{i} " * (i % 3 + 1), "completion": f"f{i}"}) + "\n"
                                       for i in range(16)))
    for name, n in (("c", 30), ("d", 12)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{name} p{i} " * (i % 3 + 1), "chosen": f"yes {i}",
                                                             "rejected": f"no {i} " * (i % 2 + 1)}) + "\n"
                                                 for i in range(n)))
    return d


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def mixed(data: Path, weights=(0.5, 0.5), names=("a", "b"), records=None, **options) -> dict:
    key = "weight" if records is None else "records"
    parts = tuple({"source": str(data / f"{n}.jsonl"), key: w} for n, w in zip(names, records or weights, strict=True))
    return dict(source="+".join(p["source"] for p in parts), mix=parts, num_proc=1, overwrite=True, on_error="skip", **options)


_COLD: dict[str, tuple[dict[str, str], list[int]]] = {}


def cold(options: dict) -> tuple[dict[str, str], list[int]]:
    """A --no-cache build of ``options``: its files' sha256s and each part's records read; made once."""
    k = json.dumps(options, sort_keys=True, default=str)
    if k not in _COLD:
        out = Path(tempfile.mkdtemp(prefix="packer-cold-"))
        try:
            result = build(BuildConfig(out=str(out / "b"), cache=False, **options))
            _COLD[k] = digest(out / "b"), [s["records_read"] for s in result.manifest.stats.sources or ()]
        finally:
            shutil.rmtree(out)
    return _COLD[k]


def meta_of(name: str) -> dict:
    """The meta.json of the entry of the source whose file is ``name``."""
    (meta,) = [m for m in (json.loads((p / "meta.json").read_text()) for p in entry_dirs())
               if Path(m["about"]["sources"][0]).name == name]
    return meta


def test_other_weights_seed_and_limit_re_plan_byte_identical(data, tmp_path):
    first = build(BuildConfig(out=str(tmp_path / "first"), **mixed(data)))
    assert not first.replanned and len(entry_dirs()) == 2  # one entry a part
    # B ran out (a weighted mix ends there): its entry holds all of it; A's, the records drawn from it
    metas = sorted((json.loads((p / "meta.json").read_text()) for p in entry_dirs()), key=lambda m: m["about"]["sources"])
    assert [m["complete"] for m in metas] == [False, True] and metas[1]["counts"]["records"] == B_RECORDS
    assert metas[1]["skips"] == {"at": [3, 11], "reasons": ["null_field", "wrong_type"]}  # each record's, read again
    for options in (mixed(data, (0.3, 0.7)), mixed(data, (0.3, 0.7), limit=9, pack="bfd", max_len=64),
                    mixed(data, limit=25, seed=0), mixed(data, (0.4, 0.6), limit=30, seed=2)):
        result = build(BuildConfig(out=str(tmp_path / "replan"), **options))
        assert result.replanned and not result.warnings, options
        assert digest(tmp_path / "replan") == cold(options)[0], options
    report = verify(str(tmp_path / "replan"), source=f"{data / 'a.jsonl'},{data / 'b.jsonl'}", progress=False)
    assert report.ok and report.checked, report.problems
    assert build(BuildConfig(out=str(tmp_path / "pure"), **mixed(data, (0.3, 0.7)))).extended is None


def test_records_beyond_an_entry_are_the_only_ones_tokenized(data, tmp_path):
    """Another seed draws 2 more of A than its entry holds: only those are read and tokenized, and A's entry
    then holds 20; more weight on A reads it to its end (A's 28 more; A then ends the mix, as in a cold build),
    and A's entry says it holds all; a build within both then tokenizes nothing. Each byte-identical."""
    build(BuildConfig(out=str(tmp_path / "first"), **mixed(data)))
    for options, more, held in ((mixed(data, seed=1), (2, 0), 20), (mixed(data, (0.8, 0.2)), (28, 0), A_RECORDS),
                                (mixed(data, (0.7, 0.3), seed=3), None, A_RECORDS)):
        result = build(BuildConfig(out=str(tmp_path / "out"), **options))
        assert result.replanned and result.extended == more and not result.warnings, options
        assert digest(tmp_path / "out") == cold(options)[0], options
        a = meta_of("a.jsonl")
        assert a["counts"]["records"] == held and a["complete"] == (held == A_RECORDS)
        assert a["skips"] == {"at": [i for i in A_BAD if i < held], "reasons": ["null_field"] * sum(i < held for i in A_BAD)}
    assert len(entry_dirs()) == 2
    report = verify(str(tmp_path / "out"), source=f"{data / 'a.jsonl'},{data / 'b.jsonl'}", progress=False)
    assert report.ok and report.checked, report.problems


def test_a_part_without_an_entry_is_tokenized_alone(data, tmp_path):
    """A source added to a mix built before: its records alone are read and tokenized (and those the draws take
    beyond the others' entries), the rest re-drawn from the entries, byte-identical; its entry is then kept."""
    build(BuildConfig(out=str(tmp_path / "first"), **mixed(data)))
    three = mixed(data, (0.4, 0.4, 0.2), names=("a", "b", "e"))
    expected, read = cold(three)
    result = build(BuildConfig(out=str(tmp_path / "three"), **three))
    assert result.replanned and result.extended == (max(0, read[0] - 18), 0, read[2]) and read[2] > 0
    assert digest(tmp_path / "three") == expected and meta_of("e.jsonl")["counts"]["records"] == read[2]
    assert build(BuildConfig(out=str(tmp_path / "again"), **{**three, "limit": 20})).extended is None


def test_an_entry_of_all_the_records_not_known_to_be_all(tmp_path, data):
    """--limit 16 of a 16-record source: its entry cannot know it holds them all; a build without --limit reads on
    from its end, finds none, says so and marks the entry complete (the next build reads nothing)."""
    args = ["build", str(data / "e.jsonl"), "-j", "1", "-q"]
    assert CliRunner().invoke(main, [*args, "--limit", "16", "--out", str(tmp_path / "a")]).exit_code == 0
    assert not meta_of("e.jsonl")["complete"]
    done = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b")])
    assert "re-planned from cached tokens; the source holds no records beyond them (nothing tokenized)" in done.output
    assert digest(tmp_path / "b") == cold(dict(source=str(data / "e.jsonl"), num_proc=1, overwrite=True))[0]
    assert meta_of("e.jsonl")["complete"]
    assert build(BuildConfig(out=str(tmp_path / "c"), source=str(data / "e.jsonl"), num_proc=1)).extended is None


def test_the_cli_says_it_re_planned_and_lists_the_parts(data, tmp_path):
    runner = CliRunner()
    args = ["build", str(data / "a.jsonl"), str(data / "b.jsonl"), "-j", "1", "-q", "--on-error", "skip"]
    assert runner.invoke(main, [*args, "--mix", "0.5,0.5", "--out", str(tmp_path / "a")]).exit_code == 0
    done = runner.invoke(main, [*args, "--mix", "0.2,0.8", "--out", str(tmp_path / "b")])
    assert done.exit_code == 0 and "re-planned from cached tokens: the source was not read" in done.output, done.output
    done = runner.invoke(main, [*args, "--mix", "0.5,0.5", "--seed", "1", "--out", str(tmp_path / "c")])
    assert "re-planned from cached tokens; tokenized 2 more records of part 1)" in done.output, done.output
    done = runner.invoke(main, [*args, "--mix", "0.9,0.1", "--out", str(tmp_path / "d"), "--json"])
    assert json.loads(done.output)["replanned"] is True and json.loads(done.output)["extended"] == [A_RECORDS - 20, 0]
    listed = runner.invoke(main, ["cache"])
    assert "2 entries" in listed.output and f"all its {B_RECORDS} records" in listed.output, listed.output
    assert sorted(e["sources"][0] for e in json.loads(runner.invoke(main, ["cache", "list", "--json"]).output)["entries"]
                  ) == [str(data / "a.jsonl"), str(data / "b.jsonl")]


def test_skips_under_two_reasons_are_counted_exactly(data, tmp_path):
    """B's entry lists its skipped records 3 (null_field) and 11 (wrong_type), each with its reason (the spill
    counts them by reason only: the two records are read again and encoded alone when the entry is made), so a
    build taking B's first 5 records counts one null_field, as a cold build does."""
    one = dict(source=str(data / "b.jsonl"), num_proc=1, overwrite=True, on_error="skip")
    build(BuildConfig(out=str(tmp_path / "whole"), **one))
    for limit in (2, 5, 15):
        options = {**one, "limit": limit}
        result = build(BuildConfig(out=str(tmp_path / f"l{limit}"), **options))
        assert result.replanned and digest(tmp_path / f"l{limit}") == cold(options)[0]
        assert result.manifest.stats.dropped_by_reason == {2: {}, 5: {"null_field": 1},
                                                           15: {"null_field": 1, "wrong_type": 1}}[limit]


def test_preference_pairs_and_records_counts_re_plan(data, tmp_path):
    """Two examples a record (one id): a pair mix's re-draw keeps each pair whole; a mix by records counts takes
    each part's first records, so counts within those held re-plan and counts beyond them tokenize those beyond
    (beyond the part's records: the cold build's error)."""
    pairs = mixed(data, names=("c", "d"), pack="bfd", max_len=128)
    build(BuildConfig(out=str(tmp_path / "p"), **pairs))
    for options in ({**pairs, "mix": tuple({**p, "weight": w} for p, w in zip(pairs["mix"], (0.2, 0.8), strict=True))},
                    {**pairs, "limit": 7, "seed": 4}):
        result = build(BuildConfig(out=str(tmp_path / "p2"), **options))
        assert result.replanned and digest(tmp_path / "p2") == cold(options)[0], options
    counts = mixed(data, records=(20, 12))
    assert not build(BuildConfig(out=str(tmp_path / "r"), **counts)).replanned
    fewer = mixed(data, records=(9, 12), seed=5)
    assert build(BuildConfig(out=str(tmp_path / "r2"), **fewer)).replanned
    assert digest(tmp_path / "r2") == cold(fewer)[0]
    beyond = mixed(data, records=(25, 12))
    assert build(BuildConfig(out=str(tmp_path / "r3"), **beyond)).extended == (5, 0)
    assert digest(tmp_path / "r3") == cold(beyond)[0]
    with pytest.raises(SourceError, match=f"a.jsonl: ended after {A_RECORDS} records, the mix asks for 50;"):
        build(BuildConfig(out=str(tmp_path / "r4"), **mixed(data, records=(50, 12))))


def test_a_source_of_several_files_is_keyed_by_the_files_read(data, tmp_path):
    """Under --limit the manifest records only the files that hold the records read, and so does an entry's key:
    a build reading both files never takes an entry made from the first alone (not even to read on from its
    end: the second file is no part of its key), one reading the first alone extends that one's, and a build
    reading both extends the entry of both files to their end."""
    folder = tmp_path / "two"
    folder.mkdir()
    lines = (data / "a.jsonl").read_text().splitlines(keepends=True)
    (folder / "x1.jsonl").write_text("".join(lines[:10]))
    (folder / "x2.jsonl").write_text("".join(lines[10:20]))
    one = dict(source=str(folder / "*.jsonl"), num_proc=1, overwrite=True, on_error="skip")
    for limit, extended in ((5, False), (8, (3,)), (15, False), (None, (5,)), (12, None), (3, None)):
        options = {**one, "limit": limit}
        result = build(BuildConfig(out=str(tmp_path / "out"), **options))
        assert result.replanned == (extended is not False) and digest(tmp_path / "out") == cold(options)[0], limit
        assert result.extended == (extended or None), limit
    # the first file's (8 records), both files' (all 20)
    assert sorted((m["counts"]["records"], m["complete"]) for m in (json.loads((p / "meta.json").read_text())
                                                                     for p in entry_dirs())) == [(8, False), (20, True)]


@pytest.mark.parametrize("pairs", [False, True])
def test_split_then_assembled_by_the_same_draws_is_the_spill_itself(tmp_path, pairs):
    """redraw.split then redraw.assemble with the same draws give the spill back byte for byte: three parts,
    skipped positions (no example), a preference spill's two examples a record, blocks smaller than the spill."""
    rng = np.random.default_rng(3)
    parts = [{"source": s, "weight": w} for s, w in (("a", 0.5), ("b", 0.3), ("c", 0.2))]
    src = mix.positions_sources(parts, 0, 500)
    kept = np.flatnonzero(rng.random(src.size) > 0.1)  # a tenth of the records skipped
    ids = np.repeat(kept, 2) if pairs else kept
    lengths = rng.integers(1, 40, ids.size).astype(np.int32)
    folder = tmp_path / "spill"
    folder.mkdir()
    rng.integers(0, 1000, int(lengths.sum()), dtype=np.int32).tofile(folder / "ids.bin")
    rng.integers(0, 2, int(lengths.sum()), dtype=np.uint8).tofile(folder / "trained.bin")
    lengths.tofile(folder / "lengths.bin")
    ids.astype(np.int64).tofile(folder / "example_ids.bin")
    into = [tmp_path / str(k) for k in range(3)]
    block, redraw.BLOCK = redraw.BLOCK, 97
    try:
        redraw.split(folder, lengths, ids, src, into)
        held = [(p, (p / "lengths.bin").stat().st_size // 4, (p / "ids.bin").stat().st_size // 4) for p in into]
        assert redraw.assemble(src, held, tmp_path / "back") == (ids.size, int(lengths.sum()))
    finally:
        redraw.BLOCK = block
    for name in ("ids.bin", "trained.bin", "lengths.bin", "example_ids.bin"):
        assert (tmp_path / "back" / name).read_bytes() == (folder / name).read_bytes(), name
    for k, p in enumerate(into):  # each part's example ids are its records' own indices
        part_ids = np.fromfile(p / "example_ids.bin", np.int64)
        assert np.array_equal(np.unique(part_ids), np.flatnonzero(np.isin(np.flatnonzero(src == k), kept)))


# -- the property: sequences of builds, damage and kills, against cold builds and a model of the store ------------

WEIGHTS = st.sampled_from([(0.5, 0.5), (0.2, 0.8), (0.8, 0.2)])
OPTIONS = st.sampled_from([{}, {"seed": 1}, {"limit": 12}, {"limit": 30, "seed": 1}, {"pack": "bfd", "max_len": 64},
                           {"limit": 20, "max_len": 32, "overlong": "split", "epochs": 2}])
DAMAGE = st.sampled_from(["truncate", "flip", "no_meta", "foreign", "killed_writer", "killed_split", "killed_restore",
                          "killed_extend"])
STEP = st.one_of(st.tuples(st.just("build"), WEIGHTS, OPTIONS), st.tuples(st.just("build"), WEIGHTS, OPTIONS),
                 st.tuples(st.just("damage"), DAMAGE, st.integers(0, 3)))  # builds twice as often


def _damage(kind: str, pick: int, out: Path) -> int | None:
    """Damage an entry as a disk, a person or a kill would; returns the part whose entry must not be used."""
    tokens = out / STAGING / "tokens"
    if kind == "killed_writer":
        killed_writer()
        return None
    if kind == "killed_extend":  # an extension's spill of another build's draws, killed: never taken for this one's
        (tokens / token_store.REST).mkdir(parents=True, exist_ok=True)
        (out / STAGING / LOCK).write_bytes(LOCK_BYTES)
        (tokens / token_store.REST / "identity.json").write_text("{}")
        (tokens / token_store.REST / "progress.json").write_text('{"records": 3, "examples": 3, "tokens": 3, '
                                                                 '"skipped": [{}, {}], "finished": true}')
        for name in ("ids.bin", "lengths.bin", "trained.bin", "example_ids.bin"):
            (tokens / token_store.REST / name).write_bytes(b"\x01" * 24)
        return None
    if kind in ("killed_split", "killed_restore"):  # a build killed while it split or re-drew its parts' files
        (tokens / token_store.PARTS / "0").mkdir(parents=True, exist_ok=True)
        (out / STAGING / LOCK).write_bytes(LOCK_BYTES)
        for name in ("ids.bin", "lengths.bin"):
            (tokens / token_store.PARTS / "0" / name).write_bytes(b"\x07" * 12)
        if kind == "killed_restore":
            (tokens / "ids.bin").write_bytes(b"\x01" * 8)
        return None
    entries = entry_dirs()
    if not entries:
        return None
    entry = entries[pick % len(entries)]
    part = 0 if json.loads((entry / "meta.json").read_text())["about"]["sources"][0].endswith("a.jsonl") else 1
    damage_entry(entry, kind)
    return part


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(st.tuples(WEIGHTS, OPTIONS), st.lists(STEP, min_size=3, max_size=5))
def test_mix_builds_damage_and_kills_against_cold_builds(data, tmp_path, first, steps):
    steps = [("build", *first), *steps]
    with own_cache():
        out = Path(tempfile.mkdtemp(dir=tmp_path)) / "out"
        held: dict[int, tuple[int, bool]] = {}  # part -> (records its sound entry holds, whether all it has)
        damaged: set[int] = set()  # parts whose entry is damaged: found by the next build, which tokenizes
        for step in steps:
            if step[0] == "damage":
                part = _damage(step[1], step[2], out)
                if part is not None:
                    held.pop(part, None)
                    damaged.add(part)
                continue
            _, weights, extra = step
            options = mixed(data, weights, **extra)
            expected_digest, read = cold(options)
            parts, seed, limit = list(options["mix"]), options.get("seed", 0), options.get("limit")
            gone = mix.ran_out(parts, seed, limit, sum(read))  # the part whose end ended the mix
            # an entry there and none damaged: re-planned, tokenizing the records the draws take beyond the
            # entries (all those of a part without one)
            replanned = bool(held) and not damaged
            has = [held.get(k, (0, False)) for k in range(2)]
            beyond = [k for k in range(2) if read[k] > has[k][0] or (gone == k and not has[k][1])]
            result = build(BuildConfig(out=str(out), **options))
            assert result.replanned == replanned, (step, held, read, gone)
            if replanned:
                assert result.extended == (tuple(max(0, read[k] - has[k][0]) for k in range(2)) if beyond else None)
            damaged.clear()  # found, and replaced by the entry of the records this build read
            assert digest(out) == expected_digest, step
            if not result.replanned:  # each part's entry replaced unless it holds as much already
                for k in range(2):
                    if read[k] and not (k in held and (held[k][1] or (held[k][0] >= read[k] and gone != k))):
                        held[k] = (read[k], gone == k)
            for k in beyond if result.replanned else ():  # an extended entry holds the records read, and says
                held[k] = (max(read[k], has[k][0]), has[k][1] or gone == k)  # whether they are all its part has
            for entry in entry_dirs():  # every entry there is sound
                meta = json.loads((entry / "meta.json").read_text())
                assert token_store._entry_problem(entry, meta["identity"], True) is None


@pytest.mark.parametrize(("where", "nth", "resumed"), [("tokens/progress.json.tmp", 1, 0), (f"tokens/{token_store.PARTS}", 3, 38)])
def test_killed_while_tokenizing_or_splitting_a_mix_then_rebuilt(data, tmp_path, where, nth, resumed):
    """SIGKILL (test_crash's audit hook) as the spill's marker is about to be written (tokenizing: nothing
    committed) or as the third file under the spill's .parts is opened (splitting it into the store): no entry;
    the rerun resumes its spill, splits it (a leftover ignored), keeps both entries and is byte-identical to a
    cold build; another weight then re-plans."""
    from test_crash import _AT

    cache, stamp, out = tmp_path / "cache", tmp_path / "moment", tmp_path / "killed"
    args = [str(data / "a.jsonl"), str(data / "b.jsonl"), "--mix", "0.5,0.5", "--on-error", "skip", "-j", "1", "-q",
            "--out", str(out)]
    env = {**os.environ, "PACKER_CACHE": str(cache), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _AT, "open", str(out / STAGING / where), str(nth), "kill", str(stamp),
                           *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert stamp.exists() and done.returncode == -9, done.stderr
    os.environ["PACKER_CACHE"] = str(cache)  # the fixture restores it
    assert not entry_dirs()
    again = build(BuildConfig(out=str(out), **mixed(data)))
    assert not again.replanned and again.resumed == resumed and digest(out) == cold(mixed(data))[0]
    assert len(entry_dirs()) == 2
    other = mixed(data, (0.3, 0.7))
    assert build(BuildConfig(out=str(tmp_path / "other"), **other)).replanned
    assert digest(tmp_path / "other") == cold(other)[0]


def test_killed_while_extending_then_rebuilt(data, tmp_path, monkeypatch):
    """SIGKILL as the first extended entry's files are put together (the records beyond it read and tokenized,
    their spill finished): the entry is untouched; the rerun takes that spill as it is, extends the entry and is
    byte-identical to a cold build; then the same draws re-plan without tokenizing."""
    from test_crash import _AT

    cache, stamp, out = tmp_path / "cache", tmp_path / "moment", tmp_path / "killed"
    os.environ["PACKER_CACHE"] = str(cache)  # the fixture restores it
    build(BuildConfig(out=str(tmp_path / "first"), **mixed(data)))
    args = [str(data / "a.jsonl"), str(data / "b.jsonl"), "--mix", "0.5,0.5", "--seed", "1", "--on-error", "skip",
            "-j", "1", "-q", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _AT, "open", "ids.bin.tmp", "1", "kill", str(stamp), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert stamp.exists() and done.returncode == -9, done.stderr
    rest = out / STAGING / "tokens" / token_store.REST
    assert json.loads((rest / "progress.json").read_text())["finished"] and meta_of("a.jsonl")["counts"]["records"] == 18
    monkeypatch.setattr(extension.Rest, "chunks", lambda *_: pytest.fail("the finished extension was read again"))
    again = build(BuildConfig(out=str(out), **mixed(data, seed=1)))
    assert again.extended == (2, 0) and digest(out) == cold(mixed(data, seed=1))[0]
    assert meta_of("a.jsonl")["counts"]["records"] == 20 and not (out / STAGING).exists()
    assert build(BuildConfig(out=str(tmp_path / "after"), **mixed(data, seed=1))).extended is None


class Stopped(BaseException):
    """A build stopped mid-way (as by a kill: no handler of packer's catches it)."""


def test_an_interrupted_extension_resumes_where_it_stopped(data, tmp_path, monkeypatch):
    """The records beyond the entries are tokenized in chunks committed one by one (here 3 records a chunk): a
    build interrupted in its third chunk resumes at the third, reading none of the first six records again, and
    is byte-identical to a cold build."""
    from packer.building import spill

    build(BuildConfig(out=str(tmp_path / "first"), **mixed(data)))  # A's entry: its first 18 records
    options = mixed(data, (0.9, 0.1))
    expected = cold(options)[0]
    monkeypatch.setattr(spill, "CHUNK", 3)
    monkeypatch.setattr(spill, "COMMIT_RECORDS", 1)
    firsts, real, once = [], mix.MixEncoder.encode, [True]

    def encode(self, chunk):
        firsts.append([piece[1] for piece in chunk.pieces])  # each part's first record index in the chunk
        if len(firsts) == 3 and once:
            once.clear()
            raise Stopped  # as a kill would, mid-chunk
        return real(self, chunk)

    monkeypatch.setattr(mix.MixEncoder, "encode", encode)
    with pytest.raises(Stopped):
        build(BuildConfig(out=str(tmp_path / "out"), **options))
    assert firsts == [[18], [21], [24]] and meta_of("a.jsonl")["counts"]["records"] == 18
    firsts.clear()
    result = build(BuildConfig(out=str(tmp_path / "out"), **options))
    assert firsts[0] == [24] and result.extended == (A_RECORDS - 18, 0) and digest(tmp_path / "out") == expected
    assert meta_of("a.jsonl")["complete"]


def test_an_extension_of_thousands_of_records_through_two_workers_is_the_cold_build(tmp_path):
    """Where the store meets the pool (every test above runs -j 1 on a few records): an extension's chunks hold only
    the positions no entry holds, so they are not consecutive, and the pool cuts each into tasks by its records'
    rank (it cut by position and lost records: the mix then ended early, or the build failed). Weights 0.5/0.5
    then 0.7/0.3 over 3,000 + 1,000 records: 1,210 records of part 1 tokenized by two workers, the cold build's
    bytes."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"prompt": f"Add {i} and {i}.", "completion": f" {2 * i}"}) + "\n"
                                              for i in range(3000)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"prompt": f"Double {i}.", "completion": f" {2 * i}"}) + "\n"
                                              for i in range(1000)))

    def options(weights):
        parts = tuple({"source": str(tmp_path / f"{n}.jsonl"), "weight": w} for n, w in zip("ab", weights, strict=True))
        return dict(source="a+b", mix=parts, num_proc=2)

    build(BuildConfig(out=str(tmp_path / "first"), **options((0.5, 0.5))))
    again = build(BuildConfig(out=str(tmp_path / "again"), **options((0.7, 0.3))))
    assert again.replanned and again.extended == (1210, 0)
    build(BuildConfig(out=str(tmp_path / "cold"), cache=False, **options((0.7, 0.3))))
    assert digest(tmp_path / "again") == digest(tmp_path / "cold")


def test_a_part_read_by_a_records_count_is_never_all_of_its_source(data, tmp_path):
    """A one-part mix reading 30 of a.jsonl's 48 records by a count keeps an entry of 30 records, not all of the
    source: the one-source build of a.jsonl after it takes those 30 and tokenizes the 18 after them (it was cut
    short at 30, the source's entry marked complete), the cold build's bytes."""
    part = {"source": str(data / "a.jsonl"), "records": 30}
    build(BuildConfig(out=str(tmp_path / "counted"), source=part["source"], mix=(part,), on_error="skip", num_proc=1))
    assert meta_of("a.jsonl")["complete"] is False
    one = dict(source=str(data / "a.jsonl"), on_error="skip", num_proc=1)
    after = build(BuildConfig(out=str(tmp_path / "one"), **one))
    assert after.extended == (A_RECORDS - 30,)
    assert digest(tmp_path / "one") == cold(one)[0]


def test_what_the_store_keys_and_what_it_will_not_key(data):
    """The libraries that make the tokens are in every part's identity; a Hub source read offline (no revision to
    pin its content) gets none, so such a build neither uses nor keeps entries."""
    from packer.building.pipeline import open_source, tokenizer_path
    from packer.building.tokenization import load_tokenizer, tokenizer_info

    config = BuildConfig(out="-", **mixed(data))
    tokenizer = load_tokenizer(tokenizer_path(None))
    opened = open_source(config, tokenizer, skip_errors=True)
    info = tokenizer_info(tokenizer, "bundled")
    idents = token_store.identities(config, info, tuple(config.mix), opened.source, opened.encoder)
    assert [set(i["libraries"]) for i in idents] == [{"tokenizers", "transformers", "jinja2"}] * 2
    assert all(i["libraries"]["tokenizers"] for i in idents)
    hub = {**opened.source, "parts": [opened.source["parts"][0], {"source": "owner/name", "kind": "hub", "id": "owner/name",
                                                                   "config": None, "split": "train", "revision": None}]}
    assert token_store.identities(config, info, tuple(config.mix), hub, opened.encoder) is None
    hub["parts"][1]["revision"] = "0123abcd"
    assert token_store.identities(config, info, tuple(config.mix), hub, opened.encoder) is not None
