"""Benchmark of the rerun's re-check (a script, not a test): python benchmarks/bench_reuse.py [--limit N]

A rerun of the same build into its folder re-checks the finished build before it says "nothing to do"
(``packer.building.output.damage``: the manifest's content hash, every shard's size and sha256, the datasets
files). Prints, for a build of the bundled FLAN-style sample (one process): the build's seconds, the
re-check's seconds with and without the shards' sha256, and the shards' size and hash throughput.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from packer import BuildConfig, build
from packer.building import output
from packer.contract import schema


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=None, help="records of the bundled sample (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        start = time.perf_counter()
        build(BuildConfig(source="flan", out=str(out), limit=args.limit, pack="bfd", max_len=2048, num_proc=1))
        t_build = time.perf_counter() - start
        data = json.loads((out / schema.MANIFEST_NAME).read_bytes())
        size = sum(e["bytes"] for e in data["shards"])

        def best(fn) -> float:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                assert fn() is None
                times.append(time.perf_counter() - start)
            return min(times)

        t_full = best(lambda: output.damage(out, data))
        entries = data["shards"]
        t_manifest = best(lambda: schema.Manifest.from_json(data) and None)
    print(f"rerun re-check: {len(entries)} shard(s), {size / 1e6:,.1f} MB; best of {args.repeats} (warm page cache)")
    print(f"  build (num_proc 1)                {t_build:>9.3f} s")
    print(f"  re-check, manifest hash only      {t_manifest:>9.4f} s")
    print(f"  re-check, with shard sha256s      {t_full:>9.4f} s  ({size / t_full / 1e9:.2f} GB/s; "
          f"{t_full / t_build:.1%} of the build)")


if __name__ == "__main__":
    main()
