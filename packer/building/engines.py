"""Engines: where the two parallel steps of a build run. The pipeline (:mod:`packer.building.pipeline`) is the
same whichever runs them, and so are the bytes.

An engine provides

- ``encode_chunks(stream, encoder, start)``: the :class:`~packer.building.tokenization.Encoded` chunks of
  records ``start`` … of ``stream`` (a :class:`packer.building.mix.MixStream`, encoded by a
  :class:`packer.building.mix.MixEncoder`), ``spill.CHUNK`` records each, *in source order*;
- ``write_shards(plan, spill, staging, shard_bytes, progress, row_format, compression)``: every shard of the plan written into
  ``staging``; a :class:`~packer.building.writer.Written`: their :class:`~packer.contract.schema.ShardEntry` in order
  and the counts the stats take from the rows.

:class:`LocalEngine` runs them on this machine; :class:`packer.building.ray_engine.RayEngine` as Ray Data tasks.
:func:`for_config` is the one place an engine is picked by name.

Local parallelism: ``num_proc == 1`` tokenizes in this process and lets the Rust tokenizer spread each
``encode_batch`` over every core (rayon threads); ``num_proc > 1`` runs that many worker processes
(fork where the platform has it, so no worker re-imports transformers; spawn elsewhere), each with
``TOKENIZERS_PARALLELISM=false`` so N processes use N cores. This process reads the stream (one
reader: a file or Hub stream cannot be split by position) and sends each chunk's records to a worker,
each chunk cut into tasks of ``TASK`` records (a text encoder's results concatenate: the same
arrays as the whole chunk's), at most ``_AHEAD`` tasks in hand per worker, each to the one with the
fewest; workers return flat numpy arrays, taken from whichever is ready and handed on, joined into
their chunk, in source order. Workers ignore Ctrl-C and
die with the parent; the parent kills them whenever the tokenize step ends, so an interrupt or an
error never waits on them.
"""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from ..contract.config import BuildConfig
from ..contract.schema import RowFormat
from ..errors import WorkerError
from ..planning.plan import Plan
from . import spill as spill_
from .mix import MixChunk, MixEncoder, MixStream
from .ray_engine import RayEngine
from .tokenization import Encoded
from .writer import Written, write_shards


class Engine(Protocol):
    def encode_chunks(self, stream: MixStream, encoder: MixEncoder, start: int) -> Iterator[Encoded]: ...

    def write_shards(self, plan: Plan, spill: spill_.Spill, staging: Path, *, shard_bytes: int,
                     progress: bool, row_format: RowFormat | None = None, compression: str | None = None) -> Written: ...


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """This machine: ``num_proc`` tokenizing processes, then ``num_proc`` threads writing shards."""

    num_proc: int = 1

    def encode_chunks(self, stream: MixStream, encoder: MixEncoder, start: int) -> Iterator[Encoded]:
        chunks: Iterator[MixChunk] = (chunk for _, chunk in stream.chunks(start, spill_.CHUNK))
        if self.num_proc > 1:
            first = list(itertools.islice(chunks, 1))
            chunks = itertools.chain(first, chunks)
            # a full chunk: a pool pays for its start-up (its tasks keep both workers busy). Started once the
            # first chunk is read, not the second: the workers tokenize while this process parses the rest
            if first and first[0].size >= spill_.CHUNK:
                return _pool_chunks(chunks, encoder, self.num_proc)
        return map(encoder.encode, chunks)

    def write_shards(self, plan: Plan, spill: spill_.Spill, staging: Path, *, shard_bytes: int,
                     progress: bool, row_format: RowFormat | None = None, compression: str | None = None) -> Written:
        with tqdm(total=plan.num_rows, desc="write", unit="row", disable=not progress, dynamic_ncols=True) as bar:
            return write_shards(plan, spill.store(), staging, shard_bytes=shard_bytes, on_rows=bar.update,
                                threads=self.num_proc, row_format=row_format, compression=compression)


def for_config(config: BuildConfig) -> Engine:
    """The engine ``config.engine`` names."""
    return RayEngine() if config.engine == "ray" else LocalEngine(config.num_proc or os.cpu_count() or 1)


# Records a worker is sent at a time: a quarter of a spill chunk, so that the workers end together (the one
# that finishes first idles at most about a task's time at the end of a build, where with whole chunks it
# was up to a chunk's: ~0.6 s of one core for 1,000 FLAN records, a third of the bundled build's
# tokenizing), and large enough that a task's pipe round trip and encode_batch call cost nothing beside
# its tokenizing.
TASK = 250


def _splittable(encoder: MixEncoder) -> bool:
    """Whether ``encoder``'s chunks may be encoded in parts and the parts' results concatenated: the text
    and pair encoders' own ``encode`` (one example or pair per record, each tokenized alone). An encoder
    that is another class's (images: their own arrays beside the tokens) gets whole chunks."""
    from .preference import PairEncoder
    from .tokenization import Encoder

    return all(type(e).encode in (Encoder.encode, PairEncoder.encode) for e in encoder.encoders)


def _tasks(chunk: MixChunk, size: int) -> list[MixChunk]:
    """``chunk`` cut into runs of at most ``size`` of its records, in mix order, each a chunk of its own: a part's
    records in a run are a slice of its records (its positions increase), first index moved on. Cut by the
    records' rank, not by position: a chunk's positions need not be consecutive (an extension's chunk holds only
    the positions no token store entry holds: :mod:`packer.building.extension`)."""
    if chunk.size <= size:
        return [chunk]
    every = np.sort(np.concatenate([positions for _, _, _, positions in chunk.pieces]))
    out = []
    for lo in range(0, every.size, size):
        hi = min(lo + size, every.size)
        first, last = int(every[lo]), int(every[hi - 1])
        pieces = []
        for k, start, records, positions in chunk.pieces:
            a, b = (int(i) for i in np.searchsorted(positions, [first, last + 1]))
            if b > a:
                pieces.append((k, start + a, {c: v[a:b] for c, v in records.items()}, positions[a:b]))
        out.append(MixChunk(tuple(pieces), hi - lo))
    return out


def _joined(parts: list[Encoded]) -> Encoded:
    """A chunk's tasks' results as the chunk's own: its examples are theirs in order."""
    if len(parts) == 1:
        return parts[0]
    skipped = parts[0].skipped
    for part in parts[1:]:
        skipped = skipped + part.skipped
    return Encoded(np.concatenate([p.ids for p in parts]), np.concatenate([p.trained for p in parts]),
                   np.concatenate([p.lengths for p in parts]), np.concatenate([p.example_ids for p in parts]), skipped)


def _pool_chunks(chunks: Iterator[MixChunk], encoder: MixEncoder, num_proc: int) -> Iterator[Encoded]:
    """The chunks, read here from the stream (so an error reading it is raised
    here, as it is), encoded by ``num_proc`` worker processes and yielded in source order.

    Each chunk is cut into tasks (``TASK`` records each, where the encoder allows: :func:`_splittable`).
    Each task goes to the worker with the fewest in hand (at most ``_AHEAD`` each), and results are
    taken from whichever worker has one ready, then handed out in source order, a chunk's tasks joined:
    a worker that runs faster (the other shares its core with this process) is never held back waiting
    for the slower one's results to be taken, which in lock-step left a core idle for ~7% of the 48k
    build. At most ``num_proc * (_AHEAD + 1)`` tasks are out at once, so memory stays bounded. A record
    error is raised when its chunk's turn comes, the first in source order, as in a single process.

    Our own few lines instead of ``multiprocessing.Pool``: a Pool can hang in ``terminate()`` when a
    worker dies holding its task queue's lock (Ctrl-C reaches every process of the terminal's group),
    which left the output's lock held forever. Here the workers ignore SIGINT and hold nothing the
    parent needs: on any exit of this generator (end, error, Ctrl-C, close) the parent kills them and
    reaps them, which cannot block.
    """
    workers = _Workers(num_proc, encoder)
    chunks = iter(chunks)
    size = TASK if _splittable(encoder) else None
    unsent: deque[MixChunk] = deque()  # tasks of the chunks read, not yet sent
    cut: deque[int] = deque()  # per chunk read and not yet handed out: its tasks
    ready: dict[int, tuple[bool, object]] = {}  # task index -> (ok, result or exception), not yet handed out
    sent = done = 0
    more = True

    def feed() -> None:  # every worker topped up, as far as the stream and the bound allow
        nonlocal sent, more
        while sent - done < num_proc * (_AHEAD + 1) and (w := workers.idlest()) is not None:
            if not unsent:
                chunk = next(chunks, None) if more else None
                if chunk is None:
                    more = False
                    return
                tasks = _tasks(chunk, size) if size else [chunk]
                cut.append(len(tasks))
                unsent.extend(tasks)
            workers.send(w, sent, unsent.popleft())
            sent += 1

    try:
        feed()
        while cut:
            parts = []
            for _ in range(cut[0]):
                while done not in ready:
                    k, outcome = workers.receive_any()
                    ready[k] = outcome
                    feed()
                ok, value = ready.pop(done)
                if not ok:
                    raise value
                done += 1
                parts.append(value)
            cut.popleft()
            feed()
            yield _joined(parts)
            feed()
    finally:
        workers.kill()


_AHEAD = 2  # tasks in hand per worker: one being encoded, one waiting, so no worker idles


class _Workers:
    """N forked (spawned where fork is missing) processes, each fed chunks of records through its own pipe."""

    def __init__(self, n: int, encoder: MixEncoder):
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.procs, self.conns, self.outboxes = [], [], []
        self.in_hand: list[deque[int]] = []  # per worker, the chunks sent and not yet answered, in order
        try:
            for _ in range(n):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(theirs, os.getpid(), encoder),
                                   daemon=True)
                _start_ignoring_ctrl_c(proc)
                theirs.close()
                self.procs.append(proc)
                self.conns.append(mine)
                self.in_hand.append(deque())
                # A chunk of records can outgrow the pipe's buffer: sent from this thread, it would block
                # while the worker blocks sending back its previous result, which this thread has not yet
                # taken (a deadlock). A feeder thread per worker sends; this thread only receives.
                outbox: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=_feed, args=(mine, outbox), daemon=True).start()
                self.outboxes.append(outbox)
        except BaseException:
            self.kill()
            raise

    def idlest(self) -> int | None:
        """The worker with the fewest chunks in hand, if it has fewer than ``_AHEAD``."""
        w = min(range(len(self.in_hand)), key=lambda i: len(self.in_hand[i]))
        return w if len(self.in_hand[w]) < _AHEAD else None

    def send(self, w: int, k: int, chunk: MixChunk) -> None:
        self.in_hand[w].append(k)
        self.outboxes[w].put(chunk)

    def receive_any(self) -> tuple[int, tuple[bool, object]]:
        """(chunk index, (ok, result or exception)) from a worker that has one ready (the first, if several)."""
        waiting = [self.conns[i] for i in range(len(self.conns)) if self.in_hand[i]]
        conn = min(wait(waiting), key=self.conns.index)
        i = self.conns.index(conn)
        try:
            outcome = conn.recv()
        except (EOFError, OSError):  # the worker died without a word (killed, out of memory), or in mid-message
            self.procs[i].join(1)
            code = self.procs[i].exitcode
            raise WorkerError(f"a tokenizing worker process died (exit code {code}); rerun, or pass -j 1") from None
        return self.in_hand[i].popleft(), outcome

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL: a worker holds nothing to clean up, the parent writes everything
        for proc in self.procs:
            proc.join()
        for outbox in self.outboxes:
            outbox.put(None)  # the feeder ends (a send to a dead worker fails at once, and ends it too)
        for conn in self.conns:
            conn.close()


def _feed(conn, outbox: queue.SimpleQueue) -> None:
    """Send the chunks put in ``outbox`` to one worker, until ``None`` or the worker is gone."""
    while (chunk := outbox.get()) is not None:
        try:
            conn.send(chunk)
        except Exception:  # the worker was killed and the pipe closed under us (OSError, or TypeError
            return  # when the close lands mid-send): the build is ending and nothing waits for this chunk


def _start_ignoring_ctrl_c(proc) -> None:
    """Start a worker with SIGINT blocked from before its fork until it ignores it (``_worker_main``).
    Ctrl-C reaches every process of the terminal's group; one landing before a new worker's first line
    ran raised KeyboardInterrupt in its bootstrap, which printed "Process ForkProcess-1:" beside the
    parent's one line (seen when a Ctrl-C came as the second worker started, under load). Only this
    thread's mask changes, and only for the fork: the parent takes a Ctrl-C as before, once it is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        proc.start()
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _worker_main(conn, parent: int, encoder: MixEncoder) -> None:
    # Ctrl-C reaches every process of the terminal's group: the parent alone handles it (it kills us).
    # Blocked since the fork (_start_ignoring_ctrl_c): ignored first, then unblocked, so one that came in
    # between is discarded, never raised here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers use N cores
    # Results are sent from a thread of their own: a result outgrows the pipe's buffer, so its send waits
    # until the parent reads it, and the parent is now and then busy a few ms (parsing the next chunk,
    # fsyncing the spill); this thread meanwhile encodes the next task (encode_batch releases the GIL).
    results: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_send_results, args=(conn, results), daemon=True).start()
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent closed our pipe, or died
            return
        try:
            result = (True, encoder.encode(chunk))
        except Exception as e:  # the parent raises it (a RecordError names the record)
            result = (False, _portable(e))
        results.put(result)


def _send_results(conn, results: queue.SimpleQueue) -> None:
    """Send a worker's results, in order. A result that cannot be sent ends the worker at once, so the parent
    reads the end of its pipe (a WorkerError there) rather than waiting for a result that never comes."""
    while True:
        result = results.get()
        try:
            conn.send(result)
        except BaseException:
            os._exit(1)


def _portable(e: Exception) -> Exception:
    """``e`` if it survives the pipe (pickles and unpickles), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent dies (Linux), so a ``kill -9`` of the build
    does not leave workers running on (and holding inherited file descriptors) for seconds."""
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
