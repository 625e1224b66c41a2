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
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

MAX_PARAMS = 8_000_000


def _trl_template(name: str) -> str:
    """A chat template TRL ships (``trl/chat_templates``): the families' own, as their checkpoints hold them."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


QWEN_TEMPLATE = _trl_template("qwen2_5_vl")
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tokenizer(specials: list[str], named: dict | None = None):
    """A byte-level tokenizer (each byte a token) with ``specials`` as whole tokens; pad is ``<pad>``;
    ``named``: attributes a family's processor reads from its tokenizer (``boi_token``: the token), each
    with its ``_id``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"pad_token": "<pad>", "eos_token": "<|im_end|>", "bos_token": "<bos>",
                             "additional_special_tokens": list(dict.fromkeys(specials))})  # fmt: skip
    for name, value in (named or {}).items():
        fast.add_special_tokens({"additional_special_tokens": [value]})
        setattr(fast, name, value)
        setattr(fast, name + "_id", fast.convert_tokens_to_ids(value))
    return fast


def _without_video(cls):
    """The family's processor class, accepting no video processor (its torchvision is absent here) and no
    audio feature extractor (the images are what is judged)."""

    def check_argument_for_proper_class(self, name, argument):
        if argument is None and name not in ("image_processor", "tokenizer"):  # video, audio: not built here
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


COMMON_SPECIALS = ["<image>", "<|image_pad|>", "<start_of_image>", "<end_of_image>", "<image_soft_token>",
                   "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<IMG_CONTEXT>", "<img>", "</img>",
                   "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>", "<video>", "<|video_pad|>"]  # fmt: skip
# Tokens a family's processor reads from its tokenizer by name, as its checkpoints spell them
NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
         "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
         "video_token": "<video>"}  # fmt: skip
# The vision tower's widths and depth for every family (what the config class has of these names)
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, depth=2, num_heads=2,
              embed_dim=32, out_hidden_size=64, projection_dim=32)  # fmt: skip


def _only_known(cls, values: dict) -> dict:
    default = cls()
    return {k: v for k, v in values.items() if hasattr(default, k) and not isinstance(getattr(cls, k, None), property)}


def _processor(model_type: str, image: dict, extra: dict, template: str | None, like: str | None = None):
    """The family's processor class over its image processor (PIL variant where there is one) and a
    byte-level tokenizer holding the special tokens its code reads (discovered: built twice)."""
    import inspect

    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or IMAGE_PROCESSOR_MAPPING_NAMES[like or model_type]
    names = names if isinstance(names, dict) else {"torchvision": names}
    image_processor = getattr(transformers, names.get("pil") or names["torchvision"])(**image)
    cls = _without_video(getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type]))
    params = inspect.signature(cls.__init__).parameters
    specials, named = list(COMMON_SPECIALS), {}
    for _ in range(12):
        tok = tokenizer(specials, named)
        kwargs = dict(image_processor=image_processor, tokenizer=tok, **extra)
        for name in ("video_processor", "feature_extractor", "qformer_tokenizer", "audio_tokenizer"):
            if name in params and name not in kwargs:
                kwargs[name] = None
        if "chat_template" in params:
            kwargs["chat_template"] = template
        try:
            processor = cls(**kwargs)
        except AttributeError as e:  # a token its processor reads from the tokenizer: give it one
            match = re.search(r"has no attribute '?(\w+?)(_id)?'?$", str(e))
            if not match or match.group(1) in named:
                raise
            named[match.group(1)] = NAMED.get(match.group(1), f"<{match.group(1)}>")
            continue
        found = [v for k, v in vars(processor).items() if k.endswith("_token") and isinstance(v, str)]
        if set(found) <= set(specials):
            return processor
        specials += found
    raise ValueError(f"{cls.__name__}: its special tokens could not be settled")


def _token_ids(config, processor) -> None:
    """The config's special token ids set to the tokenizer's (image_token_id <- processor.image_token, ...)."""
    tok = processor.tokenizer
    for c in [config, getattr(config, "text_config", None)]:
        if c is None:
            continue
        for name in list(vars(c)):
            if not (name.endswith("_token_id") or name.endswith("_token_index")) or name.startswith(("pad", "bos", "eos")):
                continue
            own_name = name.replace("_token_index", "_token_id")
            own = getattr(tok, own_name, None)  # the tokenizer's own first (Gemma 3's processor renames)
            own = own if isinstance(own, int) else getattr(processor, own_name, None)
            text = getattr(processor, name.rsplit("_token", 1)[0] + "_token", None)
            if isinstance(own, int):
                setattr(c, name, own)
            elif isinstance(text, str):
                setattr(c, name, tok.convert_tokens_to_ids(text))


def _side(image_processor) -> int | None:
    """The side of the square pictures an image processor makes (its crop or its resize), if it says one."""
    for name in ("crop_size", "size"):
        size = getattr(image_processor, name, None)
        if isinstance(size, dict) and isinstance(size.get("height"), int) and size.get("height") == size.get("width"):
            return size["height"]
    return None


def recipe(model_type: str, vision: dict | None = None, text: dict | None = None, image: dict | None = None,
           processor: dict | None = None, top: dict | None = None, template: str | None = None,
           like: str | None = None):
    """How to build a tiny ``model_type``: its config class with small text (the text sweep's SMALL) and
    vision parts, its processor with ``image`` settings (sized to the tiny tower) and ``processor`` kwargs;
    ``like``: the type whose image processor it uses where transformers maps none for it."""

    def make():
        import transformers
        from transformers import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        try:
            from sweep_architectures import _small_for
        except ImportError:  # imported as benchmarks.vlm_tiny
            from benchmarks.sweep_architectures import _small_for

        proc = _processor(model_type, image or {}, processor or {}, template, like)
        cls = CONFIG_MAPPING[model_type]
        default = cls()
        text_cls = type(default.get_text_config())
        vision_cls = type(default.vision_config)
        text_cfg = {**_small_for(text_cls), "vocab_size": len(proc.tokenizer), "pad_token_id": proc.tokenizer.pad_token_id,
                    "bos_token_id": proc.tokenizer.bos_token_id, "eos_token_id": proc.tokenizer.eos_token_id,
                    **(text or {})}  # fmt: skip
        vision_cfg = {**_only_known(vision_cls, VISION), **(vision or {})}
        side = _side(proc.image_processor)  # the tower sized to the pictures its processor makes
        if side and "image_size" not in (vision or {}) and isinstance(getattr(vision_cls(), "image_size", None), int):
            vision_cfg["image_size"] = side
        if "model_type" in vision_cls().to_dict():
            vision_cfg["model_type"] = vision_cls().model_type
        config = cls(text_config=text_cfg, vision_config=vision_cfg, **(top or {}))
        _token_ids(config, proc)
        return getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]), config, proc

    return make


PINS = [[28, 28], [28, 56], [56, 28], [56, 56]]
QWEN_IMAGE = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
QWEN25_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, window_size=56,
                     fullatt_block_indexes=[1])  # fmt: skip
QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=16,
                    num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip
MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]))
MROPE_INTERLEAVED = dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3],
                                              mrope_interleaved=True))  # fmt: skip
QWEN35_TEXT = dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 1, 1],
                                        mrope_interleaved=True, partial_rotary_factor=0.5))  # fmt: skip
RECIPES = {
    "qwen2_vl": recipe("qwen2_vl", dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=1), MROPE,
                       dict(QWEN_IMAGE, patch_size=14, merge_size=2), template=QWEN_TEMPLATE),
    "qwen2_5_vl": recipe("qwen2_5_vl", QWEN25_VISION, MROPE, dict(QWEN_IMAGE, patch_size=14, merge_size=2),
                         template=QWEN_TEMPLATE),
    # the benchmark's: the text decoder ~10x the vision tower, as in the released Qwen2.5-VL models
    "qwen2_5_vl+bench": recipe("qwen2_5_vl", dict(QWEN25_VISION, out_hidden_size=256), dict(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, layer_types=["full_attention"] * 4,
        num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 6, 6])),
        dict(QWEN_IMAGE, patch_size=14, merge_size=2), template=QWEN_TEMPLATE),
    "qwen3_vl": recipe("qwen3_vl", QWEN3_VISION, MROPE_INTERLEAVED, dict(QWEN_IMAGE, patch_size=16, merge_size=2),
                       template=QWEN_TEMPLATE),
    "qwen3_5": recipe("qwen3_5", {k: v for k, v in QWEN3_VISION.items() if k != "deepstack_visual_indexes"},
                      QWEN35_TEXT, dict(QWEN_IMAGE, patch_size=16, merge_size=2), template=QWEN_TEMPLATE),
    "qwen3_5_moe": recipe("qwen3_5_moe", {k: v for k, v in QWEN3_VISION.items() if k != "deepstack_visual_indexes"},
                          QWEN35_TEXT, dict(QWEN_IMAGE, patch_size=16, merge_size=2), template=QWEN_TEMPLATE),
    "llava": recipe("llava", dict(image_size=56, patch_size=14), None,
                    dict(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
                    dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
                    dict(vision_feature_layer=-1)),
    "gemma3": recipe("gemma3", dict(image_size=64, patch_size=16), dict(sliding_window=6),
                     dict(size={"height": 64, "width": 64}), dict(image_seq_length=4), dict(mm_tokens_per_image=4)),
    "idefics3": recipe("idefics3", dict(image_size=64, patch_size=16), None,
                       dict(size={"longest_edge": 128}, max_image_size={"longest_edge": 64}), dict(image_seq_len=4)),
    "smolvlm": recipe("smolvlm", dict(image_size=64, patch_size=16), None,
                      dict(size={"longest_edge": 128}, max_image_size={"longest_edge": 64}), dict(image_seq_len=4)),
    "llava_onevision": recipe(
        "llava_onevision", dict(image_size=28, patch_size=14), None,
        dict(size={"height": 28, "width": 28}, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]]),
        dict(num_image_tokens=4, vision_feature_select_strategy="full"),
        dict(image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]], vision_feature_select_strategy="full")),
    "internvl": recipe("internvl", dict(image_size=[28, 28], patch_size=[14, 14]), None,
                       dict(size={"height": 28, "width": 28}, max_patches=4), dict(image_seq_length=1)),
    "lfm2_vl": recipe("lfm2_vl"),
    "qwen3_vl_moe": recipe("qwen3_vl_moe", QWEN3_VISION, MROPE_INTERLEAVED, dict(QWEN_IMAGE, patch_size=16, merge_size=2),
                           template=QWEN_TEMPLATE, like="qwen3_vl"),
    "llava_next": recipe("llava_next", dict(image_size=28, patch_size=14), None,
                         dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=PINS),
                         dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
                         dict(image_grid_pinpoints=PINS, vision_feature_layer=-1)),
    "llava_next_video": recipe(
        "llava_next_video", dict(image_size=28, patch_size=14), None,
        dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=PINS),
        dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
        dict(image_grid_pinpoints=PINS, vision_feature_layer=-1)),
    "vipllava": recipe("vipllava", dict(image_size=56, patch_size=14), None,
                       dict(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
                       dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
                       dict(vision_feature_layers=[-1, -2])),
    "paligemma": recipe("paligemma", dict(image_size=28, patch_size=14, projection_dim=64), None,
                        dict(size={"height": 28, "width": 28}, image_seq_length=4), None, dict(projection_dim=64)),
    "glm4v": recipe("glm4v", None, MROPE),
    "paddleocr_vl": recipe("paddleocr_vl", None, MROPE),
    "glm46v": recipe("glm46v", None, MROPE),
    "glm4v_moe": recipe("glm4v_moe", None, dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                     mrope_section=[1, 1, 2], partial_rotary_factor=0.5)),
                        like="glm4v"),
}


def build(model_type: str, seed: int = 0) -> tuple[Any, Any]:
    """(model, processor): a tiny random float32 model in train mode, dropout off, eager attention."""
    make = RECIPES.get(model_type) or recipe(model_type)  # a type without one: built generically
    with _quiet():
        model_cls, config, processor = make()
        for c in [config, *(getattr(config, k) for k in getattr(config, "sub_configs", {}))]:
            if c is None:
                continue
            c.use_cache = False
            for name, value in list(vars(c).items()):
                if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                    setattr(c, name, 0.0)
        with torch.device("meta"):  # sized first: a family's default tower can hold hundreds of millions
            n = sum(p.numel() for p in model_cls._from_config(config).parameters())
        if n > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {n:,} parameters (its vision tower's defaults)")
        torch.manual_seed(seed)
        model = model_cls._from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.train(), processor


def chat_example(model, processor, images: list, messages: list[dict]) -> dict:
    """One example alone, made by hand as the images build makes it: the processor's chat template with its
    images (``apply_chat_template(tokenize=True, return_dict=True)``), labels (-100 on the image
    placeholders), and its positions from the model's own ``get_rope_index`` (the Qwen mRoPE families;
    ``arange`` on every axis for a text-only example)."""
    out = processor.apply_chat_template(messages, images=images or None, tokenize=True, return_dict=True,
                                        return_tensors="pt")  # fmt: skip
    ex = {k: v for k, v in out.items() if k != "attention_mask"}
    ids = ex["input_ids"]
    n = ids.shape[1]
    if images:
        pos, _ = model.model.get_rope_index(ids, ex["mm_token_type_ids"], image_grid_thw=ex["image_grid_thw"])
    else:
        pos = torch.arange(n).view(1, 1, n).expand(3, 1, n)
    labels = ids.masked_fill(ids == model.config.image_token_id, -100)
    labels[0, 0] = -100
    return ex | {"position_ids": pos, "labels": labels}


def packed_row(exs: list[dict]) -> dict:
    """The loader's batch for a row of ``exs`` (Qwen-VL keys): tokens, labels, positions and token types
    concatenated along the row, the vision inputs along the image axis, the boundaries as kwargs."""
    import itertools

    lens = [e["input_ids"].shape[1] for e in exs]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    row = {k: torch.cat([e[k] for e in exs], -1) for k in ("input_ids", "labels", "mm_token_type_ids", "position_ids")}
    for key in ("pixel_values", "image_grid_thw"):
        parts = [e[key] for e in exs if key in e]
        if parts:
            row[key] = torch.cat(parts)
    return row | {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lens), "max_length_k": max(lens)}


def save_processor(processor, folder) -> Path:
    """``processor`` as a processor folder the images build loads (``--processor``): its image processor,
    tokenizer, chat template and class name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    processor.image_processor.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(processor.chat_template)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": type(processor).__name__}))
    return folder
