"""Every family packer packs images for, exact against that family's own processor (docs/images.md).

Each processor is built offline from its image processor's class defaults (the PIL backend), the real
Qwen3 tokenizer given the family's special tokens, and the chat template TRL ships for the family (for
templates that read an answer's parts only, TRL's ``{% generation %}``-tagged twin via --chat-template,
as a user would give it). Per family: every record's tokens are ``processor.apply_chat_template``'s, the
loss is on the answers only, and the loader's vision inputs are the processor's output for each example
alone, concatenated (Idefics3/SmolVLM: one batch of the row's images); for the mRoPE families the
positions are a tiny random model's own ``get_rope_index`` per example."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import need_shared

from packer import BuildConfig, build
from packer.contract import schema
from packer.errors import ConfigError

pytest.importorskip("PIL.Image")
cbook = pytest.importorskip("matplotlib.cbook")
trl = pytest.importorskip("trl")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"

# family: (image processor, its arguments, processor class, template, tagged twin or None, processor config,
#          the tokenizer's named special tokens, added special tokens)
GEMMA = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
QWEN3 = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # Qwen3-VL's preprocessor config
FAMILIES = {
    "qwen3_vl": ("qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil", QWEN3, "Qwen3VLProcessor",
                 "qwen3_vl.jinja", None, {}, None, ()),
    "qwen3_5": ("qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil", QWEN3, "Qwen3VLProcessor",
                "qwen3_5_nothink.jinja", None, {}, None, ()),
    "gemma3": ("gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil", {}, "Gemma3Processor", "gemma3.jinja",
               None, {"image_seq_length": 256}, GEMMA, ()),
    "idefics3": ("idefics3.image_processing_pil_idefics3.Idefics3ImageProcessorPil", {}, "Idefics3Processor",
                 "idefics3.jinja", "idefics3_training.jinja", {"image_seq_len": 169}, None,
                 ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")),
    "qwen2_vl": ("qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil", {}, "Qwen2VLProcessor",
                 "qwen2_5_vl.jinja", None, {}, None, ()),  # Qwen2-VL's template is Qwen2.5-VL's
    "smolvlm": ("smolvlm.image_processing_pil_smolvlm.SmolVLMImageProcessorPil", {}, "SmolVLMProcessor",
                "smolvlm.jinja", "smolvlm_training.jinja", {"image_seq_len": 64}, None,
                ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")),
    "llava": ("llava.image_processing_pil_llava.LlavaImageProcessorPil", {}, "LlavaProcessor", "llava_next.jinja",
              "llava_next_training.jinja", {"patch_size": 14, "vision_feature_select_strategy": "default"}, None,
              ("<image>",)),
}


def _processor_folder(root: Path, name: str) -> Path:
    import importlib

    from transformers import AutoTokenizer

    module, cls, processor_class, template, _, config, named, added = FAMILIES[name]
    path, _, attr = module.rpartition(".")
    image_processor = getattr(importlib.import_module(f"transformers.models.{path}"), attr)(**cls)
    tokenizer = AutoTokenizer.from_pretrained(str(need_shared("tokenizers/qwen3")),
                                              **({"extra_special_tokens": named} if named else {}))
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": list(added)})
    folder = root / name
    folder.mkdir()
    image_processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class, **config}))
    return folder


RECORDS = [
    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Who is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Grace Hopper."}]}], "images": ["a.jpg"]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                               {"type": "text", "text": "and"}, {"type": "image"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "The same person."}]}],
     "images": ["a.jpg", "b.png"]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}], "images": []},
]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("family_data")
    photo = Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    photo.resize((160, 120)).save(folder / "a.jpg")
    photo.resize((90, 200)).save(folder / "b.png")
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return folder


def _reference(processor, record: dict, folder: Path):
    messages, images = json.loads(json.dumps(record["messages"])), iter(record["images"])
    for message in messages:
        for part in message["content"]:
            if part["type"] == "image":
                part["image"] = str(folder / next(images))
    if type(processor).__name__.startswith("SmolVLM"):
        # SmolVLM's apply_chat_template reads its video processor (torchvision) even for images: its own
        # __call__ on its template's text and the image files, loaded by transformers, is the reference
        from transformers.image_utils import load_image
        from transformers.utils.chat_template_utils import render_jinja_template

        text = render_jinja_template(conversations=[messages], chat_template=processor.chat_template)[0][0]
        files = [load_image(str(folder / name)) for name in record["images"]]
        return processor(text=[text], images=[files] if files else None)
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True)


def _tiny_rope(name: str):
    """A tiny random model's own get_rope_index (Qwen2-VL's, Qwen3-VL's, Qwen3.5's)."""
    from transformers import Qwen3_5Config, Qwen3_5Model, Qwen3VLConfig, Qwen3VLModel

    text = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 16, "vocab_size": 152000, "head_dim": 8}
    vision = {"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 16, "intermediate_size": 16,
              "deepstack_visual_indexes": []}
    if name == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLModel

        return Qwen2VLModel(Qwen2VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
            vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2})).get_rope_index
    if name == "qwen3_5":
        return Qwen3_5Model(Qwen3_5Config(text_config={**text, "layer_types": ["full_attention"]},
                                          vision_config=vision)).get_rope_index
    return Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision)).get_rope_index


# The suite samples two families (the "replace" rule with token type ids; an mRoPE family through Qwen3.5's own
# model); PACKER_IMAGE_FAMILIES=all runs every one (about 10 s each on a busy 2-core machine).
SAMPLED = list(FAMILIES) if os.environ.get("PACKER_IMAGE_FAMILIES") == "all" else ["gemma3", "qwen3_5"]


@pytest.mark.parametrize("name", SAMPLED)
def test_a_family_is_exact_against_its_own_processor(name, source, tmp_path):
    import torch

    from packer import make_dataloader
    from packer.contract.vision import load_processor

    folder = _processor_folder(tmp_path, name)
    processor = load_processor(str(folder))
    twin = FAMILIES[name][4]
    out = tmp_path / "out"
    build(BuildConfig(source=str(source / "data.jsonl"), out=str(out), processor=str(folder), num_proc=1,
                      max_len=8192, chat_template=str(TEMPLATES / twin) if twin else None))
    rows = schema.open_shard(out / "shard-00000.arrow").to_pylist()
    assert len(rows) == 1 and sorted(rows[0]["example_ids"]) == [0, 1, 2]
    row, at, refs = rows[0], 0, []
    for example, n in zip(row["example_ids"], row["seq_lens"], strict=True):
        ids, mask = row["input_ids"][at:at + n], row["loss_mask"][at:at + n]
        at += n
        ref = _reference(processor, RECORDS[example], source)
        refs.append(ref)
        assert ids[:-1] == ref["input_ids"][0], (name, example)  # token for token, the appended EOS aside
        trained = processor.tokenizer.decode([t for t, m in zip(ids, mask) if m])
        answer = RECORDS[example]["messages"][1]["content"][0]["text"]
        assert answer in trained and "Who is this" not in trained and "Compare" not in trained
    batch = next(iter(make_dataloader(out, shuffle=False)))
    with_images = [r for r in refs if "pixel_values" in r]
    axis = 1 if name in ("idefics3", "smolvlm") else 0
    expected = np.concatenate([np.asarray(r["pixel_values"]) for r in with_images], axis=axis)
    assert np.array_equal(batch["pixel_values"].numpy(), expected)  # bit for bit
    for key in ("image_grid_thw", "pixel_attention_mask"):
        if key in with_images[0]:
            assert np.array_equal(batch[key].numpy(), np.concatenate([np.asarray(r[key]) for r in with_images], axis))
    type_ids = "token_type_ids" if name == "gemma3" else "mm_token_type_ids" if name.startswith("qwen") else None
    if type_ids is not None:  # the processor's own 0/1 mask, per example, concatenated (the EOS: 0)
        assert batch[type_ids][0].tolist() == [t for r in refs for t in [*r[type_ids][0], 0]]
    if name.startswith("qwen"):
        rope = _tiny_rope(name)
        eos = torch.tensor([[batch["input_ids"][0, batch["cu_seq_lens_q"][1] - 1]]])
        parts = [rope(torch.cat([torch.tensor(r["input_ids"]), eos], 1),
                      mm_token_type_ids=torch.tensor([[*r["mm_token_type_ids"][0], 0]]),
                      image_grid_thw=torch.tensor(np.asarray(r["image_grid_thw"])) if "image_grid_thw" in r else None)[0]
                 for r in refs]
        assert torch.equal(batch["position_ids"][1:], torch.cat(parts, dim=2))
    else:
        assert batch["position_ids"].shape == batch["input_ids"].shape


def test_a_family_packer_does_not_know_is_refused_in_one_line(tmp_path):
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    folder = tmp_path / "siglip"
    SiglipImageProcessorPil().save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "SiglipProcessor"}))
    (tmp_path / "d.jsonl").write_text(json.dumps(RECORDS[2]) + "\n")
    with pytest.raises(ConfigError, match=r"SiglipProcessor is not a family packer packs images for \(known: .*Gemma 3"):
        build(BuildConfig(source=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"), processor=str(folder),
                          tokenizer="bundled"))
