"""On a GPU: hybrid models' packed rows through the kernels vs the per-segment path vs each example alone.

    python benchmarks/gpu_mixers_check.py

Installs nothing; skips what is absent (no CUDA: exits 0 saying so). For each tiny hybrid of the sweep
(GatedDeltaNet, short convolution, Mamba2, Mamba1, lightning attention, KDA), bf16 and fp32 on CUDA:

- alone: each example through the unprepared model, one per forward (whatever kernels are installed);
- per-segment: ``prepare(model)``'s path, the packed row (each mixer once per example);
- kernel: the unprepared model given the packed row with the loader's ``cu_seq_lens_q`` and ``seq_idx``,
  only where every kernel its mixers would need is importable (flash-linear-attention for
  GatedDeltaNet/KDA, causal-conv1d for the convolutions, mamba-ssm for the Mamba2 scan); Mamba1's
  selective scan takes no boundaries, so there is no kernel path for it.

Prints the largest logit difference of each against alone, relative to the largest logit. The kernel
path is not what ``prepare`` uses; this script is the evidence a future change would need to take it.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import sys

import torch

from benchmarks.sweep_architectures import tiny_model

# model type -> the packages whose kernels its mixers call with boundaries (empty: no kernel path)
KERNELS = {
    "qwen3_5_text": ("fla", "causal_conv1d"),
    "qwen3_next": ("fla", "causal_conv1d"),
    "lfm2": ("causal_conv1d",),
    "granitemoehybrid": ("mamba_ssm", "causal_conv1d"),
    "bailing_hybrid": ("fla", "causal_conv1d"),
    "minimax": (),
    "mamba": (),
    "jamba": (),
}
OVERRIDES = {"minimax": dict(block_size=16), "granitemoehybrid": dict(mamba_chunk_size=16)}


def _row(exs, device):
    lens = [len(e) for e in exs]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), device=device, dtype=torch.int32),
                                      torch.tensor(lens, device=device))[None]  # fmt: skip
    return dict(input_ids=torch.cat(exs)[None], position_ids=torch.cat([torch.arange(n, device=device) for n in lens])[None],
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens), seq_idx=seq_idx,
                use_cache=False)  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the per-segment path is checked on CPU by the test suite)")
        return 0
    from packer import prepare

    present = {p: importlib.util.find_spec(p) is not None for p in ("fla", "causal_conv1d", "mamba_ssm")}
    print("kernels:", ", ".join(f"{p} {'present' if ok else 'absent'}" for p, ok in present.items()))
    worst = 0.0
    for model_type, needs in KERNELS.items():
        for dtype in (torch.float32, torch.bfloat16):
            base = tiny_model(model_type, OVERRIDES.get(model_type)).to("cuda", dtype)
            gen = torch.Generator().manual_seed(0)
            exs = [torch.randint(3, 256, (n,), generator=gen).cuda() for n in (5, 70, 9)]
            with torch.no_grad():
                alone = torch.cat([base(input_ids=e[None], use_cache=False).logits[0] for e in exs]).float()
                scale = alone.abs().max().item()
                prepared = prepare(copy.deepcopy(base), max_tokens=128)
                seg = (prepared(**_row(exs, "cuda")).logits[0].float() - alone).abs().max().item() / scale
                worst = max(worst, seg if dtype == torch.float32 else 0.0)
                line = f"{model_type:18s} {str(dtype):15s} per-segment {seg:.2e}"
                if needs and all(present[p] for p in needs):
                    try:
                        kern = (base(**_row(exs, "cuda")).logits[0].float() - alone).abs().max().item() / scale
                        line += f"   kernel path {kern:.2e}"
                    except Exception as e:  # a kernel that refuses the call: say which
                        line += f"   kernel path failed: {type(e).__name__}: {str(e)[:80]}"
                else:
                    line += "   kernel path: " + ("none (no boundaries in its kernels)" if not needs else
                                                  "skipped, absent: " + ", ".join(p for p in needs if not present[p]))
            print(line, flush=True)
    print(f"per-segment path, fp32: worst relative difference {worst:.2e} (exact: below 1e-5)")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
