"""packer touches only what it provably wrote: the files its manifests list (checked by their content
hash) and its staging folder (proven by its lock file). A name proves nothing; a source inside ``--out``
is refused before anything is touched; ``--overwrite`` replaces the previous build and nothing else.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner
from conftest import ROOT, make_build, one_line
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from packer import BuildConfig, build
from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema
from packer.contract.schema import LOCK, LOCK_BYTES, STAGING
from packer.errors import PackerError

RECORDS = [{"prompt": f"question {i}?", "completion": f"answer {i}."} for i in range(12)]
FIELDS = ["--prompt-field", "prompt", "--completion-field", "completion"]


def build_cli(*args: str):
    return CliRunner().invoke(main, ["build", *args, "-q"])


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, None for a folder."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def write_arrow(path: Path) -> None:
    table = pa.Table.from_pylist(RECORDS)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def write_jsonl(path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))


# -- a source inside --out ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["arrow_named_like_a_shard", "state_json", "dataset_info_json", "glob_of_shards",
                                  "mix_part", "folder"])
def test_a_source_inside_out_is_refused_before_anything_is_touched(tmp_path, monkeypatch, case):
    d = tmp_path / "d"
    d.mkdir()
    write_arrow(d / "shard-00000.arrow")
    write_arrow(d / "shard-00001.arrow")
    write_jsonl(d / "state.json")
    write_jsonl(d / "dataset_info.json")
    monkeypatch.chdir(d)
    args = {"arrow_named_like_a_shard": ["shard-00000.arrow", "--out", "."],
            "state_json": [str(d / "state.json"), "--out", str(d)],
            "dataset_info_json": [str(d / "dataset_info.json"), "--out", str(d)],
            "glob_of_shards": [str(d / "*.arrow"), "--out", str(d)],
            "mix_part": ["flan", str(d / "state.json"), "--mix", "0.5,0.5", "--out", str(d)],
            "folder": [str(d), "--out", str(d)]}[case]
    before = snapshot(d)
    line = one_line(build_cli(*args, *([] if case == "mix_part" else FIELDS)))
    assert "source" in line.lower() and "--out" in line, line
    assert snapshot(d) == before


# -- what is in --out already ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["state.json", "dataset_info.json", "shard-final.arrow", "manifest.json.tmp",
                                  "manifest.json", ".packer-lock", "LOCK"])
def test_a_users_file_with_a_packer_like_name_is_not_packers(tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_bytes(b'{"app": "mine"}\n')
    before = snapshot(out)
    line = one_line(build_cli("flan", "--limit", "5", "--out", str(out)))
    assert name in line and ("cannot prove it wrote" in line or "packer did not write" in line or "not a manifest packer "
                             "wrote" in line), line
    assert snapshot(out) == before


def test_overwrite_never_deletes_a_web_apps_manifest(tmp_path):
    out = tmp_path / "site"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "My PWA", "start_url": "/"}')
    (out / "index.html").write_text("<html></html>")
    before = snapshot(out)
    line = one_line(build_cli("flan", "--limit", "5", "--overwrite", "--out", str(out)))
    assert "manifest.json is not a manifest packer wrote" in line
    assert snapshot(out) == before


@pytest.mark.parametrize("name", ["state.json", "dataset_info.json", "shard-final.arrow", STAGING])
def test_overwrite_refuses_a_foreign_file_under_a_name_a_build_writes(tmp_path, name):
    out = make_build(tmp_path / "out", limit=10)
    if name == STAGING:
        (out / name).write_bytes(b"mine")
    else:
        (out / name).unlink(missing_ok=True)
        (out / name).write_bytes(b"mine")
    before = snapshot(out)
    line = one_line(build_cli("flan", "--limit", "12", "--overwrite", "--out", str(out)))
    assert name in line, line
    assert snapshot(out) == before


def test_overwrite_replaces_the_previous_build_and_keeps_everything_else(tmp_path):
    out = make_build(tmp_path / "out", limit=10)
    mine = {"notes.txt": b"mine", "manifest.json.tmp": b"also mine", ".packer-lock": b"", "LOCK": b"x"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    (out / "sub").mkdir()
    (out / "sub" / "shard-00000.arrow").write_bytes(b"nested, mine")
    assert build_cli("flan", "--limit", "12", "--out", str(out)).exit_code == 2  # without --overwrite
    result = build_cli("flan", "--limit", "12", "--overwrite", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert schema.read_manifest(out).stats.examples_read == 12
    for name, data in mine.items():
        assert (out / name).read_bytes() == data
    assert (out / "sub" / "shard-00000.arrow").read_bytes() == b"nested, mine"
    assert not (out / STAGING).exists()


@pytest.mark.parametrize("inside", [{"notes": b"mine"}, {LOCK: b"my lock"}, {LOCK: b"", "more": b"x"}])
def test_a_users_staging_named_folder_is_not_packers(tmp_path, inside):
    out = tmp_path / "out"
    (out / STAGING).mkdir(parents=True)
    for name, data in inside.items():
        (out / STAGING / name).write_bytes(data)
    before = snapshot(out)
    for extra in ([], ["--overwrite"]):
        line = one_line(build_cli("flan", "--limit", "5", *extra, "--out", str(out)))
        assert f"holds {STAGING}, which packer did not create" in line
    assert snapshot(out) == before


def test_a_build_killed_mid_commit_leaves_files_the_rerun_can_prove_its_own(tmp_path):
    """What a kill between moving the shards and renaming the manifest leaves: the shards in place, the
    manifest still staged. The rerun clears them and builds the same bytes."""
    reference = make_build(tmp_path / "reference", limit=10)
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / STAGING).mkdir()
    (out / STAGING / LOCK).write_bytes(LOCK_BYTES)
    (out / schema.MANIFEST_NAME).rename(out / STAGING / schema.PENDING)
    make_build(out, limit=10)
    assert snapshot(out) == snapshot(reference)


# -- --out elsewhere, and failed builds ------------------------------------------------------------------


def test_out_on_a_filesystem_without_its_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(build_cli("flan", "--limit", "5", "--out", "gs://b/c"))  # gcsfs is not installed
    assert line.startswith("packer: error: gs://b/c: cannot open this filesystem") and "gcsfs" in line
    assert list(tmp_path.iterdir()) == []


def test_out_as_a_url_builds_locally_then_pushes(tmp_path, monkeypatch):
    # --out URL: built in a staging folder of the cache, then uploaded (docs/loader.md, "Publishing");
    # tests/test_remote.py does the same against a real S3 server
    monkeypatch.chdir(tmp_path)
    result = build_cli("flan", "--limit", "5", "--out", "memory://packer-ownership/y")
    assert result.exit_code == 0, result.output
    assert "pushed" in result.output and verify("memory://packer-ownership/y").ok
    assert list(tmp_path.iterdir()) == []


def test_out_as_a_file_url_is_the_local_folder(tmp_path):
    assert build_cli("flan", "--limit", "5", "--out", f"file://{tmp_path / 'o'}").exit_code == 0
    assert verify(tmp_path / "o").ok


def test_a_failed_build_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "new" / "out"
    line = one_line(build_cli("flan", "--limit", "20", "--max-len", "8", "--overlong", "drop", "--out", str(out)))
    assert "nothing to pack" in line
    assert not (tmp_path / "new").exists()


def test_a_failed_build_into_an_existing_folder_leaves_it_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    one_line(build_cli("flan", "--limit", "20", "--max-len", "8", "--overlong", "drop", "--out", str(out)))
    assert list(out.iterdir()) == []


def test_ray_engine_without_ray_leaves_nothing(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\nfrom packer.cli import main\n"
            "sys.argv = ['packer', 'build', 'flan', '--limit', '5', '-q', '--engine', 'ray', '--out', sys.argv[1]]\n"
            "main()")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Ray" in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()


# -- the property: whatever is there, a user's bytes stay --------------------------------------------------

# names a build writes (a user's file there is refused even with --overwrite), and names it does not
CLASHING = ["shard-00000.arrow", "shard-00001.arrow", "shard-final.arrow", "state.json", "dataset_info.json",
            "manifest.json", STAGING, f"{STAGING}/{LOCK}", f"{STAGING}/tokens/ids.bin", f"{STAGING}/{schema.PENDING}",
            f"{STAGING}/shard-00000.arrow"]
BESIDE = ["manifest.json.tmp", "shard-00000.arrow.tmp", "LOCK", ".packer-lock", "previous-manifest.json",
          "notes.txt", "tokens/progress.json", "sub/shard-00000.arrow"]
USER_NAME = st.one_of(st.sampled_from(BESIDE), st.sampled_from(BESIDE), st.sampled_from(CLASHING))


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    return make_build(tmp_path_factory.mktemp("previous") / "out", limit=10)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(user=st.dictionaries(USER_NAME, st.binary(max_size=40), max_size=3),
       with_build=st.booleans(), overwrite=st.booleans(), limit=st.sampled_from([10, 12]),
       source_inside=st.sampled_from([False, False, False, True]))
def test_a_build_never_changes_a_users_file(previous, user, with_build, overwrite, limit, source_inside):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        if with_build:
            shutil.copytree(previous, out)
        out.mkdir(exist_ok=True)
        written = {}
        for name, data in user.items():
            path = out / name
            # one entry per name: a file of the build, or a folder another name needs, is not replaced
            if path.exists() or any((out / p).is_file() for p in Path(name).parents if str(p) != "."):
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written[name] = data
        source = "flan"
        if source_inside:
            write_jsonl(out / "records.jsonl")
            written["records.jsonl"] = (out / "records.jsonl").read_bytes()
            source = str(out / "records.jsonl")
        try:
            build(BuildConfig(source=source, out=str(out), limit=limit, overwrite=overwrite,
                              **({"prompt_field": "prompt", "completion_field": "completion"} if source_inside else {})))
            built = True
        except PackerError as e:
            built = False
            event(str(e).split(": ", 2)[-1].split(" ")[0])
        event(f"built: {built}")
        for name, data in written.items():
            assert (out / name).is_file() and (out / name).read_bytes() == data, (name, built)
        assert not (built and (written and not overwrite)), "built into a folder holding a user's files"
        if built:
            assert verify(out).problems == [] or written
