"""Shared fixtures: real builds of the bundled sample, made once per test session."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# One torch thread per process, in this process and (inherited) in every process a test starts. The
# models here are tiny, so a second intra-op thread buys nothing, and on a shared machine it costs
# ~4-10x: OpenMP's threads spin waiting for a core another process holds (test_attention + test_mixers:
# 5.4 s with one thread, 22-55 s with two, beside one other busy process). Set before torch is
# imported; a value given in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The cache (the token store, remote shards) is never the user's ~/.cache: each test has its own (``_own_cache``), in
# this process and in the processes it starts with the environment of the moment. An environment a module copied
# when it was imported (test_crash's ENV) gets the session's folder with a limit of 0 bytes, which keeps no tokens:
# no test re-plans from another test's tokens, whatever the order they run in.
os.environ["PACKER_CACHE"] = tempfile.mkdtemp(prefix="packer-test-cache-")
os.environ["PACKER_CACHE_LIMIT"] = "0"

from packer import BuildConfig, build

atexit.register(shutil.rmtree, os.environ["PACKER_CACHE"], True)

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
BUNDLED_TOKENIZER = ROOT / "packer" / "data" / "tokenizer"


def pytest_collection_finish(session) -> None:
    """What the test modules imported (torch, transformers, TRL: millions of objects that live as long as the
    process) is moved out of the collector's sight: the cyclic collector otherwise walks them all on each
    full collection, an eighth of the suite's time (measured over test_loader, test_context_parallel,
    test_chat and test_inspect: 4.1 s of 34 s collecting, 2.1 s after). Objects the tests make are
    collected as ever."""
    gc.collect()
    gc.freeze()


def files_signature(folder: Path) -> tuple:
    """What changes when a file under ``folder`` is rewritten (transformers also reads subfolders, e.g.
    ``additional_chat_templates/``): each file's path, size and mtime."""
    return tuple(sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                        for p in folder.rglob("*") if p.is_file()))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PACKER_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("PACKER_CACHE_LIMIT")


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_folders_loaded_once():
    """In this process, transformers loads each tokenizer folder once (0.2-0.6 s for a real vocabulary), not
    once per build: hundreds of builds use the same few folders. packer's own code then reads that load as
    it always does (``Tokenizer``); it never changes it. A folder whose files change (size or mtime), or a
    copy elsewhere, is loaded again, and a load that fails is not kept, so every refusal runs each time.
    Builds in subprocesses (the CLI, Ctrl-C, the wheel) load their own."""
    from packer.building import tokenization

    real = tokenization._tokenizer_class
    loaded: dict[tuple, object] = {}

    class Once:
        def __init__(self, cls):
            self.cls = cls

        def from_pretrained(self, path: str, **kwargs):
            key = (self.cls, str(Path(path).resolve()), files_signature(Path(path)), tuple(sorted(kwargs.items())))
            if key not in loaded:
                loaded[key] = self.cls.from_pretrained(path, **kwargs)
            return loaded[key]

    tokenization._tokenizer_class = lambda folder: Once(real(folder))
    yield
    tokenization._tokenizer_class = real


def rewrite_column(path: Path, column: str, change) -> None:
    """Rewrite the one-batch shard at ``path`` with ``change(flat_values, offsets)`` applied to one column
    (``offsets`` None for a scalar column); the other columns are written back as they were."""
    import pyarrow as pa

    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all().combine_chunks()
    columns = []
    for name in table.schema.names:  # whichever format the shard is in, as it is
        col = table.column(name).chunk(0)
        if name == column:
            if isinstance(col, pa.ListArray):
                values = col.values.to_numpy(zero_copy_only=False).copy()
                change(values, col.offsets.to_numpy())
                col = pa.ListArray.from_arrays(col.offsets, pa.array(values, col.type.value_type))
            else:
                values = col.to_numpy().copy()
                change(values, None)
                col = pa.array(values, col.type)
        columns.append(col)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=table.schema))


def need_shared(path: Path | str) -> Path:
    """``path`` under ../shared/data (given relative to it, or whole), or this test skipped with one reason
    spelt one way for every such test: a tokenizer folder needs its tokenizer.json, a file itself."""
    path = SHARED_DATA / path
    there = path.is_file() if path.suffix else (path / "tokenizer.json").is_file()
    if not there:
        pytest.skip(f"../shared/data/{path.relative_to(SHARED_DATA)} is absent (the shared GSM8K and tokenizers)")
    return path


def one_line(result) -> str:
    """The one stderr line of a CLI run (click's CliRunner) that failed as a user error: exit code 2."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def make_build(out: Path, source: str = "flan", **options) -> Path:
    """Build into ``out`` through the library (the CLI tests go through click) and return ``out``."""
    build(BuildConfig(source=source, out=str(out), **options))
    return out


@pytest.fixture(scope="session")
def flan_batch(tmp_path_factory) -> Path:
    """300 bundled records, batch mode of 4, max_len 512 (so some examples are truncated)."""
    return make_build(tmp_path_factory.mktemp("flan_batch"), limit=300, batch_size=4, max_len=512)


@pytest.fixture(scope="session")
def flan_bfd(tmp_path_factory) -> Path:
    """300 bundled records, bfd into 1,024-token rows, over-long examples split."""
    return make_build(tmp_path_factory.mktemp("flan_bfd"), limit=300, pack="bfd", max_len=1024, overlong="split")


# several chunks (of spill.CHUNK records: three, the last of one) and several shards: what parallel engines split
PARALLEL = dict(source="flan", limit=2001, pack="bfd", max_len=1024, overlong="split", shard_size_mb=1)


@pytest.fixture(scope="session")
def parallel_reference(tmp_path_factory) -> Path:
    """PARALLEL built in one process (num_proc=1): the bytes every engine and worker count must give."""
    out = tmp_path_factory.mktemp("parallel_reference") / "one"
    build(BuildConfig(out=str(out), num_proc=1, **PARALLEL))
    assert len(list(out.glob("shard-*.arrow"))) > 1
    return out


@pytest.fixture(scope="session")
def llama2_tokenizer() -> Path:
    return need_shared("llama2-tokenizer")


@pytest.fixture(scope="session")
def gsm8k_file() -> Path:
    return need_shared("gsm8k_train.jsonl")


def shard_rows(path: Path) -> list[dict]:
    """A shard's rows as dicts, with ``labels`` whichever format it is in: a format-2 shard stores the
    loss as ``loss_mask``, whose labels are the ids where it is set and -100 elsewhere."""
    from packer.contract import schema

    out = schema.open_shard(path).to_pylist()
    for row in out:
        if schema.LOSS_MASK in row:
            row["labels"] = [t if m else schema.IGNORE_INDEX for t, m in zip(row["input_ids"], row[schema.LOSS_MASK],
                                                                             strict=True)]
    return out
