"""The pool's tasks: a chunk cut into runs of records, encoded apart and joined, is the chunk encoded whole
(every array, the skip counts), for a mix of two parts and for preference pairs; through two real worker
processes too, with the first bad record in source order the one raised."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packer import BuildConfig, RecordError
from packer.building import engines, pipeline
from packer.building.tokenization import load_tokenizer


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _same(a, b) -> None:
    for name in ("ids", "trained", "lengths", "example_ids"):
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert dict(a.skipped) == dict(b.skipped) and a.skipped.by_part == b.skipped.by_part


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(pipeline.tokenizer_path(None))


def _opened(tmp_path, tokenizer, config: BuildConfig, skip: bool):
    opened = pipeline.open_source(config, tokenizer, skip_errors=skip)
    return opened, [chunk for _, chunk in opened.stream.chunks(0, 1000)]


def test_a_mix_chunk_cut_into_tasks_encodes_as_the_whole(tmp_path, tokenizer):
    a = [{"prompt": f"Add {i} and {i}.", "completion": f" {2 * i}"} for i in range(1000)]
    b = [{"prompt": f"Name {i}", "completion": f" n{i}" * (i % 5 + 1)} for i in range(1000)]
    a[3]["completion"] = None  # skipped under --on-error skip, counted in part 1
    b[100]["prompt"] = 5
    config = BuildConfig(source="-", out="-", mix=[  # prompt/completion: a pair of fields recognised
        {"source": _write(tmp_path / "a.jsonl", a), "weight": 2.0},
        {"source": _write(tmp_path / "b.jsonl", b), "weight": 1.0}], limit=1300, seed=3)
    opened, chunks = _opened(tmp_path, tokenizer, config, skip=True)
    assert [c.size for c in chunks] == [1000, 300] and len(chunks[0].pieces) == 2
    for chunk in chunks:
        tasks = engines._tasks(chunk, 250)
        assert [t.size for t in tasks] == [250] * (chunk.size // 250) + [chunk.size % 250] * (chunk.size % 250 > 0)
        _same(engines._joined([opened.encoder.encode(t) for t in tasks]), opened.encoder.encode(chunk))
    assert [sum(sum(opened.encoder.encode(c).skipped.by_part[k].values()) for c in chunks) for k in (0, 1)] == [1, 1]


def test_preference_pairs_cut_into_tasks(tmp_path, tokenizer):
    records = [{"prompt": f"Q{i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(600)]
    config = BuildConfig(source=_write(tmp_path / "p.jsonl", records), out="-")
    opened, chunks = _opened(tmp_path, tokenizer, config, skip=False)
    assert opened.pairs and engines._splittable(opened.encoder)
    whole = opened.encoder.encode(chunks[0])
    _same(engines._joined([opened.encoder.encode(t) for t in engines._tasks(chunks[0], 250)]), whole)
    assert len(whole.lengths) == 1200


def test_two_workers_give_the_chunks_and_the_first_error(tmp_path, tokenizer):
    records = [{"prompt": f"What is {i} plus {i}?", "completion": str(2 * i)} for i in range(2600)]
    path = tmp_path / "r.jsonl"
    config = BuildConfig(source=str(path), out="-", prompt_field="prompt", completion_field="completion")
    _write(path, records)
    opened, chunks = _opened(tmp_path, tokenizer, config, skip=False)
    assert engines._splittable(opened.encoder)
    got = list(engines._pool_chunks(iter(chunks), opened.encoder, 2))
    assert len(got) == 3
    for g, chunk in zip(got, chunks, strict=True):
        _same(g, opened.encoder.encode(chunk))

    records[1900]["completion"] = None  # chunk 1's last task
    records[2100]["completion"] = 7  # a later chunk, likely done first
    records[1300]["completion"] = [1]  # chunk 1's second task: the first in source order
    _write(path, records)
    opened, chunks = _opened(tmp_path, tokenizer, config, skip=False)
    with pytest.raises(RecordError, match=r"record 1301: "):
        list(engines._pool_chunks(iter(chunks), opened.encoder, 2))


def test_a_worker_killed_mid_build_is_one_line_and_the_rerun_builds(tmp_path, monkeypatch):
    """A worker that dies without a word (SIGKILL: the OOM killer's way) ends the build in one line, exit 2, naming
    its exit code; nothing is committed and the rerun, with every worker alive, builds the folder. (The kill comes
    from inside the forked worker, at its third task, so its moment does not depend on the machine's load.)"""
    import os
    import signal

    from click.testing import CliRunner
    from conftest import one_line

    from packer.building import tokenization
    from packer.cli import main
    from packer.contract import schema

    real, calls = tokenization.Encoder.encode, []

    def encode(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3 and os.getpid() != parent:  # in a worker (its own copy of calls, from the fork)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **kw)

    parent = os.getpid()
    monkeypatch.setattr(tokenization.Encoder, "encode", encode)
    args = ["build", "flan", "--limit", "3000", "-j", "2", "-q", "--out", str(tmp_path / "out")]
    line = one_line(CliRunner().invoke(main, args))
    assert line.startswith("packer: error: a tokenizing worker process died (exit code -9)") and "-j 1" in line, line
    assert not (tmp_path / "out" / schema.MANIFEST_NAME).exists()
    monkeypatch.setattr(tokenization.Encoder, "encode", real)
    assert CliRunner().invoke(main, args).exit_code == 0 and (tmp_path / "out" / schema.MANIFEST_NAME).exists()


def test_a_chunk_of_positions_with_gaps_is_cut_by_its_records(tmp_path, tokenizer):
    """An extension's chunk holds only the positions no token store entry holds (gaps between them): its tasks
    are runs of its records, every record in exactly one, in order (cut by position, the records past the
    chunk's first size positions were lost)."""
    from packer.building.mix import MixChunk

    records = [{"prompt": f"Add {i} and {i}.", "completion": f" {2 * i}"} for i in range(700)]
    config = BuildConfig(source=_write(tmp_path / "a.jsonl", records), out="-")
    opened, (chunk,) = _opened(tmp_path, tokenizer, config, skip=False)
    (k, first, columns, positions), = chunk.pieces
    gapped = MixChunk(((k, first, columns, positions * 3 + 7),), chunk.size)  # positions 7, 10, 13, ...
    tasks = engines._tasks(gapped, 250)
    assert [t.size for t in tasks] == [250, 250, 200]
    assert np.array_equal(np.concatenate([p[3] for t in tasks for p in t.pieces]), positions * 3 + 7)
    assert [p[1] for t in tasks for p in t.pieces] == [0, 250, 500]
    _same(engines._joined([opened.encoder.encode(t) for t in tasks]), opened.encoder.encode(gapped))
