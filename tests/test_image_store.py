"""The token store for image builds (packer.building.image_entry): an image build keeps its tokens and images, a
later build that differs only in what acts after tokenizing re-plans from them, byte-identical to a
``--no-cache`` build (whole, under another --limit, extended, and a mix re-drawn); --max-len is keyed where the
encoder drops an example whose cut falls in an image, and a dropped record's images are pinned too; an image
file changed, replaced or removed since is never served from the store; a damaged entry is found, removed and
tokenized again with one warning.

The processor and images are test_images.py's (a Qwen2.5-VL processor on the real Qwen3 tokenizer; real
photographs and odd-mode images); each test builds on its own copy of the images, so it may change them."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from store_tools import damage_entry, entry_dirs
from test_images import _record, data, processor_dir  # noqa: F401 - the fixtures, shared

from packer import BuildConfig, build, cache
from packer.building import image_entry, kept_tokenizers
from packer.checking.verify import verify
from packer.errors import RecordError

PIL = pytest.importorskip("PIL.Image")


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def own(data, tmp_path) -> Path:  # noqa: F811
    """A copy of the image data, its gray image rewritten uncompressed (so other pixels keep its size)."""
    folder = tmp_path / "images"
    shutil.copytree(data, folder)
    PIL.new("L", (80, 60), 128).save(folder / "gray.png", compress_level=0)
    return folder


def config(own: Path, processor_dir: Path, out: Path, **options) -> BuildConfig:  # noqa: F811
    return BuildConfig(source=str(own / "data.jsonl"), out=str(out), processor=str(processor_dir), num_proc=1,
                       overwrite=True, **{"pack": "bfd", "max_len": 2048, "overlong": "drop", **options})


_COLD: dict[tuple, dict[str, str]] = {}  # a --no-cache build's files, by its options and the images' bytes


def cold(own: Path, processor_dir: Path, out: Path, **options) -> dict[str, str]:  # noqa: F811
    """The files a ``--no-cache`` build of ``options`` makes of the images as they are now (made once)."""
    k = (str(own), tuple(sorted(options.items())), tuple(sorted(digest(own).items())))
    if k not in _COLD:
        build(config(own, processor_dir, out, cache=False, **options))
        _COLD[k] = digest(out)
    return _COLD[k]


# what acts after tokenizing, changed: an image build re-plans from its entry
CHANGED = (dict(max_len=4096, seed=3, format_version=1), dict(pack="batch", epochs=2))


def test_an_image_build_replans_byte_identical_and_verifies(own, processor_dir, tmp_path):  # noqa: F811
    first = build(config(own, processor_dir, tmp_path / "first"))
    assert not first.replanned and len(entry_dirs()) == 1
    entry = entry_dirs()[0]
    meta = json.loads((entry / "meta.json").read_text())
    assert set(image_entry.FILES) <= set(meta["files"]) and (entry / "images.bin").stat().st_size > 0
    assert {Path(f["path"]).name for f in meta[image_entry.LISTED]} == {
        "hopper.jpg", "hopper_wide.png", "hopper_tall.jpg", "gray.png", "cmyk.jpg", "alpha.png", "animated.gif",
        "rotated.jpg"}
    for changed in CHANGED:
        result = build(config(own, processor_dir, tmp_path / "replan", **changed))
        assert result.replanned and not result.warnings, changed
        assert digest(tmp_path / "replan") == cold(own, processor_dir, tmp_path / "cold", **changed), changed
    report = verify(str(tmp_path / "replan"), source=str(own / "data.jsonl"), progress=False)
    assert report.ok, [str(p) for p in report.problems]
    # under --overlong truncate the encoder drops an example whose cut falls in an image: --max-len is keyed, and
    # the dropped records' images (not stored) are pinned by the bytes an encode of each alone reads
    truncate = dict(overlong="truncate", max_len=100)
    first = build(config(own, processor_dir, tmp_path / "truncate", **truncate))
    assert not first.replanned and first.manifest.stats.dropped_by_reason == {"image_over_max_len": 2}
    assert not build(config(own, processor_dir, tmp_path / "other", overlong="truncate", max_len=200)).replanned
    assert len(entry_dirs()) == 3  # --overlong drop's (no --max-len in it), and one for each --max-len truncated at
    again = build(config(own, processor_dir, tmp_path / "truncate", seed=7, **truncate))
    assert again.replanned and digest(tmp_path / "truncate") == cold(own, processor_dir, tmp_path / "cold", seed=7,
                                                                      **truncate)
    PIL.new("RGB", (28, 28), (0, 0, 0)).save(own / "hopper.jpg")  # record 1's, which dropped: now it fits
    again = build(config(own, processor_dir, tmp_path / "truncate", seed=7, **truncate))
    assert not again.replanned and again.manifest.stats.dropped_by_reason == {"image_over_max_len": 1}
    assert digest(tmp_path / "truncate") == cold(own, processor_dir, tmp_path / "cold", seed=7, **truncate)


def test_an_image_file_changed_since_is_never_served(own, processor_dir, tmp_path):  # noqa: F811
    """Rewritten with other pixels of the same size, replaced by one of another size, removed: each time the
    build tokenizes (or fails, or skips, as a --no-cache build does), and its new entry is used after."""
    build(config(own, processor_dir, tmp_path / "first"))
    before = (own / "gray.png").stat().st_size
    PIL.new("L", (80, 60), 129).save(own / "gray.png", compress_level=0)
    assert (own / "gray.png").stat().st_size == before
    for change in ("pixels", "size"):
        if change == "size":
            PIL.new("L", (160, 90), 128).save(own / "gray.png")
        again = build(config(own, processor_dir, tmp_path / "again", seed=5))
        assert not again.replanned and not again.warnings, change
        assert digest(tmp_path / "again") == cold(own, processor_dir, tmp_path / "cold", seed=5), change
    assert build(config(own, processor_dir, tmp_path / "third", seed=6)).replanned  # the entry of the files now
    (own / "gray.png").unlink()
    with pytest.raises(RecordError, match="'gray.png': cannot be read"):
        build(config(own, processor_dir, tmp_path / "again", seed=5))
    assert entry_dirs() == []  # the entry of the files as they were is gone
    skip = build(config(own, processor_dir, tmp_path / "again", seed=5, on_error="skip"))
    assert not skip.replanned and skip.manifest.stats.dropped_by_reason == {"image_missing": 3}
    assert entry_dirs() == []  # what decided those skips (a file missing) is in no stored byte: no entry kept
    assert digest(tmp_path / "again") == cold(own, processor_dir, tmp_path / "cold", seed=5, on_error="skip")
    # a file that cannot be read now (a symlink to itself: not missing, an OSError of its own) is changed too
    PIL.new("L", (80, 60), 128).save(own / "gray.png", compress_level=0)
    assert not build(config(own, processor_dir, tmp_path / "fourth", on_error="skip")).replanned and entry_dirs()
    (own / "gray.png").unlink()
    (own / "gray.png").symlink_to("gray.png")
    loop = build(config(own, processor_dir, tmp_path / "loop", seed=5, on_error="skip"))
    assert not loop.replanned and digest(tmp_path / "loop") == cold(own, processor_dir, tmp_path / "cold", seed=5,
                                                                   on_error="skip")


def test_a_processor_whose_configuration_changed_is_another_build(own, processor_dir, tmp_path):  # noqa: F811
    """The processor's fingerprint holds its configuration files (a processor_config.json setting decides Gemma 3's
    and LLaVA's image tokens): one edited since the entry was made is another build, tokenized, never re-planned."""
    mine = tmp_path / "processor"
    shutil.copytree(processor_dir, mine)
    first = build(config(own, mine, tmp_path / "first"))
    settings = json.loads((mine / "processor_config.json").read_text())
    (mine / "processor_config.json").write_text(json.dumps({**settings, "image_seq_length": 64}))
    again = build(config(own, mine, tmp_path / "again", seed=3))
    assert not again.replanned
    assert again.manifest.tokenizer["processor"]["fingerprint"] != first.manifest.tokenizer["processor"]["fingerprint"]
    assert build(config(own, mine, tmp_path / "third", seed=4)).replanned  # the entry of the processor as it is now


def test_a_damaged_image_entry_is_removed_and_tokenized_again(own, processor_dir, tmp_path):  # noqa: F811
    """Its images altered, its image index cut short, its meta.json gone, or the image files it lists edited (a file
    dropped from the listing, then changed: the meta's own sha256 finds it): found, the entry removed and the
    source tokenized again with one warning, the new entry used after."""
    build(config(own, processor_dir, tmp_path / "first"))
    for damage in ("images", "index", "no_meta", "listing"):
        [entry] = entry_dirs()
        if damage == "images":  # a bit flipped: the sha256 finds it
            data = bytearray((entry / "images.bin").read_bytes())
            data[len(data) // 2] ^= 1
            (entry / "images.bin").write_bytes(bytes(data))
        elif damage == "index":  # cut short: the size finds it
            with open(entry / "image_index.bin", "r+b") as f:
                f.truncate((entry / "image_index.bin").stat().st_size - 8)
        elif damage == "listing":
            meta = json.loads((entry / "meta.json").read_text())
            meta[image_entry.LISTED] = [f for f in meta[image_entry.LISTED] if not f["path"].endswith("gray.png")]
            (entry / "meta.json").write_text(json.dumps(meta))
            PIL.new("L", (80, 60), 131).save(own / "gray.png", compress_level=0)
        else:
            damage_entry(entry, damage)
        result = build(config(own, processor_dir, tmp_path / "again", **CHANGED[0]))
        assert not result.replanned and len(result.warnings) == 1 and "was not used" in result.warnings[0], damage
        assert digest(tmp_path / "again") == cold(own, processor_dir, tmp_path / "cold", **CHANGED[0]), damage
    assert build(config(own, processor_dir, tmp_path / "third", seed=4)).replanned


def test_under_a_limit_an_entry_is_extended_or_its_first_records_taken(own, processor_dir, tmp_path):  # noqa: F811
    assert not build(config(own, processor_dir, tmp_path / "a", limit=3)).replanned
    # beyond the entry: its records read and tokenized alone, their images appended, the entry replaced
    more = build(config(own, processor_dir, tmp_path / "b", limit=6))
    assert more.replanned and more.extended == (3,) and not more.warnings
    assert digest(tmp_path / "b") == cold(own, processor_dir, tmp_path / "cold", limit=6)
    assert verify(str(tmp_path / "b"), source=str(own / "data.jsonl"), progress=False).ok
    [entry] = entry_dirs()
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["counts"]["records"] == 6 and len(meta[image_entry.LISTED]) == 7  # records 0-5 read 7 files
    fewer = build(config(own, processor_dir, tmp_path / "c", limit=4, seed=1))  # within it: its first records'
    assert fewer.replanned and fewer.extended is None
    assert digest(tmp_path / "c") == cold(own, processor_dir, tmp_path / "cold", limit=4, seed=1)
    (own / "hopper_wide.png").write_bytes((own / "hopper.jpg").read_bytes())  # read by record 1: not extended
    again = build(config(own, processor_dir, tmp_path / "e", limit=8))
    assert not again.replanned and again.extended is None


def test_a_mix_of_image_sources_is_redrawn_from_its_parts_entries(own, processor_dir, tmp_path):  # noqa: F811
    """Each part's tokens and images kept apart (split out of the mix's spill), re-drawn under another seed, and
    extended by a larger --limit: each build byte-identical to its --no-cache build, each image its example's."""
    second = tmp_path / "second"
    second.mkdir()
    shutil.copy(own / "hopper_wide.png", second / "w.png")
    shutil.copy(own / "gray.png", second / "g.png")
    other = [{"messages": _record(10 + i, ["w.png"])["messages"][:2], "images": [["w.png"], ["g.png"]][i % 2]}
             for i in range(6)]
    (second / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in other))
    parts = ({"source": str(own / "data.jsonl"), "weight": 0.5}, {"source": str(second / "other.jsonl"), "weight": 0.5})

    def mixed(out: Path, **options) -> BuildConfig:
        return BuildConfig(source="mix", mix=parts, out=str(out), processor=str(processor_dir), pack="bfd",
                           max_len=4096, num_proc=1, overwrite=True, **options)

    assert not build(mixed(tmp_path / "mix", limit=6)).replanned and len(entry_dirs()) == 2
    for options in (dict(limit=6, seed=1), dict(limit=10, seed=1)):
        result = build(mixed(tmp_path / "mix", **options))
        assert result.replanned and not result.warnings, options
        build(mixed(tmp_path / "cold", cache=False, **options))
        assert digest(tmp_path / "mix") == digest(tmp_path / "cold"), options
    assert result.extended is not None and sum(result.extended) > 0
    report = verify(str(tmp_path / "mix"))
    assert report.ok and report.checked["images"] > 0, [str(p) for p in report.problems]



def test_a_replan_from_a_processor_met_before_imports_neither_transformers_nor_torch(own, processor_dir, tmp_path):  # noqa: F811
    """The processor's facts kept by the first build: a re-plan from the shell loads no processor (nor imports
    transformers, whose processing modules import torch), byte-identical to a --no-cache build."""
    build(config(own, processor_dir, tmp_path / "first"))
    code = ("import sys; from packer.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nprint(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    args = [str(own / "data.jsonl"), "--out", str(tmp_path / "replan"), "--processor", str(processor_dir), "--pack",
            "bfd", "--max-len", "4096", "--overlong", "drop", "-j", "1", "-q"]
    done = subprocess.run([sys.executable, "-c", code, "build", *args], capture_output=True, text=True, check=True)
    assert "re-planned from cached tokens" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    assert digest(tmp_path / "replan") == cold(own, processor_dir, tmp_path / "cold", max_len=4096)


def test_processor_facts_damaged_or_of_a_changed_folder_are_not_used(own, processor_dir, tmp_path):  # noqa: F811
    """Facts kept damaged (their JSON edited) or of another shape: the processor is loaded, the build re-plans
    byte-identical and the facts are kept sound again. The folder's preprocessor_config.json edited (a smaller
    size limit): the facts kept are not its, the build's identity differs and it tokenizes."""
    processor = tmp_path / "processor"
    shutil.copytree(processor_dir, processor)
    build(config(own, processor, tmp_path / "first"))
    [kept] = (cache.Cache(kept_tokenizers.PROCESSOR_FACTS).folder).glob("*.json")
    sound = kept.read_bytes()
    digest_line, _, body = sound.partition(b"\n")
    reshaped = json.dumps({"record": {}}).encode()
    build(config(own, processor, tmp_path / "cold", seed=2, cache=False))
    for damage in (digest_line + b"\n" + body.replace(b"<|image_pad|>", b"<|video_pad|>"),
                   hashlib.sha256(reshaped).hexdigest().encode() + b"\n" + reshaped):
        kept.write_bytes(damage)
        again = build(config(own, processor, tmp_path / "again", seed=2))
        assert again.replanned and not again.warnings
        assert digest(tmp_path / "again") == digest(tmp_path / "cold")
        assert kept.read_bytes() == sound
    settings = json.loads((processor / "preprocessor_config.json").read_text())
    settings["size"]["longest_edge"] = 128 * 28 * 28
    (processor / "preprocessor_config.json").write_text(json.dumps(settings))
    changed = build(config(own, processor, tmp_path / "changed", seed=2))
    assert not changed.replanned and len(list(kept.parent.glob("*.json"))) == 2
    assert changed.manifest.tokenizer["processor"]["fingerprint"] != again.manifest.tokenizer["processor"]["fingerprint"]
    build(config(own, processor, tmp_path / "cold", seed=2, cache=False))
    assert digest(tmp_path / "changed") == digest(tmp_path / "cold")


def test_a_processor_changed_while_the_build_runs_is_refused(own, processor_dir, tmp_path):  # noqa: F811
    """The build reads its processor's facts (its identity, its manifest record) when it opens the source and loads
    the processor only when it tokenizes: a folder changed between the two is refused in one line, never tokenized
    by another processor than the one recorded; facts read while the folder changes are not kept."""
    from packer.building import pipeline, processor_facts
    from packer.building.tokenization import load_tokenizer
    from packer.errors import ConfigError

    mine = tmp_path / "processor"
    shutil.copytree(processor_dir, mine)
    cfg = config(own, mine, tmp_path / "out")
    opened = pipeline.open_source(cfg, load_tokenizer(str(mine)), skip_errors=False,
                                  processors=processor_facts.PROCESSORS)
    settings = json.loads((mine / "preprocessor_config.json").read_text())
    (mine / "preprocessor_config.json").write_text(json.dumps({**settings, "merge_size": 4}))
    with pytest.raises(ConfigError, match="its files changed while the build ran"):
        opened.encoder.ready()
    before = processor_facts.PROCESSORS.key(mine)
    (mine / "processor_config.json").write_text((mine / "processor_config.json").read_text() + " ")
    processor_facts.PROCESSORS.keep(mine, {"any": 1}, before)  # read under another key than the folder's now
    assert processor_facts.PROCESSORS.get(mine) is None
