"""Image+text builds (docs/images.md), Qwen2.5-VL end to end, against transformers' own processor.

The processor is built offline from its class defaults (the PIL image processor), the real Qwen3 tokenizer
(it holds Qwen's vision tokens) and the Qwen2.5-VL chat template TRL ships; the images are real
photographs (matplotlib's sample data) at several sizes and aspect ratios, and synthetic ones in the odd
modes (grayscale, CMYK, alpha, animated, EXIF-rotated). The references never share packer's image code:
the processor opens each file itself (``{"type": "image", "image": path}``), and positions come from a
tiny random Qwen2.5-VL model's own ``get_rope_index``."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import need_shared, one_line

from packer import BuildConfig, build
from packer.cli import main
from packer.contract import schema
from packer.errors import ConfigError, RecordError

PIL = pytest.importorskip("PIL.Image")
matplotlib_cbook = pytest.importorskip("matplotlib.cbook")


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> Path:
    import trl
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(need_shared("tokenizers/qwen3")))
    folder = tmp_path_factory.mktemp("qwen2_5_vl_processor")
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text((Path(trl.__file__).parent / "chat_templates" / "qwen2_5_vl.jinja").read_text())
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return folder


def _images(folder: Path) -> list[str]:
    """Real photographs at several sizes and aspect ratios, and synthetic images in the odd modes."""
    from PIL import Image

    hopper = Image.open(matplotlib_cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    shutil.copy(matplotlib_cbook.get_sample_data("grace_hopper.jpg", asfileobj=False), folder / "hopper.jpg")
    hopper.resize((300, 120)).save(folder / "hopper_wide.png")
    hopper.crop((100, 0, 190, 400)).save(folder / "hopper_tall.jpg", quality=90)
    Image.new("L", (80, 60), 128).save(folder / "gray.png")
    Image.new("CMYK", (70, 90), (10, 200, 30, 0)).save(folder / "cmyk.jpg")
    Image.new("RGBA", (64, 64), (255, 0, 0, 100)).save(folder / "alpha.png")
    frames = [Image.new("P", (50, 40), c) for c in (1, 2)]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:])
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated a quarter turn: 120 wide as stored, 120 high as seen
    hopper.resize((120, 56)).save(folder / "rotated.jpg", exif=exif.tobytes())
    return ["hopper.jpg", "hopper_wide.png", "hopper_tall.jpg", "gray.png", "cmyk.jpg", "alpha.png", "animated.gif",
            "rotated.jpg"]


def _record(i: int, images: list) -> dict:
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"What is in picture set {i}?"}]
    messages = [{"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": f"Answer number {i}."}]}]
    if i % 4 == 1:  # a second turn, its image in the middle of the text
        messages += [{"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "image"},
                                                   {"type": "text", "text": "this?"}]},
                     {"role": "assistant", "content": "Also that."}]
    return {"messages": messages, "images": images + (["gray.png"] if i % 4 == 1 else [])}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("image_data")
    names = _images(folder)
    groups = [[names[0]], [names[1], names[2]], [], [names[3]], [names[4], names[5]], [names[6]], [names[7]], []]
    with open(folder / "data.jsonl", "w") as f:
        for i, group in enumerate(groups):
            f.write(json.dumps(_record(i, group)) + "\n")
    return folder


@pytest.fixture(scope="module")
def built(data, processor_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("image_build")
    build(BuildConfig(source=str(data / "data.jsonl"), out=str(out), processor=str(processor_dir), pack="bfd",
                      max_len=2048, num_proc=1))
    return out


def _processor(processor_dir):
    from packer.contract.vision import load_processor

    return load_processor(str(processor_dir))


def _reference(processor, record: dict, folder: Path, tensors: bool = False):
    """The processor's own output for one record, opening its image files itself."""
    messages, images = json.loads(json.dumps(record["messages"])), iter(record["images"])
    for message in messages:
        if isinstance(message["content"], list):
            for part in message["content"]:
                if part["type"] == "image":
                    part["image"] = str(folder / next(images))
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         **({"return_tensors": "pt"} if tensors else {}))


def _segments(out: Path):
    """(example id, ids, labels, row's images) of every segment of the build, in order."""
    records = []
    for shard in sorted(out.glob("shard-*.arrow")):
        table = schema.open_shard(shard).to_pylist()
        for row in table:
            at = 0
            for example, n in zip(row["example_ids"], row["seq_lens"], strict=True):
                ids = row["input_ids"][at:at + n]
                mask = row["loss_mask"][at:at + n]
                records.append((example, ids, mask, row))
                at += n
    return records


def test_every_record_is_the_processors_tokens_and_trains_only_its_answers(built, data, processor_dir):
    processor = _processor(processor_dir)
    lines = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    segments = _segments(built)
    assert sorted(e for e, *_ in segments) == list(range(len(lines)))  # every record accounted for
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_id = processor.image_token_id
    for example, ids, mask, _ in segments:
        ref = _reference(processor, lines[example], data)["input_ids"][0]
        assert ids[:-1] == ref and ids[-1] == eos, example  # token for token, the appended EOS aside
        trained = processor.tokenizer.decode([t for t, m in zip(ids, mask) if m])
        answers = [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
                   for m in lines[example]["messages"] if m["role"] == "assistant"]
        assert trained == "".join(a + "<|im_end|>" for a in answers)
        assert not any(m for t, m in zip(ids, mask) if t == image_id)
    manifest = schema.read_manifest(built)
    assert manifest.tokenizer["processor"]["class"] == "Qwen2_5_VLProcessor"
    assert manifest.stats.examples_read == len(lines) and manifest.stats.examples_dropped == 0


def test_each_image_is_stored_once_as_its_source_bytes(built, data):
    sources = {p.read_bytes() for p in data.iterdir() if p.suffix != ".jsonl"}
    lines = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    stored, source_bytes = [], sum(len((data / n).read_bytes()) for r in lines for n in r["images"])
    for shard in sorted(built.glob("shard-*.arrow")):
        for row in schema.open_shard(shard).to_pylist():
            stored += row["images"]
            assert len(row["image_tokens"]) == len(row["images"]) and len(row["image_sizes"]) == 2 * len(row["images"])
    assert set(stored) <= sources and sum(map(len, stored)) == source_bytes  # never pixels, never re-encoded
    assert sum(p.stat().st_size for p in built.glob("shard-*.arrow")) <= 1.1 * source_bytes + 65536


def test_the_loader_yields_the_processors_vision_inputs_and_the_models_positions(built, data, processor_dir):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    from packer import make_dataloader

    processor = _processor(processor_dir)
    config = Qwen2_5_VLConfig(text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                           "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 152000,
                                           "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
                              vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 16,
                                             "intermediate_size": 16})
    model = Qwen2_5_VLModel(config)
    lines = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    row_examples = [row["example_ids"] for shard in sorted(built.glob("shard-*.arrow"))
                    for row in schema.open_shard(shard).to_pylist()]
    batches = list(make_dataloader(built, shuffle=False))
    assert len(batches) == len(row_examples) == schema.read_manifest(built).stats.rows
    eos = torch.tensor([[processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]])
    for batch, examples in zip(batches, row_examples, strict=True):
        refs = [_reference(processor, lines[e], data, tensors=True) for e in examples]
        with_images = [r for r in refs if "pixel_values" in r]
        if with_images:  # the processor's output for each example alone, concatenated, bit for bit
            assert torch.equal(batch["pixel_values"], torch.cat([r["pixel_values"] for r in with_images]))
            assert torch.equal(batch["image_grid_thw"], torch.cat([r["image_grid_thw"] for r in with_images]))
        else:
            assert "pixel_values" not in batch and "image_grid_thw" not in batch
        positions = [model.get_rope_index(torch.cat([r["input_ids"], eos], 1),  # the appended EOS: text
                                          mm_token_type_ids=torch.cat([r["mm_token_type_ids"], eos * 0], 1),
                                          image_grid_thw=r.get("image_grid_thw"))[0] for r in refs]
        assert batch["position_ids"].shape == (4, 1, batch["input_ids"].shape[1])
        assert torch.equal(batch["position_ids"][1:], torch.cat(positions, dim=2))
        cu = batch["cu_seq_lens_q"].tolist()
        assert torch.equal(batch["position_ids"][0, 0], torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])]))
        assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == processor.image_token_id).long())


def test_parquet_with_datasets_image_dicts_builds_the_same_tokens(built, data, processor_dir, tmp_path):
    lines = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({  # as datasets writes them: messages a list of structs, images its Image feature's dicts
        "messages": pa.array([r["messages"] for r in _as_parts(lines)]),
        "images": pa.array([[{"bytes": (data / n).read_bytes(), "path": n} for n in r["images"]] for r in lines],
                           pa.list_(image)),
    })
    pq.write_table(table, tmp_path / "data.parquet")
    out = tmp_path / "out"
    build(BuildConfig(source=str(tmp_path / "data.parquet"), out=str(out), processor=str(processor_dir), pack="bfd",
                      max_len=2048, num_proc=1))
    assert [s[:3] for s in _segments(out)] == [s[:3] for s in _segments(built)]


def _as_parts(lines: list[dict]) -> list[dict]:
    """Every message's content as a list of parts (Parquet needs one type per column)."""
    out = []
    for r in lines:
        messages = [{**m, "content": m["content"] if isinstance(m["content"], list) else
                     [{"type": "text", "text": m["content"]}]} for m in r["messages"]]
        out.append({**r, "messages": messages})
    return out


def _bomb(path: Path, size: int = 20_000) -> None:
    """A real 20,000 x 20,000 1-bit PNG (50 MB of zero rows, deflated to ~50 kB)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\0" * (1 + size // 8)
    raw = zlib.compress(row * size, 9)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


BAD_IMAGES = {"missing": "image_missing", "undecodable": "image_undecodable", "count": "image_count",
              "bomb": "image_too_large"}  # case: the reason a skipped record is counted under


def _bad_image_source(tmp_path: Path, data: Path, cases: list[str]) -> dict:
    """A good record, one bad record for each of ``cases`` (records 2, 3, ...), and a good one after them."""
    bad = {"missing": _record(2, ["nowhere.png"]), "count": {**_record(2, ["gray.png"]), "images": []},
           "undecodable": _record(2, ["broken.jpg"]), "bomb": _record(2, ["bomb.png"])}
    if "bomb" in cases:
        _bomb(tmp_path / "bomb.png")
    shutil.copy(data / "hopper.jpg", tmp_path / "hopper.jpg")
    shutil.copy(data / "gray.png", tmp_path / "gray.png")
    (tmp_path / "broken.jpg").write_bytes((data / "hopper.jpg").read_bytes()[:2000])
    lines = [_record(0, ["hopper.jpg"]), *(bad[case] for case in cases), _record(3, ["gray.png"])]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return dict(source=str(tmp_path / "data.jsonl"), num_proc=1)


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_a_bad_image_names_its_record_and_image(case, data, processor_dir, tmp_path):
    config = {**_bad_image_source(tmp_path, data, [case]), "processor": str(processor_dir)}
    with pytest.raises(RecordError) as e:
        build(BuildConfig(out=str(tmp_path / "a"), **config))
    assert "record 2" in str(e.value) and e.value.reason == BAD_IMAGES[case] and "\n" not in str(e.value)
    assert case == "count" or "image 1 of 1" in str(e.value)


def test_bad_images_are_skipped_and_counted_each_under_its_reason(data, processor_dir, tmp_path):
    """One build over every kind of bad image (a skip build per kind before: each proved here, and that the
    records after a skipped one are read as they are)."""
    config = {**_bad_image_source(tmp_path, data, list(BAD_IMAGES)), "processor": str(processor_dir)}
    result = build(BuildConfig(out=str(tmp_path / "b"), on_error="skip", **config))
    stats = result.manifest.stats
    assert stats.dropped_by_reason == dict.fromkeys(BAD_IMAGES.values(), 1) and stats.examples_packed == 2


def test_the_cli_refuses_a_bad_image_in_one_line(data, processor_dir, tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps(_record(0, ["nowhere.png"])) + "\n")
    result = CliRunner().invoke(main, ["build", str(tmp_path / "data.jsonl"), "--processor", str(processor_dir),
                                       "--out", str(tmp_path / "out"), "-j", "1", "-q"])
    line = one_line(result)
    assert "record 1" in line and "nowhere.png" in line and "--on-error skip" in line


def test_packing_never_cuts_an_image(data, processor_dir, tmp_path):
    for mode in ({"pack": "wrap"}, {"overlong": "split"}):
        with pytest.raises(ConfigError, match="image"):
            BuildConfig(source="x.jsonl", out="o", processor=str(processor_dir), **mode)
    long_text = _record(0, ["hopper_wide.png"])  # 44 image tokens, then a long answer: truncated after the image
    long_text["messages"][1]["content"][0]["text"] = "word " * 300
    cut = _record(3, ["hopper.jpg"])  # 378 image tokens past --max-len 200: dropped, counted
    lines = [long_text, cut, _record(2, [])]
    for name in ("hopper_wide.png", "hopper.jpg"):
        shutil.copy(data / name, tmp_path / name)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for pack in ("batch", "bfd", "optimal"):
        out = tmp_path / pack
        result = build(BuildConfig(source=str(tmp_path / "data.jsonl"), out=str(out), processor=str(processor_dir),
                                   max_len=200, pack=pack, num_proc=1))
        stats = result.manifest.stats
        assert stats.dropped_by_reason == {"image_over_max_len": 1} and stats.examples_truncated == 1
        segments = _segments(out)
        assert sorted(e for e, *_ in segments) == [0, 2]
        first = next(s for s in segments if s[0] == 0)
        assert len(first[1]) == 200 and first[3]["image_tokens"] == [44]


def test_a_text_build_has_no_image_columns(tmp_path):
    """The image columns are optional: a build without --processor has none (test_digests pins its bytes)."""
    result = build(BuildConfig(source="flan", out=str(tmp_path / "t"), limit=20))
    assert not result.manifest.row_format.images
    assert "processor" not in result.manifest.tokenizer
    assert "images" not in schema.open_shard(next((tmp_path / "t").glob("shard-*.arrow"))).schema.names


def test_verify_checks_the_image_columns_and_rederives_the_tokens(built, data, tmp_path):
    from conftest import rewrite_column

    from packer.checking.verify import verify

    report = verify(built, source=str(data / "data.jsonl"))
    lines = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    assert report.ok, [str(p) for p in report.problems]
    assert report.checked["images"] == sum(len(r["images"]) for r in lines)
    from PIL import Image, ImageOps

    changed = tmp_path / "changed_source"  # the same records, one picture replaced by another of its size
    shutil.copytree(data, changed)
    ImageOps.mirror(Image.open(data / "hopper_wide.png")).save(changed / "hopper_wide.png")
    problems = [str(p) for p in verify(built, source=str(changed / "data.jsonl")).problems]
    assert any("other images than their source" in p for p in problems), problems
    for column, change, expect in (
        ("image_tokens", lambda v, o: v.__setitem__(0, v[0] + 1), "the processor gives"),
        ("images", lambda v, o: v.__setitem__(0, v[0][:300]), "does not decode"),
    ):
        copy = tmp_path / column
        shutil.copytree(built, copy)
        rewrite_column(next(copy.glob("shard-*.arrow")), column, change)
        problems = [str(p) for p in verify(copy).problems if p.check == "images"]
        assert any(expect in p for p in problems), problems


def test_inspect_shows_each_segments_images_and_marks_their_spans(built):
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", str(built), "--row", "0", "--full"])
    assert result.exit_code == 0, result.output
    table = schema.open_shard(next(built.glob("shard-*.arrow"))).to_pylist()[0]
    assert result.output.count("image(s):") == sum(1 for n in _per_segment_images(table) if n)
    assert "⟦image: " in result.output and "<|image_pad|>" not in result.output
    shown = json.loads(runner.invoke(main, ["inspect", str(built), "--row", "0", "--json"]).output)
    assert [i["tokens"] for s in shown["segments"] for i in s.get("images", [])] == table["image_tokens"]
    summary = json.loads(runner.invoke(main, ["inspect", str(built), "--json"]).output)["images"]
    stored = [b for shard in built.glob("shard-*.arrow") for row in schema.open_shard(shard).to_pylist() for b in row["images"]]
    assert summary == {"images": len(stored), "bytes": sum(map(len, stored)), "processor": "Qwen2_5_VLProcessor"}


def _per_segment_images(row: dict) -> list[int]:
    """Images per segment, from the row's image tokens and counts alone."""
    ids, at, out, k = row["input_ids"], 0, [], 0
    for n in row["seq_lens"]:
        tokens = sum(1 for t in ids[at:at + n] if t == 151655)
        m = 0
        while tokens > 0:
            tokens -= row["image_tokens"][k]
            k, m = k + 1, m + 1
        out.append(m)
        at += n
    return out


def test_llava_style_records_and_pil_images(data, processor_dir, tmp_path):
    """LLaVA-style data (``image`` + ``conversations`` with ``<image>``) is chat data with image parts."""
    from PIL import Image

    from packer.building.images import read_image

    shutil.copy(data / "hopper.jpg", tmp_path / "hopper.jpg")
    record = {"id": "a", "image": "hopper.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWho is this?"}, {"from": "gpt", "value": "Grace Hopper."}]}
    (tmp_path / "llava.jsonl").write_text(json.dumps(record) + "\n")
    build(BuildConfig(source=str(tmp_path / "llava.jsonl"), out=str(tmp_path / "out"), processor=str(processor_dir),
                      num_proc=1))
    (example, ids, mask, _), = _segments(tmp_path / "out")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWho is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Grace Hopper."}]}]
    reference = _reference(_processor(processor_dir), {"messages": messages, "images": ["hopper.jpg"]}, tmp_path)
    assert ids[:-1] == reference["input_ids"][0]
    # a PIL image (what `datasets` decodes an Image feature to) is stored as the bytes of the file it came from
    assert read_image(Image.open(tmp_path / "hopper.jpg"), None, "image 1").data == (tmp_path / "hopper.jpg").read_bytes()


def test_a_mix_of_image_sources_keeps_each_examples_images(built, data, processor_dir, tmp_path):
    import numpy as np

    from packer.building.mix import positions_sources
    from packer.checking.verify import verify

    lines = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    second = tmp_path / "second"
    second.mkdir()
    shutil.copy(data / "hopper_wide.png", second / "w.png")
    other = [{"messages": _record(10 + i, ["w.png"])["messages"][:2], "images": ["w.png"]} for i in range(6)]
    (second / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in other))
    parts = ({"source": str(data / "data.jsonl"), "weight": 0.5}, {"source": str(second / "other.jsonl"), "weight": 0.5})
    out = tmp_path / "mix"
    result = build(BuildConfig(source="mix", mix=parts, out=str(out), processor=str(processor_dir), pack="bfd",
                               max_len=4096, num_proc=1, limit=10))
    processor = _processor(processor_dir)
    source = positions_sources(list(parts), 0, result.manifest.stats.examples_read)
    for example, ids, _, _ in _segments(out):
        k = int(source[example])
        index = int(np.sum(source[:example] == k))
        record, folder = (lines[index], data) if k == 0 else (other[index], second)
        assert ids[:-1] == _reference(processor, record, folder)["input_ids"][0]
    report = verify(out)
    assert report.ok and report.checked["images"] > 0, [str(p) for p in report.problems]


def test_dataloader_workers_decode_and_preprocess_the_same_batches(built):
    import torch

    from packer import make_dataloader

    alone = list(make_dataloader(built, shuffle=False))
    workers = list(make_dataloader(built, shuffle=False, num_workers=2))
    assert len(alone) == len(workers)
    for a, b in zip(alone, workers, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_a_processors_tokenizer_folder_is_the_default_processor_for_records_with_images(data, processor_dir, tmp_path):
    with_images = build(BuildConfig(source=str(data / "data.jsonl"), out=str(tmp_path / "a"),
                                    tokenizer=str(processor_dir), num_proc=1, limit=3))
    assert with_images.manifest.config.processor == str(processor_dir) and with_images.manifest.row_format.images
    (tmp_path / "text.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                  {"role": "assistant", "content": "Hello."}]}) + "\n")
    text = build(BuildConfig(source=str(tmp_path / "text.jsonl"), out=str(tmp_path / "b"), tokenizer=str(processor_dir),
                             num_proc=1))
    assert text.manifest.config.processor is None and not text.manifest.row_format.images


def test_shards_are_cut_by_their_image_bytes_too(processor_dir, tmp_path):
    """--shard-size counts a row's images: two rows of a 1.2 MB image each make two 1 MB shards."""
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(0).integers(0, 256, (640, 640, 3), dtype=np.uint8)  # incompressible
    Image.fromarray(noise).save(tmp_path / "noise.png")
    lines = [_record(i, ["noise.png"]) for i in (0, 2)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = build(BuildConfig(source=str(tmp_path / "data.jsonl"), out=str(tmp_path / "out"), processor=str(processor_dir),
                               batch_size=1, shard_size_mb=1, num_proc=1))
    assert len(result.manifest.shards) == 2


def test_a_hub_processor_that_is_not_in_the_cache_is_one_line_offline(data, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(main, ["build", str(data / "data.jsonl"), "--processor", "nobody-packer/no-such-vlm",
                                       "--tokenizer", "bundled", "--out", str(tmp_path / "out"), "-q"])
    line = one_line(result)
    assert "--processor nobody-packer/no-such-vlm" in line and "download it" in line


def test_an_interrupted_image_build_resumes_to_the_same_bytes(built, data, processor_dir, tmp_path, monkeypatch):
    """Stopped after its first commit, with the second chunk's images already appended past the marker
    (image_spill truncates them there), the rerun resumes from the committed records and writes the very
    bytes of the uninterrupted build: two-record chunks over the 8 records, stopped at the second commit."""
    from packer.building import spill

    monkeypatch.setattr(spill, "CHUNK", 2)
    monkeypatch.setattr(spill, "COMMIT_RECORDS", 2)
    real, calls = spill._commit, []

    def commit(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(*a)

    monkeypatch.setattr(spill, "_commit", commit)
    out = tmp_path / "out"
    config = BuildConfig(source=str(data / "data.jsonl"), out=str(out), processor=str(processor_dir), pack="bfd",
                         max_len=2048, num_proc=1)
    with pytest.raises(KeyboardInterrupt):
        build(config)
    staged = out / schema.STAGING / schema.TOKENS_DIR
    assert (staged / "images.bin").stat().st_size > 0 and not (out / schema.MANIFEST_NAME).exists()
    monkeypatch.setattr(spill, "_commit", real)
    result = build(config)
    assert result.resumed == 2  # the first chunk's records, not tokenized again
    files = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert files == {p.relative_to(built): p.read_bytes() for p in sorted(built.rglob("*")) if p.is_file()}
