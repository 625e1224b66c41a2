"""Tokenize-stage scaling (a script, not a test): python benchmarks/bench_scaling.py [--repeat 4]

Times reading, formatting + tokenizing (no spill) of the bundled sample repeated ``--repeat`` times, with
the bundled tokenizer and with the Llama 2 one if present:
- 1 process, Rust threads off (TOKENIZERS_PARALLELISM=false): the single-core baseline;
- 2 processes (``--num-proc 2``: fork pool, one Rust thread each);
- 1 process, Rust threads on (rayon spreads each encode_batch over every core): packer's num_proc=1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA2 = ROOT.parent / "shared" / "data" / "llama2-tokenizer"

CHILD = r"""
import gzip, os, sys, tempfile, time
from packer import BuildConfig
from packer.building import sources
from packer.building.pipeline import open_source, tokenizer_path
from packer.building.tokenization import load_tokenizer
from packer.building.engines import LocalEngine
tok_name, num_proc, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with gzip.open(sources.resolve("flan").files[0], "rb") as f:
    sample = f.read()
data = os.path.join(tempfile.mkdtemp(), "flan.jsonl")
with open(data, "wb") as f:  # the sample repeated, read as a stream like any local file
    f.write(sample * repeat)
tok = load_tokenizer(tokenizer_path(None if tok_name == "bundled" else tok_name))
opened = open_source(BuildConfig(source=data, recipe="flan", out="-"), tok, skip_errors=False)
n = [0]
t = time.perf_counter()
for chunk in LocalEngine(num_proc).encode_chunks(opened.stream, opened.encoder, 0):
    n[0] += len(chunk.lengths)
print(time.perf_counter() - t, n[0])
"""


def run(tok: str, num_proc: int, repeat: int, threads: bool) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "true" if threads else "false"}
    out = subprocess.run([sys.executable, "-c", CHILD, tok, str(num_proc), str(repeat)], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    print(f"cores {os.cpu_count()}, {6000 * args.repeat:,} records, tokenize stage only")
    toks = ["bundled"] + ([str(LLAMA2)] if (LLAMA2 / "tokenizer.json").is_file() else [])
    for tok in toks:
        one = run(tok, 1, args.repeat, threads=False)
        two = run(tok, 2, args.repeat, threads=False)
        rayon = run(tok, 1, args.repeat, threads=True)
        name = "bundled" if tok == "bundled" else "llama2"
        print(f"{name:>8}: 1 proc {one:6.2f} s | 2 procs {two:6.2f} s ({one / two:.2f}x) | "
              f"1 proc + Rust threads {rayon:6.2f} s ({one / rayon:.2f}x)")


if __name__ == "__main__":
    main()
