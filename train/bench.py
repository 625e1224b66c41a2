"""Padded minibatches vs packer rows, the published table reproduced: FLAN-like and OrcaMath-like data.

    python -m train.bench [--plot docs/train-bench.png]                   # CPU: minutes
    python -m train.bench --device cuda                                   # one GPU: bf16, ~1B Llama
    python -m train.bench --quick                                         # does it all run? seconds

Per dataset, a ``batch``-mode build (B examples per row, in shuffled order) is trained twice from the
same random Llama-shaped model, the same rows in the same order, one row per optimizer step: once as
padded minibatches and once as packer rows (``train.measure`` says how each side runs). Each side
runs ``--repeats`` times, each run in a fresh process (so peak memory is its own), interleaved as
padded, packed, packed, padded, … (a drift of the machine's load hits both sides alike). The table
gives the median and the spread [min–max] of non-padding tokens/s and peak memory, the final loss,
the largest loss difference over all steps, and the packed/padded ratios of the medians. Then the
loader against transformers' ``DataCollatorWithFlattening`` (``train.loader_bench``).

Datasets: ``flan``, the bundled synthetic FLAN-style sample (bundled tokenizer); ``math``, GSM8K
train from ../shared/data (Llama 2 tokenizer) where that folder exists, else the ``orcamath`` recipe
from the Hub (online only; skipped with a line when it cannot be read). ``--shards DIR`` benchmarks
a ``batch``-mode build of your own instead.

Defaults, CPU: the ``cpu`` model (hidden 512, 4 layers: its matmuls, not per-call overhead, dominate a
step), fp32, batch of 4, max-len 512, 1 + 6 steps, one torch thread per run (on a shared machine a
second thread mostly waits for its descheduled twin: measured 4.7 s a step with one thread, 11.9 s
with two, under load). CUDA (needs flash-attn): the ``1b`` model, bf16,
batch of 16, max-len 2,048, 5 + 40 steps; peak memory is ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer import BuildConfig, build
from packer.contract import schema
from packer.errors import PackerError
from train.measure import MODES
from train.model import SIZES

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
LLAMA2 = SHARED / "llama2-tokenizer"

# per device: model size, batch size, max-len, timed steps, warm-up steps, learning rate
DEFAULTS = {
    "cpu": dict(size="cpu", batch_size=4, max_len=512, steps=6, warmup=1, lr=1e-3),
    "cuda": dict(size="1b", batch_size=16, max_len=2048, steps=40, warmup=5, lr=3e-4),
}
for _kind in DEFAULTS.values():
    _kind.update(datasets=["flan", "math"], repeats=3)
QUICK = dict(datasets=["flan"], size="tiny", max_len=256, steps=2, warmup=0, repeats=1)


class BenchError(Exception):
    """A bad argument or a missing requirement, told in one line (exit 2)."""


@dataclass(frozen=True, kw_only=True)
class Dataset:
    key: str
    label: str
    source: str
    recipe: str | None = None
    tokenizer: str | None = None  # None: packer's bundled tokenizer


def datasets() -> dict[str, Dataset]:
    flan = Dataset(key="flan", label="FLAN-like (bundled synthetic sample)", source="flan")
    if (SHARED / "gsm8k_train.jsonl").is_file():
        math = Dataset(key="math", label="OrcaMath-like (GSM8K train, Llama 2 tokenizer)",
                       source=str(SHARED / "gsm8k_train.jsonl"), recipe="gsm8k",
                       tokenizer=str(LLAMA2) if (LLAMA2 / "tokenizer.json").is_file() else None)
    else:
        math = Dataset(key="math", label="OrcaMath-like (orcamath recipe, Hub)", source="orcamath")
    return {"flan": flan, "math": math}


def check_cuda(cuda_available: bool, flash_attn_available: bool) -> None:
    """The CUDA run needs both; refuse in one line otherwise (the facts are arguments so tests can
    check each refusal on a CPU machine)."""
    if not cuda_available:
        raise BenchError("--device cuda: CUDA is not available here (torch.cuda.is_available() is False)")
    if not flash_attn_available:
        raise BenchError(
            "--device cuda needs flash-attn (padded: flash_attention_2, packed: flash_attn_varlen_func): "
            "pip install -e '.[train,flash]'"
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__.split("\n")[0])
    p.add_argument("--datasets", nargs="+", choices=["flan", "math"], help="default: flan math (--quick: flan)")
    p.add_argument("--shards", default=None, help="a batch-mode build of your own instead of --datasets")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--size", choices=list(SIZES), help="model size (default: cpu on CPU, 1b on CUDA)")
    p.add_argument("--batch-size", type=int, help="examples per optimizer step (default 4 CPU, 16 CUDA)")
    p.add_argument("--max-len", type=int, help="longer examples are truncated (default 512 CPU, 2048 CUDA)")
    p.add_argument("--steps", type=int, help="timed optimizer steps per run (default 6 CPU, 40 CUDA)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 1 CPU, 5 CUDA)")
    p.add_argument("--repeats", type=int, help="runs per side, interleaved (default 3)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 1e-3 CPU, 3e-4 CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU run (default 1: steadier on a shared machine)")
    p.add_argument("--plot", default=None, help="write the loss curves and tokens/s to this PNG")
    p.add_argument("--work", default="shards/bench", help="where the builds go (default shards/bench)")
    p.add_argument("--no-loader", action="store_true", help="skip the loader comparison")
    p.add_argument("--quick", action="store_true",
                   help="a check that it all runs, well under a minute on CPU: flan only, the tiny model, max-len 256, "
                        "2 steps, 1 run a side, no loader comparison (the figures are not the published ones)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run, in a fresh process
    args = p.parse_args(argv)
    if args.child:
        return args
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    if kind == "cuda":
        import torch

        check_cuda(torch.cuda.is_available(), importlib.util.find_spec("flash_attn") is not None)
    if args.quick:
        args.no_loader = True
    for name, value in {**DEFAULTS[kind], **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:  # what the command line gives wins, also over --quick
            setattr(args, name, value)
    for name, least in (("steps", 1), ("warmup", 0), ("repeats", 1), ("threads", 1), ("batch_size", 1), ("max_len", 2)):
        if getattr(args, name) < least:
            raise BenchError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {least}")
    if args.plot and not args.plot.endswith(".png"):
        raise BenchError(f"--plot {args.plot}: give a .png file name")
    return args


def prepare_build(ds: Dataset, args: argparse.Namespace) -> Path:
    """The ``batch``-mode build this comparison needs: exactly warmup + steps rows (rebuilt only when
    absent, since the same config gives the same folder)."""
    rows = args.warmup + args.steps
    out = Path(args.work) / f"{ds.key}-b{args.batch_size}-m{args.max_len}-r{rows}"
    build(BuildConfig(source=ds.source, recipe=ds.recipe, tokenizer=ds.tokenizer, out=str(out), pack="batch",
                      batch_size=args.batch_size, max_len=args.max_len, limit=rows * args.batch_size,
                      overwrite=True))
    return out


def loader_build(args: argparse.Namespace) -> Path:
    """2,400 bundled records, rows of 8 (300 rows): enough for a pass to take milliseconds, not microseconds."""
    out = Path(args.work) / "loader-b8-m512"
    build(BuildConfig(source="flan", out=str(out), pack="batch", batch_size=8, max_len=512, limit=2400,
                      overwrite=True))
    return out


def run_side(shards: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side in a fresh process; its result is the last line it prints (JSON)."""
    spec = dict(threads=args.threads, shards=str(shards), mode=mode, steps=args.steps, warmup=args.warmup, size=args.size,
                device=args.device, lr=args.lr)
    cmd = [sys.executable, "-m", "train.bench", "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"the {mode} run on {shards} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(shards: Path, args: argparse.Namespace, progress) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` runs per side, in the order padded, packed, packed, padded, padded, packed, …"""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            runs[mode].append(run_side(shards, mode, args))
            progress(f"  run {r + 1}/{args.repeats} {mode}: {runs[mode][-1]['tokens_per_s']:,.0f} tokens/s")
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    try:
        args = parse(argv)
        if args.child:
            import torch

            from train.measure import run

            spec = json.loads(args.child)
            torch.set_num_threads(spec.pop("threads"))
            print(json.dumps(run(**spec)))
            return {}
        return _bench(args)
    except (BenchError, PackerError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from train import report
    from train.loader_bench import bench_loader, loader_lines

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.shards:
        manifest = schema.read_manifest(args.shards)
        if manifest.config.pack != "batch":
            raise BenchError(f"{args.shards}: built with --pack {manifest.config.pack}; this needs batch")
        targets = {f"{args.shards}": Path(args.shards)}
    else:
        targets = {}
        for key in args.datasets:
            ds = datasets()[key]
            try:
                targets[ds.label] = prepare_build(ds, args)
            except PackerError as e:
                print(f"{ds.label}: skipped, it cannot be built here: {e}")
    cuda = args.device.startswith("cuda")
    memory_kind = "max_memory_allocated" if cuda else "max RSS rise"
    results: dict[str, Any] = {}
    lines = []
    for name, shards in targets.items():
        progress(f"{name}: {args.repeats} runs per side")
        runs = compare(shards, args, progress)
        results[name] = {"runs": runs, "summary": report.summary(runs)}
        lines += report.table(name, results[name]["summary"], memory_kind)
    if results:
        shape = SIZES[args.size]
        head = (f"padded vs packed: {args.size} Llama (hidden {shape.hidden}, {shape.layers} layers, the vocabulary "
                f"of each build's tokenizer), {args.device} {'bf16' if cuda else 'fp32'}, "
                f"batch of {args.batch_size}, max-len {args.max_len}, {args.warmup} untimed + {args.steps} "
                f"timed steps; {args.repeats} runs per side, interleaved; median [min–max]")
        print("\n".join([head, *lines]))
        if args.plot:
            report.plot(results, args.plot, head.split(";")[0])
            print(f"plot: {args.plot}")
    if not args.no_loader:
        loader = bench_loader(Path(args.shards) if args.shards else loader_build(args))
        results["loader"] = loader
        print("\n".join(loader_lines(loader)))
    return results


if __name__ == "__main__":
    main()
