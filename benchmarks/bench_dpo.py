"""A DPO step packed (packer's rows) against TRL's padded one, on CPU: tokens/s and peak memory, one run.

    python benchmarks/bench_dpo.py [--pairs 64] [--batch 8] [--steps 4]

The pairs are made from GSM8K (../shared/data): each question's answer is chosen, the next question's
answer rejected. The same pairs, in the same batches of ``--batch`` pairs (packer's ``--pack batch``: the
optimizer steps of padded DPO), go through one policy forward + backward and one reference forward a
step, each side in its own process (so each has its own peak RSS): TRL 1.16's ``DPOTrainer.compute_loss``
on its collator's padded batches, and ``packer.training.preference.dpo_step`` on the packed rows of the
same tiny random Llama (vocab of Llama 2's tokenizer). tokens/s counts real tokens (the pairs' own), so
padding counts as cost, not as work. Peak memory is the child's max RSS less its RSS before the first
step (the model and libraries), i.e. what the steps themselves add.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
TOKENIZER = DATA / "llama2-tokenizer"


def make_pairs(path: Path, n: int) -> None:
    with open(DATA / "gsm8k_train.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(n + 1), f, strict=False)]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": rows[i]["question"] + "\n", "chosen": rows[i]["answer"],
                                "rejected": rows[i + 1]["answer"]}) + "\n")


def tiny(vocab: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=4096)).float()


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_packed(folder: str, steps: int) -> dict:
    import torch

    from packer import prepare, read_manifest
    from packer.training.loader import PackedDataset
    from packer.training.preference import dpo_step
    m = read_manifest(folder)
    policy = prepare(tiny(m.tokenizer["vocab_size"], 0), max_tokens=m.stats.max_row_tokens)
    ref = prepare(tiny(m.tokenizer["vocab_size"], 1), max_tokens=m.stats.max_row_tokens)
    rows = list(PackedDataset(folder))[:steps]
    base = rss_mb()
    tokens, start = 0, time.perf_counter()
    for row in rows:
        dpo_step(policy, ref, row, beta=0.1).loss.backward()
        tokens += row["input_ids"].numel()
    seconds = time.perf_counter() - start
    del torch
    return {"tokens": tokens, "computed": tokens, "seconds": seconds, "peak_mb": rss_mb() - base}


def child_trl(source: str, batch: int, steps: int, out: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    with open(source) as f:
        records = [json.loads(line) for line in f]
    policy, ref = tiny(len(tok), 0), tiny(len(tok), 1)
    args = DPOConfig(output_dir=out, per_device_train_batch_size=batch, max_length=None, report_to=[], use_cpu=True,
                     gradient_checkpointing=False)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(records),
                         processing_class=tok)
    data = trainer.train_dataset
    batches = [trainer.data_collator([data[i] for i in range(s * batch, min((s + 1) * batch, len(data)))])
               for s in range(steps)]
    policy.train()
    base = rss_mb()
    tokens = computed = 0
    start = time.perf_counter()
    for b in batches:
        trainer.compute_loss(policy, b).backward()
        tokens += int(b["attention_mask"].sum())
        computed += b["input_ids"].numel()
    return {"tokens": tokens, "computed": computed, "seconds": time.perf_counter() - start, "peak_mb": rss_mb() - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", nargs="*")
    a = parser.parse_args()
    if a.child:
        kind, *rest = a.child
        result = child_packed(rest[0], a.steps) if kind == "packed" else child_trl(rest[0], a.batch, a.steps, rest[1])
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "pairs.jsonl", Path(tmp) / "pairs"
        make_pairs(src, a.pairs)
        # batch mode shuffles the pairs into rows: the same B pairs a step, not the same ones as TRL's
        # (its loader is sequential here); equal on average over the steps, which is what a rate measures
        subprocess.run([sys.executable, "-m", "packer", "build", str(src), "--out", str(out), "--tokenizer",
                        str(TOKENIZER), "--batch-size", str(a.batch), "--max-len", "2048"], check=True,
                       capture_output=True)
        results = {}
        for kind, extra in (("packed", [str(out)]), ("trl", [str(src), str(Path(tmp) / "trl")])):
            done = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--batch", str(a.batch),
                                   "--child", kind, *extra], check=True, capture_output=True, text=True)
            results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    for kind, r in results.items():
        print(f"{kind:7s} {r['tokens']:7,} real tokens ({r['computed']:7,} computed) in {r['seconds']:6.2f} s: "
              f"{r['tokens'] / r['seconds']:8,.0f} tokens/s, peak +{r['peak_mb']:6.0f} MB")
    p, t = results["packed"], results["trl"]
    print(f"packed / TRL padded: {p['tokens'] / p['seconds'] / (t['tokens'] / t['seconds']):.2f}x tokens/s, "
          f"{p['peak_mb'] / max(t['peak_mb'], 1):.2f}x peak memory ({a.steps} steps of {a.batch} pairs)")


if __name__ == "__main__":
    main()
