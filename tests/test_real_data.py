"""Real data from ../shared/data: GSM8K with the Llama 2 tokenizer (skips when it is absent).

packer reads tokenizers without transformers (which would import torch), so these tests hold its
tokens to what transformers' own AutoTokenizer gives on a real, SentencePiece-style tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_build, shard_rows
from transformers import AutoTokenizer

from packer.contract import schema


@pytest.fixture(scope="module")
def gsm8k_build(tmp_path_factory, gsm8k_file, llama2_tokenizer):
    out = tmp_path_factory.mktemp("gsm8k")
    return make_build(out, source=str(gsm8k_file), recipe="gsm8k", tokenizer=str(llama2_tokenizer),
                      limit=400, pack="bfd", max_len=2048)


def test_tokens_and_loss_mask_match_transformers(gsm8k_build, gsm8k_file, llama2_tokenizer):
    tok = AutoTokenizer.from_pretrained(str(llama2_tokenizer))
    records = [json.loads(line) for line in gsm8k_file.read_text().splitlines()[:400]]
    manifest = schema.read_manifest(gsm8k_build)
    seen = 0
    for shard in manifest.shards:
        for row in shard_rows(gsm8k_build / shard.file):
            bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
            ids, labels = np.array(row["input_ids"]), np.array(row["labels"])
            for k, example in enumerate(row["example_ids"]):
                seg_ids, seg_labels = ids[bounds[k] : bounds[k + 1]], labels[bounds[k] : bounds[k + 1]]
                r = records[example]
                prompt = f"Question: {r['question']}\nAnswer: "
                expected = tok(prompt + r["answer"])["input_ids"] + [tok.eos_token_id]
                assert seg_ids.tolist() == expected
                trained = seg_labels != schema.IGNORE_INDEX
                # every token after the prompt's tokens is trained, and none of the prompt's own
                n_prompt = len(tok(prompt.rstrip(" "))["input_ids"])
                assert not trained[:n_prompt].any() and trained[n_prompt + 1 :].all()
                assert tok.decode(seg_ids[trained], skip_special_tokens=True).strip() == r["answer"].strip()
                seen += 1
    assert seen == 400 == manifest.stats.examples_packed


def test_bfd_is_near_the_lower_bound_on_real_lengths(tmp_path, gsm8k_file, llama2_tokenizer):
    out = make_build(tmp_path / "all", source=str(gsm8k_file), recipe="gsm8k", tokenizer=str(llama2_tokenizer),
                     pack="bfd", max_len=4096)
    stats = schema.read_manifest(out).stats.to_json()
    assert stats["examples_packed"] == stats["examples_read"] == 7473
    assert stats["rows"] <= 1.01 * stats["lower_bound"]
    assert stats["fill"] > 0.99
