"""What padding for context parallelism costs, per layout and CP size (a script, not a test):
python benchmarks/cp_padding.py [--max-tokens 16384] [--max-len 4096]

Builds, in a temporary folder, the bundled sample (bundled tokenizer) and GSM8K (``../shared/data``,
the Llama 2 tokenizer) once without padding and once per layout (zigzag, contiguous) and CP size
N = 2, 4, 8 (bfd rows of ``--max-tokens``), and prints a Markdown table of what each build's manifest
records (``packer inspect`` shows the same): padding tokens, their share of the rows' tokens, and the
rows against the unpadded build's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from packer.building.pipeline import build
from packer.contract.config import BuildConfig

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DATASETS = {
    "bundled sample": dict(source="flan"),
    "GSM8K (Llama 2)": dict(source=str(SHARED / "gsm8k_train.jsonl"), recipe="gsm8k",
                            tokenizer=str(SHARED / "llama2-tokenizer")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--data", choices=list(DATASETS), action="append", help="only these (default: both)")
    args = parser.parse_args()
    print(f"bfd rows of <= {args.max_tokens:,} tokens, examples cut at {args.max_len:,}\n")
    print("| data | layout | N | padding tokens | of the rows | rows (unpadded) |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, source) in enumerate(DATASETS.items()):
            if args.data and name not in args.data:
                continue
            folder = Path(tmp) / str(k)
            common = dict(**source, pack="bfd", max_len=args.max_len, max_tokens=args.max_tokens)
            base = build(BuildConfig(out=str(folder / "base"), **common)).manifest.stats
            for layout in ("zigzag", "contiguous"):
                for n in (2, 4, 8):
                    out = folder / f"{layout}-{n}"
                    s = build(BuildConfig(out=str(out), cp_size=n, cp_layout=layout, **common)).manifest.stats
                    print(f"| {name} | {layout} | {n} | {s.pad_tokens:,} | {s.pad_tokens / (s.tokens + s.pad_tokens):.3%} "
                          f"| {s.rows:,} ({base.rows:,}) |", flush=True)


if __name__ == "__main__":
    main()
