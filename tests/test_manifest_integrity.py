"""The manifest's content hash, and a rerun that re-checks what it would reuse.

Any edit of the manifest is found by verify and refused by the loader at open; the same build command
run again on a damaged folder (a shard deleted or changed, a datasets file gone) rebuilds it,
byte-identical, instead of saying "nothing to do"; an edited manifest or an unlisted shard is refused
(packer cannot prove them its own).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from conftest import make_build

from packer import BuildConfig, build
from packer.checking import verify
from packer.contract import schema
from packer.errors import OutputError, ShardFormatError
from packer.training.loader import PackedDataset

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


def _truncate_shard(out):
    path = out / schema.shard_name(0)
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("damage", [_delete_shard, _flip_shard_byte, _truncate_shard])
def test_one_shard_file_check_for_rerun_verify_and_loader(copy, damage):
    """A rerun's reuse (output.damage), verify and the loader (verify=True) say the same of a damaged
    shard file: one check of size and sha256 against the manifest (schema.shard_file_problems)."""
    from packer.building import output

    damage(copy)
    entry = schema.read_manifest(copy).shards[0]
    first = schema.shard_file_problems(copy, entry)[0]
    assert output.damage(copy, json.loads((copy / schema.MANIFEST_NAME).read_text())) == f"{entry.file}: {first}"
    assert first in [p.message for p in verify.verify(copy).problems if p.check == "files"]
    with pytest.raises(ShardFormatError) as caught:
        PackedDataset(copy, verify=True)
    assert f"{entry.file}: {first}; " in str(caught.value)


@pytest.mark.parametrize("damage", [_delete_shard, _flip_shard_byte, _delete_datasets_info])
def test_rerun_rebuilds_a_damaged_folder(small, copy, damage):
    damage(copy)
    assert not verify.verify(copy).ok
    result = rerun(copy)
    assert not result.reused
    assert digests(copy) == digests(small)
    assert verify.verify(copy).ok


@pytest.mark.parametrize("damage", [_edit_manifest, _leftover_shard])
def test_rerun_refuses_what_it_cannot_prove_is_its_own(copy, damage):
    """An edited manifest proves nothing (its content hash fails), and a shard no manifest lists is not
    packer's: the rerun refuses the folder and changes nothing in it."""
    damage(copy)
    before = digests(copy)
    with pytest.raises(OutputError, match="not a manifest packer wrote|cannot prove it wrote"):
        rerun(copy)
    assert digests(copy) == before


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


def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list) and node and isinstance(node[0], dict):
        yield from _leaves(node[0], (*path, 0))
    else:
        yield path


def test_mistyped_values_anywhere_give_packer_errors(small, tmp_path):
    """Every value of the manifest mistyped in turn (and re-hashed, as a tool rewriting it consistently
    would): verify returns a report, inspect and the loader raise a one-line PackerError or work; never
    a TypeError, KeyError or ValueError (the adversarial pass found 10 in verify, 28 in the loader)."""
    from packer.checking import inspect_
    from packer.errors import PackerError

    original = json.loads((small / schema.MANIFEST_NAME).read_text())
    out = tmp_path / "out"
    shutil.copytree(small, out)
    views = {
        "verify": lambda: verify.verify(out, quick=False),
        "inspect": lambda: inspect_.summary(out),
        "inspect --row": lambda: inspect_.row(out, 0),
        "inspect --example": lambda: inspect_.find_example(out, 0),
        "loader": lambda: next(iter(PackedDataset(out, shuffle=False))),
    }
    failures = []
    for path in _leaves(original):
        if path == (schema.CONTENT_HASH,):
            continue
        for value in (None, "x", -1, [], 10**12):
            manifest = json.loads(json.dumps(original))
            node = manifest
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            manifest[schema.CONTENT_HASH] = schema.content_sha256(manifest)
            (out / schema.MANIFEST_NAME).write_bytes(schema.dump_manifest(manifest))
            for name, view in views.items():
                try:
                    view()
                except PackerError as e:
                    assert "\n" not in str(e)
                except Exception as e:  # what this test looks for
                    failures.append(f"{name} with {'.'.join(map(str, path))} = {value!r}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures[:10])


def test_a_huge_seq_len_allocates_nothing_in_inspect_or_verify(copy):
    """A seq_len of 10^9 in a shard (same size, manifest as built): inspect and verify, under a 3 GiB
    address-space limit, answer with a ShardFormatError or a report; they never size anything by it."""
    import subprocess
    import sys

    import pyarrow as pa

    path = copy / schema.shard_name(0)
    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all().combine_chunks()
    seq = table.column("seq_lens").chunk(0)
    values = seq.values.to_numpy().copy()
    values[0] = 10**9
    columns = [pa.ListArray.from_arrays(seq.offsets, pa.array(values, pa.int32())) if name == "seq_lens"
               else table.column(name).chunk(0) for name in table.schema.names]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=table.schema))
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from packer.checking import inspect_, verify
from packer.errors import OutputError, ShardFormatError
report = verify.verify({str(copy)!r})
assert any("seq_lens" in p.message for p in report.problems), report.problems
for view in (lambda: inspect_.summary({str(copy)!r}), lambda: inspect_.row({str(copy)!r}, 0),
             lambda: inspect_.find_example({str(copy)!r}, 0), lambda: inspect_.plot_data({str(copy)!r})):
    try:
        view()
        sys.exit("a view accepted the damaged row")
    except ShardFormatError as e:
        assert "seq_lens" in str(e), e
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the typed manifest: config is the BuildConfig, types from the annotations ----------------------------


def _rewrite_config(out, change) -> None:
    path = out / schema.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    change(manifest["config"])
    manifest[schema.CONTENT_HASH] = schema.content_sha256(manifest)
    path.write_bytes(schema.dump_manifest(manifest))


def test_config_is_the_build_config_and_round_trips_to_its_bytes(small):
    manifest = schema.read_manifest(small)
    assert manifest.config == BuildConfig(source="flan", out="", **{k: v for k, v in OPTIONS.items() if k != "num_proc"})
    assert manifest.dumps() == (small / schema.MANIFEST_NAME).read_bytes()


def test_a_field_recorded_only_when_set_reads_as_its_default(copy):
    _rewrite_config(copy, lambda c: c.pop("epochs", None))  # as a manifest from before --epochs holds it
    assert schema.read_manifest(copy).config.epochs == 1


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("max_len", "512", "max_len mistyped"), ("seed", True, "seed mistyped"), ("pack", "zigzag", "--pack must be"),
    ("max_lenn", 5, "unknown keys max_lenn"), ("max_len", 10**12, "more than a row can hold"),
])
def test_a_config_build_config_refuses_is_a_manifest_problem_everywhere(copy, key, value, needle):
    from packer.checking import inspect_

    _rewrite_config(copy, lambda c: c.update({key: value}))
    problems = [p for p in verify.verify(copy).problems if p.check == "manifest"]
    assert any("config" in p.where and needle in p.message for p in problems), problems
    for read in (lambda: PackedDataset(copy), lambda: inspect_.summary(copy)):
        with pytest.raises(ShardFormatError, match=f"config: not a valid build config.*{needle}"):
            read()


def test_field_types_come_from_the_annotations():
    """A ``float | None`` field (the parser once looked types up from a table of annotation strings)."""
    import dataclasses

    @dataclasses.dataclass
    class Later:
        ratio: float | None = None
        count: int = 0
        reasons: dict[str, int] | None = None

    kinds = schema._field_types(Later)
    assert all(schema._typed(v, kinds["ratio"]) for v in (None, 0.5, 1))
    assert not schema._typed("0.5", kinds["ratio"]) and not schema._typed(True, kinds["count"])
    assert schema._typed({"a": 1}, kinds["reasons"]) and not schema._typed([], kinds["reasons"])
