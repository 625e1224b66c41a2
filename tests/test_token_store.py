"""The token store (packer.building.token_store): a re-plan from it is byte-identical to a cold build, and the
store is never trusted blindly (damaged, partial, foreign entries; kills; two builds at once; a full disk).

The property test runs sequences of builds with changed options, damaged entries and what kills leave, each
build checked against a ``--no-cache`` build of the same config (made once per config); the real kill, the
real full disk (a tmpfs of a few kB in a user namespace) and two real processes at once are tests of their own.
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

import pytest
from click.testing import CliRunner
from conftest import ROOT, need_shared
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_tools import damage_entry, entry_dirs, killed_writer, own_cache

from packer import BuildConfig, build, cache
from packer.building import kept_tokenizers, token_store
from packer.building.tokenization import load_tokenizer, tokenizer_info
from packer.checking.verify import verify
from packer.cli import main
from packer.contract.schema import LOCK, LOCK_BYTES, STAGING

LIMITS = (60, 90)  # records: two token identities, small enough that a build is a fraction of a second
_COLD: dict[tuple, dict[str, str]] = {}  # a config's --no-cache build: file -> sha256


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def config(out: Path, **options) -> BuildConfig:
    return BuildConfig(source="flan", out=str(out), num_proc=1, overwrite=True, **options)


def cold(**options) -> dict[str, str]:
    """The folder a --no-cache build of ``options`` makes, made once per session."""
    k = tuple(sorted(options.items()))
    if k not in _COLD:
        out = Path(tempfile.mkdtemp(prefix="packer-cold-"))
        try:
            build(config(out / "b", cache=False, **options))
            _COLD[k] = digest(out / "b")
        finally:
            shutil.rmtree(out)
    return _COLD[k]


# -- re-planning ----------------------------------------------------------------------------------------


def test_replan_is_byte_identical_verifies_and_says_so(tmp_path):
    first = build(config(tmp_path / "first", limit=LIMITS[0]))
    assert not first.replanned and len(entry_dirs()) == 1
    changed = dict(limit=LIMITS[0], pack="bfd", max_len=512, seed=3, epochs=2, cp_size=2, world_size=2,
                   balance="attention", format_version=1, compression="zstd", shard_size_mb=1)
    result = build(config(tmp_path / "replan", **changed))
    assert result.replanned and result.resumed is None and not result.warnings
    assert digest(tmp_path / "replan") == cold(**changed)
    report = verify(str(tmp_path / "replan"), source="flan", progress=False)
    assert report.ok, report.problems
    # what acts before planning is keyed: another --train-on tokenizes again; a --limit beyond the records the
    # entry holds tokenizes only the records beyond them (its entry, of more records, replaces the one of
    # fewer); a --limit within them re-plans from their first records
    beyond = build(config(tmp_path / "limit", limit=LIMITS[1]))
    assert beyond.replanned and beyond.extended == (LIMITS[1] - LIMITS[0],) and not beyond.warnings
    assert digest(tmp_path / "limit") == cold(limit=LIMITS[1])
    assert verify(str(tmp_path / "limit"), source="flan", progress=False).ok
    assert not build(config(tmp_path / "train-on", limit=LIMITS[0], train_on="all")).replanned
    assert len(entry_dirs()) == 2
    assert build(config(tmp_path / "fewer", **changed)).replanned
    assert digest(tmp_path / "fewer") == cold(**changed)


def test_the_cache_limit_evicts_the_least_recently_used_entry(tmp_path, monkeypatch):
    build(config(tmp_path / "a", limit=LIMITS[0]))
    (first,) = entry_dirs()
    everything = sum(f.stat().st_size for f in cache.root().rglob("*") if f.is_file())
    monkeypatch.setenv("PACKER_CACHE_LIMIT", str(int(everything * 1.2)))  # room for one of the two entries
    build(config(tmp_path / "b", limit=LIMITS[1], train_on="all"))
    assert [p.name for p in entry_dirs()] != [first.name] and len(entry_dirs()) == 1  # the older one went
    assert not build(config(tmp_path / "a2", limit=LIMITS[0], seed=1)).replanned
    monkeypatch.setenv("PACKER_CACHE_LIMIT", "1kB")  # less than one entry: none is kept, the build is whole
    assert not build(config(tmp_path / "c", limit=LIMITS[0], on_error="skip")).warnings
    assert all(json.loads((p / "meta.json").read_text())["identity"]["config"].get("on_error") != "skip"
               for p in entry_dirs())


def test_what_the_pack_mode_reads_is_keyed(tmp_path):
    """A source with a text column beside a prompt/completion pair: --pack wrap trains the text, another mode
    the pair, so the two builds' tokens differ and a wrap build never re-plans from a batch build's."""
    source = tmp_path / "both.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}", "text": f"plain text {i} " * 9})
                              + "\n" for i in range(40)))
    options = dict(source=str(source), num_proc=1, pack="wrap", max_tokens=64)
    assert not build(BuildConfig(out=str(tmp_path / "batch"), source=str(source), num_proc=1)).replanned
    wrapped = build(BuildConfig(out=str(tmp_path / "wrap"), **options))
    assert not wrapped.replanned
    build(BuildConfig(out=str(tmp_path / "cold"), cache=False, **options))
    assert digest(tmp_path / "wrap") == digest(tmp_path / "cold")
    assert build(BuildConfig(out=str(tmp_path / "wrap2"), seed=1, **options)).replanned


def test_cli_summary_no_cache_and_the_cache_command(tmp_path):
    runner = CliRunner()
    args = ["build", "flan", "--limit", str(LIMITS[0]), "-j", "1", "-q"]
    assert runner.invoke(main, [*args, "--out", str(tmp_path / "a"), "--no-cache"]).exit_code == 0
    assert not token_store.folder().exists() or not entry_dirs()  # --no-cache keeps nothing
    assert runner.invoke(main, [*args, "--out", str(tmp_path / "b")]).exit_code == 0
    done = runner.invoke(main, [*args[:-1], "--out", str(tmp_path / "c"), "--pack", "bfd"])  # its bars shown
    assert done.exit_code == 0 and "re-planned from cached tokens" in done.output
    assert "write:" in done.stderr and "tokenize:" not in done.stderr and "resuming" not in done.stderr  # nothing was
    as_json = runner.invoke(main, [*args, "--out", str(tmp_path / "d"), "--seed", "2", "--json"])
    assert json.loads(as_json.output)["replanned"] is True
    listed = runner.invoke(main, ["cache"])
    assert listed.exit_code == 0 and "1 entry" in listed.output and f"{LIMITS[0]} records" in listed.output
    listed = json.loads(runner.invoke(main, ["cache", "list", "--json"]).output)
    assert [e["sources"] for e in listed["entries"]] == [["flan"]] and listed["entries"][0]["bytes"] > 0
    cleared = runner.invoke(main, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 token store entry" in cleared.output and not entry_dirs()
    assert not build(config(tmp_path / "e", limit=LIMITS[0])).replanned


# -- tokenizers met before: rebuilt without transformers ------------------------------------------------------


@pytest.mark.parametrize("folder", ["bundled", "llama2-tokenizer", "tokenizers/qwen3"])
def test_a_tokenizer_rebuilt_from_its_parts_is_the_same_tokenizer(folder):
    """The parts a build keeps give transformers' tokenizer back (its fingerprint, ids and offsets, special
    tokens, chat templates) by the Rust library alone; damaged parts are not used."""
    path = ROOT / "packer" / "data" / "tokenizer" if folder == "bundled" else need_shared(folder)
    loaded = load_tokenizer(str(path), memo=kept_tokenizers.TOKENIZERS)  # loaded by transformers, its parts kept
    rebuilt = load_tokenizer(str(path), memo=kept_tokenizers.TOKENIZERS)
    # what a build reads of it before it tokenizes comes from the kept facts: no Rust tokenizer made for it
    assert tokenizer_info(rebuilt, "t") == tokenizer_info(loaded, "t") and len(rebuilt) == len(loaded)
    assert rebuilt.control_tokens() == loaded.control_tokens() and rebuilt.top_id() == loaded.top_id()
    assert rebuilt._backend is None
    assert type(rebuilt.backend_tokenizer) is type(loaded.backend_tokenizer) and rebuilt is not loaded
    rebuilt._facts = None  # now read from the Rust tokenizer made at first use: the same
    assert tokenizer_info(rebuilt, "t") == tokenizer_info(loaded, "t")
    # what the rebuilt one records (kept, not made again) is what it is: its own serialisation and ids
    assert rebuilt.backend_tokenizer.to_str() == rebuilt.serialized() == loaded.backend_tokenizer.to_str()
    assert rebuilt.top_id() == max(rebuilt.backend_tokenizer.get_vocab(with_added_tokens=True).values()) > 0
    assert rebuilt.special_tokens_map == loaded.special_tokens_map and rebuilt.chat_template == loaded.chat_template
    assert rebuilt.control_tokens() == loaded.control_tokens()
    texts = ["Hello world!  你好 🙂\n\n  spaced", f"{loaded.eos_token} and <|im_start|>user\nhi<|im_end|>", ""]
    for a, b in zip(loaded.backend_tokenizer.encode_batch(texts), rebuilt.backend_tokenizer.encode_batch(texts),
                    strict=True):
        assert (a.ids, a.offsets) == (b.ids, b.offsets)
    kept = next(cache.Cache(kept_tokenizers.FACTS).folder.glob("*.json"))
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of the serialised tokenizer
    kept.write_bytes(bytes(data))
    assert kept_tokenizers.TOKENIZERS.get(path) is None


def test_a_replan_makes_no_rust_tokenizer(tmp_path, monkeypatch):
    """A build re-planned from the store never tokenizes, so a tokenizer rebuilt from its kept parts is not made (0.4 s
    for a large vocabulary); one that tokenizes makes it once, before any worker starts (they share it)."""
    import tokenizers

    made = []
    real = tokenizers.Tokenizer.from_str
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", lambda text: made.append(1) or real(text))
    build(config(tmp_path / "first", limit=LIMITS[0]))  # the tokenizer's parts kept, its tokens kept
    made.clear()
    assert build(config(tmp_path / "replan", limit=LIMITS[0], pack="bfd")).replanned and made == []
    assert not build(config(tmp_path / "tokenizes", limit=LIMITS[0], train_on="all")).replanned
    assert made == [1]


# -- never trusted blindly: the property ------------------------------------------------------------------

PLANNING = st.sampled_from([{}, {"pack": "bfd", "seed": 1}, {"max_len": 256, "overlong": "split", "epochs": 2},
                            {"pack": "bfd", "max_len": 512, "format_version": 1}])  # few: each needs its cold build
TOKENS = st.sampled_from([{"limit": LIMITS[0]}, {"limit": LIMITS[1]}, {"limit": LIMITS[0], "train_on": "all"}])
DAMAGE = st.sampled_from(["truncate", "flip", "no_meta", "torn_meta", "edited_meta", "foreign", "killed_writer",
                         "killed_restore"])
STEP = st.one_of(st.tuples(st.just("build"), TOKENS, PLANNING), st.tuples(st.just("damage"), DAMAGE, st.integers(0, 9)))


def _damage(kind: str, pick: int, out: Path) -> str | None:
    """Damage an entry as a disk, a person or a kill would; returns the entry's name if it must not be used."""
    entries = entry_dirs()
    if kind == "killed_writer":
        killed_writer()
        return None
    if kind == "killed_restore":  # a build killed while linking an entry into its staging folder
        staging = out / STAGING
        (staging / "tokens").mkdir(parents=True, exist_ok=True)
        (staging / LOCK).write_bytes(LOCK_BYTES)
        if entries:
            shutil.copyfile(entries[0] / "ids.bin", staging / "tokens" / "ids.bin")
        return None
    if not entries:
        return None
    entry = entries[pick % len(entries)]
    damage_entry(entry, kind)
    return entry.name


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(st.lists(STEP, min_size=2, max_size=4))
def test_builds_damage_and_kills_against_cold_builds(tmp_path, steps):
    with own_cache():
        out = Path(tempfile.mkdtemp(dir=tmp_path)) / "out"
        stored: dict[str, int] = {}  # the records the store holds sound, by --train-on (the key without --limit)
        damaged: set[str] = set()  # entries damaged since their last use
        names: dict[str, str] = {}
        for step in steps:
            if step[0] == "damage":
                name = _damage(step[1], step[2], out)
                if name is not None:
                    damaged.add(name)
                    stored = {k: n for k, n in stored.items() if names[k] != name}
                continue
            _, tokens, planning = step
            k = tokens.get("train_on", "assistant")
            before = {p.name for p in entry_dirs()}
            result = build(config(out, **tokens, **planning))
            # a --limit within the records held re-plans from their first ones; beyond them, it tokenizes those beyond
            assert result.replanned == (k in stored), (step, stored)
            assert result.extended == (None if not result.replanned or stored[k] >= tokens["limit"] else
                                       (tokens["limit"] - stored[k],)), (step, stored)
            assert digest(out) == cold(**tokens, **planning), step
            if k not in names:  # an entry's name is its identity's key: the same whenever it is made again
                names[k] = ({p.name for p in entry_dirs()} - before).pop()
            if names.get(k) in damaged:
                assert any("was not used" in w for w in result.warnings), result.warnings
                damaged.discard(names[k])
            stored[k] = max(stored.get(k, 0), tokens["limit"])
            entry = token_store.folder() / names[k]
            assert token_store._meta_problem(entry, json.loads((entry / "meta.json").read_text())["identity"]) is None


# -- real processes: a kill, a full disk, two builds at once ------------------------------------------------


def _run(args: list[str], cache: Path, *, prefix: list[str] = (), **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PACKER_CACHE": str(cache), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*prefix, sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_killed_while_writing_the_store_then_rebuilt(tmp_path):
    """SIGKILL as the store's second file is linked into its temporary entry (test_crash's audit hook): no
    entry, a temporary one half made; the rerun resumes its finished spill, keeps the entry (the leftover
    cleared) and is byte-identical; a build after it re-plans."""
    from test_crash import _AT

    cache, stamp, out = tmp_path / "cache", tmp_path / "moment", tmp_path / "killed"
    args = ["flan", "--limit", str(LIMITS[0]), "-j", "1", "-q", "--out", str(out)]
    done = _run(["-c", _AT, "os.link", str(out / STAGING / "tokens"), "2", "kill", str(stamp), *args], cache)
    assert stamp.exists() and done.returncode == -9, done.stderr
    os.environ["PACKER_CACHE"] = str(cache)  # this test's fixture restores it
    assert not entry_dirs() and list(token_store.folder().glob(".tmp-*"))  # what the kill left
    again = build(config(out, limit=LIMITS[0]))
    assert not again.replanned and again.resumed == LIMITS[0] and digest(out) == cold(limit=LIMITS[0])
    assert len(entry_dirs()) == 1 and not list(token_store.folder().glob(".tmp-*"))
    assert build(config(tmp_path / "third", limit=LIMITS[0], pack="bfd")).replanned


def test_full_disk_under_the_store_leaves_the_build_unharmed(tmp_path):
    """The cache on a tmpfs of 64 kB (a user and mount namespace: no privilege needed), the build's folder on
    the real disk: the build succeeds, byte-identical, with one warning that the store was skipped."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (user namespaces) is not allowed here")
    cache = tmp_path / "cache"
    cache.mkdir()
    out = tmp_path / "out"
    script = (f"mount -t tmpfs -o size=64k tmpfs {cache} && exec \"$0\" -m packer build flan --limit {LIMITS[0]} "
              f"-j 1 -q --out {out}")
    done = _run([], cache, prefix=["unshare", "-rm", "sh", "-c", script])
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "token store was skipped (No space left on device)" in warnings[0], done.stdout
    assert digest(out) == cold(limit=LIMITS[0])


def test_two_builds_at_once_share_the_store(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-m", "packer", "build", "flan", "--limit", str(LIMITS[0]), "-j", "1",
                               "-q", "--json", "--out", str(tmp_path / f"b{i}")],
                              env={**os.environ, "PACKER_CACHE": str(cache), "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and json.loads(out)["warnings"] == [], err
    assert digest(tmp_path / "b0") == digest(tmp_path / "b1") == cold(limit=LIMITS[0])
    os.environ["PACKER_CACHE"] = str(cache)
    assert len(entry_dirs()) == 1
    assert build(config(tmp_path / "after", limit=LIMITS[0], pack="bfd")).replanned


def test_the_same_files_by_another_path_replan(tmp_path, monkeypatch):
    """An entry is keyed by its source's content, not by the path it was given by: the file given relative, absolute,
    or copied into another folder re-plans (byte-identical to a cold build of that path); other bytes under the same
    name tokenize."""
    import gzip

    from packer.contract.recipes import RECIPES

    data = tmp_path / "data"
    data.mkdir()
    (data / "s.jsonl").write_bytes(gzip.decompress(RECIPES["flan"].local.read_bytes())[:200_000].rsplit(b"\n", 1)[0] + b"\n")
    monkeypatch.chdir(data)

    def one(source: str, out: str, **options) -> tuple[bool, dict[str, str]]:
        result = build(BuildConfig(source=source, recipe="flan", out=str(tmp_path / out), num_proc=1, **options))
        return result.replanned, digest(tmp_path / out)

    assert one("s.jsonl", "a") == (False, one("s.jsonl", "a-cold", cache=False)[1])
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    shutil.copy(data / "s.jsonl", elsewhere / "s.jsonl")
    for source, out in ((str(data / "s.jsonl"), "b"), (f"./{'s.jsonl'}", "c"), (str(elsewhere / "s.jsonl"), "d")):
        replanned, got = one(source, out, max_len=512)
        assert replanned and got == one(source, out + "-cold", max_len=512, cache=False)[1], source
    (elsewhere / "s.jsonl").write_bytes((elsewhere / "s.jsonl").read_bytes().replace(b"the", b"teh", 1))
    assert not one(str(elsewhere / "s.jsonl"), "e")[0]


def test_a_chat_replan_imports_no_transformers(tmp_path):
    """A chat build re-planned from the store reads no record, so it compiles no chat template (which imports
    transformers: half a second) and makes no Rust tokenizer; byte-identical to a --no-cache build all the same."""
    records = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                             {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(40)]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    build(BuildConfig(source=str(source), out=str(tmp_path / "first"), num_proc=1))  # tokens and tokenizer kept
    code = ("import sys; from packer.cli import main\ntry:\n    main(['build', sys.argv[1], '--out', sys.argv[2], "
            "'--pack', 'bfd', '-q'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / "replan")], capture_output=True,
                          text=True, check=True, env={**os.environ})
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    assert json.loads((tmp_path / "replan" / "manifest.json").read_text())["stats"]["examples_read"] == 40
    build(BuildConfig(source=str(source), out=str(tmp_path / "cold"), pack="bfd", num_proc=1, cache=False))
    assert digest(tmp_path / "replan") == digest(tmp_path / "cold")
