"""Every build's source as a mix of parts (one, or several), each formatted by its own recipe or fields,
interleaved deterministically for the seed.

A mix is a list of parts, from the command line (``packer build flan gsm8k.jsonl chat.jsonl --mix
0.5,0.3,0.2``) or a YAML/JSON file (``--mix mix.yaml``)::

    - {source: flan, weight: 0.5}
    - {source: gsm8k.jsonl, recipe: gsm8k, weight: 0.3}
    - {source: chat.jsonl, messages_field: messages, weight: 0.2}
    - {source: Open-Orca/FLAN, files: "cot_zsopt_data/*.parquet", recipe: flan, weight: 0.1}

``files`` picks files inside a Hub repo or a local folder (a glob relative to it).

Every part has a ``weight`` (the mix draws each next record's source with these probabilities, and
ends when the drawn source has no record left, or at ``--limit`` records), or every part has a
``records`` count (exactly that many of its first records, in an order shuffled for the seed; a source
that holds fewer is an error). The draws are a pure function of the seed and the weights, so a mix is
reproduced exactly by a rerun, a resume or ``verify --source``. Example ids in the shards are
positions in the mix.

Each part is read as its own stream (:mod:`packer.building.sources`) and encoded by its own
:class:`packer.building.tokenization.Encoder` (so chat and prompt/completion sources mix under one tokenizer);
:class:`MixEncoder` puts a chunk's examples back in mix order. A build from one source reads it as a
mix of one part (:func:`packer.building.pipeline.open_source`), so every build has one stream, one chunk and one
encoder type; only the manifest tells them apart (a one-source build records its source, not ``parts``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, SourceError
from ..planning.accounting import account
from .image_encoder import EncodedImages, reordered
from .tokenization import Encoded, Encoder, Skipped

if TYPE_CHECKING:
    from .sources import Stream

FIELDS = ("prompt_field", "completion_field", "messages_field", "text_field")
KEYS = ("source", "weight", "records", "recipe", "split", "files", *FIELDS)
DRAW_BLOCK = 4096  # draws are made in blocks of this many, whatever the chunk size
PART = np.int32  # a mix position's part
# a mix by records counts: the sum of the counts is bounded (as it was when the order was drawn whole)
RECORDS_DRAWN = 2**31
CHECK_FROM = 1 << 20  # a weighted mix's draws counted under --limit before the parts are asked if they hold them
FILES_BESIDE = 64  # open files a build needs besides its mix parts' (spill, shards, tokenizer, workers' pipes)
SALT = 0x6D6978  # "mix": the draws' stream of random numbers is apart from the plan's for the same seed


def parts_from_cli(sources: tuple[str, ...], mix: str | None) -> list[dict[str, Any]] | None:
    """The mix the command line gives (None for a one-source build): weights for the sources, or a file."""
    if mix is not None and Path(mix).suffix.lower() in (".yaml", ".yml", ".json"):
        if sources:
            raise ConfigError(f"--mix {mix} is a mix file, which names the sources itself; give no SOURCE with it")
        return read_mix_file(mix)
    if mix is None:
        if len(sources) > 1:
            raise ConfigError(f"{len(sources)} sources need --mix: weights (--mix 0.5,0.3,0.2) or a mix file (--mix mix.yaml)")
        return None
    words = [w.strip() for w in mix.split(",")]
    if len(words) != len(sources):
        raise ConfigError(f"--mix {mix} gives {len(words)} weights for {len(sources)} sources; give one per SOURCE")
    return check_parts([{"source": s, "weight": _number(w, f"--mix {mix}")} for s, w in zip(sources, words, strict=True)],
                       f"--mix {mix}")


def _number(word: str, where: str) -> float:
    try:
        value = float(word)
    except ValueError:
        raise ConfigError(f"{where}: weight {word!r} is not a number; give weights like 0.5,0.3,0.2") from None
    if not np.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: weight {word!r} must be a finite number ≥ 0")
    return value


def read_mix_file(path: str) -> list[dict[str, Any]]:
    """The parts of a YAML or JSON mix file: a list of parts, or ``{"sources": [...]}``."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--mix {path}: cannot be read ({e.strerror or e}); check the path") from e
    try:
        if path.lower().endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # json and yaml raise their own error types; both mean "not a mix file"
        raise ConfigError(f"--mix {path}: not valid {'JSON' if path.lower().endswith('.json') else 'YAML'} "
                          f"({str(e).splitlines()[0][:150]})") from e
    if isinstance(data, dict) and "sources" in data:
        data = data["sources"]
    if not isinstance(data, list) or not data:
        raise ConfigError(f"--mix {path}: must be a list of sources ({{source, weight or records, ...}})")
    return check_parts(data, f"--mix {path}")


def check_parts(parts: list, where: str) -> list[dict[str, Any]]:
    """Each part checked and normalised (keys in a fixed order, weights as given)."""
    out = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("source"), str) or not part["source"]:
            raise ConfigError(f"{where}: part {i + 1} is not a {{source: ..., weight: ...}} entry")
        unknown = sorted(set(part) - set(KEYS))
        if unknown:
            raise ConfigError(f"{where}: part {i + 1} ({part['source']}) has unknown keys {', '.join(unknown)}; "
                              f"known: {', '.join(KEYS)}")
        if ("weight" in part) == ("records" in part):
            raise ConfigError(f"{where}: part {i + 1} ({part['source']}) needs a weight or a records count (one)")
        clean = {k: part[k] for k in KEYS if part.get(k) is not None}
        if "weight" in clean:
            clean["weight"] = _number(str(clean["weight"]), where)
        else:
            n = clean["records"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"{where}: part {i + 1} ({part['source']}) records must be a whole number ≥ 1, got {n!r}")
        for key in ("recipe", "split", "files", *FIELDS):
            if key in clean and not isinstance(clean[key], str):
                raise ConfigError(f"{where}: part {i + 1} ({part['source']}) {key} must be a string")
        out.append(clean)
    kinds = {"weight" in p for p in out}
    if len(kinds) > 1:
        raise ConfigError(f"{where}: give every source a weight, or every source a records count, not both")
    if kinds == {True} and sum(p["weight"] for p in out) <= 0:
        raise ConfigError(f"{where}: the weights sum to zero; give at least one source a positive weight")
    if kinds == {False} and sum(p["records"] for p in out) > RECORDS_DRAWN:
        raise ConfigError(f"{where}: the records counts sum to {sum(p['records'] for p in out):,}, more than the "
                          f"{RECORDS_DRAWN:,} a mix by counts can draw; use weights "
                          "and --limit for a larger mix")
    return out


# -- the draws --------------------------------------------------------------------------------------


def draws(parts: list[dict[str, Any]], seed: int, limit: int | None) -> Iterator[np.ndarray]:
    """The source of each mix position, in blocks: a pure function of the parts, seed and limit."""
    rng = np.random.default_rng([SALT, seed])
    if "records" in parts[0]:
        yield from _shuffled_counts(np.array([p["records"] for p in parts], np.int64), rng, limit)
        return
    p = np.array([part["weight"] for part in parts], dtype=np.float64)
    if not math.isfinite(sum(p.tolist())):  # weights near the float maximum: their ratios are what counts
        p /= p.max()
    p /= p.sum()
    left = limit
    while left is None or left > 0:
        block = rng.choice(len(parts), size=DRAW_BLOCK, p=p).astype(PART)
        if left is not None:
            block = block[:left]
            left -= block.size
        yield block


def ran_out(parts: list[dict[str, Any]], seed: int, limit: int | None, records: int) -> int | None:
    """The part whose running out ended a weighted mix after ``records`` records: the part of the draw at
    that position (a mix ends at the first draw of a part with no record left). None for a mix by counts,
    one of one part, or one that ended at its limit. O(records) numpy, no reading."""
    if len(parts) < 2 or "records" in parts[0] or (limit is not None and records >= limit):
        return None
    seen = 0
    for block in draws(parts, seed, limit):
        if seen + block.size > records:
            return int(block[records - seen])
        seen += block.size
    return None


def _shuffled_counts(left: np.ndarray, rng: np.random.Generator, limit: int | None) -> Iterator[np.ndarray]:
    """The parts of a uniformly shuffled multiset (``left[k]`` copies of part k), a block at a time and never
    the whole order: each block is a random ordered sample, without replacement, of the records not drawn
    yet (their indices taken by Floyd's algorithm in ``Generator.choice``, O(block), mapped to parts by the
    counts left), so ``--limit 30`` of a 50,000,000-record mix costs what 30 records cost. A block's size does
    not depend on the limit, so a limited mix is a prefix of the whole one; a block is at least as large
    as the number of parts, so the per-block O(parts) work adds up to O(records)."""
    block = max(DRAW_BLOCK, left.size)
    total = int(left.sum())
    while total > 0 and (limit is None or limit > 0):
        n = min(block, total)
        picked = np.searchsorted(np.cumsum(left), rng.choice(total, size=n, replace=False), side="right").astype(PART)
        left -= np.bincount(picked, minlength=left.size)
        total -= n
        if limit is not None:
            picked = picked[:limit]
            limit -= picked.size
        yield picked


def positions_sources(parts: list[dict[str, Any]], seed: int, n: int) -> np.ndarray:
    """int32[n]: the source of each of the first ``n`` mix positions (recomputed, nothing read)."""
    out = list(draws(parts, seed, n))
    return np.concatenate(out)[:n] if out else np.zeros(0, PART)


def part_limits(parts: list[dict[str, Any]], seed: int, limit: int, holds: Callable[[int, int], bool]) -> list[int]:
    """How many of the first ``limit`` mix positions each part gives: how far each part is read.

    Counted a block of draws at a time, never an array of ``limit``. A weighted mix ends where a drawn
    part has no record left, so once ``CHECK_FROM`` positions are counted, and at every doubling, each
    part is asked whether it holds its count (``holds(part, n)``, which reads no further than ``n``);
    the count stops at the first that does not, so a ``--limit`` beyond the data costs what the data
    costs. Each part's count is then at least what the mix reads of it.
    """
    if len(parts) == 1:  # every draw is the one part's
        return [limit]
    counts = np.zeros(len(parts), np.int64)
    done, check = 0, CHECK_FROM
    for block in draws(parts, seed, limit):
        counts += np.bincount(block, minlength=len(parts))
        done += block.size
        if "weight" in parts[0] and done >= check:
            check *= 2
            if not all(holds(k, int(n)) for k, n in enumerate(counts)):
                break
    return counts.tolist()


def _room_for_files(parts: int) -> None:
    """A mix reads its parts side by side, each holding a file open (the files of one part are read one
    after another), so the soft limit on open files is raised to what that needs, within the hard limit
    (as any process may for its own needs). Past the hard limit, reading says so (``packer.building.readers``)."""
    try:
        import resource
    except ImportError:  # not POSIX: no such limit to read
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = parts + FILES_BESIDE
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))


# -- reading ----------------------------------------------------------------------------------------


class _Reader:
    """One part's records, taken n at a time across its stream's batches."""

    def __init__(self, stream: Stream, size: int, first: int = 0):
        self.batches = stream.chunks(first, size)  # from record `first`: those before it passed over by the stream
        self.batch: dict[str, list] = {}
        self.offset = 0

    def take(self, n: int) -> dict[str, list]:
        parts: list[dict[str, list]] = []
        while n > 0:
            have = len(next(iter(self.batch.values()))) - self.offset if self.batch else 0
            if have == 0:
                nxt = next(self.batches, None)
                if nxt is None:
                    break
                self.batch, self.offset = nxt[1], 0
                continue
            k = min(n, have)
            parts.append({c: v[self.offset:self.offset + k] for c, v in self.batch.items()})
            self.offset += k
            n -= k
        if len(parts) == 1:  # within one batch (always, for a one-part mix): its columns as they are
            return parts[0]
        return {c: [x for p in parts for x in p.get(c, [None] * len(next(iter(p.values()))))]
                for c in dict.fromkeys(c for p in parts for c in p)}


def in_runs(blocks: Iterator[tuple[np.ndarray, ...]], size: int) -> Iterator[tuple[np.ndarray, ...]]:
    """Blocks of parallel arrays (the draws, a block at a time) regrouped into runs of ``size`` entries, the last
    one shorter: a chunk's draws whatever the block size."""
    pending: tuple[np.ndarray, ...] | None = None
    for block in blocks:
        pending = block if pending is None else tuple(np.concatenate([p, b]) for p, b in zip(pending, block, strict=True))
        while pending[0].size >= size:
            yield tuple(p[:size] for p in pending)
            pending = tuple(p[size:] for p in pending)
    if pending is not None and pending[0].size:
        yield pending


@dataclass(frozen=True, slots=True)
class MixChunk:
    """One chunk of the mix: per part present, its records (in its own order) and their mix positions."""

    pieces: tuple[tuple[int, int, dict[str, list], np.ndarray], ...]  # (part, first index in part, records, positions)
    size: int


@dataclass(frozen=True, slots=True)
class MixStream:
    """The parts' streams interleaved by the draws: what every build reads, a chunk at a time (``chunks``)."""

    parts: tuple[dict[str, Any], ...]
    streams: tuple[Stream, ...]  # one per part
    seed: int
    limit: int | None = None

    @property
    def name(self) -> str:
        return "+".join(p["source"] for p in self.parts)

    def total(self) -> int | None:
        """About how many records the mix gives, for a progress bar, or None where a part cannot say cheaply.
        A weighted mix ends at the first draw of a part that has run out: near the fewest of a part's
        records over its share of the draws. Under a limit, the limit (or the parts' records, if fewer):
        the parts' files are not read to count them."""
        if "records" in self.parts[0]:
            known: int | None = sum(p["records"] for p in self.parts)
        elif self.limit is not None:
            known = None
        else:
            counts = [s.total() for s in self.streams]
            share = np.array([p["weight"] for p in self.parts], np.float64)
            share /= share.max()  # weights near the float maximum: their ratios are what counts
            share /= share.sum()
            known = None if None in counts else int(min(c / w for c, w in zip(counts, share, strict=True) if w > 0))
        if self.limit is None:
            return known
        return self.limit if known is None else min(known, self.limit)

    def chunks(self, start: int = 0, size: int = 1000) -> Iterator[tuple[int, MixChunk]]:
        """``(first position, chunk)`` of ``size`` positions each, from position ``start`` (a chunk boundary: an
        interrupted spill commits whole chunks). The draws before ``start`` are counted, not read: each part's
        stream opens at its first record after them, so a resumed build does not make its records again up to
        where it stopped (a local file's records before it are passed over as :func:`packer.building.readers.records`
        says: JSON lines unparsed; a Hub part is skipped by `datasets`, which still reads them)."""
        _room_for_files(len(self.streams))
        readers: list[_Reader | None] = [None] * len(self.streams)  # each opened at its first draw from `start` on
        nexts = [0] * len(self.streams)  # each part's next record
        lo = 0
        for (chunk,) in in_runs(((block,) for block in draws(list(self.parts), self.seed, self.limit)), size):
            if lo < start:  # tokenized by the run this one resumes: a part that ran out would have ended it there
                nexts = [a + int(b) for a, b in zip(nexts, np.bincount(chunk, minlength=len(nexts)), strict=True)]
                lo += int(chunk.size)
                continue
            pieces, cut = [], chunk.size
            firsts = list(nexts)
            got = []
            for k in range(len(readers)):
                want = int((chunk == k).sum())
                if want and readers[k] is None:
                    readers[k] = _Reader(self.streams[k], size, nexts[k])
                records = readers[k].take(want) if want else {}
                n = len(next(iter(records.values()))) if records else 0
                got.append(records)
                if n < want:  # this part ran out at its (n+1)-th draw in the chunk
                    if "records" in self.parts[k]:
                        raise short(self.parts[k], firsts[k] + n)
                    cut = min(cut, int(np.flatnonzero(chunk == k)[n]))
            ended = cut < chunk.size  # a weighted part ran out: the mix ends here
            chunk = chunk[:cut]
            for k, records in enumerate(got):
                positions = np.flatnonzero(chunk == k)
                nexts[k] += int(positions.size)
                if positions.size:
                    records = {c: v[:positions.size] for c, v in records.items()}
                    pieces.append((k, firsts[k], records, lo + positions))
            if chunk.size:
                yield lo, MixChunk(tuple(pieces), int(chunk.size))
            lo += int(chunk.size)
            if ended:
                return


def short(part: dict[str, Any], records: int) -> SourceError:
    """The error of a mix by records counts whose ``part`` ended after ``records`` records, fewer than its count."""
    return SourceError(f"{part['source']}: ended after {records:,} records, the mix asks for {part['records']:,}; "
                       "lower its records count or check the source")


class MixEncoder:
    """Encodes a :class:`MixChunk`: each part's records by its own Encoder, examples back in mix order."""

    def __init__(self, encoders: list[Encoder], wheres: list[str]):
        self.encoders, self.wheres = encoders, wheres  # wheres: how an error names a part's record

    def ready(self) -> None:
        """Make now, in this process, what encoding needs and its parts defer (a tokenizer rebuilt from kept parts
        makes its Rust tokenizer at first use, 0.4 s for a large vocabulary; a chat template is compiled at first
        use, and a broken one fails here, before any record is read): workers forked after it share them, rather
        than each making its own."""
        for encoder in self.encoders:
            encoder.ready()

    def encode(self, chunk: MixChunk) -> Encoded:
        done: list[Encoded] = []
        skipped: list[dict[str, int]] = [{} for _ in self.encoders]
        for k, first, records, positions in chunk.pieces:
            enc = self.encoders[k].encode(records, first, where=self.wheres[k])
            # example ids: from the part's own record index to the position in the mix
            enc.example_ids = positions[enc.example_ids - first].astype(np.int64)
            done.append(enc)
            skipped[k] = dict(enc.skipped)
        if len(done) == 1:  # one part's examples are in mix order already
            done[0].skipped = Skipped(tuple(skipped))
            return done[0]
        if not done:
            return Encoded(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64),
                           Skipped(tuple(skipped)))
        lengths = np.concatenate([e.lengths for e in done]).astype(np.int64)
        example_ids = np.concatenate([e.example_ids for e in done])
        ids = np.concatenate([e.ids for e in done])
        trained = np.concatenate([e.trained for e in done])
        order = np.argsort(example_ids, kind="stable")
        starts = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        new_len = lengths[order]
        new_starts = np.zeros(new_len.size + 1, np.int64)
        np.cumsum(new_len, out=new_starts[1:])
        index = np.repeat(starts[:-1][order] - new_starts[:-1], new_len) + np.arange(int(new_starts[-1]))
        out = Encoded(ids[index], trained[index], new_len, example_ids[order], Skipped(tuple(skipped)))
        return reordered(out, done, order) if isinstance(done[0], EncodedImages) else out  # an image build's images too


def part_counts(parts: list[dict[str, Any]], seed: int, records: int, example_ids: np.ndarray, lengths: np.ndarray,
                plan, skipped: Skipped) -> list[dict[str, Any]]:
    """Each part's counts (:func:`packer.planning.accounting.account`, one epoch's, so they add up to the totals):
    records read, examples packed whole / split / truncated / dropped, skipped by reason, and the tokens
    its examples hold in the rows of every epoch (as the totals' ``tokens``)."""
    src = positions_sources(parts, seed, records)
    example_src = src[np.asarray(example_ids)] if len(example_ids) else np.zeros(0, PART)
    acct = account(plan, lengths, source=example_src, parts=len(parts))
    out = []
    for k, (part, c) in enumerate(zip(parts, acct.parts, strict=True)):
        dropped = {**skipped.by_part[k], **({"overlong": c.dropped} if c.dropped else {})}
        out.append({
            "source": part["source"],
            "records_read": int((src == k).sum()),
            "examples": c.examples,
            "examples_packed": c.whole,
            "examples_split": c.split,
            "examples_truncated": c.truncated,
            "dropped_by_reason": dict(sorted(dropped.items())),
            "tokens": c.tokens * acct.epochs,
        })
    return out
