"""DPO on packed rows: each segment's completion log-probability from one packed forward, and the loss.

A preference build's row holds whole pairs, chosen then rejected (``pair_roles`` 1, 0, ...; labels on the
completions only, −100 at every segment start). One forward of the row gives every segment's logits;
token ``t``'s log-probability is read from logits ``t − 1`` (labels are unshifted), and summed per segment
by ``cu_seq_lens``, so a segment never sees another's tokens (the varlen attention keeps them apart, which
``prepare(model)`` vouches for, on the policy and on the reference alike).

The DPO sigmoid loss is ``−log σ(β ((π_c − ref_c) − (π_r − ref_r)))`` per pair (Rafailov et al., eq. 7), the
rewards ``β (π − ref)``. TRL 1.16 computes it inline in ``DPOTrainer._compute_loss`` and exposes no loss
function, so it is written here from the paper; ``tests/test_preference.py`` checks it, its rewards and
its gradients against ``DPOTrainer`` on TRL's own padded batches. A step of ``num_items_in_batch`` pairs
(the loader counts pairs for a preference build) sums the pairs' losses and divides by it: the mean over
the optimizer step's pairs, as TRL's ``per_sequence_loss.mean()`` is over its batch. A filler row (the
loader's, labels all −100) adds no loss: :func:`dpo_loss`'s rule, so the context-parallel route, which calls
it directly, shares it with :func:`dpo_step`.

The reference, computed once (docs/preference.md, "A reference computed once"): :func:`precompute_reference`
runs it over every row of a build (one epoch, in order, one rank) and stores each pair's summed chosen and
rejected log-probs in an Arrow file the user names, keyed by the pair's example id (the loader's
``pair_ids``), so any shuffle, world size, context-parallel share or resume finds them; the file records
the build's manifest sha256, which :class:`StoredReference` checks when opened, and each pair's two
sequence lengths, which it checks on every lookup (another build of the same source shares the pair ids),
and a sha256 of its values and metadata, checked when opened (a changed or non-finite value is refused).
Log-probs are float64 throughout (``_TokenLogps``), the DPO outputs in the policy's dtype.
``dpo_step(policy, stored, batch)`` then reads the reference's values instead of running a second model,
on a batch on any device.

Context parallelism: a CP rank holds a share of each row (``shift_labels``, ``seq_idx``);
:func:`share_logps` sums its tokens' log-probs per segment, and the sum over the CP group (an all-reduce) is
the row's :func:`segment_logps`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from .. import fs
from ..contract.schema import IGNORE_INDEX
from ..errors import ConfigError, ShardFormatError
from .loader import PackedDataset, manifest_fingerprint

REFERENCE_FORMAT = "packer-reference-logps"  # the stored reference's schema metadata "format"
# 3: the log-probs in float64 (as dpo_step sums them) and a sha256 of the values and metadata ("sha256"),
#    checked when the file is opened;
# 2: each pair's chosen and rejected lengths beside its log-probs, checked on every lookup; float32 log-probs,
#    no checksum: still read (its values checked finite; a changed value cannot be told), with a warning;
# 1 had no lengths: refused.
REFERENCE_VERSION = "3"
READABLE_REFERENCE_VERSIONS = ("2", "3")
REFERENCE_COLUMNS = ("pair_id", "chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")

log = logging.getLogger("packer")

MODEL_KEYS = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# Elements of a float64 chunk of logits (128 MB): the float64 log-probs never hold a float64 copy of the row.
CHUNK_ELEMENTS = 1 << 24


def _wide(device: torch.device) -> torch.dtype:
    """float64, where the device has it (Apple's MPS has none: float32 there, as before)."""
    return torch.float32 if device.type == "mps" else torch.float64


class _TokenLogps(torch.autograd.Function):
    """Each row's log-softmax at its label, in float64, from logits ``[N, V]`` of any float dtype.

    A DPO loss is a difference of sums of hundreds of log-probs: in float32 (log_softmax, then a sum) a
    930-token sequence's sum is ~1e-3 off and the loss and gradient 1e-5 to 1e-3 relative off. Here the
    logsumexp and the backward's softmax are computed in float64 a chunk of rows at a time, so only the
    logits (which the graph holds anyway) and one float64 value a row are kept for the backward; the
    gradient returns in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        step = max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
        wide = _wide(logits.device)
        lse = torch.empty(logits.shape[0], dtype=wide, device=logits.device)
        for a in range(0, logits.shape[0], step):
            lse[a : a + step] = torch.logsumexp(logits[a : a + step].to(wide), dim=-1)
        ctx.save_for_backward(logits, labels, lse)
        return logits.gather(-1, labels[:, None])[:, 0].to(wide) - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, labels, lse = ctx.saved_tensors
        grad = grad.to(lse.dtype)
        out = torch.empty_like(logits)
        step = max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
        for a in range(0, logits.shape[0], step):  # d/dx (x[label] - lse) = onehot(label) - softmax(x)
            g = grad[a : a + step, None]
            chunk = torch.exp(logits[a : a + step].to(lse.dtype) - lse[a : a + step, None]).mul_(-g)
            out[a : a + step] = chunk.scatter_add_(-1, labels[a : a + step, None], g).to(out.dtype)
        return out, None


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 ``[N]``: log p(labels[i]) under logits ``[N, V]``; 0 where the label is −100 (no gradient there)."""
    mask = labels != IGNORE_INDEX
    return _TokenLogps.apply(logits, labels.clamp(min=0)) * mask


def segment_logps(logits: torch.Tensor, labels: torch.Tensor, cu_seq_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, mean) completion log-probability of each segment of one packed row: float64 ``[segments]``,
    each token's log-prob and their sum in float64 (``_TokenLogps``; ``dpo_step`` returns its outputs in the
    policy's dtype).

    ``logits`` ``[1, T, V]``, ``labels`` ``[1, T]`` (unshifted, −100 where not trained), ``cu_seq_lens``
    ``[segments + 1]``."""
    logits, labels = logits[0, :-1], labels[0, 1:].to(logits.device)
    mask = labels != IGNORE_INDEX
    logp = token_logps(logits, labels)
    cu = cu_seq_lens.to(device=logits.device, dtype=torch.int64)
    # token t+1's log-prob sits at t: segment k's targets are positions cu[k] .. cu[k+1]-2 of the shifted row
    segment = torch.searchsorted(cu[1:], torch.arange(labels.numel(), device=logits.device) + 1, right=True)
    n = cu.numel() - 1
    summed = torch.zeros(n, device=logits.device, dtype=logp.dtype).index_add(0, segment, logp)
    count = torch.zeros(n, device=logits.device, dtype=logp.dtype).index_add(0, segment, mask.to(logp.dtype))
    return summed, summed / count.clamp(min=1)


@dataclass(frozen=True, slots=True)
class DPOOutput:
    loss: torch.Tensor  # sum of the row's pair losses / num_items (pairs of the optimizer step)
    losses: torch.Tensor  # [pairs]
    chosen_rewards: torch.Tensor  # [pairs], detached: beta * (policy - reference) log-prob of chosen
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # [pairs] policy summed log-probs
    rejected_logps: torch.Tensor


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, pair_roles: torch.Tensor, *,
             beta: float = 0.1, num_items: int | None = None,
             loss_tokens: int | torch.Tensor | None = None) -> DPOOutput:
    """The DPO sigmoid loss of a row's pairs from each segment's summed log-prob (policy and reference).

    A filler row (the loader's copy of a row with every label −100, completing the last optimizer step) adds
    nothing: every field is zero (its pairs' loss would otherwise be a constant, log 2 against a reference
    model, another against a stored one). It is known by ``loss_tokens``, the row's trained tokens (labels ≠
    −100; on a context-parallel share, the CP group's sum of ``shift_labels ≠ −100``, all-reduced with the
    log-probs), being 0; not given, by every segment's policy log-prob being exactly 0, a sum over no trained
    token (a real segment's is below 0 unless the policy is saturated, where its gradient all but vanishes)."""
    chosen, rejected = pair_roles == 1, pair_roles == 0
    pc, pr = policy_logps[chosen], policy_logps[rejected]
    rc, rr = reference_logps[chosen].detach(), reference_logps[rejected].detach()
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    items = losses.numel() if num_items is None else num_items
    # 1 for a real row, 0 for a filler: a tensor on the log-probs' device, so no host sync a step
    if loss_tokens is None:
        real = (policy_logps != 0).any()
    else:
        real = torch.as_tensor(loss_tokens, device=policy_logps.device) != 0
    real = real.to(losses.dtype)
    losses = losses * real
    return DPOOutput(losses.sum() / max(items, 1), losses, beta * chosen_ratio.detach() * real,
                     beta * rejected_ratio.detach() * real, pc * real, pr * real)


def packed_logps(model, batch: dict[str, Any]) -> torch.Tensor:
    """Each pair segment's summed completion log-prob of one loader batch, from one forward of ``model``
    (a static-shape row's padding segments, after the pairs', left out)."""
    logits = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits
    return segment_logps(logits, batch["labels"], batch["cu_seq_lens_q"])[0][: len(batch["pair_roles"])]


def share_logps(logits: torch.Tensor, shift_labels: torch.Tensor, seq_idx: torch.Tensor, segments: int
                ) -> torch.Tensor:
    """A context-parallel rank's part of each segment's summed completion log-prob, float64 ``[segments]``.

    ``logits`` ``[1, t, V]`` of the rank's share, ``shift_labels`` and ``seq_idx`` ``[1, t]`` as the loader's CP
    share gives them (labels shifted over the whole row before the split, so no target is lost at a share's
    edge). Summed over the CP group's ranks (``all_reduce``) it is :func:`segment_logps`'s sum; a padding
    segment past ``segments`` (static shapes) is trained nowhere and left out."""
    labels, seg = shift_labels[0].to(logits.device), seq_idx[0].to(device=logits.device, dtype=torch.int64)
    logp = token_logps(logits[0], torch.where(seg < segments, labels, IGNORE_INDEX))
    return torch.zeros(segments, device=logits.device, dtype=logp.dtype).index_add(0, seg.clamp(max=segments - 1), logp)


def _host(value: Any) -> np.ndarray:
    """A batch entry as a numpy array in host memory: a tensor on any device is copied there first (numpy
    refuses a CUDA tensor with a TypeError)."""
    return value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)


def row_lengths(batch: dict[str, Any]) -> np.ndarray:
    """Each pair segment's tokens in the loader's unsharded row (its padding included, as ``seq_lens``
    stores it), int64 ``[segments]``, from a row, a static-shape row (its padding segment after the pairs' is
    left out) or a context-parallel share: a zigzag share's ``cu_seq_lens_q`` are the row's divided by the CP
    size, so its ``cp_cu_seqlens_padded`` (the row's) are read; a contiguous share's are the row's."""
    cu = batch["cp_cu_seqlens_padded"] if "cp_cu_seqlens_padded" in batch else batch["cu_seq_lens_q"]
    return np.diff(_host(cu).astype(np.int64))[: len(batch["pair_roles"])]


def reference_checksum(meta: dict[str, str], columns: list[np.ndarray]) -> str:
    """sha256 of a reference file's metadata (but its own entry) and its columns' values, types and shapes."""
    digest = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    for column in columns:
        digest.update(f"{column.dtype.str}{column.shape}".encode())
        digest.update(np.ascontiguousarray(column).tobytes())
    return digest.hexdigest()


def _refuse_non_finite(path: Any, ids: np.ndarray, values: np.ndarray, what: str) -> None:
    """values ``[pairs, 2]`` (chosen, rejected): a NaN or an infinity would make every step's loss NaN."""
    bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
    if bad.size:
        k = bad[0]
        raise ShardFormatError(
            f"{path}: pair {int(ids[k])}'s {what} reference log-probs are {values[k, 0]} (chosen) and "
            f"{values[k, 1]} (rejected), not finite ({bad.size} pairs so): the reference model's forward "
            "overflowed or the file is damaged; run precompute_reference again (on float32 logits)")


class StoredReference:
    """A reference's summed log-probs stored by :func:`precompute_reference`, for the build in ``directory``
    only: another build's file is refused (ShardFormatError, one line) when it is opened, and on every
    lookup a pair whose two sequences are not as long as in the build it was computed on (another build of
    the same source, e.g. another ``--max-len``, shares its pair ids)."""

    def __init__(self, path: str | os.PathLike, directory: str | os.PathLike) -> None:
        try:  # read into memory (a few MB a million pairs), so no view outlives the file
            with pa.OSFile(str(path)) as source:
                table = pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise ConfigError(f"{path}: not a reference file precompute_reference() wrote ({e})") from None
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        if meta.get("format") != REFERENCE_FORMAT:
            raise ConfigError(f"{path}: not a reference file precompute_reference() wrote (format "
                              f"{meta.get('format')!r})")
        version = meta.get("version")
        if version not in READABLE_REFERENCE_VERSIONS:
            raise ShardFormatError(f"{path}: reference file version {version!r}, this packer reads versions "
                                   f"{', '.join(READABLE_REFERENCE_VERSIONS)}; run precompute_reference again")
        try:
            columns = [table.column(name) for name in REFERENCE_COLUMNS]
        except KeyError as e:
            raise ShardFormatError(f"{path}: a reference file of version {version} without its "
                                   f"column {e}; it is damaged, run precompute_reference again") from None
        nulls = [c for c, name in zip(columns, REFERENCE_COLUMNS, strict=True) if c.null_count]
        if nulls:
            raise ShardFormatError(f"{path}: nulls in a reference file's columns; it is damaged, run "
                                   "precompute_reference again")
        columns = [c.to_numpy() for c in columns]
        if version == REFERENCE_VERSION and meta.get("sha256") != reference_checksum(meta, columns):
            raise ShardFormatError(f"{path}: its values or metadata are not the ones precompute_reference wrote "
                                   f"(sha256 {meta.get('sha256', 'missing')[:12]}… does not match): the file was "
                                   "changed or damaged; run precompute_reference again")
        if version != REFERENCE_VERSION:
            log.warning("%s: a reference file of version %s, without a checksum: a changed value cannot be told "
                        "(its values are checked finite); precompute_reference writes version %s, with one",
                        path, version, REFERENCE_VERSION)
        _refuse_non_finite(path, columns[0], np.stack(columns[1:3], 1), "stored")
        mine = manifest_fingerprint(directory)
        if meta.get("manifest_sha256") != mine:
            raise ShardFormatError(
                f"{path}: reference log-probs of another build (manifest sha256 {meta.get('manifest_sha256', '')[:12]}…, "
                f"{directory} has {mine[:12]}…); run precompute_reference on this build")
        self.path, self.meta = Path(path), meta
        self.ids, self.values = columns[0], np.stack(columns[1:3], 1)
        self.lengths = np.stack(columns[3:], 1).astype(np.int64)  # [pairs, 2]: chosen, rejected tokens

    def __len__(self) -> int:
        return self.ids.size

    def segment_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """The stored reference's summed log-prob of each segment of ``batch`` (in the row's order, by its
        ``pair_roles``), float64 ``[segments]`` on ``pair_roles``'s device, looked up by the row's
        ``pair_ids``. The batch may be on any device (read in host memory, a few ints a row); each pair's
        sequence lengths (:func:`row_lengths`) must be the stored ones, else ShardFormatError."""
        ids, roles = _host(batch["pair_ids"]).astype(np.int64), _host(batch["pair_roles"])
        at = np.minimum(np.searchsorted(self.ids, ids), max(self.ids.size - 1, 0))
        missing = ids[self.ids[at] != ids] if self.ids.size else ids
        if missing.size:
            raise ConfigError(f"{self.path}: holds no reference log-probs for pair {int(missing[0])}; it was computed "
                              "for another build or is damaged: run precompute_reference again")
        chosen, rejected = roles == 1, roles == 0
        lengths = row_lengths(batch)
        got = np.stack([lengths[chosen], lengths[rejected]], 1)
        wrong = np.flatnonzero((got != self.lengths[at]).any(axis=1))
        if wrong.size:
            k = wrong[0]
            raise ShardFormatError(
                f"{self.path}: pair {int(ids[k])} is {got[k, 0]} + {got[k, 1]} tokens (chosen + rejected) in this "
                f"batch, {self.lengths[at[k], 0]} + {self.lengths[at[k], 1]} in the build the reference was computed "
                f"on ({self.meta.get('build', '?')}): the reference file is of another build; run "
                "precompute_reference on the build these batches come from")
        out = np.empty(roles.size, np.float64)
        out[chosen], out[rejected] = self.values[at, 0], self.values[at, 1]
        device = batch["pair_roles"].device if torch.is_tensor(batch["pair_roles"]) else torch.device("cpu")
        return torch.from_numpy(out).to(device=device, dtype=_wide(device))


def precompute_reference(reference, directory: str | os.PathLike, out_path: str | os.PathLike, *,
                         model_name: str | None = None,
                         progress: Callable[[Iterable, int], Iterable] | None = None) -> StoredReference:
    """Run ``reference`` once over every row of the build in ``directory`` (one epoch, in order, one rank;
    no grad) and store each pair's summed chosen and rejected completion log-probs at ``out_path``, an Arrow
    IPC file outside the build folder (packer owns every file in it), keyed by the pair's example id and
    recording the build's manifest sha256. ``progress(rows, total)`` may wrap the rows (tqdm). Returns the
    stored reference, opened."""
    out = Path(out_path).resolve()
    local = fs.local_path(directory)
    if local is not None and out.is_relative_to(Path(local).resolve()):
        raise ConfigError(f"{out_path}: inside the build folder {directory}, whose files are the manifest's; "
                          "write the reference log-probs beside it instead")
    dataset = PackedDataset(directory, shuffle=False, rank=0, world_size=1, grad_accum=1)
    if not dataset.manifest.stats.paired:  # the manifest says (a build with no rows is refused by the loader)
        raise ConfigError(f"{directory}: not a preference build (no pair_roles): a DPO reference needs pairs")
    device = next(reference.parameters()).device
    ids, chosen, rejected, lengths = [], [], [], []
    rows = iter(dataset) if progress is None else progress(dataset, len(dataset))
    with torch.no_grad():
        for batch in rows:
            logps = packed_logps(reference, {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
            roles = batch["pair_roles"].to(logps.device)
            ids.append(batch["pair_ids"].numpy())
            chosen.append(logps[roles == 1].cpu().numpy())
            rejected.append(logps[roles == 0].cpu().numpy())
            tokens, host_roles = row_lengths(batch), batch["pair_roles"].numpy()
            lengths.append(np.stack([tokens[host_roles == 1], tokens[host_roles == 0]], 1))
    if not ids:  # the loader refuses a build of no rows; this says so should one get here
        raise ShardFormatError(f"{directory}: no rows, no pairs: nothing to compute a reference on")
    ids, lengths = np.concatenate(ids), np.concatenate(lengths).astype(np.int32)
    order = np.argsort(ids, kind="stable")
    if np.any(np.diff(ids[order]) == 0):
        raise ShardFormatError(f"{directory}: a pair id appears twice in one epoch; the build is damaged, verify it")
    values = np.stack([np.concatenate(chosen), np.concatenate(rejected)], 1).astype(np.float64)[order]
    _refuse_non_finite(out_path, ids[order], values, "computed")  # before the file exists
    meta = {"format": REFERENCE_FORMAT, "version": REFERENCE_VERSION, "manifest_sha256": dataset.fingerprint,
            "build": str(directory), "model": model_name or getattr(getattr(reference, "config", None),
                                                                     "_name_or_path", "") or ""}
    columns = [ids[order].astype(np.int64), values[:, 0].copy(), values[:, 1].copy(), lengths[order, 0].copy(),
               lengths[order, 1].copy()]
    meta["sha256"] = reference_checksum(meta, columns)
    table = pa.table(dict(zip(REFERENCE_COLUMNS, columns, strict=True))).replace_schema_metadata(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(partial, out)  # a reader never sees half a file
    return StoredReference(out, directory)


def dpo_step(model, reference, batch: dict[str, Any], *, beta: float = 0.1) -> DPOOutput:
    """One packed DPO forward: the policy's log-probs with grad, and the reference's on the same row: a
    model run without grad, or a :class:`StoredReference`'s values (no forward)."""
    if isinstance(reference, StoredReference):
        ref = reference.segment_logps(batch)
    else:
        with torch.no_grad():
            ref = packed_logps(reference, batch)
    policy = packed_logps(model, batch)
    # the filler rule is dpo_loss's (the CP route calls it directly): a row with no trained token adds nothing
    out = dpo_loss(policy, ref.to(policy.device), batch["pair_roles"].to(policy.device), beta=beta,
                   num_items=batch.get("num_items_in_batch"),
                   loss_tokens=(batch["labels"] != IGNORE_INDEX).sum())
    # computed in float64, returned in the policy's dtype, at least float32: a bf16 sum of -13,000 is ±32
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    return DPOOutput(*(getattr(out, f).to(dtype) for f in DPOOutput.__slots__))
