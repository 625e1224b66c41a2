"""Invariants of packer.planning.plan over many seeded random length lists, plus a reference BFD."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packer.errors import ConfigError
from packer.planning.plan import Plan, plan, rank_work_ratio


def flan_like(n: int, seed: int = 0, clip: int = 4096) -> np.ndarray:
    """Lognormal, heavy-tailed: median ~250, mean ~470 tokens, clipped to [1, clip]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.ceil(rng.lognormal(np.log(250), 1.124, n)), 1, clip).astype(np.int64)


def reference_bfd_loads(sizes: list[int], cap: int) -> list[int]:
    """Per-item best-fit-decreasing, the textbook way; returns the sorted row loads."""
    rooms: list[int] = []
    for s in sorted(sizes, reverse=True):
        best = -1
        for i, room in enumerate(rooms):
            if room >= s and (best < 0 or room < rooms[best]):
                best = i
        if best < 0:
            rooms.append(cap - s)
        else:
            rooms[best] -= s
    return sorted(cap - r for r in rooms)


def segments_by_example(p: Plan, n: int) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for e, s, ln in zip(p.example.tolist(), p.start.tolist(), p.length.tolist(), strict=True):
        out[e].append((s, ln))
    return out


def check_plan(
    lengths, p: Plan, *, mode: str, max_len: int, overlong: str = "truncate", budget=None, batch_size=None
):
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    m = p.length.size
    for a in (p.example, p.start, p.length, p.row_splits):
        assert a.dtype == np.int64 and a.ndim == 1
    assert p.example.size == p.start.size == m
    rs = p.row_splits
    assert rs[0] == 0 and rs[-1] == m
    assert p.num_rows == rs.size - 1
    assert np.all(np.diff(rs) >= 1), "empty row"
    assert np.all(p.length > 0) and np.all(p.start >= 0)
    if m:
        assert np.all(p.start + p.length <= lengths[p.example])
    row_len = p.row_lengths()
    assert row_len.shape == (p.num_rows,)
    assert int(row_len.sum()) == int(p.length.sum())

    # coverage of every example
    segs = segments_by_example(p, n)
    for i, ln in enumerate(lengths.tolist()):
        got = sorted(segs[i])
        if mode == "wrap":
            pos = 0
            for s, k in got:
                assert s == pos
                pos += k
            assert pos == ln, (i, got, ln)
        elif ln <= max_len:
            assert got == [(0, ln)], (i, got, ln)
        elif overlong == "truncate":
            assert got == [(0, max_len)]
        elif overlong == "drop":
            assert got == []
        else:
            k = -(-ln // max_len)
            assert got == [(j * max_len, min(max_len, ln - j * max_len)) for j in range(k)]

    # rows
    if mode in ("bfd", "wrap"):
        assert np.all(row_len <= budget)
    if mode == "wrap" and p.num_rows:
        assert np.all(row_len[:-1] == budget)
    if mode == "batch" and p.num_rows:
        counts = np.diff(rs)
        assert np.all(counts[:-1] == batch_size) and 1 <= counts[-1] <= batch_size

    # stats
    st = p.stats
    json.dumps(st)
    for k, v in st.items():
        assert type(v) in (int, float), (k, type(v))
    assert st["examples"] == n
    assert st["tokens_in"] == int(lengths.sum())
    assert st["tokens"] == int(p.length.sum())
    assert st["tokens"] + st["tokens_truncated"] + st["tokens_dropped"] == st["tokens_in"]
    assert (
        st["examples_packed"] + st["examples_split"] + st["examples_truncated"] + st["examples_dropped"]
        == st["examples"]
    )
    whole = sum(1 for i in range(n) if segs[i] == [(0, int(lengths[i]))])
    assert st["examples_packed"] == whole
    assert st["segments"] == m
    assert st["rows"] == p.num_rows
    assert st["max_row_tokens"] == (int(row_len.max()) if p.num_rows else 0)
    b = st["row_budget"]
    if mode != "batch":
        assert b == budget
    if p.num_rows:
        assert st["lower_bound"] == -(-st["tokens"] // b)
        assert st["fill"] == pytest.approx(st["tokens"] / (p.num_rows * b))
        assert p.num_rows >= st["lower_bound"] or mode == "batch"
    if mode == "batch":
        want = sum((rs[r + 1] - rs[r]) * int(p.length[rs[r] : rs[r + 1]].max()) for r in range(p.num_rows))
        assert st["padded_tokens"] == want
    if overlong == "split" and mode != "wrap":
        assert st["examples_split"] == int((lengths > max_len).sum())
    return segs


def random_lengths(rng, n_max=60, len_max=50):
    n = int(rng.integers(0, n_max))
    hi = int(rng.integers(1, len_max))
    return rng.integers(1, hi + 1, n)


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlong", ["truncate", "split", "drop"])
def test_bfd_invariants_random(overlong):
    rng = np.random.default_rng(1)
    for _ in range(150):
        lengths = random_lengths(rng)
        max_tokens = int(rng.integers(1, 40))
        max_len = int(rng.integers(1, max_tokens + 1))
        p = plan(lengths, mode="bfd", max_len=max_len, max_tokens=max_tokens, overlong=overlong, seed=3)
        check_plan(lengths, p, mode="bfd", max_len=max_len, overlong=overlong, budget=max_tokens)


@pytest.mark.parametrize("overlong", ["truncate", "split", "drop"])
def test_batch_invariants_random(overlong):
    rng = np.random.default_rng(2)
    for _ in range(150):
        lengths = random_lengths(rng)
        max_len = int(rng.integers(1, 40))
        b = int(rng.integers(1, 9))
        w = int(rng.integers(1, 4))
        bal = [None, "tokens", "attention"][int(rng.integers(0, 3))]
        p = plan(
            lengths, mode="batch", max_len=max_len, batch_size=b, overlong=overlong, world_size=w, balance=bal
        )
        check_plan(lengths, p, mode="batch", max_len=max_len, overlong=overlong, batch_size=b)


def test_wrap_invariants_random():
    rng = np.random.default_rng(3)
    for _ in range(200):
        lengths = random_lengths(rng)
        max_tokens = int(rng.integers(1, 40))
        p = plan(lengths, mode="wrap", max_len=max_tokens)
        segs = check_plan(lengths, p, mode="wrap", max_len=max_tokens, budget=max_tokens)
        # source order: segments walk the concatenation front to back
        if p.example.size:
            assert np.all(np.diff(p.example) >= 0)
        assert p.stats["examples_split"] == sum(len(s) > 1 for s in segs)


def test_wrap_cuts_documents_across_rows():
    p = plan([5, 3, 9, 2], mode="wrap", max_len=4)  # 19 tokens: |0000|0111|2222|2222|233
    assert p.example.tolist() == [0, 0, 1, 2, 2, 2, 3]
    assert p.start.tolist() == [0, 4, 0, 0, 4, 8, 0]
    assert p.length.tolist() == [4, 1, 3, 4, 4, 1, 2]
    assert p.row_splits.tolist() == [0, 1, 3, 4, 5, 7]
    assert p.row_lengths().tolist() == [4, 4, 4, 4, 3]
    assert p.stats["examples_split"] == 2 and p.stats["examples_packed"] == 2


def test_bfd_small_example_contents():
    p = plan([5, 3, 9, 2], mode="bfd", max_len=8, overlong="split")
    rows = sorted(
        tuple(zip(p.example[a:b].tolist(), p.start[a:b].tolist(), p.length[a:b].tolist(), strict=True))
        for a, b in zip(p.row_splits[:-1], p.row_splits[1:], strict=True)
    )
    assert rows == sorted([((2, 0, 8),), ((0, 0, 5), (1, 0, 3)), ((3, 0, 2), (2, 8, 1))])


def test_bfd_matches_reference_bfd():
    rng = np.random.default_rng(4)
    for _ in range(300):
        cap = int(rng.integers(1, 60))
        n = int(rng.integers(0, 90))
        sizes = rng.integers(1, cap + 1, n)
        if rng.random() < 0.5:  # many small items too
            sizes = np.minimum(sizes, rng.integers(1, cap + 1))
        p = plan(sizes, mode="bfd", max_len=cap, seed=int(rng.integers(0, 100)))
        want = reference_bfd_loads(sizes.tolist(), cap)
        assert p.num_rows == len(want)
        assert sorted(p.row_lengths().tolist()) == want


@pytest.mark.parametrize("max_tokens", [4096, 2048])
def test_bfd_near_lower_bound_on_flan_like(max_tokens):
    lengths = flan_like(20_000, seed=5)
    assert 200 < np.median(lengths) < 300 and 400 < lengths.mean() < 540
    p = plan(lengths, mode="bfd", max_len=max_tokens, max_tokens=max_tokens, overlong="split")
    check_plan(lengths, p, mode="bfd", max_len=max_tokens, overlong="split", budget=max_tokens)
    assert p.num_rows <= 1.01 * p.stats["lower_bound"], (p.num_rows, p.stats["lower_bound"])
    assert p.stats["fill"] > 0.99


def test_bfd_items_over_half_each_open_a_row():
    p = plan([60, 70, 51, 80, 55], mode="bfd", max_len=100)
    assert p.num_rows == 5


def _rows_as_sets(p: Plan):
    return [
        tuple(zip(p.example[a:b].tolist(), p.start[a:b].tolist(), strict=True))
        for a, b in zip(p.row_splits[:-1].tolist(), p.row_splits[1:].tolist(), strict=True)
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="batch", max_len=300, batch_size=4, overlong="split"),
        dict(mode="bfd", max_len=300, max_tokens=600, overlong="split"),
        dict(mode="batch", max_len=300, batch_size=4, world_size=4, balance="attention"),
        dict(mode="bfd", max_len=300, max_tokens=600, world_size=4, balance="tokens"),
    ],
)
def test_deterministic_for_seed_and_seed_changes_order(kwargs):
    lengths = flan_like(500, seed=6, clip=900)
    a = plan(lengths, seed=11, **kwargs)
    b = plan(lengths, seed=11, **kwargs)
    c = plan(lengths, seed=12, **kwargs)
    for x, y in [
        (a.example, b.example),
        (a.start, b.start),
        (a.length, b.length),
        (a.row_splits, b.row_splits),
    ]:
        assert np.array_equal(x, y)
    assert a.stats == b.stats
    assert not np.array_equal(a.example, c.example)
    if kwargs["mode"] == "bfd":  # the seed moves rows, never their contents
        assert sorted(_rows_as_sets(a)) == sorted(_rows_as_sets(c))


def test_plan_arrays_are_read_only():
    p = plan([3, 4, 5], mode="bfd", max_len=8)
    with pytest.raises(ValueError):
        p.length[0] = 1


# --------------------------------------------------------------------------------------------------
# balanced ranks


def _step_sets(p: Plan, w: int, b: int):
    per = w * b
    keys = list(zip(p.example.tolist(), p.start.tolist(), strict=True))
    return [sorted(keys[i : i + per]) for i in range(0, len(keys), per)]


@pytest.mark.parametrize("by", ["tokens", "attention"])
@pytest.mark.parametrize("overlong", ["truncate", "split"])
def test_batch_balance_keeps_steps_and_lowers_ratio(by, overlong):
    w, b = 8, 4
    lengths = flan_like(3_000, seed=7, clip=2048)
    plain = plan(lengths, mode="batch", max_len=1024, batch_size=b, overlong=overlong, world_size=w, seed=9)
    bal = plan(
        lengths, mode="batch", max_len=1024, batch_size=b, overlong=overlong, world_size=w, seed=9, balance=by
    )
    check_plan(lengths, bal, mode="batch", max_len=1024, overlong=overlong, batch_size=b)
    assert _step_sets(plain, w, b) == _step_sets(bal, w, b)
    before, after = rank_work_ratio(plain, w, by), rank_work_ratio(bal, w, by)
    assert after < before
    assert after < 1 + 0.5 * (before - 1)
    assert bal.stats["rank_work_max_over_mean"] == pytest.approx(after)
    assert plain.stats["rank_work_max_over_mean"] == pytest.approx(rank_work_ratio(plain, w, "tokens"))


@pytest.mark.parametrize("by", ["tokens", "attention"])
def test_bfd_balance_keeps_rows_and_lowers_ratio(by):
    w = 8
    lengths = flan_like(5_000, seed=8, clip=2048)
    plain = plan(lengths, mode="bfd", max_len=2048, world_size=w, seed=1)
    bal = plan(lengths, mode="bfd", max_len=2048, world_size=w, seed=1, balance=by)
    check_plan(lengths, bal, mode="bfd", max_len=2048, budget=2048)
    assert sorted(_rows_as_sets(plain)) == sorted(_rows_as_sets(bal))
    before, after = rank_work_ratio(plain, w, by), rank_work_ratio(bal, w, by)
    assert after < before
    assert after < (1.01 if by == "tokens" else 1.05)
    assert bal.stats["rank_work_max_over_mean"] == pytest.approx(after)


def test_wrap_balance_keeps_rows():
    lengths = flan_like(1_000, seed=9, clip=2048)
    plain = plan(lengths, mode="wrap", max_len=1024)
    bal = plan(lengths, mode="wrap", max_len=1024, world_size=4, balance="attention")
    check_plan(lengths, bal, mode="wrap", max_len=1024, budget=1024)
    assert sorted(_rows_as_sets(plain)) == sorted(_rows_as_sets(bal))
    assert rank_work_ratio(bal, 4, "attention") < rank_work_ratio(plain, 4, "attention")


def test_rank_work_ratio_by_hand():
    p = plan([1, 3, 2, 2], mode="wrap", max_len=1)  # 8 rows of 1 token
    assert rank_work_ratio(p, 2, "tokens") == 1.0
    q = Plan(
        example=np.array([0, 1, 2, 3]),
        start=np.zeros(4, np.int64),
        length=np.array([1, 3, 2, 2]),
        row_splits=np.arange(5),
        stats={},
    )
    assert rank_work_ratio(q, 2, "tokens") == pytest.approx((3 / 2 + 2 / 2) / 2)
    assert rank_work_ratio(q, 2, "attention") == pytest.approx((9 / 5 + 1.0) / 2)
    assert rank_work_ratio(q, 8, "tokens") == 1.0  # no full step


# --------------------------------------------------------------------------------------------------
# arguments


@pytest.mark.parametrize("mode", ["batch", "bfd", "wrap"])
def test_empty_input_gives_empty_plan(mode):
    kw = dict(batch_size=2) if mode == "batch" else {}
    p = plan(np.zeros(0, np.int64), mode=mode, max_len=8, **kw)
    assert p.num_rows == 0 and p.row_splits.tolist() == [0] and p.length.size == 0
    assert p.stats["rows"] == 0 and p.stats["tokens"] == 0 and p.stats["fill"] == 0.0
    json.dumps(p.stats)


@pytest.mark.parametrize(
    "lengths, kwargs, fragment",
    [
        ([1, 2], dict(mode="pack", max_len=8), "mode"),
        ([1, 2], dict(mode="bfd", max_len=0), "max_len"),
        ([1, 2], dict(mode="bfd", max_len=8, max_tokens=4), "max_tokens"),
        ([1, 2], dict(mode="bfd", max_len=8, batch_size=2), "batch_size"),
        ([1, 2], dict(mode="wrap", max_len=8, batch_size=2), "batch_size"),
        ([1, 2], dict(mode="batch", max_len=8), "batch_size"),
        ([1, 2], dict(mode="batch", max_len=8, batch_size=0), "batch_size"),
        ([1, 2], dict(mode="batch", max_len=8, batch_size=2, max_tokens=16), "max_tokens"),
        ([1, 2], dict(mode="bfd", max_len=8, overlong="clip"), "overlong"),
        ([1, 2], dict(mode="bfd", max_len=8, balance="flops"), "balance"),
        ([1, 2], dict(mode="bfd", max_len=8, world_size=0), "world_size"),
        ([1, 2], dict(mode="bfd", max_len=8, seed=-1), "seed"),
        ([1, 2], dict(mode="bfd", max_len=True), "max_len"),
        ([1, 0], dict(mode="bfd", max_len=8), "example 1"),
        ([1.5, 2], dict(mode="bfd", max_len=8), "integers"),
        ([[1, 2]], dict(mode="bfd", max_len=8), "1-D"),
    ],
)
def test_bad_arguments_raise_config_error(lengths, kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        plan(lengths, **kwargs)


def test_max_len_over_max_tokens_message_gives_value_limit_and_fix():
    with pytest.raises(ConfigError) as e:
        plan([1], mode="bfd", max_len=9000, max_tokens=8192)
    msg = str(e.value)
    assert "9000" in msg and "8192" in msg and ("lower" in msg or "raise" in msg)


def test_overlong_accounting():
    lengths = [10, 3, 25, 8]
    for overlong, want in [
        ("truncate", dict(examples_truncated=2, tokens_truncated=2 + 17, tokens=8 + 3 + 8 + 8)),
        ("drop", dict(examples_dropped=2, tokens_dropped=35, tokens=11)),
        ("split", dict(examples_split=2, tokens=46, segments=2 + 1 + 4 + 1)),
    ]:
        p = plan(lengths, mode="bfd", max_len=8, max_tokens=16, overlong=overlong)
        for k, v in want.items():
            assert p.stats[k] == v, (overlong, k)
        assert p.stats["examples_packed"] == 2
