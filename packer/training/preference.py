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
the optimizer step's pairs, as TRL's ``per_sequence_loss.mean()`` is over its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..contract.schema import IGNORE_INDEX

MODEL_KEYS = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def segment_logps(logits: torch.Tensor, labels: torch.Tensor, cu_seq_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, mean) completion log-probability of each segment of one packed row: float32 ``[segments]``.

    ``logits`` ``[1, T, V]``, ``labels`` ``[1, T]`` (unshifted, −100 where not trained), ``cu_seq_lens``
    ``[segments + 1]``."""
    logits, labels = logits[0, :-1].float(), labels[0, 1:]
    mask = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0] * mask
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
             beta: float = 0.1, num_items: int | None = None) -> DPOOutput:
    """The DPO sigmoid loss of a row's pairs from each segment's summed log-prob (policy and reference)."""
    chosen, rejected = pair_roles == 1, pair_roles == 0
    pc, pr = policy_logps[chosen], policy_logps[rejected]
    rc, rr = reference_logps[chosen].detach(), reference_logps[rejected].detach()
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    items = losses.numel() if num_items is None else num_items
    return DPOOutput(losses.sum() / max(items, 1), losses, beta * chosen_ratio.detach(),
                     beta * rejected_ratio.detach(), pc, pr)


def packed_logps(model, batch: dict[str, Any]) -> torch.Tensor:
    """Each segment's summed completion log-prob of one loader batch, from one forward of ``model``."""
    logits = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits
    return segment_logps(logits, batch["labels"], batch["cu_seq_lens_q"])[0]


def dpo_step(model, reference, batch: dict[str, Any], *, beta: float = 0.1) -> DPOOutput:
    """One packed DPO forward: the policy's log-probs with grad, the reference's (same row) without."""
    with torch.no_grad():
        ref = packed_logps(reference, batch)
    return dpo_loss(packed_logps(model, batch), ref, batch["pair_roles"], beta=beta,
                    num_items=batch.get("num_items_in_batch"))
