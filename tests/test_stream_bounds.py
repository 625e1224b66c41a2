"""Every record size and count limit holds on the stream, before the input is read whole (issue 29,
class 4): a huge record is refused (or skipped and counted) without being held, a mix by counts under
``--limit`` costs what the records read cost, and inputs a reader cannot decode, or paths that name
no user, are one line."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from packer.building import mix


# -- a mix by records counts under --limit ------------------------------------------------------------


def test_a_mix_by_counts_under_a_limit_draws_only_what_the_limit_takes():
    parts = [{"source": "a", "records": 50_000_000}, {"source": "b", "records": 3}]
    tracemalloc.start()
    try:
        drawn = mix.positions_sources(parts, 0, 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert drawn.size == 30
    assert peak < 4 << 20, f"{peak:,} bytes drawn for 30 positions"


@pytest.mark.parametrize("counts", [[7, 3000, 10_000], [1] * 5000, [40_000, 1]])
def test_a_mix_by_counts_gives_each_part_exactly_its_count_and_a_limit_is_its_prefix(counts):
    parts = [{"source": f"p{k}", "records": n} for k, n in enumerate(counts)]
    whole = mix.positions_sources(parts, 5, sum(counts))
    assert np.bincount(whole, minlength=len(counts)).tolist() == counts
    for limit in (1, 30, 4097, sum(counts) - 1):
        assert np.array_equal(mix.positions_sources(parts, 5, limit), whole[:limit])
    assert not np.array_equal(whole, mix.positions_sources(parts, 6, sum(counts))), "the seed shuffles"
