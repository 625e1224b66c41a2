"""The context-parallel layouts on the real kernel (a script for a CUDA machine with flash-attn):
python benchmarks/gpu_cp_check.py [--rows 4] [--tol 1e-2]

Builds the bundled sample padded for a CP group of 8 (zigzag and contiguous, bfd rows of 4,096 tokens, in
a temporary folder), and for each layout and CP size N in 1, 2, 4, 8 takes each rank's share from the
loader (``PackedDataset(cp_rank=r, cp_size=N)``). Random q/k/v (fp16, 8 heads of 64) are drawn for the
whole row; the keys/values of all ranks are gathered (emulated: the row's, in row order, as ring attention
delivers them over its steps), and each rank's queries go through ``flash_attn_varlen_func`` with the
boundaries that rank's layout gives:

- zigzag: per segment, the rank's chunk ``r`` attends the segment's first ``r+1`` chunks and its chunk
  ``2N-1-r`` the first ``2N-r`` (causal, bottom-right aligned: what the ring steps of
  ``zigzag_ring_flash_attn_varlen_func`` add up to), chunk sizes from the rank's ``cu_seq_lens_q``;
- contiguous: the rank's slice of the row against every key of its segments up to the slice's end (what
  ``llama3_flash_attn_prepare_cu_seqlens`` computes from the row's global ``cu_seq_lens_q``).

The rank outputs, put back in row order, are compared with one ``flash_attn_varlen_func`` over the whole
row. Also checks that a static-shape row (``static_shapes=True``: ``cu_seqlens`` padded with empty
segments) gives the same outputs on its real tokens. Prints the largest difference per case; exits 1 when
one exceeds ``--tol``, 2 when CUDA or flash-attn is missing. ``--cpu-reference`` dry-runs the script on
CPU in fp32 with the reference of flash-attn's documented semantics from ``tests/test_varlen_kernels.py``
(the index logic, not the kernel).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from packer.planning import context_parallel as cp
from packer.training.loader import PackedDataset

DEVICE, DTYPE = "cuda", torch.float16
GROUP = 8
SIZES = (1, 2, 4, 8)
HEADS, DIM = 8, 64


def build(out: Path, layout: str) -> None:
    subprocess.run([sys.executable, "-m", "packer.cli", "build", "flan", "--out", str(out), "--limit", "400",
                    "--pack", "bfd", "--max-len", "2048", "--max-tokens", "4096", "--overlong", "split",
                    "--cp-size", str(GROUP), "--cp-layout", layout, "-q"], check=True, capture_output=True)


def cu(lengths) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.as_tensor(np.asarray(lengths), dtype=torch.int32).cumsum(0)
    return out.to(DEVICE)


def gather(x: torch.Tensor, starts, sizes) -> torch.Tensor:
    """Rows of ``x`` from each (start, size) range, concatenated."""
    idx = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes, strict=True)]) if len(sizes) else []
    return x[torch.as_tensor(np.asarray(idx, np.int64)).to(DEVICE)]


def attend(flash, q, k, v, q_lens, k_lens) -> torch.Tensor:
    return flash(q, k, v, cu(q_lens), cu(k_lens), int(max(q_lens)), int(max(k_lens)), causal=True)


def zigzag_rank(flash, share, row_cu, q, k, v, n, r) -> tuple[torch.Tensor, np.ndarray]:
    """The rank's output (its tokens in its own order) and those tokens' indices in the row."""
    local = share["cu_seq_lens_q"].numpy().astype(np.int64)
    chunk = np.diff(local) // 2  # each segment's chunk: the rank holds two of them
    starts = row_cu[:-1]
    outs = []
    for c in (r, 2 * n - 1 - r):
        q_c = gather(q, starts + c * chunk, chunk)
        kv_len = (c + 1) * chunk  # the segment's keys up to the chunk's end
        outs.append((attend(flash, q_c, gather(k, starts, kv_len), gather(v, starts, kv_len), chunk, kv_len), chunk))
    # interleave back to the rank's order: per segment, its first chunk then its second
    first, second = outs[0][0].split(chunk.tolist()), outs[1][0].split(chunk.tolist())
    out = torch.cat([t for pair in zip(first, second, strict=True) for t in pair])
    return out, cp.zigzag_indices(row_cu, n, r)


def contiguous_rank(flash, share, row_cu, q, k, v, n, r) -> tuple[torch.Tensor, np.ndarray]:
    glob = share["cu_seq_lens_q"].numpy().astype(np.int64)  # the row's cu_seqlens (llama3 takes them whole)
    total = int(glob[-1])
    a, b = r * total // n, (r + 1) * total // n
    seg_lo, seg_hi = glob[:-1], glob[1:]
    hit = (seg_hi > a) & (seg_lo < b)
    q_lo, q_hi = np.maximum(seg_lo[hit], a), np.minimum(seg_hi[hit], b)
    k_lo = seg_lo[hit]
    out = attend(flash, gather(q, q_lo, q_hi - q_lo), gather(k, k_lo, q_hi - k_lo), gather(v, k_lo, q_hi - k_lo),
                 q_hi - q_lo, q_hi - k_lo)
    return out, np.arange(a, b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="rows checked per layout and size (default 4)")
    parser.add_argument("--tol", type=float, default=1e-2, help="largest difference allowed, fp16 (default 1e-2)")
    parser.add_argument("--cpu-reference", action="store_true", help="dry run on CPU with the kernel's reference")
    args = parser.parse_args()
    global DEVICE, DTYPE
    if args.cpu_reference:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_varlen_kernels import reference_flash_attn_varlen_func as reference

        def flash(q, k, v, cu_q, cu_k, max_q, max_k, causal):  # the reference wants the exact maxima
            return reference(q, k, v, cu_q, cu_k, int((cu_q[1:] - cu_q[:-1]).max()),
                             int((cu_k[1:] - cu_k[:-1]).max()), causal=causal)

        DEVICE, DTYPE = "cpu", torch.float32
        print(f"CPU dry run with the reference of flash-attn's semantics · torch {torch.__version__}")
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 2
    else:
        try:
            import flash_attn
            from flash_attn import flash_attn_varlen_func as flash
        except ImportError:
            print("flash-attn is not installed (pip install flash-attn): nothing checked")
            return 2
        print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · flash-attn {flash_attn.__version__}")
    worst, failed = 0.0, False
    with tempfile.TemporaryDirectory() as tmp:
        for layout in cp.LAYOUTS:
            out_dir = Path(tmp) / layout
            build(out_dir, layout)
            whole = list(PackedDataset(out_dir, shuffle=False))[: args.rows]
            shares = {n: [list(PackedDataset(out_dir, shuffle=False, cp_rank=r, cp_size=n))[: args.rows]
                          for r in range(n)] for n in SIZES if n > 1}
            static = list(PackedDataset(out_dir, shuffle=False, static_shapes=True))[: args.rows]
            for k_row, row in enumerate(whole):
                row_cu = row["cu_seq_lens_q"].numpy().astype(np.int64)
                t = int(row_cu[-1])
                gen = torch.Generator(device=DEVICE).manual_seed(k_row)
                q, k, v = (torch.randn(t, HEADS, DIM, generator=gen, device=DEVICE, dtype=DTYPE) for _ in range(3))
                unsplit = attend(flash, q, k, v, np.diff(row_cu), np.diff(row_cu))
                # the static-shape row: its padding segment and empty ones change nothing on the real tokens
                fixed_cu = static[k_row]["cu_seq_lens_q"].numpy().astype(np.int64)
                extra = int(fixed_cu[-1]) - t
                pad = torch.zeros(extra, HEADS, DIM, device=DEVICE, dtype=DTYPE)
                fixed = flash(torch.cat([q, pad]), torch.cat([k, pad]), torch.cat([v, pad]), cu(np.diff(fixed_cu)),
                              cu(np.diff(fixed_cu)), static[k_row]["max_length_q"], static[k_row]["max_length_k"],
                              causal=True)[:t]
                results = [("static", (fixed - unsplit).abs().max().item())]
                for n in SIZES:
                    if n == 1:
                        continue
                    rank_fn = zigzag_rank if layout == "zigzag" else contiguous_rank
                    out = torch.empty_like(unsplit)
                    for r in range(n):
                        o, idx = rank_fn(flash, shares[n][r][k_row], row_cu, q, k, v, n, r)
                        out[torch.as_tensor(idx).to(DEVICE)] = o
                    results.append((f"N={n}", (out - unsplit).abs().max().item()))
                text = "  ".join(f"{name} {d:.2e}" for name, d in results)
                print(f"{layout:<11} row {k_row} ({t:,} tokens, {row_cu.size - 1} segments): max |split - unsplit| {text}")
                worst = max([worst] + [d for _, d in results])
                failed |= any(d > args.tol for _, d in results)
    print(f"largest difference {worst:.2e} (tolerance {args.tol:g}): {'MISMATCH' if failed else 'OK'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
