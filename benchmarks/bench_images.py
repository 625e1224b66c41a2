"""Figures for image+text builds (docs/images.md): bytes on disk against the source, build time against the
processor alone over the same records, and the loader's rows/s and images/s (0 and 2 workers) against
TRL's VLM collator on padded batches of 8.

    python benchmarks/bench_images.py [--records 96]

Needs the Qwen3 tokenizer in ../shared/data/tokenizers/qwen3, trl and matplotlib (its sample photograph).
The processor is Qwen2.5-VL's, built offline from its class defaults as tests/test_images.py builds it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def processor_folder(folder: Path) -> Path:
    import trl
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3")).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text((Path(trl.__file__).parent / "chat_templates" / "qwen2_5_vl.jinja").read_text())
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return folder


def data(folder: Path, records: int) -> list[dict]:
    """Records of one or two real photographs (matplotlib's, at four sizes and aspect ratios) and a question."""
    import matplotlib.cbook as cbook
    from PIL import Image

    photo = Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    shutil.copy(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False), folder / "p0.jpg")
    for k, size in enumerate(((640, 480), (320, 200), (200, 360)), start=1):
        photo.resize(size).save(folder / f"p{k}.jpg", quality=90)
    out = []
    for i in range(records):
        names = [f"p{i % 4}.jpg"] + ([f"p{(i + 1) % 4}.jpg"] if i % 3 == 0 else [])
        parts = [{"type": "image"} for _ in names] + [{"type": "text", "text": f"Describe picture set {i} in detail."}]
        out.append({"messages": [{"role": "user", "content": parts},
                                 {"role": "assistant", "content": [{"type": "text", "text": "A portrait. " * (5 + i % 20)}]}],
                    "images": names})
    with open(folder / "data.jsonl", "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=96)
    args = parser.parse_args()
    from PIL import Image

    from packer import BuildConfig, build, make_dataloader
    from packer.contract.vision import load_processor

    tmp = Path(tempfile.mkdtemp(prefix="bench_images_"))
    proc_dir = processor_folder(tmp / "processor")
    src = tmp / "src"
    src.mkdir()
    records = data(src, args.records)
    processor = load_processor(str(proc_dir))

    def with_paths(record):
        images = iter(record["images"])
        return [{**m, "content": [{**p, "image": str(src / next(images))} if p["type"] == "image" else p
                                  for p in m["content"]]} for m in record["messages"]]

    t = time.perf_counter()  # the processor alone: every record tokenized with its images (files opened by it)
    for r in records:
        processor.apply_chat_template(with_paths(r), tokenize=True, return_dict=True)
    alone = time.perf_counter() - t
    t = time.perf_counter()
    result = build(BuildConfig(source=str(src / "data.jsonl"), out=str(tmp / "out"), processor=str(proc_dir),
                               pack="bfd", max_len=8192, num_proc=1))
    built = time.perf_counter() - t
    stats = result.manifest.stats
    shard_bytes = sum(s.bytes for s in result.manifest.shards)
    image_count = sum(len(r["images"]) for r in records)
    image_bytes = sum((src / n).stat().st_size for r in records for n in r["images"])
    print(f"records {len(records)}, images {image_count}, tokens {stats.tokens:,}, rows {stats.rows}")
    print(f"source: {image_bytes:,} image bytes (as referenced) + {(src / 'data.jsonl').stat().st_size:,} JSONL")
    print(f"shards: {shard_bytes:,} bytes = {shard_bytes / stats.tokens:.2f} B/token, {shard_bytes / image_count:,.0f} "
          f"B/image; {shard_bytes / image_bytes:.3f}x the images' source bytes")
    print(f"build {built:.2f} s (processor loaded, imports warm) vs the processor alone {alone:.2f} s: "
          f"{built / alone:.2f}x")

    for workers in (0, 2):
        loader = make_dataloader(tmp / "out", shuffle=False, num_workers=workers)
        t = time.perf_counter()
        rows = images = 0
        for batch in loader:
            rows += 1
            images += 0 if "image_grid_thw" not in batch else len(batch["image_grid_thw"])
        dt = time.perf_counter() - t
        print(f"loader, {workers} workers: {rows / dt:.1f} rows/s, {images / dt:.1f} images/s ({stats.tokens / dt:,.0f} tokens/s)")

    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collator = DataCollatorForVisionLanguageModeling(processor)
    t = time.perf_counter()
    images = 0
    for lo in range(0, len(records), 8):
        batch = [{"messages": r["messages"], "images": [Image.open(src / n) for n in r["images"]]}
                 for r in records[lo:lo + 8]]
        out = collator(batch)
        images += len(out["image_grid_thw"])
    dt = time.perf_counter() - t
    print(f"TRL VLM collator, padded batches of 8: {len(records) / 8 / dt:.1f} batches/s, {images / dt:.1f} images/s, "
          f"{len(records) / dt:.1f} examples/s")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
