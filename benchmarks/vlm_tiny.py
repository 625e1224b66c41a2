"""Tiny random vision-language models of transformers' image-text-to-text types, with their processors,
built offline: the family's own processor class over its own image processor (class defaults, sized down
where the tiny tower needs it) and a byte-level tokenizer holding the family's special tokens; the model
from its config class with small text and vision parts, its token ids the tokenizer's.

    build("qwen2_5_vl") -> (model, processor)

Used by benchmarks/sweep_architectures.py (``--vlm``), the tests and examples/vlm_sft.py. A type with no
recipe here is built generically (its processor mapping's classes, special tokens read from the
processor's defaults); what cannot be built raises, and the sweep lists it as not buildable.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import torch

TEXT = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, use_cache=False)  # fmt: skip
# A Qwen-VL style chat template (the families' own is in their checkpoints, not in transformers)
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif item['type'] == 'text' %}"
    "{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tokenizer(specials: list[str], **extra: str):
    """A byte-level tokenizer (each byte a token) with ``specials`` as whole tokens; pad is ``<pad>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"pad_token": "<pad>", "eos_token": "<|im_end|>",
                             "additional_special_tokens": list(dict.fromkeys(specials))})  # fmt: skip
    for name, value in extra.items():
        setattr(fast, name, value)
    return fast


def _without_video(cls):
    """The family's processor class, accepting no video processor (its torchvision is absent here)."""

    def check_argument_for_proper_class(self, name, argument):
        if argument is None and name == "video_processor":
            return None
        return cls.check_argument_for_proper_class(self, name, argument)

    return type(cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                       "__module__": cls.__module__})  # fmt: skip


def _quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _qwen(model_type: str, config_cls: str, model_cls: str, processor_cls: str, vision: dict, text: dict | None = None):
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    def make():
        tok = tokenizer(QWEN_SPECIALS)
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=vision.get("patch_size", 14), merge_size=vision.get("spatial_merge_size", 2),
            min_pixels=56 * 56, max_pixels=28 * 28 * 64,
        )  # fmt: skip
        processor = _without_video(getattr(transformers, processor_cls))(
            image_processor=image_processor, tokenizer=tok, video_processor=None, chat_template=QWEN_TEMPLATE)
        ids = tok.convert_tokens_to_ids
        rope = dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3])
        config = getattr(transformers, config_cls)(
            text_config=dict(TEXT, vocab_size=len(tok), rope_parameters=rope, **(text or {})), vision_config=vision,
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        )  # fmt: skip
        return getattr(transformers, model_cls), config, processor

    return make


QWEN25_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, window_size=56,
                     fullatt_block_indexes=[1])  # fmt: skip
RECIPES = {
    "qwen2_5_vl": _qwen("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor",
                        QWEN25_VISION),
}


def build(model_type: str, seed: int = 0) -> tuple[Any, Any]:
    """(model, processor): a tiny random float32 model in train mode, dropout off, eager attention."""
    recipe = RECIPES.get(model_type)
    if recipe is None:
        raise ValueError(f"no tiny recipe for {model_type!r}")
    with _quiet():
        model_cls, config, processor = recipe()
        for c in [config, *(getattr(config, k) for k in getattr(config, "sub_configs", {}))]:
            if c is None:
                continue
            c.use_cache = False
            for name, value in list(vars(c).items()):
                if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                    setattr(c, name, 0.0)
        torch.manual_seed(seed)
        model = model_cls._from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.train(), processor
