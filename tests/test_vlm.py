"""prepare() on vision-language models: packed rows with images exact, the vision tower left per image, the
guard on at the forward. Rows made by hand here, as the images build makes them: each example through its
processor's ``apply_chat_template`` alone, its 3-D positions from the model's own ``get_rope_index`` alone,
concatenated (docs/training.md, "Vision-language models"). Tiny random models (benchmarks/vlm_tiny.py)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from PIL import Image

from benchmarks.vlm_tiny import build, chat_example, packed_row
from packer import prepare
from packer.errors import ConfigError


def _image(h: int, w: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy())


CHATS = [  # (images, messages): two images of other grids, one below min_pixels, text only
    ([_image(90, 150, 1), _image(200, 60, 2)], "Compare these.", "The first is wider."),
    ([_image(30, 40, 3)], "What is this?", "A small picture."),
    ([], "Say hi.", "Hi."),
]


def _example(model, processor, images, question, answer) -> dict:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    return chat_example(model, processor, images, messages)


def _loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")


@pytest.fixture(scope="module")
def qwen():
    model, processor = build("qwen2_5_vl")
    reference = copy.deepcopy(model)  # untouched, eager everywhere
    exs = [_example(model, processor, *chat) for chat in CHATS]
    prepare(model, processor=processor)
    return model, reference, processor, exs


def test_qwen25_vl_packed_rows_with_images_equal_each_example_alone(qwen):
    model, reference, _, exs = qwen
    assert model.config.text_config._attn_implementation == "packer_varlen"
    assert model.config.vision_config._attn_implementation == "eager"  # the tower keeps its own, per image
    row = packed_row(exs)
    logits = model(**row).logits[0]
    bounds = row["cu_seq_lens_q"].tolist()
    sum(_loss(logits[a:b], row["input_ids"][0, a:b]) for a, b in itertools.pairwise(bounds)).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for i, ex in enumerate(exs):
        alone = reference(**ex).logits[0]
        _loss(alone, ex["input_ids"][0]).backward()
        d = (logits[bounds[i] : bounds[i + 1]] - alone).abs().max()
        assert d <= 1e-5 * alone.abs().max(), (i, d)
    for name, p in reference.named_parameters():  # the vision tower's and projector's too
        assert (packed[name] - p.grad).abs().max() <= 1e-5 * (p.grad.abs().max() + 1e-6), name
    assert any(n.startswith("model.visual") for n in packed)
    # the form with a text-position row first ([4, 1, T]: each example's arange, then its 3-D positions)
    text_row = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)]).view(1, 1, -1)
    with torch.no_grad():
        four = model(**row | {"position_ids": torch.cat([text_row, row["position_ids"]])}).logits[0]
    assert torch.equal(four, logits.detach())


def test_the_guard_refuses_what_prepare_did_not_vet(qwen):
    model, _, _, exs = qwen
    row = packed_row(exs)
    first_image = int((row["input_ids"][0] == model.config.image_token_id).nonzero()[0])
    cut = torch.tensor([0, first_image + 2, row["input_ids"].shape[1]], dtype=torch.int32)
    cases = {
        "no pixel_values": ({k: v for k, v in row.items() if k != "pixel_values"}, "no pixel_values"),
        "3-D positions, no cu_seq_lens": ({k: v for k, v in row.items() if not k.startswith("cu_seq")}, "mRoPE"),
        # a boundary inside the row's first image: its example's placeholders are not whole images
        "image cut": (row | {"cu_seq_lens_q": cut, "cu_seq_lens_k": cut}, "not whole"),
    }
    for name, (batch, words) in cases.items():
        with pytest.raises(ConfigError, match=words) as e, torch.no_grad():
            model(**batch)
        assert "\n" not in str(e.value), name
    vision = model.config.vision_config
    was = vision._attn_implementation_internal
    vision._attn_implementation_internal = "sdpa"  # a later switch of the tower's attention
    try:
        with pytest.raises(ConfigError, match="attn_implementation changed"), torch.no_grad():
            model(**row)
    finally:
        vision._attn_implementation_internal = was


def test_a_vlm_without_its_processor_is_refused_in_one_line():
    model, _ = build("llava")
    before = model.config.to_json_string()
    with pytest.raises(ConfigError, match=r"LlavaForConditionalGeneration.*processor=processor") as e:
        prepare(model)
    assert "\n" not in str(e.value) and model.config.to_json_string() == before


def test_llava_vision_tower_never_sees_the_rows_boundaries():
    from packer.training import vision_probe

    model, processor = build("llava")
    prepare(model, processor=processor)
    seen = []
    model.model.vision_tower.register_forward_pre_hook(lambda m, a, k: seen.append(set(k)), with_kwargs=True)
    exs = vision_probe.examples(processor)
    with torch.no_grad():
        model(**vision_probe.row(model, exs, [1, 2, 0]))
    assert seen and not any(k.startswith(("cu_seq_lens", "max_length")) for keys in seen for k in keys)


def test_gemma3_refused_under_causal_kernels_exact_with_its_mask_per_example():
    """Gemma 3's image tokens attend both ways: packer_varlen is refused (naming the way that works), sdpa
    with packer's per-example mask is exact, and a text-only packed row runs after prepare."""
    from packer.training import vision_probe

    model, processor = build("gemma3")
    reference = copy.deepcopy(model)
    before = model.config.to_json_string()
    with pytest.raises(ConfigError, match="implementation='sdpa'") as e:
        prepare(model, processor=processor)
    assert "\n" not in str(e.value) and model.config.to_json_string() == before
    prepare(model, processor=processor, implementation="sdpa")
    exs = vision_probe.examples(processor)
    text_only = vision_probe.row(model, [exs[2], exs[2]], [0, 0])
    with torch.no_grad():
        got = model(**text_only).logits[0]
        alone = reference(**exs[2]).logits[0]
    n = exs[2]["input_ids"].shape[1]
    assert (got[n:] - alone).abs().max() <= 1e-5 * alone.abs().max()
    with_images = vision_probe.row(model, exs, [1, 2, 0])
    with pytest.raises(ConfigError, match="without token_type_ids"), torch.no_grad():  # its blocks unmarked
        model(**{k: v for k, v in with_images.items() if k != "token_type_ids"})
