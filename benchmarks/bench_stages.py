"""Where a build's time goes besides the tokenizer (a script, not a test): each stage of the build path, run by
the build's own functions in one process, one thread, CPU seconds.

    python benchmarks/bench_stages.py [--repeat 8] [--llama2 DIR]

Data: the bundled FLAN-style sample repeated ``--repeat`` times as one JSONL file (8 → 48,000 records), the
Llama 2 tokenizer, ``--pack bfd``, format 2. The Rust tokenizer runs on one thread (``TOKENIZERS_PARALLELISM=
false``, as in a build's worker processes), so every figure is CPU seconds of one core, comparable with the
tokenizer's own: ``encode_batch`` is the floor, every other line is what packer adds to it. CPU seconds are
what a shared machine disturbs least (wall time is printed beside them).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one thread, a worker's

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LLAMA2 = ROOT.parent / "shared" / "data" / "llama2-tokenizer"
SAMPLE = ROOT / "packer" / "data" / "flan_sample.jsonl.gz"


class Timer:
    def __init__(self):
        self.rows: list[tuple[str, float, float]] = []

    def __call__(self, name: str, fn, *args, **kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.rows.append((name, time.process_time() - cpu, time.perf_counter() - wall))
        return out


class Ready:
    """An engine (``packer.building.engines.Engine``'s ``encode_chunks``) whose chunks were encoded before: the
    spill's own cost, apart from encoding."""

    def __init__(self, chunks):
        self.chunks = chunks

    def encode_chunks(self, stream, encoder, start):
        return iter(self.chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--llama2", type=Path, default=LLAMA2)
    args = ap.parse_args()
    t = Timer()
    cpu0 = time.process_time()
    from packer import BuildConfig
    from packer.building import pipeline, spill, token_store
    from packer.building.tokenization import load_tokenizer, tokenizer_info
    from packer.building.writer import write_shards
    from packer.contract import schema
    imports = time.process_time() - cpu0

    tmp = Path(tempfile.mkdtemp(prefix="bench_stages-"))
    os.environ["PACKER_CACHE"] = str(tmp / "cache")
    try:
        source = tmp / f"flan_x{args.repeat}.jsonl"
        source.write_bytes(gzip.decompress(SAMPLE.read_bytes()) * args.repeat)
        config = BuildConfig(source=str(source), recipe="flan", tokenizer=str(args.llama2), pack="bfd", out=str(tmp / "o"))
        tokenizer = t("load the tokenizer (transformers' class)", load_tokenizer, str(args.llama2))
        info = t("the tokenizer's fingerprint", tokenizer_info, tokenizer, str(args.llama2))
        opened = t("open the source, sha256 of its file", pipeline.open_source, config, tokenizer, skip_errors=False)
        chunks = t("read and parse the JSON into columns", lambda: [c for _, c in opened.stream.chunks(0, spill.CHUNK)])
        encoder = opened.encoder.encoders[0]

        def texts():
            out = []
            for chunk in chunks:
                for _, _, records, _ in chunk.pieces:
                    names = list(records)
                    out += [encoder.example(dict(zip(names, row))) for row in zip(*(records[n] for n in names))]
            return out

        examples = t("format (record → text + trained spans)", texts)
        plain = [text for text, _, _ in examples]
        t("encode_batch (the tokenizer: the floor)", lambda: [encoder.backend.encode_batch(
            plain[i:i + spill.CHUNK], add_special_tokens=encoder.add_special_tokens) for i in range(0, len(plain),
                                                                                                spill.CHUNK)])
        encoded = t("Encoder.encode: format + encode_batch + ids, flags", lambda: [opened.encoder.encode(c) for c in chunks])
        identity = {"config": config.identity(), "tokenizer": info, "source": opened.source}
        folder = tmp / "spill"
        tokens = t("spill: append, fsync every 8 chunks", spill.tokenize, opened.stream, opened.encoder, folder,
                   identity, engine=Ready(encoded))
        plan = t("plan (bfd, global)", pipeline.plan_rows, config, tokens.lengths, tokens.trained_flags())
        staging = tmp / "staging"
        staging.mkdir()
        fmt = schema.RowFormat.of(2, id_bound=len(tokenizer), longest_segment=config.longest_segment(), padded=False,
                                  pairs=False)
        t("write the shards (Arrow, hashed as written), 1 thread", write_shards, plan, tokens.store(), staging,
          shard_bytes=256 << 20, threads=1, row_format=fmt)
        stored = token_store.identities(config, info, pipeline.source_parts(config), opened.source, opened.encoder)
        t("token store: keep the spill (link, sha256)", token_store.save, stored, opened.stream, opened.encoder, tokens,
          [{}])
        t("token store: restore (link, check sha256)", token_store.restore, stored, opened.stream, tmp / "restored",
          identity)
        total_tokens = tokens.tokens
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    floor = next(cpu for name, cpu, _ in t.rows if name.startswith("encode_batch"))
    print(f"{args.repeat * 6000:,} records, {total_tokens:,} tokens, Llama 2, one thread; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'stage':<56} {'CPU s':>7} {'wall s':>7} {'/ encode_batch':>15}")
    print(f"{'imports (packer, numpy, pyarrow)':<56} {imports:>7.2f} {'':>7} {imports / floor:>15.1%}")
    for name, cpu, wall in t.rows:
        print(f"{name:<56} {cpu:>7.2f} {wall:>7.2f} {cpu / floor:>15.1%}")
    print("\nAs Markdown (docs/benchmarks.md):\n\n| stage | CPU s | / `encode_batch` |\n|---|---|---|")
    print(f"| imports (packer, numpy, pyarrow) | {imports:.2f} | {imports / floor:.1%} |")
    for name, cpu, _ in t.rows:
        bold = "**" if name.startswith("encode_batch") else ""
        print(f"| {bold}{name}{bold} | {bold}{cpu:.2f}{bold} | {cpu / floor:.1%} |")


if __name__ == "__main__":
    main()
