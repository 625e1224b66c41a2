"""TRL's chat templates against transformers: a sample of tests/chat_sweep.py here (every template pair with a
``_training`` twin on three conversations that cover reasoning, tool calls and multi-turn; the templates without
a twin on the offset reference), each template with the bundled tokenizer plus the template's markup tokens (a
small tokenizer: saving and loading one per template is quick); ``python tests/chat_sweep.py`` runs the whole set
with Qwen3's tokenizer (every TRL template x every conversation, ~15 minutes)."""

from __future__ import annotations

import pytest
from chat_sweep import check_pair, check_template, conversations, originals, own_tokenizer, templates
from conftest import need_shared

from packer.contract.recipes import BUNDLED_TOKENIZER

SAMPLE = ("system_three_turns", "reasoning_content", "tool_call_object_args")
PAIRS = templates()


def test_the_set_is_the_trl_set():
    assert len(PAIRS) >= 15 and {"qwen3", "llama3", "deepseekv3", "gemma", "phi3"} <= {n for n, _, _ in PAIRS}


def own(*sources):
    """The bundled tokenizer with the templates' markup as added tokens (see chat_sweep.own_tokenizer)."""
    from transformers import AutoTokenizer

    folder = own_tokenizer("".join(p.read_text() for p in sources), BUNDLED_TOKENIZER)
    return AutoTokenizer.from_pretrained(str(folder)), folder


@pytest.mark.parametrize(("name", "original", "twin"), PAIRS, ids=[p[0] for p in PAIRS])
def test_template_pair(name, original, twin):
    cases = [c for c in conversations() if c[0] in SAMPLE]
    untagged, tagged = check_pair(*own(original, twin), name, original, twin, cases)
    assert not tagged.failures, tagged.failures  # tagged: exactly return_assistant_tokens_mask
    assert not untagged.failures, untagged.failures  # untagged: the twin's mask
    assert untagged.checked + untagged.refused + len(untagged.failures) == len(cases)


@pytest.mark.parametrize("name", ["glm4moe", "gptoss"])
def test_turn_ends_and_reasoning_channels_on_every_conversation(name):
    """GLM-4-MoE closes no turn (the next header, <|observation|> after a tool call, ends it) and gpt-oss
    ends a call with <|call|> and renders reasoning as an analysis message before the final one: the
    originals give their twin's mask on the whole set, each conversation compared with the twin."""
    (_, original, twin), = [p for p in PAIRS if p[0] == name]
    cases = conversations()
    untagged, tagged = check_pair(*own(original, twin), name, original, twin, cases)
    assert not tagged.failures and not untagged.failures, (tagged.failures, untagged.failures)
    assert untagged.compared_with_twin == untagged.checked >= len(cases) - 1


def test_llama3_pair_on_the_llama_tokenizer():
    """Llama 3's template needs a bos_token (Qwen3's is null, so transformers refuses it there)."""
    folder = need_shared("tokenizers/llama3_1")
    from transformers import AutoTokenizer

    (name, original, twin), = [p for p in PAIRS if p[0] == "llama3"]
    cases = [c for c in conversations() if c[0] in ("system_three_turns", "unicode", "six_turns")]
    untagged, tagged = check_pair(AutoTokenizer.from_pretrained(str(folder)), folder, name, original, twin, cases)
    assert not tagged.failures and not untagged.failures, (tagged.failures, untagged.failures)
    assert untagged.checked == len(cases) and untagged.compared_with_twin == len(cases)


# TRL's templates that have no tagged twin (and the multimodal ones, on text), on the offset reference: each
# assistant piece located in transformers' render by character offsets, tokens against apply_chat_template
NO_TWIN = [(n, p) for n, p in originals() if not p.with_name(f"{n}_training.jinja").is_file()]


@pytest.mark.parametrize(("name", "path"), NO_TWIN, ids=[n for n, _ in NO_TWIN])
def test_template_without_a_twin_on_the_offset_reference(name, path):
    cases = conversations()
    tokenizer, folder = own(path)
    checked = check_template(tokenizer, folder, path, cases)
    assert not checked.wrong and not checked.refused, (checked.wrong, checked.refused)
    assert checked.exact + checked.refused_both == len(cases)
