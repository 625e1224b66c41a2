"""Hardening, data correctness: a character the tokenizer spells in several tokens is trained whole.

Llama 2's byte fallback spells most emoji and many CJK characters as 3-4 byte tokens. The trained span
of a completion, a chat turn or a text must end with all of them, and ``verify --source`` must find a
build where it does not (it recomputes the mask from token offsets, apart from the encoder).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import make_build, shard_rows
from transformers import AutoTokenizer

from packer.checking import verify
from packer.contract import schema

# Each ends in a character that Llama 2 spells in byte tokens (the last one a ZWJ family: 👧 last).
ENDINGS = ["Cats 😀", "答案是猫", "Done 🎉🎉", "x = 42 🚀", "家族 👨\u200d👩\u200d👧", "猫"]


def _records() -> list[dict]:
    return [{"question": f"Question {i}: say something", "answer": ENDINGS[i % len(ENDINGS)]} for i in range(24)]


def _segments(out):
    for entry in schema.read_manifest(out).shards:
        for row in shard_rows(out / entry.file):
            bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
            ids, labels = np.array(row["input_ids"]), np.array(row["labels"])
            for k, example in enumerate(row["example_ids"]):
                yield example, ids[bounds[k] : bounds[k + 1]], labels[bounds[k] : bounds[k + 1]]


def _assert_whole_last_character(out, tokenizer_dir, expected_ends: dict[int, str]) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    seen = 0
    for example, ids, labels in _segments(out):
        trained = ids[labels != schema.IGNORE_INDEX]
        assert trained[-1] == tok.eos_token_id
        text = tok.decode(trained[:-1].tolist(), skip_special_tokens=True)
        assert "\ufffd" not in text, f"example {example}: a character is trained in part: {text!r}"
        assert text.endswith(expected_ends[example]), (text, expected_ends[example])
        seen += 1
    assert seen == len(expected_ends)


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("emoji") / "qa.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _records()))
    return path


def test_completion_trains_every_byte_token_of_its_last_character(tmp_path, qa_file, llama2_tokenizer):
    out = make_build(tmp_path / "out", source=str(qa_file), tokenizer=str(llama2_tokenizer), pack="bfd",
                     max_len=256, prompt_field="question", completion_field="answer")
    _assert_whole_last_character(out, llama2_tokenizer, {i: r["answer"] for i, r in enumerate(_records())})
    report = verify.verify(out, source=str(qa_file))
    assert report.ok, report.problems


def test_text_field_trains_its_last_character_whole(tmp_path, llama2_tokenizer):
    path = tmp_path / "text.jsonl"
    texts = [f"Line {i} ends in {ENDINGS[i % len(ENDINGS)]}" for i in range(12)]
    path.write_text("".join(json.dumps({"body": t}, ensure_ascii=False) + "\n" for t in texts))
    out = make_build(tmp_path / "out", source=str(path), tokenizer=str(llama2_tokenizer), pack="bfd",
                     max_len=256, text_field="body")
    _assert_whole_last_character(out, llama2_tokenizer, dict(enumerate(texts)))
    assert verify.verify(out, source=str(path)).ok


def test_chat_turn_trains_its_last_character_whole(tmp_path, llama2_tokenizer):
    # Llama 2's own files with a template whose assistant turn ends in its content, no end-of-turn token
    tokenizer = tmp_path / "llama2-chat"
    shutil.copytree(llama2_tokenizer, tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST] "
                               "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    path = tmp_path / "chat.jsonl"
    chats = [[{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": ENDINGS[i % len(ENDINGS)]}]
             for i in range(12)]
    path.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in chats))
    out = make_build(tmp_path / "out", source=str(path), tokenizer=str(tokenizer), pack="bfd", max_len=256,
                     messages_field="messages")
    _assert_whole_last_character(out, tokenizer, {i: c[1]["content"] for i, c in enumerate(chats)})
    assert verify.verify(out, source=str(path)).ok


def test_verify_source_finds_a_partly_trained_last_character(tmp_path, qa_file, llama2_tokenizer):
    """The old encoder's mask (the last character's trailing byte tokens untrained) written into the
    shards: verify --source, recomputing the mask on its own, reports it."""
    import pyarrow as pa

    out = make_build(tmp_path / "out", source=str(qa_file), tokenizer=str(llama2_tokenizer), pack="bfd",
                     max_len=256, prompt_field="question", completion_field="answer", format_version=1)
    for entry in schema.read_manifest(out).shards:  # format 1: the labels rewritten as they are stored
        rows = schema.open_shard(out / entry.file).to_pylist()
        for row in rows:
            labels, end = row["labels"], 0
            for n in row["seq_lens"]:
                end += n
                tail = [j for j in range(end - n, end - 1) if labels[j] != schema.IGNORE_INDEX][-3:]
                for j in tail:  # every ending is a 3- or 4-byte character: its last 3 byte tokens
                    labels[j] = schema.IGNORE_INDEX
                row["num_loss_tokens"] -= len(tail)
        with pa.OSFile(str(out / entry.file), "wb") as sink, pa.ipc.new_stream(sink, schema.ROW_SCHEMA) as writer:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema.ROW_SCHEMA))
    report = verify.verify(out, source=str(qa_file))
    assert [p.check for p in report.problems if "trained where" in p.message] == ["source"], report.problems
