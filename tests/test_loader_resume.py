"""The loader's one position (epoch, rows delivered): exact resume at every point, with workers, with
``remainder="drop"``, across planned epochs, and elastic resume at another world size, against a
reference that replays the whole epoch. Builds are written by hand (``test_loader.write_build``): row
``r``'s first token names it."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loader import is_filler, row_of, write_build

from packer.errors import ConfigError
from packer.training.loader import PackedDataLoader, PackedDataset, make_dataloader

N = 23  # rows per planned epoch: a prime, so no world size or grad_accum here divides it
E = 2  # planned epochs of the build


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume")
    write_build(directory, N * E, epochs=E, rows_per_shard=N, rows_per_batch=N)  # few batches: opening is cheap
    return directory


def _loaders(directory, world_size, workers=0, **kw):
    return [make_dataloader(directory, rank=r, world_size=world_size, num_workers=workers, **kw)
            for r in range(world_size)]


def _take(loaders, steps=None):
    """Every rank hands out ``steps`` batches (all of the pass when None), in lockstep; the real rows in
    the order the ranks' batches make one global sequence (step by step, rank by rank). ``loaders`` may
    be iterators already under way."""
    per_rank = [[(row_of(b), is_filler(b)) for b in itertools.islice(dl, steps)] for dl in loaders]
    assert len({len(s) for s in per_rank}) == 1, "every rank makes the same number of steps"
    return [row for step in zip(*per_rank) for row, filler in step if not filler]


def _state(loaders):
    states = [dl.state_dict() for dl in loaders]
    assert all(s == states[0] for s in states), "the position is global: every rank's state is the same"
    return json.loads(json.dumps(states[0]))  # a checkpoint survives serialisation


# -- the cases that failed --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["loader", "dataset"])
def test_state_right_after_set_epoch_resumes_the_whole_new_epoch(built, kind):
    """set_epoch(1) after finishing epoch 0, state before epoch 1's first batch: resuming gives all of epoch 1."""
    make = (lambda: make_dataloader(built, seed=4)) if kind == "loader" else (lambda: PackedDataset(built, seed=4))
    a = make()
    epoch0 = [row_of(b) for b in a]
    a.set_epoch(1)
    state = a.state_dict()
    epoch1 = [row_of(b) for b in a]
    b = make()
    b.load_state_dict(state)
    assert [row_of(x) for x in b] == epoch1 and len(epoch1) == N and sorted(epoch0) == list(range(N))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_resumed_skip_does_not_stick_with_workers(built, workers):
    """After the resumed rest of an epoch, a later pass over that epoch is whole again."""
    whole = [row_of(b) for b in make_dataloader(built, seed=2, num_workers=workers)]
    first = make_dataloader(built, seed=2)
    _take([iter(first)], 5)
    dl = make_dataloader(built, seed=2, num_workers=workers)
    dl.load_state_dict(first.state_dict())
    assert [row_of(b) for b in dl] == whole[5:]
    assert [row_of(b) for b in dl] == whole, "a second pass over the epoch skipped the resumed rows again"
    dl.set_epoch(0)
    assert [row_of(b) for b in dl] == whole


@pytest.mark.parametrize(("make", "needle"), [
    (lambda d: PackedDataset(d, seed=-1), "seed -1"),
    (lambda d: PackedDataset(d, seed=1.5), "seed 1.5"),
    (lambda d: PackedDataset(d, shuffle="yes"), "shuffle 'yes'"),
    (lambda d: PackedDataset(d, world_size=True), "world_size True"),
    (lambda d: PackedDataset(d, grad_accum=2.0), "grad_accum 2.0"),
    (lambda d: PackedDataset(d).set_epoch(-1), "epoch -1"),
    (lambda d: PackedDataset(d).set_epoch(2**63), "epoch 9223372036854775808"),
    (lambda d: make_dataloader(d).set_epoch("1"), "epoch '1'"),
    (lambda d: make_dataloader(d, num_workers=-1), "num_workers -1"),
    (lambda d: PackedDataLoader(PackedDataset(d), num_workers=1, persistent_workers=True), "persistent_workers"),
    (lambda d: PackedDataLoader(PackedDataset(d), num_workers=1, in_order=False), "in_order"),
])
def test_bad_arguments_are_a_config_error_when_given(built, make, needle):
    with pytest.raises(ConfigError, match=needle) as caught:
        make(built)
    assert "\n" not in str(caught.value)


def test_drop_refusal_counts_one_epochs_rows(built):
    with pytest.raises(ConfigError, match=f"an epoch has {N} rows") as caught:
        PackedDataset(built, world_size=4, grad_accum=6, remainder="drop")  # 24 > 23 rows per epoch, < 46 in all
    assert str(N * E) not in str(caught.value)


def test_elastic_resume_4_then_2_then_3(built):
    """Each rank's state is the same global position; the rest of the epoch is dealt over the new ranks."""
    reference = _take(_loaders(built, 4, seed=7))
    got = _take(loaders := _loaders(built, 4, seed=7), 2)
    state = _state(loaders)
    for world_size, steps in ((2, 3), (3, None)):
        loaders = _loaders(built, world_size, seed=7)
        for dl in loaders:
            dl.load_state_dict(state)
        got += _take(loaders, steps)
        state = _state(loaders)
    assert got == reference and Counter(got) == Counter(range(N))


def test_elastic_resume_refused_where_the_plan_is_balanced_for_a_world_size(tmp_path):
    write_build(tmp_path, N, config={"pack": "bfd", "world_size": 4, "balance": "tokens"})
    loaders = _loaders(tmp_path, 4)
    _take(loaders, 2)
    state = _state(loaders)
    with pytest.raises(ConfigError, match="balance") as caught:
        make_dataloader(tmp_path, rank=0, world_size=2).load_state_dict(state)
    assert "\n" not in str(caught.value) and "world size 4" in str(caught.value)
    make_dataloader(tmp_path, rank=0, world_size=4).load_state_dict(state)  # the same world size resumes
    at_end = _loaders(tmp_path, 4)
    _take(at_end)
    make_dataloader(tmp_path, rank=0, world_size=2).load_state_dict(_state(at_end))  # an epoch's end is no split


def test_elastic_resume_inside_an_optimizer_step_is_refused(built):
    loaders = _loaders(built, 2, grad_accum=2)
    _take(loaders, 3)
    state = _state(loaders)
    with pytest.raises(ConfigError, match="inside an optimizer step") as caught:
        make_dataloader(built, rank=0, world_size=3, grad_accum=2).load_state_dict(state)
    assert "\n" not in str(caught.value)


def test_a_version_1_state_resumes(built):
    """States written before the position was global (version 1: steps_done on one rank) still load."""
    dl = make_dataloader(built, rank=1, world_size=2, grad_accum=2, seed=3)
    whole = [row_of(b) for b in dl]
    v1 = {"version": 1, "epoch": 0, "steps_done": 5, "manifest_sha256": dl.dataset.fingerprint, "num_rows": N * E,
          "world_size": 2, "rank": 1, "seed": 3, "shuffle": True, "grad_accum": 2, "remainder": "pad"}
    resumed = make_dataloader(built, rank=1, world_size=2, grad_accum=2, seed=3)
    resumed.load_state_dict(v1)
    assert [row_of(b) for b in resumed] == whole[5:]


# -- the property: any history of cuts, world sizes and workers delivers the epoch exactly ----------

def _check_chain(directory, epoch, segments, remainder, shuffle, workers):
    """Run epoch ``epoch`` through ``segments`` of (world_size, grad_accum, micro-batches), each resumed
    from the last one's state, the last one on to the epoch's end, then the next epoch; compare with one
    uninterrupted pass (the reference replay of the whole epoch) at the setting the epoch's order was
    drawn for: the first that handed out a batch (before that, nothing of the epoch was delivered)."""
    kw = dict(seed=5, shuffle=shuffle, remainder=remainder)
    w_ref, g_ref = next(((w, g) for w, g, steps in segments if steps), segments[-1][:2])
    first = _loaders(directory, w_ref, grad_accum=g_ref, **kw)
    for dl in first:
        dl.set_epoch(epoch)
    reference = _take(first)
    got, state = [], None
    for i, (w, g, steps) in enumerate(segments):
        loaders = _loaders(directory, w, workers if i == len(segments) - 1 else 0, grad_accum=g, **kw)
        for dl in loaders:
            if state is None:
                dl.set_epoch(epoch)
            else:
                dl.load_state_dict(state)
        passes = [iter(dl) for dl in loaders]
        got += _take(passes, steps)
        state = _state(loaders)
        assert state["epoch"] == epoch
    got += _take(passes)  # the last segment goes on to the epoch's end
    end = _state(loaders)
    if remainder == "pad":
        assert got == reference, "the epoch's rows, each once, in the reference's order"
        assert Counter(got) == Counter(range((epoch % E) * N, (epoch % E + 1) * N))
    else:  # drop: the last setting leaves out what does not fill its optimizer steps
        assert got == reference[: len(got)] and len(reference) - len(got) < w * g
    for dl in loaders:
        dl.load_state_dict(end)
    assert _take(loaders) == [], "a state at the epoch's end resumes to nothing more of it"
    fresh = _loaders(directory, w, grad_accum=g, **kw)
    for dl in loaders + fresh:
        dl.set_epoch(epoch + 1)
    assert _take(loaders) == _take(fresh), "the next epoch is whole"


_setting = st.tuples(st.integers(1, 4), st.integers(1, 3))


@st.composite
def _segments(draw, max_segments):
    """A history: each segment a setting and a cut; a cut before another setting falls on an optimizer
    step's end (an elastic resume inside one is refused, see above)."""
    settings_ = draw(st.lists(_setting, min_size=1, max_size=max_segments))
    out = []
    for i, (w, g) in enumerate(settings_):
        steps = draw(st.integers(0, -(-N // w) + g))
        if i + 1 < len(settings_) and settings_[i + 1] != (w, g):
            steps -= steps % g
        out.append((w, g, steps))
    return out


@pytest.mark.filterwarnings("ignore:.*replays planned epoch")  # epochs past the build's 2 are drawn too
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(epoch=st.integers(0, 2), segments=_segments(3), remainder=st.sampled_from(["pad", "drop"]),
       shuffle=st.booleans())
def test_any_history_delivers_the_epoch_exactly(built, epoch, segments, remainder, shuffle):
    if remainder == "drop" and any(w * g > N for w, g, _ in segments):
        return  # such a setting is refused at construction (an empty epoch)
    _check_chain(built, epoch, segments, remainder, shuffle, workers=0)


@pytest.mark.filterwarnings("ignore:.*replays planned epoch")
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(epoch=st.integers(0, 2), segments=_segments(2), workers=st.sampled_from([1, 2]))
def test_any_history_delivers_the_epoch_exactly_with_workers(built, epoch, segments, workers):
    """The same with DataLoader worker processes (few cases: each pass starts processes)."""
    _check_chain(built, epoch, [(min(w, 2), g, s) for w, g, s in segments], "pad", True, workers)
