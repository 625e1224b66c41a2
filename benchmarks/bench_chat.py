"""Chat build throughput against TRL's own preprocessing, one run, same conversations (a script, not a test).

    python benchmarks/bench_chat.py [--n 4000]

The conversations are tests/chat_sweep.py's set (system prompts, 1-6 turns, reasoning, tool calls and
replies, unicode) repeated with varied numbers, written to one jsonl file, tokenized with Qwen3's
tokenizer (../shared/data/tokenizers/qwen3):

- packer: ``packer.build`` (read, render, locate the assistant spans, tokenize, plan, write shards) at
  ``num_proc`` 1 and 2, with Qwen3's own template (untagged: two renders per conversation) and with
  TRL's tagged twin qwen3_training.jinja as --chat-template (one render);
- TRL: what ``SFTTrainer`` does with ``assistant_only_loss=True``: ``datasets.map`` of
  ``apply_chat_template(..., tools=..., tokenize=True, return_dict=True, return_assistant_tokens_mask=True)``
  with the tagged twin, at ``num_proc`` 1 and 2 (packing and writing not counted for TRL).

Each side runs once untimed first (imports, caches); figures are wall clock, from before the source is
read to after the output exists. Prints conversations/s and tokens/s and packer's ratio over TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
QWEN3 = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"


def make_data(path: Path, n: int, templates: list[str | None]) -> None:
    """``n`` conversations from the sweep's set that transformers renders with every template here (Qwen3's
    own template refuses an assistant turn without content, for one)."""
    from chat_sweep import conversations
    from transformers import AutoTokenizer

    from packer.building.chat import normalize_messages

    tokenizer = AutoTokenizer.from_pretrained(str(QWEN3))

    def renders(record) -> bool:
        try:
            for template in templates:
                tokenizer.apply_chat_template(normalize_messages(record["messages"], "messages"), tokenize=False,
                                              tools=record.get("tools"), chat_template=template)
        except Exception:
            return False
        return True

    base = [record for _, record in conversations() if renders(record)]
    with path.open("w") as f:
        for i in range(n):
            record = json.loads(json.dumps(base[i % len(base)], ensure_ascii=False).replace("2", str(i % 97)))
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def packer_run(src: Path, out: Path, num_proc: int, template: str | None) -> tuple[float, int]:
    from packer import BuildConfig, build

    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    result = build(BuildConfig(source=str(src), out=str(out), tokenizer=str(QWEN3), chat_template=template,
                               pack="bfd", max_len=4096, max_tokens=16384, num_proc=num_proc))
    return time.perf_counter() - t, result.manifest.stats.tokens


def trl_run(src: Path, num_proc: int, template: str) -> tuple[float, int]:
    import datasets
    from transformers import AutoTokenizer

    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(src), split="train")
    tokenizer = AutoTokenizer.from_pretrained(str(QWEN3))

    def tokenize(example):
        out = tokenizer.apply_chat_template(example["messages"], tools=example.get("tools"), chat_template=template,
                                            tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    ds = ds.map(tokenize, remove_columns=ds.column_names, num_proc=num_proc if num_proc > 1 else None,
                load_from_cache_file=False)
    tokens = sum(len(ids) for ids in ds["input_ids"])
    return time.perf_counter() - t, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4000)
    args = parser.parse_args()
    import trl

    twin = str(Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja")
    twin_text = Path(twin).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "chats.jsonl"
        make_data(src, args.n, [None, twin_text])
        packer_run(src, tmp / "warm", 1, None)  # untimed: imports, the datasets cache of the file
        trl_run(src, 1, twin_text)
        rows = []
        for proc in (1, 2):
            for label, template in (("own template", None), ("tagged twin", twin)):
                seconds, tokens = packer_run(src, tmp / "out", proc, template)
                rows.append((f"packer -j {proc}, Qwen3 {label}", seconds, tokens))
            seconds, tokens = trl_run(src, proc, twin_text)
            rows.append((f"TRL map num_proc={proc}, tagged twin", seconds, tokens))
    print(f"{args.n:,} conversations, Qwen3 tokenizer, {os.cpu_count()} cores")
    for label, seconds, tokens in rows:
        print(f"  {label:40s} {seconds:7.2f} s  {args.n / seconds:8.0f} conv/s  {tokens / seconds:10.0f} tokens/s")
    by = {label: seconds for label, seconds, _ in rows}
    for proc in (1, 2):
        trl_s = by[f"TRL map num_proc={proc}, tagged twin"]
        for label in ("own template", "tagged twin"):
            print(f"  -j {proc}: packer ({label}) is {trl_s / by[f'packer -j {proc}, Qwen3 {label}']:.2f}x TRL's speed")


if __name__ == "__main__":
    main()
