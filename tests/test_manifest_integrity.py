"""The manifest's content hash, and a rerun that re-checks what it would reuse.

Any edit of the manifest is found by verify and refused by the loader at open; the same build command
run again on a damaged folder (a shard deleted or changed, the manifest edited, a datasets file gone)
rebuilds it, byte-identical, instead of saying "nothing to do".
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from conftest import make_build

from packer import BuildConfig, build, schema, verify
from packer.errors import ShardFormatError
from packer.loader import PackedDataset

OPTIONS = dict(limit=60, pack="bfd", max_len=512, shard_size_mb=1, num_proc=1)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_build(tmp_path_factory.mktemp("small") / "out", **OPTIONS)


def digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture
def copy(small, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(small, out)
    return out


def rerun(out):
    return build(BuildConfig(source="flan", out=str(out), **OPTIONS))


def _delete_shard(out):
    (out / schema.shard_name(0)).unlink()


def _flip_shard_byte(out):
    path = out / schema.shard_name(0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the hash sees it
    path.write_bytes(bytes(data))


def _edit_manifest(out):  # a count, not what names the build (that would be another build: refused)
    path = out / schema.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["stats"]["loss_tokens"] += 1
    path.write_bytes(schema.dump_manifest(manifest))


def _delete_datasets_info(out):
    (out / schema.DATASETS_INFO_NAME).unlink()


def _leftover_shard(out):
    shutil.copy(out / schema.shard_name(0), out / schema.shard_name(99))


@pytest.mark.parametrize("damage", [_delete_shard, _flip_shard_byte, _edit_manifest, _delete_datasets_info,
                                    _leftover_shard])
def test_rerun_rebuilds_a_damaged_folder(small, copy, damage):
    damage(copy)
    assert not verify.verify(copy).ok
    result = rerun(copy)
    assert not result.reused
    assert digests(copy) == digests(small)
    assert verify.verify(copy).ok


def test_rerun_reuses_an_intact_folder(small, copy):
    assert rerun(copy).reused
    assert digests(copy) == digests(small)


@pytest.mark.parametrize("edit", [
    lambda m: m["tokenizer"].update(vocab_size=m["tokenizer"]["vocab_size"] + 1),
    lambda m: m["tokenizer"].update(eos_token_id=3),
    lambda m: m["config"].update(max_len=513),
    lambda m: m["config"].update(seed=7),
    lambda m: m["source"].update(name="other"),
    lambda m: m["stats"].update(fill=0.5),
    lambda m: m.update(note="edited"),
    lambda m: m.pop(schema.CONTENT_HASH),
])
def test_any_manifest_edit_is_found_by_verify_and_refused_by_the_loader(copy, edit):
    path = copy / schema.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_bytes(schema.dump_manifest(manifest))
    report = verify.verify(copy, quick=True)
    assert report.problems[0].where.endswith(schema.CONTENT_HASH), report.problems
    with pytest.raises(ShardFormatError, match=schema.CONTENT_HASH):
        PackedDataset(copy)


def test_single_digit_edits_are_all_found(copy):
    """Every digit of the manifest changed in turn (the adversarial pass found 192 of 290 unnoticed)."""
    path = copy / schema.MANIFEST_NAME
    text = path.read_text()
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    for i in digits[:: max(1, len(digits) // 150)]:
        edited = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1 :]
        try:
            data = json.loads(edited)
        except json.JSONDecodeError:
            continue
        manifest, problems = schema.parse_manifest(data)
        assert problems, f"an edit at character {i} went unnoticed"
