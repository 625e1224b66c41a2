"""Rows ready for context parallelism (CP), and fixed shapes: the padding rules and each rank's share.

Pure numpy. The build uses it to pad segments (``--cp-size``, ``--cp-layout``, ``--pad-to-multiple-of``)
and the loader to hand a CP rank its share of a row (``cp_rank``/``cp_size``) or a row of fixed shape
(``static_shapes``). A CP group of N ranks splits one row; every rank sees the same row.

Padding. A padding token is appended at the end of a segment: its id is the tokenizer's pad id (its
eos id when it has none), its label -100 (trained nowhere), its position continues the segment's.
``seq_lens`` holds the padded lengths (what the kernels take as ``cu_seqlens``) and the shard column
``pad_lens`` how many of each segment's tokens are padding, so the unpadded ``cu_seqlens`` stay
exact. Causal attention makes the padding harmless: it sits after every real token of its segment,
so no real token attends to it::

    zigzag, N = 2: segments to a multiple of 2N = 4         contiguous, N = 3: the row to a multiple of N
    seq     a a a a a b b b                                  a a a a a b b b
    padded  a a a a a p p p | b b b p                        a a a a a b b b p       (9 = 3 × 3)
    chunks  0 0 1 1 2 2 3 3 | 0 1 2 3                        rank 0: a a a   rank 1: a a b   rank 2: b b p
    rank 0  chunks 0 and 3 of each segment: a a p p b p     (llama3-style: the row cut in N slices)
    rank 1  chunks 1 and 2:                 a a a p b b

- ``zigzag`` (TransformerEngine THD ``thd_get_partitioned_indices``, ring-flash-attention's
  ``zigzag_ring_flash_attn_varlen_func``): every segment is cut into 2N equal chunks and rank ``r``
  takes chunks ``r`` and ``2N-1-r`` of each, so every rank does the same causal work. Segments are
  padded to a multiple of ``lcm(2N, M)``. The rank's ``cu_seqlens`` are the padded ones divided by N.
- ``contiguous`` (ring-flash-attention's ``llama3_flash_attn_varlen_func``): the row is cut into N
  equal slices; only the row's length must divide by N, so the row's last segment is padded (segments
  themselves to a multiple of M). The kernel takes the row's *global* ``cu_seqlens``.

``M`` is ``--pad-to-multiple-of`` (FP8 GEMMs want 16). The budget includes the padding: a row never
exceeds ``max_tokens``.

Labels. A rank's last token predicts a token that lives on another rank (zigzag: always), so labels
are shifted over the whole row *before* the split (``shift_labels``, which transformers' loss takes
instead of shifting the rank's own labels) and ``num_items_in_batch`` stays the global count: the
ranks' summed losses are exactly the unsplit loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError

LAYOUTS = ("zigzag", "contiguous")
IGNORE_INDEX = -100  # schema.IGNORE_INDEX; repeated here, as schema imports pyarrow, this module only numpy


def pad_up(values, multiple: int):
    """``values`` rounded up to a multiple of ``multiple``."""
    return -(-values // multiple) * multiple


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """How a build pads its rows: CP group size and layout, and the kernel multiple M."""

    cp_size: int = 1
    cp_layout: str = "zigzag"
    multiple: int = 1  # --pad-to-multiple-of
    pad_id: int = 0  # the id padding tokens get

    def __post_init__(self) -> None:
        if self.cp_layout not in LAYOUTS:
            raise ConfigError(f"--cp-layout must be one of {', '.join(LAYOUTS)}, got {self.cp_layout!r}")
        for name, value in (("--cp-size", self.cp_size), ("--pad-to-multiple-of", self.multiple)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer of at least 1, got {value!r}")

    @property
    def segment_multiple(self) -> int:
        """Every segment's padded length is a multiple of this."""
        return math.lcm(2 * self.cp_size, self.multiple) if self.zigzag else self.multiple

    @property
    def row_multiple(self) -> int:
        """Every row's length is a multiple of this (the last segment takes the row's padding)."""
        return self.segment_multiple if self.zigzag else math.lcm(self.cp_size, self.multiple)

    @property
    def zigzag(self) -> bool:
        return self.cp_layout == "zigzag" and self.cp_size > 1

    def budget(self, max_tokens: int) -> int:
        """The row budget the planner packs into: ``max_tokens`` rounded down to what both multiples
        divide, so that padding a row never takes it past ``max_tokens``."""
        step = math.lcm(self.segment_multiple, self.row_multiple)
        return max_tokens // step * step

    def padding(self, length: np.ndarray, row_splits: np.ndarray) -> np.ndarray:
        """int64[m]: the padding tokens at the end of each segment (rows cut by ``row_splits``)."""
        length = np.asarray(length, np.int64)
        pad = pad_up(length, self.segment_multiple) - length
        if self.row_multiple > self.segment_multiple and length.size:
            cs = np.zeros(length.size + 1, np.int64)
            np.cumsum(length + pad, out=cs[1:])
            row = cs[row_splits[1:]] - cs[row_splits[:-1]]
            last = row_splits[1:] - 1
            filled = row_splits[1:] > row_splits[:-1]
            pad[last[filled]] += (pad_up(row, self.row_multiple) - row)[filled]
        return pad


def pad_token_id(tokenizer: dict[str, Any]) -> int:
    """The id padding tokens get: the tokenizer's pad id, else its eos id (a manifest's ``tokenizer``)."""
    for key in ("pad_token_id", "eos_token_id"):
        if isinstance(tokenizer.get(key), int):
            return tokenizer[key]
    raise ConfigError(f"tokenizer {tokenizer.get('name_or_path')!r} has neither a pad nor an eos token: padding "
                      "needs one; use a tokenizer that defines either")


def padding_positions(seg_end: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """int64 indices of the padding tokens: the last ``pad[i]`` tokens before ``seg_end[i]``."""
    pad = np.asarray(pad, np.int64)
    total = int(pad.sum())
    first = np.repeat(np.asarray(seg_end, np.int64) - pad, pad)
    return first + np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(pad) - pad, pad)


# -- a rank's share ---------------------------------------------------------------------------------


def zigzag_indices(cu_padded: np.ndarray, cp_size: int, rank: int) -> np.ndarray:
    """The row's token indices rank ``rank`` holds: chunks ``rank`` and ``2N-1-rank`` of every segment
    cut into 2N (as TransformerEngine's ``thd_get_partitioned_indices``), in row order."""
    cu = np.asarray(cu_padded, np.int64)
    chunk = np.diff(cu) // (2 * cp_size)
    first = cu[:-1] + rank * chunk
    second = cu[:-1] + (2 * cp_size - 1 - rank) * chunk
    starts = np.stack([first, second], axis=1).ravel()
    sizes = np.repeat(chunk, 2)
    return np.repeat(starts, sizes) + np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(sizes) - sizes, sizes)


def cu_seqlens_on_rank(cu_seqlens: np.ndarray, cu_padded_on_rank: np.ndarray, cp_size: int, rank: int) -> np.ndarray:
    """The real (unpadded) tokens of each segment on rank ``rank`` as cumulative offsets, as
    TransformerEngine's ``get_cu_seqlens_on_cp_rank`` (both halves) computes them from the row's
    unpadded ``cu_seqlens`` and the rank's padded ones (the row's padded ``cu_seqlens // cp_size``)."""
    seqlens = np.diff(np.asarray(cu_seqlens, np.int64))
    chunk = np.diff(np.asarray(cu_padded_on_rank, np.int64)) // 2
    mine = (np.clip(seqlens - rank * chunk, 0, chunk)
            + np.clip(seqlens - (2 * cp_size - rank - 1) * chunk, 0, chunk))
    out = np.zeros(seqlens.size + 1, np.int32)
    np.cumsum(mine, out=out[1:])
    return out


def shift_labels(labels: np.ndarray) -> np.ndarray:
    """Labels shifted left over the whole row (``[..., T]``): position t holds the label of t+1, and the
    last position -100. Taken before a row is split, so no rank shifts across its share's edge."""
    labels = np.asarray(labels)
    out = np.full_like(labels, IGNORE_INDEX)
    out[..., :-1] = labels[..., 1:]
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RowView:
    """The loader's per-row transform: a CP rank's share of a row and/or a row of fixed shape.

    ``layout``: the build's padding (None: the build has none). ``static``: (budget, segments) pads
    every row to ``budget`` tokens with one padding segment and ``cu_seqlens`` to ``segments + 1``
    entries (empty segments at the end), and fixes ``max_length``. ``pad_id``: the padding's id.
    """

    cp_size: int = 1
    cp_rank: int = 0
    layout: str = "zigzag"
    static: tuple[int, int] | None = None
    pad_id: int = 0

    def __call__(self, batch: dict[str, Any], pads: np.ndarray | None) -> dict[str, Any]:
        """``batch``: the loader's row (array-likes ``[1, T]``, ``cu_seq_lens_q``); ``pads``: the row's
        ``pad_lens`` (None: no padding). Returns the rank's batch, numpy arrays and Python ints."""
        ids, pos, labels = (np.asarray(batch[k])[0] for k in ("input_ids", "position_ids", "labels"))
        cu = np.asarray(batch["cu_seq_lens_q"]).astype(np.int64)
        pads = np.zeros(cu.size - 1, np.int64) if pads is None else np.asarray(pads, np.int64)
        if self.static is not None:
            ids, pos, labels, cu, pads = self._fixed(ids, pos, labels, cu, pads)
        shifted = shift_labels(labels)
        n, r = self.cp_size, self.cp_rank
        seqlens = np.diff(cu)
        out: dict[str, Any] = {}
        if n > 1 and self.layout == "zigzag":
            idx = zigzag_indices(cu, n, r)
            local = (cu // n).astype(np.int32)
            longest = (self.static[0] if self.static else int(seqlens.max(initial=0))) // n
            unpadded = np.zeros(cu.size, np.int32)
            np.cumsum(seqlens - pads, out=unpadded[1:])
            out.update(cp_cu_seqlens=unpadded, cp_cu_seqlens_padded=cu.astype(np.int32),
                       cp_cu_seqlens_on_rank=cu_seqlens_on_rank(unpadded, local, n, r))
        else:  # contiguous (llama3-style): the rank's slice; the kernel takes the row's cu_seqlens
            share = ids.size // n
            idx = np.arange(r * share, (r + 1) * share, dtype=np.int64)
            local = cu.astype(np.int32)
            longest = self.static[0] if self.static else int(seqlens.max(initial=0))
        for key, values in (("input_ids", ids), ("position_ids", pos), ("labels", labels),
                            ("shift_labels", shifted)):
            out[key] = values[idx].astype(np.int64)[None]
        # each token's segment in the (padded) row, the rank's share of it (the padding segment has its own)
        out["seq_idx"] = np.repeat(np.arange(cu.size - 1, dtype=np.int32), np.diff(cu))[idx][None]
        return {**out, "cu_seq_lens_q": local, "cu_seq_lens_k": local, "max_length_q": longest,
                "max_length_k": longest, "seq_idx": out.pop("seq_idx"),
                "num_items_in_batch": batch["num_items_in_batch"]}

    def _fixed(self, ids, pos, labels, cu, pads):
        """The row padded to the budget by one padding segment, cu_seqlens to the fixed count."""
        budget, segments = self.static
        extra, t = budget - ids.size, ids.size
        if extra < 0 or cu.size - 1 > segments:
            raise ConfigError(f"a row of {t} tokens in {cu.size - 1} segments does not fit the static shape of "
                              f"{budget} tokens in {segments} segments")
        ids = np.concatenate([ids, np.full(extra, self.pad_id, ids.dtype)])
        pos = np.concatenate([pos, np.arange(extra, dtype=pos.dtype)])
        labels = np.concatenate([labels, np.full(extra, IGNORE_INDEX, labels.dtype)])
        fixed = np.full(segments + 2, budget, np.int64)  # + the padding segment (empty when the row is full)
        fixed[: cu.size] = cu
        pad_lens = np.zeros(segments + 1, np.int64)
        pad_lens[: pads.size] = pads
        pad_lens[pads.size] = extra
        return ids, pos, labels, fixed, pad_lens


def row_view(manifest, cp_rank: int, cp_size: int, static: bool, max_segments) -> RowView | None:
    """The loader's transform for a build (its ``schema.Manifest``), or None when rows pass as they are.

    ``max_segments``: a callable giving the most segments any row holds (counted only for ``static``).
    Refuses a CP size the build's padding does not divide (ConfigError)."""
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ConfigError(f"cp_rank {cp_rank} with cp_size {cp_size}: need 0 <= cp_rank < cp_size >= 1")
    if cp_size == 1 and not static:
        return None
    layout = manifest.config.layout()
    if cp_size > 1 and (layout is None or layout.cp_size % cp_size):
        built = "no --cp-size" if layout is None or layout.cp_size == 1 else f"--cp-size {layout.cp_size}"
        raise ConfigError(f"cp_size {cp_size}: the build was made with {built}, so its rows do not split into "
                          f"{cp_size} equal shares; rebuild with --cp-size {cp_size} (or a multiple of it)")
    pad_id = manifest.stats.pad_token_id
    shape = None
    if static:
        shape = (manifest.stats.row_budget, max_segments())
        pad_id = pad_token_id(manifest.tokenizer) if pad_id is None else pad_id
    return RowView(cp_size=cp_size, cp_rank=cp_rank, layout=layout.cp_layout if layout else "zigzag", static=shape,
                   pad_id=pad_id or 0)
