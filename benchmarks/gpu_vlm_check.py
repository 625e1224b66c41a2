"""On a GPU: packed rows with images through the flash-attn path against each example alone.

    python benchmarks/gpu_vlm_check.py

Installs nothing; skips what is absent (no CUDA: exits 0 saying so; no flash-attn: only torch's varlen
kernel and the per-segment SDPA path are checked). For a tiny Qwen2.5-VL, Qwen3-VL and LLaVA
(benchmarks/vlm_tiny.py), in bf16 on CUDA:

- alone: each example through an untouched copy on sdpa (text and vision), one per forward;
- packed: ``prepare(model, processor=processor)`` (the probe runs on a float32 copy), then the packed row
  with images, whose text attention is ``packer_varlen``: ``flash_attn_varlen_func`` where flash-attn is
  installed, else torch's ``varlen_attn`` (bf16, CUDA); the vision tower keeps sdpa, per image (a tower
  switched after ``prepare`` is refused at the forward: prepare it as it will run);
- with ``--text flash_attention_2``: transformers' own flash path vetted instead (``implementation=``;
  prepare's float32 probe then needs it on the probe's device: run it where flash-attn takes fp32, or
  read the packer_varlen result).

Prints each family's largest logit difference against alone, relative to the largest logit, and the
backend ``packer_varlen`` took. bf16 paths agree to ~1e-2 relative; a boundary crossed shows as O(1).
Exit status 1 if any difference is above 5e-2.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sweep_architectures import _vlm_rows
from benchmarks.vlm_tiny import build

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava")
LIMIT = 5e-2


def check(model_type: str, text: str) -> float:
    from packer import prepare
    from packer.training import attention

    model, processor = build(model_type)
    model.set_attn_implementation("sdpa")
    reference = copy.deepcopy(model).to("cuda", torch.bfloat16).eval()
    exs, row = _vlm_rows(model, processor, seed=3)
    prepare(model, processor=processor, implementation=text, max_tokens=max(1024, row["input_ids"].shape[1]))
    model.to("cuda", torch.bfloat16).eval()

    def on_gpu(batch: dict) -> dict:
        return {k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.to("cuda"))
                if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # fmt: skip

    with torch.no_grad():
        alone = [reference(**on_gpu(e)).logits[0].float() for e in exs]
        packed = model(**on_gpu(row)).logits[0].float()
    parts = packed.split([e["input_ids"].shape[1] for e in exs])
    worst = max(((p - a).abs().max() / a.abs().max()).item() for p, a in zip(parts, alone, strict=True))
    probe = torch.zeros(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    print(f"{model_type:12s} text={text:18s} backend="
          f"{attention.backend_for(probe) if text == 'packer_varlen' else text:12s} max rel diff {worst:.2e}")
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", default="packer_varlen", help="the text model's implementation to vet")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU paths are checked by the test suite)")
        return 0
    has_flash = importlib.util.find_spec("flash_attn") is not None
    print(f"flash-attn {'installed' if has_flash else 'absent'}; torch {torch.__version__}")
    if not has_flash and "flash" in args.text:
        print("flash_attention_2 asked for but flash-attn is absent: nothing to check")
        return 0
    worst = max(check(t, args.text) for t in FAMILIES)
    return 1 if worst > LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
