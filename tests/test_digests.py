"""Pinned bytes: the sha256 of every file of two default (batch mode) builds.

These digests change only when a change means to change the bytes of a build; such a change updates
them here and says why in its commit. A refactor that moves code must leave them as they are.
"""

from __future__ import annotations

import hashlib

from conftest import SHARED_DATA, make_build

FLAN_1000 = {
    # `packer build flan --limit 1000` with every other default
    "dataset_info.json": "dd66533afc785f534079b50ddd7088d2e6bacc3413c0a0283e53382955b0a216",
    "manifest.json": "980fa6e4ecd80c3dad1b417922335b6ac2dd6f51d051a7fe4c378adfc8b7e728",
    "shard-00000.arrow": "904a8ac116f730f201f7aa7b459a9719679eed605883d652ba54ff1657343e6d",
    "state.json": "e792d97b052367853281adad4bc8d2216667a95f4fecaebd62ec31dc65b3b1b0",
}

GSM8K_1000 = {
    # `packer build gsm8k_train.jsonl --recipe gsm8k --tokenizer llama2-tokenizer --limit 1000` run in ../shared/data
    "dataset_info.json": "dd66533afc785f534079b50ddd7088d2e6bacc3413c0a0283e53382955b0a216",
    "manifest.json": "625cb5e6e41ffb9447e63756de78165e7dbba203d5ac956f0262f7ec5b2c2853",
    "shard-00000.arrow": "5cc4ffb0dcb8bc2f82b1a4cc989493d4b978265030872eca661dbbc3373be118",
    "state.json": "844ef24ca4dba22004294371a94ea8e704dd843f4f4e323aa01e8d5a473c8a25",
}


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_bundled_sample_build_bytes_are_pinned(tmp_path):
    out = make_build(tmp_path / "flan", limit=1000)
    assert _digests(out) == FLAN_1000


def test_gsm8k_llama2_build_bytes_are_pinned(tmp_path, monkeypatch, gsm8k_file, llama2_tokenizer):
    # relative paths, so the manifest does not record where ../shared/data happens to be
    monkeypatch.chdir(SHARED_DATA)
    out = make_build(tmp_path / "gsm8k", source=gsm8k_file.name, recipe="gsm8k",
                     tokenizer=llama2_tokenizer.name, limit=1000)
    assert _digests(out) == GSM8K_1000
