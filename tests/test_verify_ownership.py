"""verify judges only what packer wrote: the user's files beside a build (which ``packer build
--overwrite`` leaves untouched) are noted and left out, while a missing or damaged file of packer's,
a file under a name a build writes that no manifest lists, and a staging folder are still problems."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import make_build

from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema

# names a build never writes: a user's, whatever they look like (a file or a folder)
USERS = {"notes.txt": b"mine", "LOCK": b"x", "manifest.json.tmp": b"{}", "shard-00000.arrow.bak": b"old",
         ".packer-lock": b"", "sub/shard-00000.arrow": b"nested", "tokens/progress.json": b"{}"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return make_build(tmp_path_factory.mktemp("v") / "out", limit=10)


def beside(built: Path, tmp_path: Path, users: dict[str, bytes]) -> Path:
    """The CLI's own scenario: the user's files in a folder, then ``packer build --overwrite`` into it."""
    out = tmp_path / "out"
    for name, data in users.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    result = CliRunner().invoke(main, ["build", "flan", "--limit", "10", "--overwrite", "-q", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("name", list(USERS))
def test_a_users_file_beside_a_build_is_noted_and_verify_passes(built, tmp_path, name):
    out = beside(built, tmp_path, {name: USERS[name]})
    result = CliRunner().invoke(main, ["verify", str(out), "-q"])  # -q: stderr holds the note alone
    assert result.exit_code == 0, result.output
    top = name.split("/")[0]
    assert result.stderr.splitlines() == [
        f"packer: note: {out}: holds {top}, which packer did not write (yours: a build leaves them untouched); not checked"]
    assert (out / name).read_bytes() == USERS[name]


def test_all_the_users_files_at_once_in_json(built, tmp_path):
    out = beside(built, tmp_path, USERS)
    report = verify(out)
    assert report.ok and len(report.notes) == 1 and "and 4 more" in report.notes[0]
    result = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["notes"] == report.notes


@pytest.mark.parametrize("damage", ["shard_missing", "shard_edited", "state_json_edited", "unlisted_shard",
                                   "foreign_staging", "packers_staging"])
def test_what_packer_wrote_is_still_judged_beside_the_users_files(built, tmp_path, damage):
    out = beside(built, tmp_path, {"notes.txt": b"mine"})
    shard = out / schema.shard_name(0)
    if damage == "shard_missing":
        shard.unlink()
    elif damage == "shard_edited":
        data = bytearray(shard.read_bytes())
        data[-9] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "state_json_edited":
        (out / "state.json").write_text("{}")
    elif damage == "unlisted_shard":
        shutil.copy(shard, out / schema.shard_name(5))
    elif damage == "foreign_staging":
        (out / schema.STAGING).write_bytes(b"mine")
    else:
        (out / schema.STAGING).mkdir()
        (out / schema.STAGING / schema.LOCK).write_bytes(schema.LOCK_BYTES)
    report = verify(out)
    assert not report.ok and all("notes.txt" not in str(p) for p in report.problems), report.problems
    assert report.notes and "notes.txt" in report.notes[0]
