"""Fine-tune a vision-language model (Qwen2.5-VL style) on packed rows with images, on the CPU.

    python examples/vlm_sft.py [--data chats.jsonl] [--steps 20] [--max-len 512] [--trainer loop|sft]

Each line of ``--data`` is a chat ``{"messages": [...], "images": ["a.jpg", ...]}`` (an image item
``{"type": "image"}`` in a message's content where each image goes, in order, the paths relative to the
file); without it, a demo set of question/answer chats about crops of matplotlib's sample photographs.
The model is a tiny random Qwen2.5-VL (benchmarks/vlm_tiny.py) with its processor, saved as a processor
folder.

The data goes through packer as any user's would: ``packer build`` with ``--processor`` (each example the
processor's tokens, its images stored once), then ``make_dataloader``: each row's tokens and labels, its
images' ``pixel_values``/``image_grid_thw`` in token order, each example's own 3-D positions from the
model's ``get_rope_index`` and the boundaries as ``cu_seq_lens_*`` (docs/images.md).
``packer.prepare(model, processor=processor)`` switches the text model to ``packer_varlen`` after probing
it with images; the vision tower keeps its own attention (per image). Each example's loss in a row equals
its loss alone (tests/test_vlm_train.py).

``--trainer sft``: TRL's ``SFTTrainer`` on the same rows (one row a micro-batch, the collator hands the row
on as it is); ``loop``: a plain PyTorch loop with a progress bar. ``make_rows`` packs chats by hand, as
the build does (the benchmark's path: benchmarks/bench_vlm.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from packer import prepare

try:
    from benchmarks.vlm_tiny import build, chat_example, packed_row, save_processor
except ModuleNotFoundError:  # `python examples/vlm_sft.py`: sys.path holds examples/, not the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.vlm_tiny import build, chat_example, packed_row, save_processor

SAMPLES = Path(__import__("matplotlib").get_data_path()) / "sample_data"
PHOTOS = ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png")


def demo_chats(n: int = 24) -> list[tuple[list, list[dict]]]:
    """(images, messages): crops of real photographs at varied sizes and shapes, a few text-only chats."""
    from PIL import Image

    photos = [Image.open(SAMPLES / name).convert("RGB") for name in PHOTOS]
    gen = torch.Generator().manual_seed(0)
    chats = []
    for i in range(n):
        k = [0, 1, 1, 2][i % 4]
        images = []
        for j in range(k):
            photo = photos[(i + j) % len(photos)]
            w, h = photo.size
            cw, ch = (int(x) for x in torch.randint(40, min(w, h), (2,), generator=gen))
            x, y = int(torch.randint(0, w - cw + 1, (1,), generator=gen)), int(torch.randint(0, h - ch + 1, (1,), generator=gen))
            images.append(photo.crop((x, y, x + cw, y + ch)))
        question = "Describe the picture." if k == 1 else "Compare them." if k else f"What is {i} plus {i}?"
        answer = f"A crop of {images[0].size[0]} by {images[0].size[1]}." if images else f"{2 * i}."
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        chats.append((images, [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]))
    return chats


def read_chats(path: str) -> list[tuple[list, list[dict]]]:
    from transformers.image_utils import load_image

    chats = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            chats.append(([load_image(str(Path(path).parent / p)) for p in record.get("images", [])], record["messages"]))
    return chats


def make_rows(model, processor, chats, max_tokens: int) -> list[dict]:
    """The chats as examples alone, packed first-fit (longest first) into rows of at most ``max_tokens``."""
    exs = [chat_example(model, processor, images, messages) for images, messages in chats]
    exs = [e for e in exs if e["input_ids"].shape[1] <= max_tokens]
    bins: list[list[dict]] = []
    for ex in sorted(exs, key=lambda e: -e["input_ids"].shape[1]):
        n = ex["input_ids"].shape[1]
        room = next((b for b in bins if sum(e["input_ids"].shape[1] for e in b) + n <= max_tokens), None)
        if room is None:
            bins.append([ex])
        else:
            room.append(ex)
    return [packed_row(b) for b in bins]


def train_loop(model, rows: list[dict], steps: int, lr: float = 1e-3, progress: bool = True) -> list[float]:
    """``steps`` optimizer steps of one packed row each (cycling); returns each step's mean token loss."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    bar = tqdm(total=steps, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    for i in range(steps):
        loss = model(**rows[i % len(rows)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.4f}")
    bar.close()
    return losses


def sft_trainer(model, processor, rows: list[dict], steps: int, output_dir: str, lr: float = 1e-3,
                progress: bool = True, trainer_cls=None):  # fmt: skip
    """TRL's SFTTrainer on packed rows: a dataset of row numbers, a collator that hands each row on as is."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=1, learning_rate=lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=not progress,
        dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False, max_length=None,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"row": list(range(len(rows)))})
    return (trainer_cls or SFTTrainer)(model=model, args=args, train_dataset=dataset, processing_class=processor,
                                       data_collator=lambda features: rows[features[0]["row"]])  # fmt: skip


def build_rows(processor, chats, max_len: int, workdir: Path) -> list[dict]:
    """``chats`` through ``packer build --processor`` and ``make_dataloader``: the loader's rows."""
    from packer import make_dataloader
    from packer.building.pipeline import build as build_shards
    from packer.contract.config import BuildConfig

    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "data.jsonl", "w") as f:
        for i, (images, messages) in enumerate(chats):
            names = [f"{i}_{j}.png" for j in range(len(images))]
            for image, name in zip(images, names, strict=True):
                image.save(data / name)
            f.write(json.dumps({"messages": messages, "images": names}) + "\n")
    out = workdir / "shards"
    build_shards(BuildConfig(source=str(data / "data.jsonl"), out=str(out), pack="bfd", max_len=max_len, num_proc=1,
                             processor=str(save_processor(processor, workdir / "processor"))))  # fmt: skip
    return [{k: v for k, v in b.items() if k != "num_items_in_batch"} for b in make_dataloader(out, shuffle=False)]


def main(argv: list[str] | None = None) -> list[float]:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", help="a JSONL of chats with images (default: the demo set)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-len", type=int, default=512, help="the longest example (the build's --max-len)")
    p.add_argument("--trainer", choices=("loop", "sft"), default="loop")
    p.add_argument("--output-dir", default="vlm-sft-out")
    args = p.parse_args(argv)
    model, processor = build("qwen2_5_vl")
    chats = read_chats(args.data) if args.data else demo_chats()
    with tempfile.TemporaryDirectory() as workdir:
        rows = build_rows(processor, chats, args.max_len, Path(workdir))
    prepare(model, processor=processor, max_tokens=max(r["input_ids"].shape[1] for r in rows))
    print(f"{len(rows)} packed rows, {sum(r['input_ids'].shape[1] for r in rows)} tokens, "
          f"{sum(len(r['image_grid_thw']) for r in rows if 'image_grid_thw' in r)} images")  # fmt: skip
    if args.trainer == "sft":
        trainer = sft_trainer(model, processor, rows, args.steps, args.output_dir)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return train_loop(model, rows, args.steps)


if __name__ == "__main__":
    main()
