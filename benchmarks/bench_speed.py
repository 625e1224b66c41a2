"""`packer build` against the raw Rust tokenizer on the same texts and cores (a script, not a test).

    python benchmarks/bench_speed.py [--repeat 8] [--runs 5] [--no-peers] [--source-only]

The physical limit of a build here is the tokenizer: ``tokenizers.Tokenizer.encode_batch`` over the
same formatted texts, batches of 1,000, its Rust threads on every core. Data: the bundled FLAN-style
sample repeated ``--repeat`` times as one JSONL file (8 → 48,000 records), the Llama 2 tokenizer
(../shared/data/llama2-tokenizer), ``--pack bfd``. Each round runs, each in its own process:

1. raw:    the texts (formatted beforehand by packer's own Formatter, untimed) are read, then only the
           ``encode_batch`` calls are timed: the tokenizer's tokens/s, nothing else in it;
2. packer: ``python -m packer.cli build FILE --recipe flan -t LLAMA2 --pack bfd -q`` timed from the shell,
           process start to exit (manifest written), with an empty ``HF_DATASETS_CACHE`` (cold cache) and no
           tokens in packer's cache, the tokenizer met before (its parts kept by an untimed ``--limit 10``
           build first: what every build after a tokenizer's first finds); then the same with ``--no-cache``
           (the tokenizer loaded by transformers, nothing kept);
3. peers:  ``datasets.map`` + TRL ``pack_dataset`` + ``save_to_disk`` (``bench_build.peers_build``), in
           a fresh process with a cold cache too, timed from process start to exit.

Rounds are interleaved (raw, packer, peers, raw, packer, ...) and each figure is the best of
``--runs``: the machine is shared, so a ratio is meaningful only between runs made close together;
each round's own ratios are printed too, and their median and range end the table (a round's sides run back
to back, so the machine's drift, up to a quarter between minutes here, moves them alike: the best of each side
pairs runs from different minutes), and the CPU seconds of every side (the raw side's are those of its
``encode_batch`` calls; packer's and the peers' of the whole process tree), which a busy machine disturbs less
than wall time.
tokens/s counts the raw tokenizer's tokens of the texts for every side (the same work: packer adds
one EOS per example and truncates at --max-len, which would only flatter it). Then the small case:
``packer build flan`` with every default (bundled tokenizer, 6,000 records), wall time from the shell
with a cold cache, best of ``--runs``, beside its floor: the bundled tokenizer's ``encode_batch`` calls
over the sample's texts, and a bare ``python -c pass`` (the interpreter's own start).

packer's modules run compiled, as an installed package's are (pip compiles them when it installs): the
untimed first builds write their bytecode into the run's temporary folder (``PYTHONPYCACHEPREFIX``), which
the timed ones read. An editable checkout in an environment that sets ``PYTHONDONTWRITEBYTECODE`` (this
project's) compiles every module at every start instead, ~0.15 s of a build's start-up here;
``--source-only`` times that. The figures end as a Markdown table, ready for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA2 = ROOT.parent / "shared" / "data" / "llama2-tokenizer"
BUNDLED_TOKENIZER = ROOT / "packer" / "data" / "tokenizer"
SAMPLE = ROOT / "packer" / "data" / "flan_sample.jsonl.gz"

RAW = r"""
import json, sys, time
from tokenizers import Tokenizer
texts = json.load(open(sys.argv[1]))
tok = Tokenizer.from_file(sys.argv[2])
tokens, t, cpu = 0, time.perf_counter(), time.process_time()
for i in range(0, len(texts), 1000):
    tokens += sum(map(len, tok.encode_batch(texts[i : i + 1000])))  # len(e): no id lists built
print(time.perf_counter() - t, tokens, time.process_time() - cpu)
"""

PEERS = r"""
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from bench_build import peers_build
peers_build(sys.argv[2], "flan", Path(sys.argv[3]), 4096, 1)
"""


def formatted_texts(source: Path) -> list[str]:
    """The texts packer tokenizes for ``source`` under the flan recipe, by packer's own Formatter."""
    from packer import BuildConfig
    from packer.building.formatting import Formatter, make_spec
    from packer.contract.recipes import RECIPES

    records = [json.loads(line) for line in source.open()]
    spec = make_spec(recipe=RECIPES["flan"], config=BuildConfig(source=str(source), out="-"), columns=list(records[0]))
    formatter = Formatter(spec)
    return ["".join(text for text, _ in formatter(r)) for r in records]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (the process and every child it waited for) and stdout of ``cmd``."""
    t, cpu = time.perf_counter(), children_cpu()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{done.stderr[-2000:]}")
    return seconds, children_cpu() - cpu, done.stdout


SOURCE_ONLY = False  # --source-only: packer's modules compiled at every start (no bytecode kept)


def cold_env(tmp: Path) -> dict[str, str]:
    """A cold `datasets` cache, and packer's cache (``$PACKER_CACHE``) without tokens: what a first build of
    new data finds. The tokenizer's kept parts stay (``packer.building.kept_tokenizers.TOKENIZERS``: a tokenizer
    met before, as on any machine after its first build); ``--no-cache`` runs show the build without them.
    packer's bytecode is kept in ``tmp`` (an installed package's modules are compiled), unless --source-only."""
    cache = tmp / "hf-datasets-cache"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(tmp / "packer-cache" / "tokens", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_CACHE": str(cache),
           "PACKER_CACHE": str(tmp / "packer-cache")}
    if not SOURCE_ONLY:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=8, help="copies of the 6,000-record sample (8: 48,000 records)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved rounds: each side's best, and each round's ratios' "
                    "median")
    ap.add_argument("--no-peers", action="store_true", help="skip datasets.map + TRL pack_dataset")
    ap.add_argument("--llama2", type=Path, default=LLAMA2, help="the Llama 2 tokenizer folder (default: ../shared/data)")
    ap.add_argument("--source-only", action="store_true", help="packer's modules compiled at every start, as in an "
                    "editable checkout under PYTHONDONTWRITEBYTECODE (default: compiled once, as installed)")
    args = ap.parse_args()
    global SOURCE_ONLY
    SOURCE_ONLY = args.source_only
    llama2 = args.llama2
    if not (llama2 / "tokenizer.json").is_file():
        raise SystemExit(f"{llama2} is absent")
    tmp = Path(tempfile.mkdtemp(prefix="bench_speed-"))
    try:
        source = tmp / f"flan_x{args.repeat}.jsonl"
        sample = gzip.decompress(SAMPLE.read_bytes())
        source.write_bytes(sample * args.repeat)
        texts = tmp / "texts.json"
        texts.write_text(json.dumps(formatted_texts(source)))
        n = 6000 * args.repeat
        print(f"cores {os.cpu_count()}, {n:,} records ({source.stat().st_size / 1e6:.0f} MB JSONL), Llama 2 "
              f"tokenizer, --pack bfd, best of {args.runs} interleaved rounds (shared machine: compare within this run)")
        timed([sys.executable, "-m", "packer.cli", "build", str(source), "--recipe", "flan", "-t", str(llama2),
               "--limit", "10", "--out", str(tmp / "warm"), "-q"], cold_env(tmp))  # keeps the tokenizer's parts
        timed([sys.executable, "-m", "packer.cli", "build", "flan", "--limit", "10", "--out", str(tmp / "warm-small"),
               "-q"], cold_env(tmp))
        best: dict[str, float] = {}  # side -> best wall seconds
        cpu: dict[str, float] = {}  # side -> CPU seconds of that best run
        # per round: packer's tokens/s over raw's, and its speed over the peers': each side run minutes apart in
        # one round, so the machine's drift (up to a quarter between minutes here) moves both alike
        rounds: dict[str, list[float]] = {"raw": [], "peers": []}
        tokens = 0
        for r in range(args.runs):
            _, _, out = timed([sys.executable, "-c", RAW, str(texts), str(llama2 / "tokenizer.json")], dict(os.environ))
            wall, count, encode_cpu = out.split()
            tokens = int(count)
            figures = {"raw": (float(wall), float(encode_cpu))}  # the encode_batch calls alone
            packer = [sys.executable, "-m", "packer.cli", "build", str(source), "--recipe", "flan", "-t", str(llama2),
                      "--pack", "bfd", "--out", str(tmp / "packer-out"), "--overwrite", "-q"]
            wall, used, _ = timed(packer, cold_env(tmp))
            figures["packer"] = (wall, used)
            wall, used, _ = timed([*packer, "--no-cache"], cold_env(tmp))
            figures["packer --no-cache"] = (wall, used)
            if not args.no_peers:
                wall, used, _ = timed([sys.executable, "-c", PEERS, str(ROOT / "benchmarks"), str(source),
                                       str(tmp / "peers-out")], cold_env(tmp))
                figures["peers"] = (wall, used)
            for k, (wall, used) in figures.items():
                if wall < best.get(k, float("inf")):
                    best[k], cpu[k] = wall, used
            ratio = figures["raw"][0] / figures["packer"][0]  # (the first round's packer run keeps the tokenizer)
            rounds["raw"].append(ratio)
            if "peers" in figures:
                rounds["peers"].append(figures["peers"][0] / figures["packer"][0])
            print(f"  round {r + 1}: " + ", ".join(f"{k} {w:.2f} s wall / {c:.2f} s CPU" for k, (w, c) in figures.items())
                  + f"; packer at {ratio:.1%} of raw in this round", flush=True)
        small_source = tmp / "flan_x1.jsonl"
        small_source.write_bytes(sample)
        small_texts = tmp / "small-texts.json"
        small_texts.write_text(json.dumps(formatted_texts(small_source)))
        small, small_cold, floor, start = [], [], [], []
        for _ in range(args.runs):
            _, _, out = timed([sys.executable, "-c", RAW, str(small_texts), str(BUNDLED_TOKENIZER / "tokenizer.json")],
                              dict(os.environ))
            floor.append(float(out.split()[0]))
            start.append(timed([sys.executable, "-c", "pass"], dict(os.environ))[0])
            default = [sys.executable, "-m", "packer.cli", "build", "flan", "--out", str(tmp / "small-out"),
                       "--overwrite", "-q"]
            small.append(timed(default, cold_env(tmp))[0])
            small_cold.append(timed([*default, "--no-cache"], cold_env(tmp))[0])
        print(f"packer build flan (6,000 records, every default, no tokens cached, from the shell): best {min(small):.2f} "
              f"s of {', '.join(f'{w:.2f}' for w in small)}; with --no-cache: best {min(small_cold):.2f} s of "
              f"{', '.join(f'{w:.2f}' for w in small_cold)}")
        print(f"  its floor: the bundled tokenizer's encode_batch over the same texts, both cores: best "
              f"{min(floor):.2f} s of {', '.join(f'{w:.2f}' for w in floor)}; python start-up {min(start):.2f} s")
        table(best, cpu, tokens, n, args, (min(small), min(small_cold), min(floor), min(start)), rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def spread(values: list[float], fmt: str) -> str:
    """The median of ``values`` with their range, as docs/benchmarks.md shows figures."""
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def table(best: dict[str, float], cpu: dict[str, float], tokens: int, n: int, args, small: tuple[float, ...],
          rounds: dict[str, list[float]]) -> None:
    """The run's figures as the Markdown table docs/benchmarks.md shows: the best wall time of each side, and
    the ratios each round gave (its sides run back to back), median [min–max]."""
    load = os.getloadavg()[0]
    print(f"\n| {n:,} records, {tokens / 1e6:.1f}M tokens, Llama 2, `--pack bfd`, best of {args.runs} "
          f"(load average {load:.1f} at the end{', modules from source' if args.source_only else ''}) "
          "| wall s | tokens/s | of raw | CPU s |")
    print("|---|---|---|---|---|")
    for name, key in (("raw `encode_batch` (both cores)", "raw"), ("`packer build` (whole process)", "packer"),
                      ("`packer build --no-cache`", "packer --no-cache"), ("`datasets.map` + TRL `pack_dataset`", "peers")):
        if key in best:
            print(f"| {name} | {best[key]:.2f} | {tokens / best[key] / 1e6:.2f}M | {best['raw'] / best[key]:.1%} "
                  f"| {cpu[key]:.1f} |")
    if "peers" in best:
        print(f"| packer vs `datasets.map` + TRL | | | **{best['peers'] / best['packer']:.2f}x** | |")
    print(f"| per round, median [min–max] of {args.runs}: packer of raw | | | **{spread(rounds['raw'], '.1%')}** | |")
    if rounds["peers"]:
        print(f"| per round: packer vs `datasets.map` + TRL | | | **{spread(rounds['peers'], '.2f')}x** | |")
    build, cold, floor, start = small
    print(f"| `packer build flan` (6,000 records, bundled tokenizer, every default) | {build:.2f} "
          f"(`--no-cache` {cold:.2f}) | | floor: `encode_batch` {floor:.2f} s, python {start:.2f} s | |")


if __name__ == "__main__":
    main()
