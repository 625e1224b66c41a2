"""packer's tokens are transformers' tokens: every held-out tokenizer folder, and one saved by transformers'
``save_pretrained`` with chat tokens added (transformers re-derives a Llama tokenizer's space handling from
its config, so the folder's tokenizer.json alone tokenizes differently), against ``AutoTokenizer``."""

from __future__ import annotations

import pytest
from conftest import SHARED_DATA, make_build
from test_chat import MULTI, built, need, trained_text, write_jsonl

from packer.building.tokenization import load_tokenizer
from packer.contract.recipes import BUNDLED_TOKENIZER

LLAMA2 = SHARED_DATA / "llama2-tokenizer"
FOLDERS = [BUNDLED_TOKENIZER, LLAMA2, SHARED_DATA / "tokenizers" / "qwen3", SHARED_DATA / "tokenizers" / "llama3_1"]
TEXTS = ["Hello world", " leading space", "two  spaces\nand a line\n\n", "<|user|>\nHi there\n<|assistant|>\nHello!</s>",
         "<|user|> \nHi <|assistant|> Hello  x", "unicode: こんにちは — مرحبا 👋", "\n", "tab\tand trailing "]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}"
                 "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def saved_with_chat_tokens(tmp_path_factory):
    """Llama 2 with chat tokens added, legacy spacing, saved by transformers (what a fine-tuning script does)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(need(LLAMA2)), legacy=True)
    hf.add_tokens(["<|user|>", "<|assistant|>"])
    hf.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("llama2-chat")
    hf.save_pretrained(str(folder))
    return folder


def _same_tokens(folder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = load_tokenizer(str(folder))
    for special in (False, True):
        expected = hf(TEXTS, add_special_tokens=special)["input_ids"]
        assert [e.ids for e in ours.backend_tokenizer.encode_batch(TEXTS, add_special_tokens=special)] == expected
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (hf.eos_token_id, hf.bos_token_id, len(hf))


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_tokens_equal_autotokenizers_on_every_folder(folder):
    _same_tokens(need(folder))


def test_tokens_equal_autotokenizers_on_a_folder_saved_with_added_tokens(saved_with_chat_tokens):
    _same_tokens(saved_with_chat_tokens)


def test_chat_build_on_a_saved_folder_equals_apply_chat_template(tmp_path, saved_with_chat_tokens):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(saved_with_chat_tokens))
    src = str(write_jsonl(tmp_path / "c.jsonl", [MULTI]))
    ((ids, trained),) = built(make_build(tmp_path / "out", src, tokenizer=str(saved_with_chat_tokens)))
    expected = hf.apply_chat_template(MULTI["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(expected) + ([hf.eos_token_id] if expected[-1] != hf.eos_token_id else [])
    assert trained_text(hf, ids, trained) == ["Blue.</s>", "Green.</s>", "White.</s>"]


def test_tokens_equal_autotokenizers_on_a_byte_level_folder_that_names_llama(tmp_path):
    """Llama 3 derivatives often name LlamaTokenizerFast over a byte-level tokenizer.json; that class would
    force Metaspace, so AutoTokenizer loads the generic backend, and so must packer."""
    import json
    import shutil

    folder = tmp_path / "llama3-named-llama"
    shutil.copytree(need(SHARED_DATA / "tokenizers" / "llama3_1"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizerFast"}))
    _same_tokens(folder)


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
def test_a_chat_build_with_a_model_specific_tokenizer_class_imports_no_torch(tmp_path, name):
    """The tokenizer's class (Qwen2Tokenizer, ...) is taken from transformers' namespace, not AutoTokenizer's
    module, which imports torch; and the build renders each conversation with transformers' renderer (the chat
    template's ``render``), which imports none either."""
    import subprocess
    import sys

    folder = need(SHARED_DATA / "tokenizers" / name)
    src = write_jsonl(tmp_path / "c.jsonl", [MULTI])
    code = ("import sys; from packer.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nassert 'torch' not in sys.modules, 'packer build imported torch'")
    subprocess.run([sys.executable, "-c", code, "build", str(src), "--messages-field", "messages", "--tokenizer",
                    str(folder), "--out", str(tmp_path / "out"), "-q"], check=True)
