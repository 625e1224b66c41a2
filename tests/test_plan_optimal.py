"""--pack optimal: BFD, then the loose rows refilled; never more rows than BFD, ⌈tokens / T⌉ + 1 at most
on real and synthetic lengths. Placement invariants are checked by test_plan.check_plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import make_build
from test_plan import _rows_as_sets, check_plan, flan_like, random_lengths, reference_bfd_loads

from packer import BuildConfig
from packer.building import sources
from packer.building.formatting import make_spec
from packer.building.pipeline import tokenizer_path
from packer.building.tokenization import Encoder, load_tokenizer
from packer.checking.verify import verify
from packer.planning import repack
from packer.planning.plan import plan, rank_work_ratio
from packer.planning.repack import _best_subset, _sand


def synthetic(shape: str, n: int, budget: int, seed: int = 0) -> np.ndarray:
    """The benchmark's shapes (benchmarks/bench_plan.py), lengths in [1, budget]."""
    rng = np.random.default_rng(seed)
    if shape == "lognormal":
        return flan_like(n, seed, clip=budget)
    if shape == "uniform":
        return rng.integers(16, budget // 2, n)
    if shape == "bimodal":
        return np.where(rng.random(n) < 0.7, rng.integers(40, 200, n), rng.integers(budget // 4, budget * 6 // 10, n))
    x = np.clip(np.ceil(rng.lognormal(np.log(250), 1.0, n)), 1, budget).astype(np.int64)  # "equal"
    x[rng.random(n) < 0.5] = 512
    return x


@pytest.mark.parametrize("overlong", ["truncate", "split", "drop"])
def test_invariants_and_never_more_rows_than_textbook_bfd(overlong):
    rng = np.random.default_rng(21)
    for _ in range(150):
        lengths = random_lengths(rng, n_max=120)
        max_tokens = int(rng.integers(1, 60))
        max_len = int(rng.integers(1, max_tokens + 1))
        p = plan(lengths, mode="optimal", max_len=max_len, max_tokens=max_tokens, overlong=overlong, seed=5)
        check_plan(lengths, p, mode="bfd", max_len=max_len, overlong=overlong, budget=max_tokens)
        segs = np.minimum(lengths, max_len) if overlong == "truncate" else lengths[lengths <= max_len]
        if overlong == "split":
            segs = p.length  # the pieces; BFD packs the same pieces
        assert p.num_rows <= len(reference_bfd_loads(segs.tolist(), max_tokens))


def test_best_subset_matches_brute_force():
    rng = np.random.default_rng(22)
    for _ in range(300):
        k = int(rng.integers(1, 6))
        sizes = sorted(set(rng.integers(1, 40, k).tolist()), reverse=True)
        counts = rng.integers(1, 4, len(sizes)).tolist()
        room = int(rng.integers(1, 120))
        taken = _best_subset(sizes, counts, room)
        items = [s for s, c in zip(sizes, counts, strict=True) for _ in range(c)]
        best = max(sum(c) for r in range(len(items) + 1) for c in itertools.combinations(items, r) if sum(c) <= room)
        assert sum(s * c for s, c in taken) == best
        used = dict.fromkeys(sizes, 0)
        for s, c in taken:
            used[s] += c
        assert all(used[s] <= c for s, c in zip(sizes, counts, strict=True))


def test_sand_matches_brute_force():
    """_sand: the most copies j of the smallest size m with one more item filling the room exactly."""
    rng = np.random.default_rng(24)
    cap = 64
    for _ in range(300):
        sizes = sorted(set(rng.integers(1, 40, int(rng.integers(1, 6))).tolist()))
        count = [0] * (cap + 1)
        for x in sizes:
            count[x] = int(rng.integers(1, 5))
        m, room = sizes[0], int(rng.integers(1, cap + 1))
        bits = sum(1 << x for x in sizes)
        multiples = sum(1 << (cap - j * m) for j in range(1, cap // m + 1))
        best = max((j for j in range(1, count[m] + 1) for b in sizes
                    if b + j * m == room and count[b] > (j if b == m else 0)), default=0)
        assert _sand(count, bits, m, multiples, cap, room) == best, (sizes, count, room)


def test_second_refill_borrows_the_fillers_the_gaps_want():
    """300 bins of a 97 (3 short), 5,000 of 50 + 50, and 10 of 3 x 33 + 1 at the end: the full bins
    the first refill borrows (spread evenly) hold no 3, so it wins nothing; the second borrows the
    bins holding the 3s the gaps want: 97 + 3 300 times, the rest of the 3s and the 1s in one bin."""
    cap = 100
    bins = [[97]] * 300 + [[50, 50]] * 5000 + [[3] * 33 + [1]] * 10
    sizes = np.array([x for b in bins for x in b])
    bin_of = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
    lower = -(-int(sizes.sum()) // cap)
    assert (len(bins), lower) == (5310, 5301)
    assert repack._refill_window(sizes, bin_of, len(bins), cap, False) is None
    new, nbins = repack.fewer_rows(sizes, bin_of, len(bins), cap)
    assert nbins == lower and new.max() == nbins - 1
    assert np.bincount(new, weights=sizes).max() <= cap


@pytest.mark.parametrize("shape", ["lognormal", "uniform", "bimodal", "equal"])
@pytest.mark.parametrize("budget", [2048, 4096])
def test_bound_plus_one_on_synthetic_shapes(shape, budget):
    for n in (10_000, 100_000):
        lengths = synthetic(shape, n, budget, seed=n)
        p = plan(lengths, mode="optimal", max_len=budget)
        b = plan(lengths, mode="bfd", max_len=budget)
        assert np.all(p.row_lengths() <= budget)
        assert np.array_equal(np.sort(p.example), np.arange(n))  # each example once
        assert p.num_rows <= b.num_rows
        assert p.num_rows <= p.stats["lower_bound"] + 1, (shape, n, budget, b.num_rows, p.stats["lower_bound"])
    if (shape, budget) in {("bimodal", 2048), ("uniform", 2048), ("bimodal", 4096)}:  # the refill does the work
        assert b.num_rows > p.stats["lower_bound"] + 1  # (100k: BFD +21, +3, +6)


def test_refill_is_bounded_by_work(monkeypatch):
    """Past MAX_BUILDS rows built the refill is abandoned and BFD's rows stay: the same rows on any machine."""
    lengths = synthetic("bimodal", 20_000, 2048, seed=7)
    b = plan(lengths, mode="bfd", max_len=2048)
    assert plan(lengths, mode="optimal", max_len=2048).num_rows < b.num_rows
    monkeypatch.setattr(repack, "MAX_BUILDS", 10)
    p = plan(lengths, mode="optimal", max_len=2048)
    assert sorted(_rows_as_sets(p)) == sorted(_rows_as_sets(b))


@pytest.fixture(scope="module")
def gsm8k_lengths(gsm8k_file, llama2_tokenizer) -> np.ndarray:
    """Every GSM8K train example's length, through packer's own format and tokenize steps."""
    src = sources.resolve(str(gsm8k_file), recipe="gsm8k")
    stream = sources.open_stream(src)
    spec = make_spec(recipe=src.recipe, config=BuildConfig(source=str(gsm8k_file), recipe="gsm8k", out="-"),
                     columns=stream.columns())
    enc = Encoder(load_tokenizer(tokenizer_path(str(llama2_tokenizer))), spec)
    return np.concatenate([enc.encode(records, lo).lengths for lo, records in stream.chunks(0, 2000)])


@pytest.mark.parametrize("budget, bfd_over", [(2048, 6), (4096, 1)])
def test_gsm8k_reaches_bound_plus_one(gsm8k_lengths, budget, bfd_over):
    assert gsm8k_lengths.size == 7473
    b = plan(gsm8k_lengths, mode="bfd", max_len=budget)
    p = plan(gsm8k_lengths, mode="optimal", max_len=budget)
    check_plan(gsm8k_lengths, p, mode="bfd", max_len=budget, budget=budget)
    lb = p.stats["lower_bound"]
    assert b.num_rows == lb + bfd_over  # the figures: 745 / 739 and 371 / 370
    assert p.num_rows <= lb + 1


@pytest.mark.parametrize("by", ["tokens", "attention"])
def test_balance_and_split_on_top(by):
    w, budget = 8, 1024
    lengths = flan_like(6_000, seed=23, clip=3000)  # some over budget: split into pieces
    plain = plan(lengths, mode="optimal", max_len=budget, overlong="split", world_size=w, seed=2)
    bal = plan(lengths, mode="optimal", max_len=budget, overlong="split", world_size=w, seed=2, balance=by)
    bfd = plan(lengths, mode="bfd", max_len=budget, overlong="split", world_size=w, seed=2)
    check_plan(lengths, bal, mode="bfd", max_len=budget, overlong="split", budget=budget)
    assert sorted(_rows_as_sets(plain)) == sorted(_rows_as_sets(bal))  # balancing moves rows only
    assert bal.num_rows <= bfd.num_rows and bal.num_rows <= bal.stats["lower_bound"] + 1
    before, after = rank_work_ratio(plain, w, by), rank_work_ratio(bal, w, by)
    assert after < before and bal.stats["rank_work_max_over_mean"] == pytest.approx(after)


def test_deterministic_and_seed_moves_rows_only():
    lengths = synthetic("bimodal", 3_000, 1024, seed=3)
    a, b = plan(lengths, mode="optimal", max_len=1024, seed=4), plan(lengths, mode="optimal", max_len=1024, seed=4)
    c = plan(lengths, mode="optimal", max_len=1024, seed=5)
    for x, y in [(a.example, b.example), (a.start, b.start), (a.length, b.length), (a.row_splits, b.row_splits)]:
        assert np.array_equal(x, y)
    assert not np.array_equal(a.example, c.example)
    assert sorted(_rows_as_sets(a)) == sorted(_rows_as_sets(c))


def test_build_and_verify_with_pack_optimal(tmp_path):
    out = make_build(tmp_path / "o", limit=600, pack="optimal", max_len=512, overlong="split", seed=3)
    report = verify(out)
    assert report.ok, report  # verify replans the build from its manifest's config, mode included
