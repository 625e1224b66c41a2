"""The loader and ``verify`` judge a row by the same checks (packer.contract.rows): real shards of each kind
(SFT, preference pairs, padded; format 1 and 2) are damaged one value at a time, in every column, keeping
the file's size and the manifest as built, and for each damage the loader refuses the rows exactly when
verify finds a row problem, with verify's first one as its message.

The suite draws one damage a column and kind (seeded); ``python tests/test_loader_agrees.py [DRAWS]`` draws
more of each (the wide sweep: 50 draws, 2,250 damages in ~35 s)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import BUNDLED_TOKENIZER, make_build, rewrite_column

from packer.checking.verify import verify
from packer.contract import schema
from packer.errors import ShardFormatError
from packer.training.loader import PackedDataset

WORDS = "the a cat dog sat ran on under mat box red blue big small quickly slowly".split()


def _pairs_source(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    path = folder / "prefs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: " + " ".join(rng.choice(WORDS, 4 + i % 5)) + "?\nA:",
                                        "chosen": " " + " ".join(rng.choice(WORDS, 1 + i % 4)),
                                        "rejected": " " + " ".join(rng.choice(WORDS, 2 + i % 3))}) + "\n"
                            for i in range(24)))
    return path


# each kind: a small real build (a few rows in each of its shards' batches)
KINDS = {
    "sft-1": dict(limit=40, pack="bfd", max_len=512, format_version=1),
    "sft-2": dict(limit=40, pack="bfd", max_len=512),
    "batch-2": dict(limit=24, batch_size=4, max_len=256),
    "padded-2": dict(limit=40, pack="bfd", max_len=512, cp_size=4),
    "pairs-1": dict(pairs=True, batch_size=2, max_len=64, format_version=1),
    "pairs-2": dict(pairs=True, pack="bfd", max_len=64),
}


def make_kind(folder: Path, kind: str) -> Path:
    options = dict(KINDS[kind])
    if options.pop("pairs", False):
        return make_build(folder / "out", str(_pairs_source(folder)), tokenizer=str(BUNDLED_TOKENIZER),
                          num_proc=1, **options)
    return make_build(folder / "out", num_proc=1, **options)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    made = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_kind(tmp_path_factory.mktemp(kind), kind)
        return made[kind]
    return get


def _changed(value, dtype: np.dtype, rng: np.random.Generator):
    """Another value of ``dtype`` than ``value``: one off, 0, -1, the type's top or a random one (wrapping
    as the type does)."""
    if dtype.kind == "b":
        return not value
    top = int(np.iinfo(dtype).max)
    for pick in rng.permutation(6):
        new = [int(value) + 1, int(value) - 1, 0, -1, top, int(rng.integers(0, min(top, 1 << 20)))][pick]
        new = np.array([new]).astype(dtype)[0]  # wraps as the stored type does (-1: a uint's top)
        if new != value:
            return new
    raise AssertionError("no other value")


def damages(shard: Path, rng: np.random.Generator, draws: int):
    """(column, description, change) for ``draws`` damages of each column of ``shard``: one value set to
    another, at a random place."""
    table = schema.open_shard(shard).combine_chunks()
    for name in table.schema.names:
        col = table.column(name).chunk(0)
        values = (col.values if isinstance(col, pa.ListArray) else col).to_numpy(zero_copy_only=False)
        for _ in range(draws):
            at = int(rng.integers(values.size))
            new = _changed(values[at], values.dtype, rng)
            yield name, f"{name}[{at}] {values[at]} -> {new}", lambda v, _o, at=at, new=new: v.__setitem__(at, new)


def _loader_error(out: Path) -> str | None:
    try:
        for _ in PackedDataset(out, shuffle=False):
            pass
    except ShardFormatError as e:
        return str(e)
    return None


def agree(out: Path, what: str) -> None:
    """The loader refuses ``out``'s rows iff verify finds a row problem, and says verify's first one."""
    said = _loader_error(out)
    report = verify(out)
    rows = [p.message for p in report.problems if p.check == "rows"]
    if rows:
        assert said is not None, f"{what}: verify finds {rows[0]!r}, the loader reads every row"
    if said is None:
        return
    assert "\n" not in said and "Traceback" not in said
    assert not report.ok, f"{what}: the loader refuses ({said}), verify finds nothing"
    if " row " in said.split(": ")[0]:  # a row check (not an open check against the manifest's totals)
        assert rows and f": {rows[0]}; " in said, (what, said, rows)


def sweep(out: Path, draws: int, seed: int) -> int:
    shard = out / schema.shard_name(0)
    intact = shard.read_bytes()
    n = 0
    for column, what, change in damages(shard, np.random.default_rng(seed), draws):
        try:
            rewrite_column(shard, column, change)
            assert shard.stat().st_size == len(intact)
            agree(out, what)
            n += 1
        finally:
            shard.write_bytes(intact)
    return n


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_loader_and_verify_agree_on_every_column_damaged(builds, kind):
    out = builds(kind)
    assert verify(out).ok and _loader_error(out) is None
    assert sweep(out, draws=1, seed=sorted(KINDS).index(kind)) == len(schema.open_shard(out / schema.shard_name(0)).schema)


def write_null(shard: Path, column: str) -> None:
    """Shard ``shard`` rewritten with a null in ``column``: its first row's (a scalar column) or its first
    value's (a list column)."""
    # read whole first (not memory-mapped): the file is rewritten below
    table = pa.ipc.open_stream(pa.BufferReader(shard.read_bytes())).read_all().combine_chunks()
    arrays = []
    for name in table.schema.names:
        col = table.column(name).chunk(0)
        if name == column:
            if isinstance(col, pa.ListArray):
                values = col.values.to_pylist()
                col = pa.ListArray.from_arrays(col.offsets, pa.array([None, *values[1:]], col.type.value_type))
            else:
                col = pa.array([None, *col.to_pylist()[1:]], col.type)
        arrays.append(col)
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=table.schema))


def test_a_null_in_any_column_is_one_line_from_loader_and_verify(builds, tmp_path):
    """A null in each column in turn (the file's size and hashes recorded anew, as a tool rewriting the shard
    would) is refused in one line by both, never a pyarrow traceback, and never read as a value: every
    column of a format-1 pair build and of a padded format-2 build (between them, each column of each format)."""
    cases = [(kind, name) for kind in ("pairs-1", "padded-2")
             for name in schema.open_shard(builds(kind) / schema.shard_name(0)).schema.names]
    for kind, column in cases:
        out = tmp_path / f"{kind}-{column}"
        shutil.copytree(builds(kind), out)
        shard = out / schema.shard_name(0)
        write_null(shard, column)
        manifest = json.loads((out / schema.MANIFEST_NAME).read_text())
        manifest["shards"][0].update(bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
        manifest[schema.CONTENT_HASH] = schema.content_sha256(manifest)
        (out / schema.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        said = _loader_error(out)
        assert said is not None and f"null values in {column}" in said and "\n" not in said, (kind, column, said)
        assert [p.message for p in verify(out).problems if p.check == "rows"][0] == f"null values in {column}"
    assert len(cases) >= 16


if __name__ == "__main__":  # the wide sweep
    import tempfile
    import time

    draws = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    with tempfile.TemporaryDirectory() as tmp:
        for i, kind in enumerate(sorted(KINDS)):
            t = time.perf_counter()
            (Path(tmp) / kind).mkdir()
            out = make_kind(Path(tmp) / kind, kind)
            n = sweep(out, draws, seed=1000 + i)
            print(f"{kind}: {n} damages, loader and verify agree ({time.perf_counter() - t:.1f} s)")
