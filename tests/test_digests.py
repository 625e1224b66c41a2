"""Pinned bytes: the sha256 of every file of two default (batch mode) builds, in format 2 (the default)
and in format 1 (``--format 1``, which must keep giving the bytes every packer before format 2 wrote).

These digests change only when a change means to change the bytes of a build; such a change updates
them here and says why in its commit. A refactor that moves code must leave them as they are. The
format-2 digests were set when format 2 became the default (narrowed ids and positions, the loss as a
bit mask, the manifest's ``columns`` and ``config.format_version``); the format-1 ones are the digests
pinned before it, unchanged.
"""

from __future__ import annotations

import hashlib

import pytest
from conftest import SHARED_DATA, make_build

FLAN_1000 = {
    # `packer build flan --limit 1000` with every other default
    "dataset_info.json": "e7da6846fe3e5829167aa16da86e74158d2dab329fc8543313cf6c09fb4ace1f",
    "manifest.json": "41ae2d1ad073cc9b5a5fefe95cf27884f002387d103d1ae0872a5ad17f68b0a0",
    "shard-00000.arrow": "bd4c2e69aeabac3118022fcb488b761caf497f8cf6c70da98d3ef14f5c2ca960",
    "state.json": "c06c0210da4a24508cf30d995337eac1bc9e30c10eb5edaec9cba561e8447f93",
}

GSM8K_1000 = {
    # `packer build gsm8k_train.jsonl --recipe gsm8k --tokenizer llama2-tokenizer --limit 1000` run in ../shared/data
    "dataset_info.json": "e7da6846fe3e5829167aa16da86e74158d2dab329fc8543313cf6c09fb4ace1f",
    "manifest.json": "c5943023f2e99e3b3d65a09bbe1d71efd7c9999adb969245ea6e2c146949350b",
    "shard-00000.arrow": "14b85354091c45208f09f4bc9b3b9a20bc1928afb276cac86b5b439a41671dee",
    "state.json": "19cb1faffe4e65ebf15c15780fc09f4f64eb8d5d847840881976342445fc2220",
}

FLAN_1000_FORMAT_1 = {
    # `packer build flan --limit 1000 --format 1`: the bytes pinned before format 2 existed
    "dataset_info.json": "dd66533afc785f534079b50ddd7088d2e6bacc3413c0a0283e53382955b0a216",
    "manifest.json": "980fa6e4ecd80c3dad1b417922335b6ac2dd6f51d051a7fe4c378adfc8b7e728",
    "shard-00000.arrow": "904a8ac116f730f201f7aa7b459a9719679eed605883d652ba54ff1657343e6d",
    "state.json": "e792d97b052367853281adad4bc8d2216667a95f4fecaebd62ec31dc65b3b1b0",
}

GSM8K_1000_FORMAT_1 = {
    "dataset_info.json": "dd66533afc785f534079b50ddd7088d2e6bacc3413c0a0283e53382955b0a216",
    "manifest.json": "625cb5e6e41ffb9447e63756de78165e7dbba203d5ac956f0262f7ec5b2c2853",
    "shard-00000.arrow": "5cc4ffb0dcb8bc2f82b1a4cc989493d4b978265030872eca661dbbc3373be118",
    "state.json": "844ef24ca4dba22004294371a94ea8e704dd843f4f4e323aa01e8d5a473c8a25",
}


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("version, pinned", [(2, FLAN_1000), (1, FLAN_1000_FORMAT_1)])
def test_bundled_sample_build_bytes_are_pinned(tmp_path, version, pinned):
    out = make_build(tmp_path / "flan", limit=1000, format_version=version)
    assert _digests(out) == pinned


@pytest.mark.parametrize("version, pinned", [(2, GSM8K_1000), (1, GSM8K_1000_FORMAT_1)])
def test_gsm8k_llama2_build_bytes_are_pinned(tmp_path, monkeypatch, gsm8k_file, llama2_tokenizer, version, pinned):
    # relative paths, so the manifest does not record where ../shared/data happens to be
    monkeypatch.chdir(SHARED_DATA)
    out = make_build(tmp_path / "gsm8k", source=gsm8k_file.name, recipe="gsm8k",
                     tokenizer=llama2_tokenizer.name, limit=1000, format_version=version)
    assert _digests(out) == pinned
