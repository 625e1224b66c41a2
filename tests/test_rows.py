"""The row invariants (packer.contract.rows) against the rows the writer makes: every planned batch, in every
mode and over-long policy, breaks no rule; and each rule, broken alone in one row, is reported for that
row and no other (so a rule can be told apart from the others, and from the rows around it)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packer.building.spill import TokenStore
from packer.building.writer import assemble
from packer.contract import rows, schema
from packer.planning.context_parallel import Layout
from packer.planning.plan import plan

VOCAB = 1000


def _store(tmp_path, lengths: np.ndarray, seed: int) -> TokenStore:
    """A token spill of random ids and completion-only flags (each example's trained tail)."""
    rng = np.random.default_rng(seed)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
    trained = np.zeros(int(offsets[-1]), np.uint8)
    for lo, n in zip(offsets[:-1].tolist(), lengths.tolist(), strict=True):
        trained[lo + rng.integers(0, n) : lo + n] = 1
    (tmp_path / "ids.bin").write_bytes(ids.tobytes())
    (tmp_path / "trained.bin").write_bytes(trained.tobytes())
    return TokenStore(tmp_path / "ids.bin", tmp_path / "trained.bin", offsets, np.arange(lengths.size) * 3)


MODES = [dict(mode="batch", batch_size=3), dict(mode="bfd", max_tokens=64), dict(mode="wrap", max_tokens=40),
         # padded for context parallelism (packer.planning.context_parallel): the padding keeps every rule too
         dict(mode="bfd", max_tokens=64, layout=Layout(cp_size=2, multiple=3, pad_id=7)),
         dict(mode="batch", batch_size=3, layout=Layout(cp_size=3, cp_layout="contiguous", pad_id=7)),
         dict(mode="wrap", max_tokens=40, layout=Layout(cp_size=4, cp_layout="contiguous", pad_id=7))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=40), how=st.sampled_from(MODES),
       overlong=st.sampled_from(["truncate", "split", "drop"]), seed=st.integers(0, 3))
def test_every_planned_batch_keeps_every_rule(tmp_path, lengths, how, overlong, seed):
    lengths = np.asarray(lengths, np.int64)
    p = plan(lengths, max_len=32, overlong=overlong, seed=seed, **how)
    if p.num_rows == 0:
        return
    limits = rows.Limits(max_segments=how.get("batch_size"), max_row_tokens=how.get("max_tokens"),
                         max_segment_tokens=None if how["mode"] == "wrap" else 32)
    batch = assemble(p, _store(tmp_path, lengths, seed), 0, p.num_rows)
    assert rows.check_arrow(batch, VOCAB, limits) == []


def _batch(tmp_path) -> rows.RowBatch:
    lengths = np.array([5, 7, 3, 9, 4, 6, 8, 2], np.int64)
    p = plan(lengths, mode="batch", batch_size=2, max_len=32)
    return rows.RowBatch.from_arrow(assemble(p, _store(tmp_path, lengths, 0), 0, p.num_rows))


def _row2(batch: rows.RowBatch, column: rows.Column) -> slice:
    """Row 2's flat slice of a list column."""
    return slice(int(column.offsets[2]), int(column.offsets[3]))


def _break(name: str, batch: rows.RowBatch) -> None:
    """Break one rule in row 2 only (the arrays are copies the test owns)."""
    tokens = _row2(batch, batch.input_ids)
    start = tokens.start
    if name == "positions":
        batch.position_ids.values[start + 1] += 1
    elif name == "label at a start":  # and counted, as a careful forgery would
        batch.labels.values[start] = batch.input_ids.values[start]
        batch.num_loss_tokens[2] += 1
    elif name == "label not the id":
        batch.labels.values[tokens.stop - 1] = batch.input_ids.values[tokens.stop - 1] + 1
    elif name == "vocab":
        batch.input_ids.values[start] = VOCAB
        batch.labels.values[start] = schema.IGNORE_INDEX
    elif name == "num_loss_tokens":
        batch.num_loss_tokens[2] += 1
    elif name == "max_seqlen":
        batch.max_seqlen[2] += 1
    elif name == "seq_lens sum":
        batch.seq_lens.values[_row2(batch, batch.seq_lens).start] += 1
    elif name == "negative example id":
        batch.example_ids.values[_row2(batch, batch.seq_lens).start] = -1


RULES = {"positions": "position_ids", "label at a start": "segment start", "label not the id": "neither -100",
         "vocab": "outside [0, 1,000)", "num_loss_tokens": "num_loss_tokens", "max_seqlen": "max_seqlen",
         "seq_lens sum": "seq_lens do not sum", "negative example id": "negative example id"}


@pytest.mark.parametrize("name", sorted(RULES))
def test_each_rule_broken_alone_is_reported_for_its_row_only(tmp_path, name):
    batch = _batch(tmp_path)
    copy = rows.RowBatch(*(rows.Column(c.values.copy(), c.offsets) if isinstance(c, rows.Column)
                           else None if c is None else c.copy()
                           for c in (getattr(batch, f) for f in rows.RowBatch.__slots__)))
    assert rows.check_rows(copy, VOCAB) == []
    _break(name, copy)
    problems = rows.check_rows(copy, VOCAB)
    assert len(problems) == 1 and RULES[name] in problems[0].message, [p.message for p in problems]
    assert problems[0].rows.tolist() == [2]


def test_layout_alone_reads_no_token_value(tmp_path):
    """``tokens=False`` (what inspect checks) does not look at ids, positions or labels."""
    batch = _batch(tmp_path)
    blank = rows.RowBatch(*(rows.Column(np.full_like(c.values, -7), c.offsets)
                            if f in ("input_ids", "position_ids", "labels") else c
                            for f, c in ((f, getattr(batch, f)) for f in rows.RowBatch.__slots__)))
    assert rows.check_rows(blank, VOCAB, tokens=False) == []
    assert {p.message.split()[0] for p in rows.check_rows(blank, VOCAB)} >= {"position_ids", "token"}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.booleans(), max_size=300), st.integers(0, 40), st.data())
def test_bits_read_every_slice_as_arrow_does(values, offset, data):
    """Bits of a sliced BooleanArray (any bit offset) against Arrow's own decoding, and labels_of against
    the textbook rule (the id where the mask is set, else -100)."""
    array = pa.array([False] * offset + values, pa.bool_()).slice(offset)
    lo = data.draw(st.integers(0, len(values)))
    hi = data.draw(st.integers(lo, len(values)))
    bits = rows.Bits.of(array)
    assert bits.unpack(lo, hi).tolist() == values[lo:hi]
    assert bits[lo:hi].unpack().tolist() == values[lo:hi]
    ids = np.arange(len(values), dtype=np.int64) + 7
    batch = rows.RowBatch(
        input_ids=rows.Column(ids, np.array([0, len(values)])), position_ids=None, labels=None,
        seq_lens=None, example_ids=None, num_loss_tokens=None, max_seqlen=None,
        loss_mask=rows.Column(bits, np.array([0, len(values)])))
    want = np.where(np.array(values, bool), ids, -100)[lo:hi]
    assert batch.labels_of(lo, hi, ids[lo:hi]).tolist() == want.tolist()
