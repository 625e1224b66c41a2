"""A DPO step packed (packer's rows) against TRL's padded one, on CPU: tokens/s and peak memory, one run;
and the rows and tokens of a whole preference set packed against TRL's padded batches.

    python benchmarks/bench_dpo.py [--data gsm8k] [--pairs 64] [--batch 8] [--steps 4]
    python benchmarks/bench_dpo.py --layout [--pairs 7473] [--batch 8] [--max-len 1024]

The pairs are made from GSM8K (../shared/data), deterministically. ``--data gsm8k`` (default): the
question is the prompt, its real answer chosen, and rejected a plausible wrong answer: the real one
with its final number changed (even records) or its reasoning cut to its first half and a wrong final
number (odd records). ``--data next``: the next question's answer rejected.

``--layout``: the first ``--pairs`` pairs built by packer (``--pack bfd``, its default row budget of 2 ×
``--max-len``) against TRL 1.16's ``DPOTrainer`` batches of ``--batch`` pairs in order, as its collator
pads them (the 2B sequences of a batch, chosen and rejected, to the longest): forwards (rows or batches)
and tokens a forward computes, padding included. The step benchmark: the same pairs, in the same batches of ``--batch`` pairs (packer's ``--pack batch``: the
optimizer steps of padded DPO), go through one policy forward + backward and one reference forward a
step, each side in its own process (so each has its own peak RSS): TRL 1.16's ``DPOTrainer.compute_loss``
on its collator's padded batches, and ``packer.training.preference.dpo_step`` on the packed rows of the
same tiny random Llama (vocab of Llama 2's tokenizer). tokens/s counts real tokens (the pairs' own), so
padding counts as cost, not as work. ``stored``: packer's step with the reference's log-probs precomputed
once (``precompute_reference``, in its own process, not timed) and read back: one forward fewer a step,
and no reference model in memory. Peak memory is the child's max RSS less its RSS before the first
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


def wrong_answer(answer: str, i: int) -> str:
    """A plausible wrong GSM8K answer: the final number changed, or (odd ``i``) half the reasoning and then it."""
    steps, _, final = answer.rpartition("\n#### ")
    try:
        wrong = str(int(final.replace(",", "")) + 1 + i % 9)
    except ValueError:  # a decimal or odd final answer
        wrong = final + "1"
    if i % 2:
        lines = steps.split("\n")
        steps = "\n".join(lines[: max(1, len(lines) // 2)])
    return f"{steps}\n#### {wrong}"


def make_pairs(path: Path, n: int, data: str = "gsm8k") -> int:
    """The first ``n`` pairs (at most GSM8K's train set) at ``path``; returns how many."""
    with open(DATA / "gsm8k_train.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(n + 1), f, strict=False)]
    n = min(n, len(rows) - (data == "next"))
    with open(path, "w") as f:
        for i in range(n):
            rejected = rows[i + 1]["answer"] if data == "next" else wrong_answer(rows[i]["answer"], i)
            f.write(json.dumps({"prompt": rows[i]["question"] + "\n", "chosen": rows[i]["answer"],
                                "rejected": rejected}) + "\n")
    return n


def tiny(vocab: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=4096)).float()


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_packed(folder: str, steps: int, stored: str | None = None) -> dict:
    """packer's steps; ``stored``: the reference's log-probs read from that file (no reference model here)."""
    import torch

    from packer import prepare, read_manifest
    from packer.training.loader import PackedDataset
    from packer.training.preference import StoredReference, dpo_step
    m = read_manifest(folder)
    policy = prepare(tiny(m.tokenizer["vocab_size"], 0), max_tokens=m.stats.max_row_tokens)
    ref = (StoredReference(stored, folder) if stored else
           prepare(tiny(m.tokenizer["vocab_size"], 1), max_tokens=m.stats.max_row_tokens))
    rows = list(PackedDataset(folder))[:steps]
    base = rss_mb()
    tokens, start = 0, time.perf_counter()
    for row in rows:
        dpo_step(policy, ref, row, beta=0.1).loss.backward()
        tokens += row["input_ids"].numel()
    seconds = time.perf_counter() - start
    del torch
    return {"tokens": tokens, "computed": tokens, "seconds": seconds, "peak_mb": rss_mb() - base}


def child_reference(folder: str, path: str) -> dict:
    """The reference run once over the build and stored (not timed against the steps)."""
    from packer import prepare, read_manifest
    from packer.training.preference import precompute_reference
    m = read_manifest(folder)
    start = time.perf_counter()
    ref = precompute_reference(prepare(tiny(m.tokenizer["vocab_size"], 1), max_tokens=m.stats.max_row_tokens), folder,
                               path)
    return {"pairs": len(ref), "seconds": time.perf_counter() - start}


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


def child_trl_layout(source: str, batch: int, max_len: int, out: str) -> dict:
    """TRL's batches of the whole set, in order: forwards and the tokens its collator pads them to."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    with open(source) as f:
        records = [json.loads(line) for line in f]
    args = DPOConfig(output_dir=out, per_device_train_batch_size=batch, max_length=max_len, report_to=[], use_cpu=True,
                     gradient_checkpointing=False)
    trainer = DPOTrainer(model=tiny(len(tok), 0), ref_model=tiny(len(tok), 1), args=args,
                         train_dataset=Dataset.from_list(records), processing_class=tok)
    data = trainer.train_dataset
    forwards = padded = real = 0
    with torch.no_grad():
        for s in range(0, len(data), batch):
            b = trainer.data_collator([data[i] for i in range(s, min(s + batch, len(data)))])
            forwards += 1
            padded += b["input_ids"].numel()
            real += int(b["attention_mask"].sum())
    return {"forwards": forwards, "padded": padded, "real": real}


def layout(a, tmp: Path) -> None:
    """Rows and tokens of the whole set: packer's bfd build against TRL's padded batches."""
    from packer import read_manifest
    src, out = tmp / "pairs.jsonl", tmp / "bfd"
    n = make_pairs(src, a.pairs, a.data)
    subprocess.run([sys.executable, "-m", "packer", "build", str(src), "--out", str(out), "--tokenizer", str(TOKENIZER),
                    "--pack", "bfd", "--max-len", str(a.max_len)], check=True, capture_output=True)
    st = read_manifest(out).stats
    done = subprocess.run([sys.executable, __file__, "--batch", str(a.batch), "--max-len", str(a.max_len), "--child",
                           "trl-layout", str(src), str(tmp / "trl")], check=True, capture_output=True, text=True)
    t = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{n:,} GSM8K pairs ({a.data}), --max-len {a.max_len}, {st.tokens:,} real tokens")
    print(f"packer bfd      {st.rows:6,} rows of <= {st.row_budget:,} tokens: {st.tokens:10,} tokens computed "
          f"(fill {st.fill:.1%}; {st.rows * st.row_budget:,} at a static shape)")
    print(f"TRL padded B={a.batch} {t['forwards']:6,} batches:             {t['padded']:10,} tokens computed "
          f"({t['real']:,} real, {t['real'] / t['padded']:.1%})")
    print(f"TRL / packer: {t['padded'] / st.tokens:.2f}x the tokens, {t['forwards'] / st.rows:.2f}x the forwards")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--data", choices=("gsm8k", "next"), default="gsm8k")
    parser.add_argument("--layout", action="store_true", help="rows and tokens of the set, not the step")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--child", nargs="*")
    a = parser.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "trl-layout":
            result = child_trl_layout(rest[0], a.batch, a.max_len, rest[1])
        elif kind == "reference":
            result = child_reference(*rest)
        elif kind in ("packed", "stored"):
            result = child_packed(rest[0], a.steps, rest[1] if kind == "stored" else None)
        else:
            result = child_trl(rest[0], a.batch, a.steps, rest[1])
        print(json.dumps(result))
        return
    if a.layout:
        with tempfile.TemporaryDirectory() as tmp:
            layout(a, Path(tmp))
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "pairs.jsonl", Path(tmp) / "pairs"
        make_pairs(src, a.pairs, a.data)
        # batch mode shuffles the pairs into rows: the same B pairs a step, not the same ones as TRL's
        # (its loader is sequential here); equal on average over the steps, which is what a rate measures
        subprocess.run([sys.executable, "-m", "packer", "build", str(src), "--out", str(out), "--tokenizer",
                        str(TOKENIZER), "--batch-size", str(a.batch), "--max-len", "2048"], check=True,
                       capture_output=True)
        results = {}
        ref = str(Path(tmp) / "ref.arrow")
        subprocess.run([sys.executable, __file__, "--child", "reference", str(out), ref], check=True,
                       capture_output=True, text=True)
        for kind, extra in (("packed", [str(out)]), ("stored", [str(out), ref]),
                            ("trl", [str(src), str(Path(tmp) / "trl")])):
            done = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--batch", str(a.batch),
                                   "--child", kind, *extra], check=True, capture_output=True, text=True)
            results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    for kind, r in results.items():
        print(f"{kind:7s} {r['tokens']:7,} real tokens ({r['computed']:7,} computed) in {r['seconds']:6.2f} s: "
              f"{r['tokens'] / r['seconds']:8,.0f} tokens/s, peak +{r['peak_mb']:6.0f} MB")
    p, t, r = results["packed"], results["trl"], results["stored"]
    print(f"stored reference / reference model, packed: {r['tokens'] / r['seconds'] / (p['tokens'] / p['seconds']):.2f}x "
          f"tokens/s, {r['peak_mb'] / max(p['peak_mb'], 1):.2f}x peak memory")
    print(f"packed / TRL padded: {p['tokens'] / p['seconds'] / (t['tokens'] / t['seconds']):.2f}x tokens/s, "
          f"{p['peak_mb'] / max(t['peak_mb'], 1):.2f}x peak memory ({a.steps} steps of {a.batch} pairs)")


if __name__ == "__main__":
    main()
