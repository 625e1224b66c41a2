"""Packed DPO's loss and gradient against an independent float64 per-sequence reference on the same logits.

Two pairs of 437-930-token sequences (prompts of 50 tokens untrained), random logits of scale ``--scale``
over ``--vocab`` tokens for the policy and a reference near it. The reference: each sequence's logits
sliced out, ``log_softmax`` in float64, summed, the DPO sigmoid loss in float64, its gradient with respect
to the (float64) logits. Packed: ``segment_logps`` and ``dpo_loss`` on the float32 row, the gradient with
respect to the float32 logits. Prints both relative differences (the gradient's: max |diff| / max |ref|).

    python benchmarks/dpo_precision.py --vocab 32000
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from packer.training.preference import dpo_loss, segment_logps

LENGTHS = (437, 930, 612, 880)  # chosen, rejected, chosen, rejected
ROLES = torch.tensor([1, 0, 1, 0])


def row(vocab: int, scale: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.randint(0, vocab, (1, int(cu[-1])), generator=gen)
    for a in cu[:-1].tolist():
        labels[0, a : a + 50] = -100  # the prompt
    policy = torch.randn(1, int(cu[-1]), vocab, generator=gen) * scale
    reference = policy + 0.05 * torch.randn(policy.shape, generator=gen)
    return policy, reference, labels, cu


def reference_loss(policy, reference, labels, cu, beta=0.1):
    """float64, one sequence at a time: the textbook DPO sigmoid loss, the mean over the pairs."""

    def sums(logits):
        out = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            lp = torch.log_softmax(logits[0, a : b - 1].double(), -1)
            target = labels[0, a + 1 : b]
            keep = target != -100
            out.append(lp[keep].gather(-1, target[keep][:, None]).sum())
        return torch.stack(out)

    p, r = sums(policy), sums(reference)
    margin = (p[ROLES == 1] - r[ROLES == 1]) - (p[ROLES == 0] - r[ROLES == 0])
    return -F.logsigmoid(beta * margin).mean()


def measure(vocab: int, scale: float) -> tuple[float, float]:
    policy, reference, labels, cu = row(vocab, scale)
    want_logits = policy.double().requires_grad_(True)
    want = reference_loss(want_logits, reference, labels, cu)
    want.backward()
    got_logits = policy.clone().requires_grad_(True)
    got = dpo_loss(segment_logps(got_logits, labels, cu)[0], segment_logps(reference, labels, cu)[0], ROLES).loss
    got.backward()
    loss_rel = abs(got.item() - want.item()) / abs(want.item())
    grad_rel = ((got_logits.grad.double() - want_logits.grad).abs().max() / want_logits.grad.abs().max()).item()
    return loss_rel, grad_rel


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--scale", type=float, default=3.0)
    args = parser.parse_args()
    loss_rel, grad_rel = measure(args.vocab, args.scale)
    print(f"vocab {args.vocab}, sequences {LENGTHS}: loss {loss_rel:.2e} relative off, gradient {grad_rel:.2e}")
