"""The row kernel (packer/training/_rowkernel.c) fuzzed under AddressSanitizer and UBSan (a script, not a test;
.ci/run runs it where a C compiler is):

    python tests/fuzz_kernel.py [--calls N] [--seed S]

It compiles the kernel apart, with ``-fsanitize=address,undefined`` (a few seconds, into a temporary folder),
then runs itself again in a Python that preloads the sanitizers' runtime and imports that build, and makes
N calls (default 20,000) with arguments drawn around a valid row: each buffer's type, length and offset,
the row's offsets and segments, the bit start, a missing labels buffer, read-only and strided buffers,
and outputs laid over each other or over the inputs (views of one allocation). A call either returns the
textbook row (compared with numpy) or raises TypeError, ValueError, BufferError or OverflowError; any
read or write outside a buffer, overlapping copy or undefined arithmetic aborts the run (the sanitizers'
report, exit code non-zero). Exit 0 with one line of counts otherwise."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parent.parent / "packer" / "training" / "_rowkernel.c"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]


def build(folder: Path, source: Path = SOURCE) -> Path:
    """The kernel (``source``) compiled with the sanitizers into ``folder``."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("fuzz_kernel: no C compiler here")
    out = folder / ("_rowkernel" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-shared", "-fPIC", *SANITIZE, f"-I{sysconfig.get_paths()['include']}", str(source),
                    "-o", str(out)], check=True)
    return out


def runtime(cc: str, name: str) -> str:
    found = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.path.isabs(found):
        sys.exit(f"fuzz_kernel: {cc} has no {name} (the sanitizers' runtime)")
    return found


def reference(ids, pos, labels, bit_start, seq_lens, o0, o1, s0, s1):
    """The textbook row: ids and positions widened, labels widened or selected by the mask's bits (or all
    -100), each token's segment and the cumulative lengths."""
    n = o1 - o0
    out_ids = ids[o0:o1].astype(np.int64)
    if labels is None:
        out_labels = np.full(n, -100, np.int64)
    elif bit_start < 0:
        out_labels = labels[o0:o1].astype(np.int64)
    else:
        bits = np.unpackbits(labels, bitorder="little")[bit_start + o0 : bit_start + o1].astype(bool)
        out_labels = np.where(bits, out_ids, -100)
    lens = seq_lens[s0:s1].astype(np.int64)
    return (out_ids, pos[o0:o1].astype(np.int64), out_labels, np.repeat(np.arange(lens.size), lens).astype(np.int32),
            np.r_[0, np.cumsum(lens)].astype(np.int32))


def draw(rng: np.random.Generator, pool: np.ndarray):
    """One call's arguments: a valid row, then a few of its parts damaged; ``pool`` is one allocation that
    overlapping buffers are views of."""
    segs = [int(x) for x in rng.integers(1, 40, rng.integers(1, 6))]
    n = sum(segs)
    before, after = int(rng.integers(0, 20)), int(rng.integers(0, 20))  # the row inside larger columns
    o0, o1 = before, before + n
    total = before + n + after
    id_type = rng.choice([np.uint16, np.uint32, np.int32])
    ids = rng.integers(0, np.iinfo(id_type).max, total, dtype=np.int64).astype(id_type)
    pos = rng.integers(0, 1 << 15, total).astype(rng.choice([np.uint16, np.uint32, np.int32]))
    if rng.random() < 0.5:
        bit_start = int(rng.integers(0, 64))
        size = (bit_start + total + 7) // 8 + int(rng.integers(0, 3))
        if rng.random() < 0.5:
            labels = rng.integers(0, 256, size, dtype=np.uint8)
        else:  # runs, as real loss masks are: whole bytes and words set or clear (the kernel's copies and fills)
            bits = np.zeros(size * 8, bool)
            for a in rng.integers(0, size * 8, (int(rng.integers(1, 4)), 2)):
                bits[min(a) : max(a)] = True
            labels = np.packbits(bits, bitorder="little")
    else:
        bit_start, labels = -1, rng.integers(-100, 1000, total).astype(np.int32)
    lead = int(rng.integers(0, 3))
    seq_lens = np.array([int(x) for x in rng.integers(1, 9, lead)] + segs + [3], np.int32)
    s0, s1 = lead, lead + len(segs)
    outs = [np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int32),
            np.empty(s1 - s0 + 1, np.int32)]
    args = [ids, pos, labels, bit_start, seq_lens, o0, o1, s0, s1, *outs]
    overlapped = False
    for _ in range(int(rng.integers(0, 4))):  # damage: a few parts at a time
        # a view numpy cannot make of an earlier damage's buffer: no damage this time
        with contextlib.suppress(ValueError, TypeError):
            overlapped |= _damage(rng, pool, args, n, total)
    return args, overlapped


def _damage(rng: np.random.Generator, pool: np.ndarray, args: list, n: int, total: int) -> bool:
    """One part of ``args`` damaged in place; True when an output was laid over another buffer."""
    overlapped = False
    what = int(rng.integers(0, 12))
    if what == 0:  # an offset anywhere, huge or negative included
        args[int(rng.integers(5, 9))] = int(rng.choice([-1, 0, 1, n, total, total + 1, 2**31, 2**62, 2**63 - 1]))
    elif what == 1:  # a buffer of another type
        k = int(rng.choice([0, 1, 2, 4, 9, 10, 11, 12, 13]))
        if isinstance(args[k], np.ndarray):
            args[k] = args[k].view(np.uint8)[: (args[k].nbytes // 8) * 8].view(
                rng.choice([np.uint8, np.int16, np.int32, np.int64, np.float32, np.uint32]))
    elif what == 2:  # a buffer shorter or longer
        k = int(rng.choice([0, 1, 2, 4, 9, 10, 11, 12, 13]))
        if isinstance(args[k], np.ndarray):
            args[k] = args[k][: int(rng.integers(0, args[k].size + 1))] if rng.random() < 0.7 else \
                np.resize(args[k], args[k].size + int(rng.integers(1, 5)))
    elif what == 3:  # the bit start
        args[3] = int(rng.choice([-1, -2, 0, 7, 63, 64, 10**6, 2**62, 2**63 - 1]))
    elif what == 4:  # a filler's missing labels
        args[2] = None
    elif what == 5:  # seq_lens damaged: negative, zero, huge
        if isinstance(args[4], np.ndarray) and args[4].dtype == np.int32 and args[4].size:
            lens = args[4].copy()
            lens[int(rng.integers(0, lens.size))] = int(rng.choice([-1, 0, 2**31 - 1, -(2**31)]))
            args[4] = lens
    elif what == 6:  # a read-only output
        k = int(rng.integers(9, 14))
        if not isinstance(args[k], np.ndarray):
            return False
        args[k] = args[k].copy()
        args[k].flags.writeable = False
    elif what == 7:  # a strided buffer
        k = int(rng.choice([0, 1, 9, 12]))
        if isinstance(args[k], np.ndarray):
            args[k] = np.repeat(args[k], 2)[::2]
    elif what in (8, 9, 10):  # an output laid over another buffer: both views of one allocation
        k = int(rng.integers(9, 14))
        v = int(rng.choice([k2 for k2 in (0, 1, 2, 4, 9, 10, 11, 12, 13) if k2 != k]))
        out, other = args[k], args[v]
        if not (isinstance(out, np.ndarray) and isinstance(other, np.ndarray)) or not out.flags.writeable:
            return False
        if out.nbytes + other.nbytes + 64 > pool.nbytes:
            return False
        at = 8 * int(rng.integers(0, (pool.nbytes - other.nbytes) // 8))
        pool[at : at + other.nbytes] = other.view(np.uint8).ravel()
        args[v] = pool[at : at + other.nbytes].view(other.dtype)
        shift = 8 * int(rng.integers(-(out.nbytes // 8), other.nbytes // 8 + 1))  # overlapping, aligned
        start = min(max(at + shift, 0), pool.nbytes - out.nbytes)
        start -= start % 8
        args[k] = pool[start : start + out.nbytes].view(out.dtype)
        overlapped = True
    else:  # not a buffer at all
        args[int(rng.choice([0, 4, 9]))] = [1, 2, 3]
    return overlapped


def fuzz(module_path: str, calls: int, seed: int) -> None:
    spec = importlib.util.spec_from_file_location("_rowkernel", module_path)
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    rng = np.random.default_rng(seed)
    pool = np.zeros(1 << 16, np.uint8)
    counts = {"rows": 0, "refused": 0, "overlaps refused": 0}
    for i in range(calls):
        args, overlapped = draw(rng, pool)
        try:
            kernel.decode(*args)
        except (TypeError, ValueError, BufferError, OverflowError) as e:
            counts["refused"] += 1
            counts["overlaps refused"] += "overlaps" in str(e)
            continue
        # a call that returns: its row is the textbook one, and no output shared memory with another buffer
        assert not overlapped or not _shares(args), f"call {i}: overlapping outputs were accepted"
        expected = reference(*args[:9])
        for got, want in zip(args[9:], expected, strict=True):
            assert np.array_equal(got, want), f"call {i}: a row other than the textbook's"
        counts["rows"] += 1
    print(f"fuzz_kernel: {calls:,} calls under AddressSanitizer and UBSan (seed {seed}): "
          + ", ".join(f"{v:,} {k}" for k, v in counts.items()))


def _shares(args) -> bool:
    outs = args[9:]
    spans = [(a.__array_interface__["data"][0], a.nbytes) for a in [x for x in args[:5] if isinstance(x, np.ndarray)]
             + outs]
    first_out = len(spans) - len(outs)
    return any(i != j and a < b + m and b < a + n and n and m
               for i, (a, n) in enumerate(spans) for j, (b, m) in enumerate(spans) if i >= first_out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", type=Path, default=SOURCE, help="the kernel's C source (default: this checkout's)")
    p.add_argument("--module", help=argparse.SUPPRESS)  # the sanitized build, in the run under the sanitizers
    a = p.parse_args()
    if a.module:
        fuzz(a.module, a.calls, a.seed)
        return
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    with tempfile.TemporaryDirectory(prefix="packer-fuzz-") as tmp:
        module = build(Path(tmp), a.source)
        env = dict(os.environ, PYTHONMALLOC="malloc",  # every allocation through ASan's, with its redzones
                   ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",  # the interpreter's own leaks are not ours
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
                   LD_PRELOAD=" ".join([runtime(cc, "libasan.so"), runtime(cc, "libubsan.so")]))
        done = subprocess.run([sys.executable, __file__, "--module", str(module), "--calls", str(a.calls),
                               "--seed", str(a.seed)], env=env)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
