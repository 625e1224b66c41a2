#!/usr/bin/env python3
"""Train the bundled byte-level BPE tokenizer on ``packer/data/flan_sample.jsonl.gz``.

Writes ``packer/data/tokenizer/`` in Hugging Face form (``tokenizer.json``,
``tokenizer_config.json`` and whatever else ``save_pretrained`` writes, e.g. the
chat template), so that ``transformers.AutoTokenizer.from_pretrained("packer/data/tokenizer")``
loads it offline as a fast tokenizer.

- Model: byte-level BPE, vocabulary 12,000 (including the special tokens),
  trained with the ``tokenizers`` library on ``inputs + "\\n\\n" + targets`` of
  every record of the SYNTHETIC FLAN-style sample.
- Byte level throughout: ``ByteLevel(add_prefix_space=False)`` pre-tokenizer and
  the ``ByteLevel`` decoder, so ``decode(encode(t), skip_special_tokens=True) == t``
  for any UTF-8 text.
- Special tokens: ``<s>`` (BOS), ``</s>`` (EOS), ``<pad>`` (PAD) and the chat role
  markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``. Like Llama, calling the
  tokenizer adds BOS (a ``TemplateProcessing`` post-processor ``<s> $A``) and
  never EOS.
- Chat template: each turn is ``<|role|>\\n`` + content + EOS, no separator
  between turns, BOS once at the start; rendering is prefix-stable.

Deterministic: the corpus is fed in file order and the BPE trainer is run
single-threaded (``RAYON_NUM_THREADS=1``, set before ``tokenizers`` is imported).
With tokenizers 0.23.3 the multi-threaded trainer gave the same merges too; the
single thread is a safeguard, and costs a few seconds. Two runs give
byte-identical files. The script checks its own output after saving (fast
tokenizer, vocab size, BOS added and EOS not, byte-level round trip, the chat
template's rendering and prefix stability).

    python data/train_tokenizer.py [--sample PATH] [--out DIR]
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers is imported: deterministic training
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import gzip
import json
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DATA = os.path.normpath(os.path.join(HERE, "..", "packer", "data"))  # shipped inside the wheel
DEFAULT_SAMPLE = os.path.join(PACKAGE_DATA, "flan_sample.jsonl.gz")
DEFAULT_OUT = os.path.join(PACKAGE_DATA, "tokenizer")
VOCAB_SIZE = 12_000
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]  # ids 0..5, in this order
MODEL_MAX_LENGTH = 1_000_000
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(path: str):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            yield rec["inputs"] + "\n\n" + rec["targets"]


def train(sample: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(sample), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def save(tok, out: str) -> None:
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):  # no stale files from another transformers version
        os.remove(os.path.join(out, name))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)


def check(out: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast, type(tok)
    assert len(tok) == VOCAB_SIZE, len(tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ids[BOS], ids[EOS], ids[PAD])
    for text in ["Hello world!", " leading space\n\ttabs and\n\nnewlines  ", "naïve café — 日本語 🙂",
                 "def f(xs):\n    return xs[::-1]\n", "x"]:
        enc = tok(text)["input_ids"]
        assert enc[0] == tok.bos_token_id and tok.eos_token_id not in enc, enc
        assert tok.decode(enc, skip_special_tokens=True) == text, (text, tok.decode(enc))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    want = "<s><|system|>\nBe brief.</s><|user|>\nHi</s><|assistant|>\nHello.</s>"
    assert text == want, repr(text)
    gen = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen == "<s><|system|>\nBe brief.</s><|user|>\nHi</s><|assistant|>\n", repr(gen)
    assert text.startswith(tok.apply_chat_template(msgs[:2], tokenize=False))  # prefix-stable
    role_ids = tok(text, add_special_tokens=False)["input_ids"]
    for rt in ROLE_TOKENS:
        assert ids[rt] in role_ids  # role markers are single tokens
    print(f"checked {out}: vocab {len(tok)}, bos={tok.bos_token_id} eos={tok.eos_token_id} "
          f"pad={tok.pad_token_id}, roles={[ids[t] for t in ROLE_TOKENS]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="train the bundled byte-level BPE tokenizer")
    ap.add_argument("--sample", default=DEFAULT_SAMPLE)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    tok = train(args.sample)
    save(tok, args.out)
    print(f"wrote {args.out}: {sorted(os.listdir(args.out))}")
    check(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
