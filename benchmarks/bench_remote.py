"""Training from a remote build, simulated on this machine (a script, not a test):

    python benchmarks/bench_remote.py [--machines 2 --ranks 2 --workers 2] [--build DIR] [--before REF]

N machines x R ranks x W DataLoader workers read one build served over HTTP on the loopback
(tests/loopback.py: range requests, bytes counted per request path). Each machine is its own cache
folder and its own URL prefix on the server (``/m0/build``, ``/m1/build``), so the server's counts are
bytes fetched per machine. Every rank is a process (``make_dataloader(url, rank, world_size=N*R,
num_workers=W)``) that reads two shuffled epochs; between them the script waits for every rank, so
the counts split by epoch. Then a rerun (new processes, the same caches) reads 20 batches.

Three variants, in one run: ``local`` (the same build read from local disk: the reference), ``before``
(the code at ``--before``, default the merge base with main: a URL's shards read whole into each rank's
heap) and ``after`` (this tree: shards fetched once a machine into the cache, memory-mapped). Printed per
variant: bytes fetched per machine for epoch 0, epoch 1 and the rerun (x the build's bytes), the peak RSS
of a rank process and of its workers (the most of any; RSS counts the page-cache pages a memory map
brings in, which depend on how the file was written), a rank's heap (RssAnon at the epochs' ends), the time to the first batch (cold), and tokens/s
per rank over each epoch against local's.

The build: the bundled sample's records eight times over (one epoch of ~70 MB in 5 shards of 16 MB), made
once in a temporary folder unless ``--build`` names one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _status_mb(key: str) -> float:
    """A /proc/self/status figure in MB: VmHWM (peak resident), RssAnon (resident heap and stacks, not the
    file pages a memory map brings in: those are the page cache's, shared, and dropped under pressure)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rank_main(url: str, rank: int, world: int, workers: int, epochs: int, limit: int | None) -> None:
    """One rank: read ``epochs`` epochs (or ``limit`` batches), waiting on stdin between epochs."""
    start = time.perf_counter()
    from packer.training.loader import make_dataloader

    loader = make_dataloader(url, rank=rank, world_size=world, num_workers=workers, seed=0)
    out = {"rank": rank, "epochs": []}
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        t0, tokens, first = time.perf_counter(), 0, None
        for k, batch in enumerate(loader):
            if first is None:
                first = time.perf_counter() - (start if epoch == 0 else t0)
            tokens += batch["input_ids"].numel()
            if limit is not None and k + 1 >= limit:
                break
        out["epochs"].append({"tokens": tokens, "seconds": time.perf_counter() - t0, "first": first,
                              "anon_mb": _status_mb("RssAnon")})
        print(json.dumps({"done": epoch}), flush=True)
        sys.stdin.readline()  # every rank has finished this epoch: the server's counts are read in between
    out["rss_mb"] = _status_mb("VmHWM")
    out["worker_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps(out), flush=True)


def run_ranks(url_of, n: int, r: int, w: int, epochs: int, limit: int | None, pythonpath: str, caches: Path,
              server, variant: str) -> dict:
    """Start N*R rank processes, step them through the epochs together, return their results and the
    server's bytes per machine per epoch."""
    procs = []
    for m in range(n):
        env = {**os.environ, "PYTHONPATH": pythonpath, "PACKER_CACHE": str(caches / f"{variant}-m{m}"),
               "OMP_NUM_THREADS": "1"}
        for k in range(r):
            cmd = [sys.executable, __file__, "--rank-run", url_of(m), str(m * r + k), str(n * r), str(w), str(epochs),
                   str(limit or 0)]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    fetched = []
    for _ in range(epochs):
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{variant}: a rank died (exit {p.wait()})")
        fetched.append({m: server.served_under[f"m{m}"] for m in range(n)} if server else {})
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
    results = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait()
    return {"ranks": results, "fetched": fetched}


def make_build(out: Path) -> Path:
    src = out.parent / "sample-x8.jsonl"
    with gzip.open(ROOT / "packer" / "data" / "flan_sample.jsonl.gz", "rt") as f:
        records = f.read()
    src.write_text(records * 8)
    subprocess.run([sys.executable, "-m", "packer", "build", str(src), "--recipe", "flan", "--shard-size", "16",
                    "--out", str(out), "--quiet"], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


def before_tree(ref: str, where: Path) -> Path:
    """The package at ``ref`` (its C kernel copied from this tree when the source is the same)."""
    where.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "packer"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    for so in (ROOT / "packer" / "training").glob("_rowkernel*.so"):
        shutil.copy(so, where / "packer" / "training" / so.name)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--build", type=Path)
    parser.add_argument("--before", default=None, help="git ref of the 'before' code (default: merge base with main)")
    parser.add_argument("--variants", default="local,before,after")
    args = parser.parse_args()
    from loopback import FileServer

    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        build = args.build or make_build(tmp / "build")
        build_bytes = sum(p.stat().st_size for p in build.iterdir() if p.is_file())
        shards = sorted(build.glob("shard-*.arrow"))
        www = tmp / "www"
        for m in range(args.machines):
            (www / f"m{m}").mkdir(parents=True)
            (www / f"m{m}" / "build").symlink_to(build.resolve())
        ref = args.before or subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], check=True,
                                            capture_output=True, text=True).stdout.strip()
        paths = {"local": str(ROOT), "after": str(ROOT), "before": str(before_tree(ref, tmp / "before"))}
        n, r, w = args.machines, args.ranks, args.workers
        print(f"build: {build_bytes / 1e6:.1f} MB in {len(shards)} shards; {n} machines x {r} ranks x {w} workers; "
              f"before = {ref[:10]}")
        table = {}
        for variant in args.variants.split(","):
            with FileServer(www) as server:
                url_of = (lambda m: str(build)) if variant == "local" else (lambda m, s=server: f"{s.url}/m{m}/build")
                t0 = time.perf_counter()
                main_run = run_ranks(url_of, n, r, w, 2, None, paths[variant], tmp / "caches", server, variant)
                base = dict(server.served_under)
                rerun = run_ranks(url_of, n, r, w, 1, 20, paths[variant], tmp / "caches", server, variant) \
                    if variant != "local" else None
                wall = time.perf_counter() - t0
                per_epoch = [[f[m] for m in range(n)] for f in main_run["fetched"]]
                e0 = [per_epoch[0][m] for m in range(n)] if variant != "local" else [0] * n
                e1 = [per_epoch[1][m] - per_epoch[0][m] for m in range(n)] if variant != "local" else [0] * n
                again = ([server.served_under[f"m{m}"] - base.get(f"m{m}", 0) for m in range(n)]
                         if rerun else [0] * n)
                ranks = main_run["ranks"]
                table[variant] = {
                    "epoch0_x": max(e0) / build_bytes, "epoch1_x": max(e1) / build_bytes, "rerun_x": max(again) / build_bytes,
                    "rank_rss": max(x["rss_mb"] for x in ranks),
                    "rank_anon": max(e["anon_mb"] for x in ranks for e in x["epochs"]), "worker_rss": max(x["worker_rss_mb"] for x in ranks),
                    "first_s": max(x["epochs"][0]["first"] for x in ranks),
                    "tok_s_e0": sum(x["epochs"][0]["tokens"] / x["epochs"][0]["seconds"] for x in ranks) / len(ranks),
                    "tok_s_e1": sum(x["epochs"][1]["tokens"] / x["epochs"][1]["seconds"] for x in ranks) / len(ranks),
                    "wall_s": wall,
                }
            print(f"  {variant}: done in {wall:.0f}s", flush=True)
        local = table.get("local")
        print("\n| variant | fetched/machine epoch 0 | epoch 1 | rerun | peak RSS rank | heap (RssAnon) rank "
              "| peak RSS worker | first batch | tokens/s/rank epoch 0 | epoch 1 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for variant, t in table.items():
            rel = (lambda a, b: f" ({a / b:.2f}x local)") if local else (lambda a, b: "")
            print(f"| {variant} | {t['epoch0_x']:.2f}x | {t['epoch1_x']:.2f}x | {t['rerun_x']:.2f}x | {t['rank_rss']:.0f} MB "
                  f"| {t['rank_anon']:.0f} MB | {t['worker_rss']:.0f} MB | {t['first_s']:.2f} s | {t['tok_s_e0']:,.0f}"
                  f"{rel(t['tok_s_e0'], local['tok_s_e0']) if local else ''} | {t['tok_s_e1']:,.0f}"
                  f"{rel(t['tok_s_e1'], local['tok_s_e1']) if local else ''} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-run":
        url, rank, world, workers, epochs, limit = sys.argv[2:8]
        rank_main(url, int(rank), int(world), int(workers), int(epochs), int(limit) or None)
    else:
        main()
