"""The token store for image builds (docs/benchmarks.md, the token store): an image build's first run (the
processor over every image: decode and checks; its tokens and images kept) against a re-plan from its entry with
another ``--max-len`` (every image file the records read re-hashed, nothing decoded), wall seconds, one run each,
imports warm and the processor loaded before either.

    python benchmarks/bench_image_store.py [--records 400] [--shell]

The records are bench_images.py's (four real photographs, one or two a record), and the same records with each
image its own file (every file then re-hashed by the re-plan). Needs what bench_images.py needs. ``--shell``: each
build a ``packer build -j 1 -q`` process of its own (the 4-file records only): the first build, a re-plan with
another ``--max-len``, and a ``--no-cache`` build, each process's start, imports and processor included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_images import data, processor_folder


def own_files(folder: Path, records: list[dict]) -> None:
    """The same records, each image a file of its own (a copy), in ``folder``."""
    out = []
    for i, record in enumerate(records):
        names = []
        for k, name in enumerate(record["images"]):
            shutil.copy(folder.parent / "shared" / name, folder / f"r{i}_{k}.jpg")
            names.append(f"r{i}_{k}.jpg")
        out.append({**record, "images": names})
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))


def timed(source: Path, processor: Path, out: Path, max_len: int) -> tuple[float, bool]:
    from packer import BuildConfig, build

    started = time.perf_counter()
    result = build(BuildConfig(source=str(source), out=str(out), processor=str(processor), pack="bfd",
                               max_len=max_len, overlong="drop", num_proc=1, overwrite=True))
    return time.perf_counter() - started, result.replanned


def shell(source: Path, processor: Path, out: Path, max_len: int, *options: str) -> float:
    """Wall seconds of one ``packer build`` process."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "packer", "build", str(source), "--out", str(out), "--processor",
                    str(processor), "--pack", "bfd", "--max-len", str(max_len), "--overlong", "drop", "-j", "1", "-q",
                    "--overwrite", *options], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--shell", action="store_true", help="each build a process of its own (the 4-file records)")
    args = parser.parse_args()
    if args.shell:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            os.environ["PACKER_CACHE"] = str(root / "cache")
            processor = processor_folder(root / "processor")
            (root / "shared").mkdir()
            data(root / "shared", args.records)
            source = root / "shared" / "data.jsonl"
            print(f"load average before: {os.getloadavg()[0]:.2f}")
            first = shell(source, processor, root / "out", 4096)
            replan = shell(source, processor, root / "out", 8192)
            cold = shell(source, processor, root / "cold", 8192, "--no-cache")
            print(f"shell ({args.records} records, 4 image files): first build {first:.2f} s, re-plan with another "
                  f"--max-len {replan:.2f} s ({replan / first:.0%}), --no-cache build {cold:.2f} s")
            print(f"load average after: {os.getloadavg()[0]:.2f}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["PACKER_CACHE"] = str(root / "cache")
        processor = processor_folder(root / "processor")
        (root / "shared").mkdir()
        records = data(root / "shared", args.records)
        (root / "own").mkdir()
        own_files(root / "own", records)
        from packer import BuildConfig, build

        # imports warm and the processor loaded before either timed build (as bench_images.py times its build)
        build(BuildConfig(source=str(root / "shared" / "data.jsonl"), out=str(root / "warm"), processor=str(processor),
                          limit=4, num_proc=1, cache=False))
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        for name in ("shared", "own"):
            first, _ = timed(root / name / "data.jsonl", processor, root / "out", 4096)
            replan, replanned = timed(root / name / "data.jsonl", processor, root / "out", 8192)
            files = len({f for r in records for f in r["images"]}) if name == "shared" else sum(
                len(r["images"]) for r in records)
            print(f"{name:>6} ({args.records} records, {files} image files): first build {first:.2f} s, re-plan "
                  f"with another --max-len {replan:.2f} s ({replan / first:.1%}; re-planned: {replanned})")
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
