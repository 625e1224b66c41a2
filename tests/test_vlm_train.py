"""A tiny Qwen2.5-VL trains on packed rows with images (rows by hand, examples/vlm_sft.py): each example's
loss in its row equals its loss alone through an untouched eager copy, before and after steps on packed
rows; the loop lowers the loss; TRL's SFTTrainer and Trainer take the same rows and log the model's loss."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.vlm_tiny import build
from examples.vlm_sft import build_rows, demo_chats, make_rows, sft_trainer, train_loop
from packer import prepare


def _per_example_losses(model, row) -> list[torch.Tensor]:
    logits = model(**{k: v for k, v in row.items() if k != "labels"}).logits[0]
    bounds = row["cu_seq_lens_q"].tolist()
    labels = row["labels"][0]
    return [torch.nn.functional.cross_entropy(logits[a : b - 1], labels[a + 1 : b], ignore_index=-100, reduction="sum")
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    model, processor = build("qwen2_5_vl")
    chats = demo_chats(8)
    rows = make_rows(model, processor, chats, max_tokens=700)
    return model, processor, chats, rows


def _check_row_losses(model, reference, rows):
    with torch.no_grad():
        for row in rows:
            packed = _per_example_losses(model, row)
            # the row's examples alone, from the row itself (each segment's own slice of every input)
            bounds = row["cu_seq_lens_q"].tolist()
            grids = iter(row.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)))
            pix = 0
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                ids = row["input_ids"][:, a:b]
                n_img = int((ids == reference.config.image_token_id).sum())
                ex = {"input_ids": ids, "mm_token_type_ids": row["mm_token_type_ids"][:, a:b]}
                if n_img:
                    thw = []
                    while sum(int(g.prod()) // 4 for g in thw) < n_img:
                        thw.append(next(grids))
                    patches = sum(int(g.prod()) for g in thw)
                    ex |= {"image_grid_thw": torch.stack(thw), "pixel_values": row["pixel_values"][pix : pix + patches]}
                    pix += patches
                logits = reference(**ex).logits[0]  # positions: the model's own, alone
                alone = torch.nn.functional.cross_entropy(logits[:-1], row["labels"][0, a + 1 : b], ignore_index=-100,
                                                          reduction="sum")  # fmt: skip
                assert torch.allclose(packed[i], alone, rtol=1e-5), (i, packed[i], alone)


def test_each_examples_loss_in_a_packed_row_equals_its_loss_alone_while_training(setup):
    model, processor, _, rows = setup
    model = copy.deepcopy(model)
    assert len(rows) >= 2 and any(len(r["cu_seq_lens_q"]) > 3 for r in rows)
    prepare(model, processor=processor)
    _check_row_losses(model, _eager_copy(model), rows)
    losses = train_loop(model, rows, steps=4, progress=False)
    assert losses[-1] < losses[0]
    _check_row_losses(model, _eager_copy(model), rows)  # the trained weights: still each example as alone


def _eager_copy(model):
    """The prepared model's weights in an untouched model: no hooks, eager everywhere."""
    fresh, _ = build("qwen2_5_vl")
    fresh.load_state_dict(model.state_dict())
    return fresh


@pytest.mark.parametrize("trainer", ["sft", "trainer"])
def test_trl_sft_trainer_and_trainer_train_on_the_packed_rows(setup, tmp_path, trainer):
    from transformers import Trainer

    model, processor, _, rows = setup
    model = prepare(copy.deepcopy(model), processor=processor)
    with torch.no_grad():
        first = model(**rows[0]).loss.item()
    t = sft_trainer(model, processor, rows, steps=2, output_dir=str(tmp_path), progress=False,
                    trainer_cls=Trainer if trainer == "trainer" else None)  # fmt: skip
    t.train()
    logged = [e["loss"] for e in t.state.log_history if "loss" in e]
    assert len(logged) == 2 and abs(float(logged[0]) - first) < 1e-5 * first, (logged, first)


def test_trains_on_make_dataloader_rows_of_an_image_build(setup, tmp_path):
    """The images build and its loader end to end: a build of chats about real photographs with the tiny
    model's own processor, make_dataloader's rows (vision inputs and [4, 1, T] positions made by the loader)
    through the prepared model, each example's loss equal to its loss alone, and a few steps lower it."""
    model, processor, chats, _ = setup
    rows = build_rows(processor, chats, 400, tmp_path)  # packer build --processor, then make_dataloader
    assert sum(len(r["cu_seq_lens_q"]) - 1 for r in rows) == len(chats) and rows[0]["position_ids"].shape[0] == 4
    model = prepare(copy.deepcopy(model), processor=processor)
    _check_row_losses(model, _eager_copy(model), rows)
    losses = train_loop(model, rows, steps=3, progress=False)
    assert losses[-1] < losses[0]
