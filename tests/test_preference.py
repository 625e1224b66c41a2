"""Preference pairs against TRL 1.16: packer's tokens are TRL's DPO preprocessing's, token for token, and
one packed DPO step (training/preference.py) gives DPOTrainer's loss, rewards and gradients on its own
padded batches, for standard and conversational data, on a tiny random Llama that prepare() accepts."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import make_build, need_shared

from packer.building.preference import extract_prompt
from packer.contract import schema
from packer.errors import ConfigError

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

QUESTIONS = ["What is 2 plus 3?", "Name a colour of the sky.", "How many legs has a spider?", "Say hi.",
             "What is the capital of France?", "Is ice cold?"]


def records(kind: str) -> list[dict]:
    out = []
    for i, q in enumerate(QUESTIONS):
        good, bad = f"The answer {i} is right, surely.", f"Wrong {'very ' * i}much."
        if kind == "standard":
            out.append({"prompt": f"Q: {q}\nA:", "chosen": " " + good, "rejected": " " + bad})
        elif kind == "implicit":
            out.append({"chosen": f"Q: {q}\nA: {good}", "rejected": f"Q: {q}\nA: {bad}"})
        else:
            out.append({"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": good}],
                        "rejected": [{"role": "assistant", "content": bad}]})
    return out


def tokenizer_for(kind: str):
    return need_shared("tokenizers/qwen3" if kind == "conversational" else "llama2-tokenizer")


def build(tmp_path, kind: str, **options):
    src = tmp_path / f"{kind}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records(kind)))
    options = {"pack": "batch", "max_len": 256, **options}
    if options["pack"] == "batch":
        options.setdefault("batch_size", len(QUESTIONS))
    return make_build(tmp_path / "out", str(src), tokenizer=str(tokenizer_for(kind)), **options)


def segments(out):
    """Every (example id, role, ids, labels) segment of a build, in row order."""
    got = []
    for entry in schema.read_manifest(out).shards:
        table = schema.open_shard(out / entry.file)
        for row in table.to_pylist():
            at = 0
            # format 1 stores labels, format 2 a loss mask (the labels are the ids where it is set)
            labels = row.get("labels") or [t if m else -100 for t, m in zip(row["input_ids"], row[schema.LOSS_MASK],
                                                                             strict=True)]
            for n, ex, role in zip(row["seq_lens"], row["example_ids"], row[schema.PAIR_COLUMN], strict=True):
                got.append((ex, role, row["input_ids"][at:at + n], labels[at:at + n]))
                at += n
    return got


def tiny_llama(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).float()


def trl_trainer(tmp_path, kind: str, model, ref, monkeypatch):
    from datasets import Dataset, arrow_dataset, fingerprint
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_for(kind)))
    # DPOTrainer's Dataset.map hashes its function for the dataset's cache fingerprint, which pickles the whole
    # tokenizer (its vocabulary and merges: most of this test's time). An in-memory dataset has no cache files, so
    # the fingerprint only names the result: a random one (what datasets itself falls back to) maps the same rows.
    monkeypatch.setattr(arrow_dataset, "update_fingerprint", lambda *_: fingerprint.generate_random_fingerprint())
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(QUESTIONS), beta=0.1,
                     max_length=None, report_to=[], use_cpu=True, bf16=False, dataset_num_proc=None,
                     gradient_checkpointing=False)
    return DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(records(kind)),
                      processing_class=tok)


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_tokens_are_trls_and_the_step_is_trls(tmp_path, kind, monkeypatch):
    from packer import prepare
    from packer.training.loader import PackedDataset
    from packer.training.preference import dpo_step

    out = build(tmp_path, kind)
    vocab = schema.read_manifest(out).tokenizer["vocab_size"]
    policy, reference = tiny_llama(vocab, 0), tiny_llama(vocab, 1)
    ours, our_ref = copy.deepcopy(policy), copy.deepcopy(reference)
    trainer = trl_trainer(tmp_path, kind, policy, reference, monkeypatch)

    # 1. tokens: each pair's two segments are TRL's prompt + chosen and prompt + rejected, labels its completion
    theirs = trainer.train_dataset
    got = segments(out)
    assert len(got) == 2 * len(theirs)
    for ex, role, ids, labels in got:
        t = theirs[ex]
        completion = t["chosen_ids"] if role == 1 else t["rejected_ids"]
        assert ids == t["prompt_ids"] + completion
        assert labels == [-100] * len(t["prompt_ids"]) + completion

    # 2. one step: TRL's loss, rewards and gradients on its padded batch of all the pairs
    batch = trainer.data_collator([theirs[i] for i in range(len(theirs))])
    policy.train()
    loss = trainer.compute_loss(policy, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    prepare(ours, max_tokens=512)
    prepare(our_ref, max_tokens=512)
    ours.train()
    row = next(iter(PackedDataset(out)))
    assert row["num_items_in_batch"] == len(QUESTIONS)  # pairs, the unit of DPO's mean
    step = dpo_step(ours, our_ref, row, beta=0.1)
    step.loss.backward()
    assert step.loss.item() == pytest.approx(loss.item(), rel=1e-5)
    assert step.chosen_logps.mean().item() == pytest.approx(metrics["logps/chosen"], rel=1e-5)
    assert step.rejected_logps.mean().item() == pytest.approx(metrics["logps/rejected"], rel=1e-5)
    # a reward is beta times a difference of two summed log-probs (hundreds, in float32 on either side): it
    # is exact to 1e-5 of the log-probs it is the difference of, not of itself
    tol = 0.1 * 1e-5 * abs(metrics["logps/chosen"])
    assert step.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"], abs=tol)
    assert step.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"], abs=tol)
    worst = 0.0
    for p, q in zip(policy.parameters(), ours.parameters(), strict=True):
        scale = p.grad.abs().max().item()
        worst = max(worst, (p.grad - q.grad).abs().max().item() / max(scale, 1e-12))
    print(f"\n{kind}: loss {step.loss.item():.7f} vs TRL {loss.item():.7f}, gradients within {worst:.1e} "
          f"of the largest (relative)")
    assert worst <= 1e-5, worst
    assert step.rejected_rewards.abs().max() > 0  # two different models: the rewards are not trivially 0


def test_implicit_prompt_is_trls():
    from trl.data_utils import extract_prompt as trl_extract
    for r in records("implicit") + [{"chosen": "ab c", "rejected": "ab d"}, {"chosen": "x", "rejected": "x y"}]:
        want = trl_extract(r)
        assert extract_prompt(r["chosen"], r["rejected"]) == (want["prompt"], want["chosen"], want["rejected"])


def test_pairs_stay_whole_and_are_counted(tmp_path):
    out = build(tmp_path, "standard", pack="bfd", max_len=12, max_tokens=40, overlong="truncate")
    m = schema.read_manifest(out)
    assert m.stats.examples == len(QUESTIONS) and m.stats.pairs + m.stats.examples_dropped == len(QUESTIONS)
    got = segments(out)
    assert [r for _, r, _, _ in got] == [1, 0] * (len(got) // 2)
    assert all(a[0] == b[0] for a, b in zip(got[0::2], got[1::2]))
    assert max(len(ids) for _, _, ids, _ in got) <= 12  # each sequence cut at max_len, as TRL's keep_start


def test_a_mix_of_pairs_and_sft_is_refused(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records("standard")))
    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    mix = [{"source": str(tmp_path / "p.jsonl"), "weight": 1.0}, {"source": str(tmp_path / "s.jsonl"), "weight": 1.0}]
    with pytest.raises(ConfigError, match="preference pairs and SFT"):
        make_build(tmp_path / "out", mix=mix, batch_size=2, tokenizer=str(tokenizer_for("standard")))


def test_format_2_padded_epochs_load_pairs(tmp_path):
    from packer.checking.verify import verify
    from packer.training.loader import PackedDataset
    out = build(tmp_path, "standard", pack="bfd", max_len=64, max_tokens=128, format_version=2,
                pad_to_multiple_of=8, epochs=2)
    m = schema.read_manifest(out)
    assert m.format_version == 2 and m.stats.padded and m.stats.paired
    assert verify(out).ok
    rows = list(PackedDataset(out, grad_accum=1))
    assert sum(len(r["pair_roles"]) for r in rows) == 2 * len(QUESTIONS)  # one epoch, every pair's two segments
    for r in rows:
        assert r["pair_roles"].tolist() == [1, 0] * (len(r["pair_roles"]) // 2)
        assert r["num_items_in_batch"] == len(r["pair_roles"]) // 2  # pairs, one row a step
