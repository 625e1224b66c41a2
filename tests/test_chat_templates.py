"""TRL's chat templates (text-only ones with a ``_training`` twin), tagged and untagged, against
transformers: a deterministic sample of tests/chat_sweep.py's conversations here (every template, three
conversations that cover reasoning, tool calls and multi-turn); ``python tests/chat_sweep.py`` runs the
whole set (every conversation, about two minutes)."""

from __future__ import annotations

import pytest
from chat_sweep import QWEN3, check_pair, conversations, templates
from conftest import SHARED_DATA

SAMPLE = ("system_three_turns", "reasoning_content", "tool_call_object_args")


@pytest.fixture(scope="module")
def hf():
    if not (QWEN3 / "tokenizer.json").is_file():
        pytest.skip("../shared/data/tokenizers/qwen3 is absent")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN3))


PAIRS = templates()


def test_the_set_is_the_trl_set():
    assert len(PAIRS) >= 15 and {"qwen3", "llama3", "deepseekv3", "gemma", "phi3"} <= {n for n, _, _ in PAIRS}


@pytest.mark.parametrize(("name", "original", "twin"), PAIRS, ids=[p[0] for p in PAIRS])
def test_template_pair(hf, name, original, twin):
    cases = [c for c in conversations() if c[0] in SAMPLE]
    untagged, tagged = check_pair(hf, QWEN3, name, original, twin, cases)
    assert not tagged.failures, tagged.failures  # tagged: exactly return_assistant_tokens_mask
    assert not untagged.failures, untagged.failures  # untagged: the twin's mask
    assert untagged.checked + untagged.refused + len(untagged.failures) == len(cases)


@pytest.mark.parametrize("name", ["glm4moe", "gptoss"])
def test_turn_ends_and_reasoning_channels_on_every_conversation(hf, name):
    """GLM-4-MoE closes no turn (the next header, <|observation|> after a tool call, ends it) and gpt-oss
    ends a call with <|call|> and renders reasoning as an analysis message before the final one: the
    originals give their twin's mask on the whole set, each conversation compared with the twin."""
    (_, original, twin), = [p for p in PAIRS if p[0] == name]
    cases = conversations()
    untagged, tagged = check_pair(hf, QWEN3, name, original, twin, cases)
    assert not tagged.failures and not untagged.failures, (tagged.failures, untagged.failures)
    assert untagged.compared_with_twin == untagged.checked >= len(cases) - 1


def test_llama3_pair_on_the_llama_tokenizer():
    """Llama 3's template needs a bos_token (Qwen3's is null, so transformers refuses it there)."""
    folder = SHARED_DATA / "tokenizers" / "llama3_1"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("../shared/data/tokenizers/llama3_1 is absent")
    from transformers import AutoTokenizer

    (name, original, twin), = [p for p in PAIRS if p[0] == "llama3"]
    cases = [c for c in conversations() if c[0] in ("system_three_turns", "unicode", "six_turns")]
    untagged, tagged = check_pair(AutoTokenizer.from_pretrained(str(folder)), folder, name, original, twin, cases)
    assert not tagged.failures and not untagged.failures, (tagged.failures, untagged.failures)
    assert untagged.checked == len(cases) and untagged.compared_with_twin == len(cases)
