"""A mix re-drawn from its parts' stored tokens: which records each part gives under the draws, and the build's
spill assembled from the parts' own spills in mix order, as a cold build would have written it; and the
other way, a build's spill split into its parts' own spills.

A part's spill (what :mod:`packer.building.token_store` keeps per part) holds what the part's first records
tokenize to alone, in the part's record order, with example ids the records' indices in the part (a preference
record's two examples share one). A mix draws each position's part (:func:`packer.building.mix.draws`), the
k-th draw of a part taking the part's k-th record, so the records a part gives are always a prefix of it, and
any mix whose every part's prefix is held is a re-draw of spills already made: its examples are the parts'
examples of those prefixes, their ids mapped from record index to mix position, merged in position order.
Records skipped under ``--on-error skip`` take a position and leave no example, as in a cold build; a
part's spill lists their indices and each one's reason, so the re-drawn build counts them exactly. An image
build's examples take their images with them (:func:`packer.building.image_spill.gather`), both ways.

Everything here is numpy over memory-mapped files, in blocks of examples: memory stays O(block + 12 bytes an
example), as in planning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import image_spill, mix
from .spill import FILES

BLOCK = 1 << 16  # examples per block when tokens are copied
_DTYPES = dict(zip(FILES, (np.int32, np.uint8, np.int32, np.int64), strict=True))  # ids, trained, lengths, example ids


@dataclass(frozen=True, slots=True)
class Held:
    """What a part's stored spill holds: its first ``records`` records, and whether they are all it has."""

    records: int
    complete: bool


def drawn(parts: list[dict[str, Any]], seed: int, limit: int | None, held: list[Held]) -> np.ndarray | None:
    """The part of each position of the mix (int32[records]) when every part's held records cover what the
    draws take from it, else None (a part would give a record beyond those held: the build tokenizes).

    A weighted mix ends at the first draw of a part with no record left, so a draw past a complete part's
    records ends the mix there, as reading it would; past an incomplete one's, the record is not held. A mix
    by records counts raises when a part holds fewer than its count: that build tokenizes too, to say so."""
    weighted = "weight" in parts[0]
    taken = np.zeros(len(parts), np.int64)
    have = np.array([h.records for h in held], np.int64)
    out: list[np.ndarray] = []
    for block in mix.draws(parts, seed, limit):
        counts = np.bincount(block, minlength=len(parts))
        over = np.flatnonzero(taken + counts > have)
        if over.size:
            # where each part that runs past its held records does so: the draw of its (have+1)-th record
            firsts = {int(k): int(np.flatnonzero(block == k)[have[k] - taken[k]]) for k in over}
            k, at = min(firsts.items(), key=lambda item: item[1])
            if not (weighted and held[k].complete):
                return None
            out.append(block[:at])
            break
        taken += counts
        out.append(block)
    return np.concatenate(out).astype(mix.PART) if out else np.zeros(0, mix.PART)


def skipped(skips: dict[str, Any], records: int) -> dict[str, int]:
    """A part's skip counts by reason over its first ``records`` records, from its spill's ``skips`` (the
    skipped records' indices, ascending, and each one's reason)."""
    n = int(np.searchsorted(np.asarray(skips["at"], np.int64), records))
    out: dict[str, int] = {}
    for reason in skips["reasons"][:n]:
        out[reason] = out.get(reason, 0) + 1
    return dict(sorted(out.items()))


def skipped_at(example_ids: np.ndarray, records: int) -> np.ndarray:
    """The indices, below ``records``, that no example has: the records that were skipped (every record read
    gives one example, two for a preference pair, or is skipped)."""
    seen = np.zeros(records, bool)
    seen[np.asarray(example_ids)] = True
    return np.flatnonzero(~seen)


def _open(folder: Path, examples: int, tokens: int) -> dict[str, np.ndarray]:
    counts = {"ids.bin": tokens, "trained.bin": tokens, "lengths.bin": examples, "example_ids.bin": examples}
    return {name: (np.memmap(folder / name, dtype=_DTYPES[name], mode="r", shape=(counts[name],)) if counts[name]
                   else np.zeros(0, _DTYPES[name])) for name in FILES}


def rank(groups: np.ndarray, n: int) -> np.ndarray:
    """Each element's index among the elements of its group (``groups``: ints below ``n``), in order."""
    order = np.argsort(groups, kind="stable")
    counts = np.bincount(groups, minlength=n)
    out = np.empty(groups.size, np.int64)
    out[order] = np.arange(groups.size) - np.repeat(_offsets(counts)[:-1], counts)
    return out


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def assemble(src: np.ndarray, parts: list[tuple[Path, int, int]], into: Path) -> tuple[int, int]:
    """Write the spill of the mix whose positions' parts are ``src`` into ``into`` (its four token files, and an
    image build's image files) from
    the parts' spills (``parts[k]``: folder, examples and tokens it holds). Returns (examples, tokens)."""
    files = [_open(folder, examples, tokens) for folder, examples, tokens in parts]
    # each part's examples of the records it gives, their ids mapped to mix positions, merged in position order
    ids_of, firsts = [], []
    for k, f in enumerate(files):
        positions = np.flatnonzero(src == k)
        n = int(np.searchsorted(f["example_ids.bin"], positions.size, side="left"))
        ids_of.append(positions[np.asarray(f["example_ids.bin"][:n])])
    merged = np.concatenate(ids_of) if ids_of else np.zeros(0, np.int64)
    part = np.repeat(np.arange(len(files), dtype=np.int32), [a.size for a in ids_of])
    order = np.argsort(merged, kind="stable")  # a pair's two examples keep their order (same id, same part)
    merged, part = merged[order], part[order]
    local = rank(part, len(files))  # each example's index in its part's spill
    for k, a in enumerate(ids_of):
        firsts.append(_offsets(np.asarray(files[k]["lengths.bin"][:a.size], np.int64)))
    base = _offsets(np.array([a.size for a in ids_of], np.int64))[:-1]
    lengths = (np.concatenate([np.asarray(f["lengths.bin"][:a.size]) for f, a in zip(files, ids_of, strict=True)])
               if ids_of else np.zeros(0, np.int32))[base[part] + local].astype(np.int32)
    into.mkdir(parents=True, exist_ok=True)
    with open(into / "ids.bin", "wb") as ids_out, open(into / "trained.bin", "wb") as trained_out:
        for lo in range(0, order.size, BLOCK):
            hi = min(lo + BLOCK, order.size)
            bp, bl = part[lo:hi], local[lo:hi]
            pieces_ids, pieces_tr, base, starts = [], [], 0, np.empty(hi - lo, np.int64)
            for k in np.unique(bp):  # the block's examples of part k: one run of its spill, in order
                mine = bp == k
                a, b = int(bl[mine][0]), int(bl[mine][-1]) + 1
                t0, t1 = int(firsts[k][a]), int(firsts[k][b])
                pieces_ids.append(np.asarray(files[k]["ids.bin"][t0:t1]))
                pieces_tr.append(np.asarray(files[k]["trained.bin"][t0:t1]))
                starts[mine] = base + firsts[k][bl[mine]] - t0
                base += t1 - t0
            block_len = lengths[lo:hi].astype(np.int64)
            dst = _offsets(block_len)
            index = np.repeat(starts - dst[:-1], block_len) + np.arange(int(dst[-1]))
            if pieces_ids:
                ids_out.write(np.concatenate(pieces_ids)[index].tobytes())
                trained_out.write(np.concatenate(pieces_tr)[index].tobytes())
    lengths.tofile(into / "lengths.bin")
    merged.astype(np.int64).tofile(into / "example_ids.bin")
    image_spill.gather([folder for folder, _, _ in parts], part, local, into)  # an image build's images too
    return int(order.size), int(lengths.sum(dtype=np.int64))


def split(folder: Path, lengths: np.ndarray, example_ids: np.ndarray, src: np.ndarray, into: list[Path | None]
          ) -> None:
    """Write each part's own spill (``into[k]``) from a mix's spill in ``folder`` (its examples' ``lengths`` and
    ``example_ids``, mix positions, and ``src``, the part of each position): part k's examples in its record
    order, their ids the records' indices in the part (``None``: a part not wanted). Appended a block of
    examples at a time."""
    example_ids = np.asarray(example_ids)
    index = rank(src, len(into))  # each position's record index in its part
    offsets = _offsets(lengths)
    tokens = int(offsets[-1])
    ids = np.memmap(folder / "ids.bin", np.int32, "r", shape=(tokens,)) if tokens else np.zeros(0, np.int32)
    trained = np.memmap(folder / "trained.bin", np.uint8, "r", shape=(tokens,)) if tokens else np.zeros(0, np.uint8)
    for path in into:
        if path is None:
            continue
        path.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            (path / name).write_bytes(b"")
    for lo in range(0, len(lengths), BLOCK):
        hi = min(lo + BLOCK, len(lengths))
        t0, t1 = int(offsets[lo]), int(offsets[hi])
        block_src = src[example_ids[lo:hi]]
        token_src = np.repeat(block_src, lengths[lo:hi])
        block_ids, block_trained = np.asarray(ids[t0:t1]), np.asarray(trained[t0:t1])
        for k in np.unique(block_src):
            if into[k] is None:  # a part not kept
                continue
            mine = block_src == k
            for name, data in (("ids.bin", block_ids[token_src == k]), ("trained.bin", block_trained[token_src == k]),
                               ("lengths.bin", np.asarray(lengths[lo:hi])[mine].astype(np.int32)),
                               ("example_ids.bin", index[example_ids[lo:hi][mine]])):
                with open(into[k] / name, "ab") as f:
                    f.write(data.tobytes())
    if (folder / image_spill.PER_EXAMPLE).is_file():  # an image build's images too: each part's examples', in order
        part = src[example_ids]
        for k, path in enumerate(into):
            if path is not None:
                mine = np.flatnonzero(part == k)
                image_spill.gather([folder], np.zeros(mine.size, np.int64), mine, path)
