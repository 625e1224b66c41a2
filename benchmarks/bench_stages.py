"""Where a build's time goes besides the tokenizer (a script, not a test): each stage of the build path, run by
the build's own functions in one process, one thread, CPU seconds.

    python benchmarks/bench_stages.py [--repeat 8] [--llama2 DIR]
    python benchmarks/bench_stages.py --chat [--repeat 2]

Data: the bundled FLAN-style sample repeated ``--repeat`` times as one JSONL file (8 → 48,000 records), the
Llama 2 tokenizer, ``--pack bfd``, format 2. The Rust tokenizer runs on one thread (``TOKENIZERS_PARALLELISM=
false``, as in a build's worker processes), so every figure is CPU seconds of one core, comparable with the
tokenizer's own: ``encode_batch`` is the floor, every other line is what packer adds to it. CPU seconds are
what a shared machine disturbs least (wall time is printed beside them).

``--chat``: a chat build's formatting instead, where the chat template, not the tokenizer, is most of the
work: GSM8K (../shared/data) as one user and one assistant message a record, ``--repeat`` times, the Qwen3
tokenizer with its own template (no ``{% generation %}`` tags: three renders a record, two where records share a
shape, ``packer.building.chat``)
and with TRL's tagged twin of it (``trl/chat_templates/qwen3_training.jinja``: one render a record).
"""

from __future__ import annotations

import argparse
import gc
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
QWEN3 = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k_train.jsonl"
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
    ap.add_argument("--chat", action="store_true", help="a chat build's stages (GSM8K as chat, Qwen3's template)")
    args = ap.parse_args()
    if args.chat:
        chat(args.repeat if args.repeat != 8 else 2)
        return
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


def chat(repeat: int) -> None:
    """A chat build's stages, one thread, for an untagged template and a tagged one."""
    import json

    import trl

    tmp = Path(tempfile.mkdtemp(prefix="bench_stages-chat-"))
    try:
        source = tmp / "gsm8k_chat.jsonl"
        lines = [json.loads(line) for line in GSM8K.read_text().splitlines()] * repeat
        source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                                           {"role": "assistant", "content": r["answer"]}]}) + "\n"
                                  for r in lines))
        tagged = Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"
        print(f"{len(lines):,} chat records (GSM8K x{repeat}), Qwen3 tokenizer, one thread; CPU s; load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"{'template':<32} {'render once':>12} {'formatting':>11} {'encode_batch':>13} {'Encoder.encode':>15}")
        for name, template in (("Qwen3's own (untagged)", None), ("TRL's qwen3_training (tagged)", str(tagged))):
            cpu = chat_stages(source, template, tmp / "o")
            print(f"{name:<32} {cpu[0]:>12.2f} {cpu[1]:>11.2f} {cpu[2]:>13.2f} {cpu[3]:>15.2f}  "
                  f"(the whole call: {cpu[3] / cpu[2]:.2f}x the tokenizer's)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def chat_stages(source: Path, template: str | None, out: Path) -> list[float]:
    """CPU seconds of: rendering each record once (transformers' renderer, what ``apply_chat_template`` costs);
    packer's formatting (that render and, for an untagged template, the renders that locate the assistant's
    output: ``packer.building.chat``); the tokenizer; the encoder's whole call (formatting, ``encode_batch``, the ids
    and loss flags)."""
    from packer import BuildConfig
    from packer.building import pipeline, spill
    from packer.building.chat import ChatTemplate
    from packer.building.tokenization import load_tokenizer

    config = BuildConfig(source=str(source), tokenizer=str(QWEN3), chat_template=template, out=str(out))
    tokenizer = load_tokenizer(str(QWEN3), template)
    opened = pipeline.open_source(config, tokenizer, skip_errors=False)
    chunks = [c for _, c in opened.stream.chunks(0, spill.CHUNK)]
    encoder = opened.encoder.encoders[0]
    records = [dict(zip(r, row)) for c in chunks for _, _, r, _ in c.pieces for row in zip(*r.values())]
    chat = encoder.formatter.template
    render = (chat if isinstance(chat, ChatTemplate) else chat.pick(None)).render
    # what this script holds (every record, text and encoding) kept out of the garbage collector's passes: a worker
    # holds one task's, and a pass over all of it (Jinja's renders make many objects) doubled the last line here
    gc.collect()
    gc.freeze()
    t = Timer()
    t("render", lambda: [render(r["messages"]) for r in records])
    texts = [text for text, _, _ in t("format", lambda: [encoder.example(r) for r in records])]
    # each result let go as the next is made, as in a worker
    t("encode_batch", lambda: [len(encoder.backend.encode_batch(texts[i:i + spill.CHUNK], add_special_tokens=False))
                               for i in range(0, len(texts), spill.CHUNK)])
    t("encode", lambda: [len(opened.encoder.encode(c).ids) for c in chunks])
    return [cpu for _, cpu, _ in t.rows]


if __name__ == "__main__":
    main()
