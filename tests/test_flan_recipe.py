"""The real FLAN recipe: --from-hub reads Open-Orca/FLAN's layout (a folder of parquet shards per
submix) as a mix drawn at the Flan Collection's rates, so --limit samples every submix. Tested offline
on a local folder laid out the same way; offline, --from-hub fails with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from packer.building import mix
from packer.cli import main
from packer.contract import schema
from packer.contract.recipes import RECIPES, hub_mix_parts


@pytest.fixture(scope="module")
def flan_repo(tmp_path_factory) -> Path:
    """Open-Orca/FLAN's layout: <submix>_zsopt_data/part.N.parquet with its fields; each submix's second
    shard is corrupt, so a build that reads it fails."""
    repo = tmp_path_factory.mktemp("FLAN")
    for files, _ in RECIPES["flan"].hub_mix:
        folder = repo / files.split("/")[0]
        folder.mkdir()
        submix = folder.name.split("_")[0]
        rows = [{"inputs": f"[{submix}] task {i % 7}: what comes after {i}?", "targets": f"{i + 1}",
                 "_template_idx": i % 3, "_task_source": submix, "_task_name": f"{submix}_task_{i % 7}",
                 "_template_type": "zs_opt"} for i in range(300)]
        pq.write_table(pa.Table.from_pylist(rows), folder / "part.0.parquet")
        (folder / "part.1.parquet").write_bytes(b"PAR1 this is not a parquet file")
    return repo


def test_limit_samples_every_submix_at_the_flan_rates(flan_repo, tmp_path):
    parts = hub_mix_parts("flan", source=str(flan_repo))
    (tmp_path / "flan.json").write_text(json.dumps(parts))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", "--mix", str(tmp_path / "flan.json"), "--limit", "400", "-q",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    m = json.loads((out / schema.MANIFEST_NAME).read_text())
    counts = [c["records_read"] for c in m["stats"]["sources"]]
    assert sum(counts) == 400 and all(c > 0 for c in counts)
    assert counts == [int((mix.positions_sources(parts, 0, 400) == k).sum()) for k in range(len(parts))]
    # only each submix's first shard was read (the corrupt second ones never were)
    assert all([Path(f["path"]).name for f in p["files"]] == ["part.0.parquet"] for p in m["source"]["parts"])
    row = CliRunner().invoke(main, ["inspect", str(out), "--row", "0", "--full"])
    assert row.exit_code == 0 and "what comes after" in row.output


def test_from_hub_offline_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    result = CliRunner().invoke(main, ["build", "flan", "--from-hub", "--limit", "20000", "-q", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    line, = result.stderr.splitlines()
    assert "cannot reach the Hugging Face Hub for 'Open-Orca/FLAN'" in line
