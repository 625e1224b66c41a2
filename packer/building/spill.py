"""The token spill: records → flat token files in the staging folder, resumable, and read back by the writer.

Records are read from the source's stream (a :class:`packer.building.mix.MixStream`, of one part for a
one-source build) in chunks of ``CHUNK``, so the input is never all in memory nor converted to a cache
on disk, formatted and tokenized by :class:`packer.building.mix.MixEncoder` (each part's
:class:`packer.building.tokenization.Encoder`), and appended *in source order* to four flat files::

    <out>/.packer-staging/tokens/
        identity.json     what the tokens were made from (source, tokenizer, config); else discarded
        ids.bin           int32[tokens]     every kept example's tokens, concatenated
        trained.bin       uint8[tokens]     1 where the token is a target
        lengths.bin       int32[examples]   tokens per example
        example_ids.bin   int64[examples]   index of the example's record in the source
        progress.json     the commit marker: records, examples and tokens done, skip counts per part

After every chunk whose records bring those since the last commit to ``COMMIT_RECORDS``, or whose end
comes ``COMMIT_SECONDS`` after it (whichever is first; with chunks of ``CHUNK`` records, every chunk), the
files are flushed and fsynced, then ``progress.json`` is replaced atomically: it is the completion
marker of every chunk before it, so a Ctrl-C or a crash loses at most the chunk under way. A rerun
after a crash with the same identity truncates the files to the marker (dropping a torn tail) and
starts at the first record not done, saying how many that is (0 too: the interrupted run committed
none), so a resumed build is byte-identical to an uninterrupted one; another identity wipes the folder.
Only ``lengths`` and ``example_ids`` come back to memory (12 bytes per example); the writer reads
the tokens back segment by segment.

Where the chunks are encoded is the engine's business (:mod:`packer.building.engines`: a local process pool, or
Ray); whichever it is, it yields them in source order, ``CHUNK`` records each, so the bytes do not
depend on it.

Cost: one ``encode_batch`` per chunk; the writes are sequential appends; memory O(chunk + 12 B/example).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from . import image_spill
from .mix import MixEncoder, MixStream
from .tokenization import Skipped

CHUNK = 1000  # records per tokenizer call (and per task sent to a worker)
# a commit (4 fsyncs and a rename: ~1 ms) at least every COMMIT_RECORDS records or COMMIT_SECONDS, whichever
# comes first, at the end of a chunk: a Ctrl-C loses little, and the build is no slower (docs/benchmarks.md)
COMMIT_RECORDS, COMMIT_SECONDS = 1000, 10.0
STAGE_VERSION = 2  # bump when the spill layout, progress.json or the chunking changes: another version is tokenized again
_FILES = {"ids": ("ids.bin", np.int32), "trained": ("trained.bin", np.uint8),
          "lengths": ("lengths.bin", np.int32), "example_ids": ("example_ids.bin", np.int64)}
IDENTITY, PROGRESS = "identity.json", "progress.json"


@dataclass(frozen=True, slots=True)
class TokenStore:
    """All examples' tokens in two flat spill files: example k is tokens offsets[k]:offsets[k+1]."""

    ids_path: Path  # int32 per token
    trained_path: Path  # uint8 per token, 1 where the token is a target
    offsets: np.ndarray  # int64[examples+1]
    example_ids: np.ndarray  # int64[examples]: source record index of each example
    images: image_spill.ImageStore | None = None  # an image build's images (packer.building.image_spill)


@dataclass(slots=True)
class Spill:
    """The finished tokenize stage: where the tokens are, and the per-example arrays planning needs."""

    folder: Path
    lengths: np.ndarray  # int32[examples]
    example_ids: np.ndarray  # int64[examples], memory-mapped
    skipped: Skipped = field(default_factory=Skipped)
    records: int = 0  # records read (kept + skipped)
    reused_records: int | None = None  # of those, how many an interrupted run had already done (None: no such run)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def trained_flags(self) -> np.ndarray:
        """Every example's loss flags, concatenated, memory-mapped (read where indexed)."""
        return _memmap(self.folder / "trained.bin", np.uint8, self.tokens)

    def store(self) -> TokenStore:
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        return TokenStore(
            ids_path=self.folder / "ids.bin",
            trained_path=self.folder / "trained.bin",
            offsets=offsets,
            example_ids=self.example_ids,
            images=image_spill.open_images(self.folder, len(self.lengths)),
        )


def open_store(folder: Path, lengths: np.ndarray) -> TokenStore:
    """The TokenStore of a finished spill in ``folder`` (a writer on another node reopens it so)."""
    return Spill(folder=folder, lengths=lengths, example_ids=_memmap(folder / "example_ids.bin", np.int64, len(lengths))).store()


def _memmap(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# ---- resumable spill -------------------------------------------------------------------------------


FILES = tuple(name for name, _ in _FILES.values())  # the token files, what a finished spill's bytes are


def _stamp(identity: dict[str, Any]) -> str:
    return json.dumps({"stage_version": STAGE_VERSION, "chunk": CHUNK, **identity}, sort_keys=True, default=str)


def counts(spill: Spill) -> dict[str, Any]:
    """A finished spill's marker: what :func:`mark_finished` writes back for a spill of the same files."""
    return {"records": spill.records, "examples": len(spill.lengths), "tokens": spill.tokens,
            "skipped": list(spill.skipped.by_part), "finished": True}


def mark_finished(folder: Path, identity: dict[str, Any], done: dict[str, Any]) -> None:
    """Make ``folder``, which holds a finished spill's token files (put there by the token store), a finished
    spill of ``identity``: :func:`tokenize` then reads nothing from the source, as after an interrupted build."""
    (folder / IDENTITY).write_text(_stamp(identity))
    (folder / PROGRESS).write_text(json.dumps({**done, "finished": True}, sort_keys=True))


def finished(folder: Path, identity: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a finished spill of ``identity`` (an interrupted build's, to be reused as it is)."""
    try:
        return ((folder / IDENTITY).read_text() == _stamp(identity)
                and json.loads((folder / PROGRESS).read_text()).get("finished") is True)
    except (OSError, ValueError, AttributeError):
        return False


def _open_spill(folder: Path, identity: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Prepare ``folder`` for appending; return the committed progress (zeros for a fresh start) and
    whether an interrupted run of this build left it (its progress may be zeros: it committed none)."""
    stamp = _stamp(identity)
    fresh = {"records": 0, "examples": 0, "tokens": 0, "skipped": []}
    progress = None
    earlier = (folder / IDENTITY).is_file() and (folder / IDENTITY).read_text() == stamp
    if earlier:
        try:
            progress = json.loads((folder / PROGRESS).read_text())
        except (OSError, json.JSONDecodeError):
            progress = None
        if progress is not None:
            for key, (name, dtype) in _FILES.items():
                count = progress["tokens"] if key in ("ids", "trained") else progress["examples"]
                path = folder / name
                need = count * np.dtype(dtype).itemsize
                if not path.is_file() or path.stat().st_size < need:
                    progress = None  # a marker without its data: start over
                    break
            if progress is not None and not image_spill.complete(folder, progress):
                progress = None  # an image build's marker without its images: start over
    if progress is None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / IDENTITY).write_text(stamp)
        progress = dict(fresh)
    for key, (name, dtype) in _FILES.items():  # drop whatever was written after the last marker
        count = progress["tokens"] if key in ("ids", "trained") else progress["examples"]
        with open(folder / name, "ab") as f:
            f.truncate(count * np.dtype(dtype).itemsize)
    return progress, earlier


def _commit(folder: Path, files: dict[str, Any], progress: dict[str, Any]) -> None:
    for f in files.values():
        f.flush()
        os.fsync(f.fileno())
    tmp = folder / (PROGRESS + ".tmp")
    tmp.write_text(json.dumps(progress, sort_keys=True))
    os.replace(tmp, folder / PROGRESS)


def tokenize(
    stream: MixStream,
    encoder: MixEncoder,
    folder: Path,
    identity: dict[str, Any],
    *,
    engine,
    progress: bool = False,
) -> Spill:
    """Tokenize every record of ``stream`` into ``folder`` (resuming a matching earlier run), the
    chunks encoded by ``engine.encode_chunks`` (a :class:`packer.building.engines.Engine`).

    A finished spill says so in its marker (``finished``), so a rerun after a crash in planning or
    writing does not read the source again."""
    folder = Path(folder)
    done, earlier = _open_spill(folder, identity)
    start = int(done["records"])
    skipped = Skipped(tuple(done["skipped"])) if done["skipped"] else Skipped.none(len(stream.parts))
    if not done.get("finished"):
        encoder.ready()  # what encoding defers made now, before any record is read (and shared by forked workers)
    chunks = engine.encode_chunks(stream, encoder, start) if not done.get("finished") else iter(())
    # the records the source holds where it knows them cheaply (metadata, line breaks within a budget, else
    # estimated), --limit if it is given: counted only for a bar that shows, and not again for a finished spill;
    # once the first chunk is in, not before the first record is read: the workers tokenize meanwhile (counting
    # the bundled sample's line breaks took 0.05-0.1 s of the build's start)
    total = start if progress and done.get("finished") else None
    count = progress and not done.get("finished")  # the total is still to be counted
    bar = tqdm(total=total, initial=start, desc="tokenize", unit="rec", disable=not progress, dynamic_ncols=True)
    if earlier and progress:  # a rerun after Ctrl-C or a crash says it picks up, not silently (0 too)
        bar.write(f"resuming: {start:,} records already tokenized"
                  + (" (all of them)" if done.get("finished") else "" if start else
                     " (the interrupted run committed none)"), file=sys.stderr)
    files = {key: open(folder / name, "ab") for key, (name, _) in _FILES.items()}  # noqa: SIM115
    images = image_spill.Appender(folder, done)  # an image build's images, beside the tokens
    pending, committed = 0, time.monotonic()  # records since the last commit, and when it was
    try:
        for chunk in chunks:
            # the arrays' own buffers written (no bytes copy of each: 2.4 MB a chunk of FLAN records)
            files["ids"].write(np.ascontiguousarray(chunk.ids, dtype=np.int32))
            files["trained"].write(np.ascontiguousarray(chunk.trained, dtype=np.uint8))
            files["lengths"].write(np.ascontiguousarray(chunk.lengths, dtype=np.int32))
            files["example_ids"].write(np.ascontiguousarray(chunk.example_ids, dtype=np.int64))
            images.append(chunk, done)
            # records, not examples: a preference record is two examples with one id (adjacent)
            ids = chunk.example_ids
            consumed = int(ids.size and 1 + np.count_nonzero(ids[1:] != ids[:-1])) + sum(chunk.skipped.values())
            done["records"] += consumed
            done["examples"] += len(chunk.lengths)
            done["tokens"] += len(chunk.ids)
            skipped += chunk.skipped
            done["skipped"] = list(skipped.by_part)
            if count:
                bar.total, count = stream.total(), False
            bar.update(consumed)
            pending += consumed
            if pending >= COMMIT_RECORDS or time.monotonic() - committed >= COMMIT_SECONDS:
                _commit(folder, {**files, **images.files}, done)
                pending, committed = 0, time.monotonic()
        done["finished"] = True
        _commit(folder, {**files, **images.files}, done)
        # the total was an estimate, or never counted (no chunk came): end the bar at 100%. A count that found
        # none (a JSON document's items) leaves the bar as it was, without a total
        if progress and (bar.total is not None or count) and bar.n != bar.total:
            bar.total = bar.n
            bar.refresh()
    finally:
        bar.close()
        for f in files.values():
            f.close()
        images.close()
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # stops a worker pool at once when a chunk failed
    total = int(done["records"])
    examples = int(done["examples"])
    lengths = np.fromfile(folder / "lengths.bin", dtype=np.int32, count=examples)
    return Spill(
        folder=folder,
        lengths=lengths,
        example_ids=_memmap(folder / "example_ids.bin", np.int64, examples),
        skipped=skipped,
        records=total,
        reused_records=start if earlier else None,
    )
