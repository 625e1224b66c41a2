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
    """Bits of a sliced BooleanArray (any bit offset) against Arrow's own decoding, labels_of against the
    textbook rule (the id where the mask is set, else -100), and the bits counted between cuts and read at
    indices against the values."""
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
    cuts = sorted(data.draw(st.lists(st.integers(0, len(values)), min_size=1, max_size=6)))
    assert bits.count(np.array(cuts, np.int64)).tolist() == [sum(values[a:b]) for a, b in zip(cuts, cuts[1:])]
    some = np.array(data.draw(st.lists(st.integers(0, max(len(values) - 1, 0)), max_size=5 * bool(values))), np.int64)
    assert bits.at(some).tolist() == [values[i] for i in some]


def test_bits_counted_alike_without_numpys_bitwise_count(monkeypatch):
    """numpy < 2 has no bitwise_count: the byte table counts the same."""
    rng = np.random.default_rng(0)
    values = (rng.random(1000) < 0.3).tolist()
    bits = rows.Bits.of(pa.array([True] * 13 + values, pa.bool_()).slice(13))
    cuts = np.array([0, 1, 63, 64, 65, 500, 999, 1000], np.int64)
    want = [sum(values[a:b]) for a, b in zip(cuts, cuts[1:])]
    assert bits.count(cuts).tolist() == want
    monkeypatch.setattr(rows, "_HAS_BITWISE_COUNT", False)
    counted = bits.count(cuts)
    assert counted.tolist() == want and counted.dtype == np.int64


# -- check_rows against the rules read row by row (the textbook), on random sound and damaged batches --------


def _textbook(r: dict, vocab: int | None, limits: rows.Limits, tokens: bool) -> list[tuple[list[int], str]]:
    """Each rule of packer.contract.rows stated per row in plain Python, in rule order: what check_rows
    must find, rows and messages, on any batch (a row whose layout is broken skipped by the token rules)."""
    ids, pos, loss, seq, eids, pads = r["ids"], r["pos"], r["loss"], r["seq"], r["eids"], r["pads"]
    n, out = len(ids), []

    def add(broken, message):
        if broken:
            out.append((broken, message))

    for name, col in (("position_ids", pos), (r["loss_name"], loss)):
        add([i for i in range(n) if len(col[i]) != len(ids[i])], f"{name} has another length than input_ids")
    if out:
        return out
    trained = [[x != schema.IGNORE_INDEX for x in row] if r["loss_name"] == "labels" else row for row in loss]
    layout = [[i for i in range(n) if len(eids[i]) != len(seq[i])], [i for i in range(n) if not seq[i]],
              [i for i in range(n) if any(s <= 0 for s in seq[i])], [i for i in range(n) if sum(seq[i]) != len(ids[i])]]
    if pads is not None:
        layout.append([i for i in range(n) if len(pads[i]) != len(seq[i])
                       or any(p < 0 or p >= s for p, s in zip(pads[i], seq[i], strict=True))])
    for broken, message in zip(layout, ["example_ids has another length than seq_lens", "no segments (an empty row)",
                                        "a segment length ≤ 0 in seq_lens", "seq_lens do not sum to the row's length "
                                        "(len(input_ids)): the segment boundaries are wrong", "pad_lens is not one count "
                                        "per segment, each below the segment's length"], strict=False):
        add(broken, message)
    bad = {i for broken in layout for i in broken}
    good = [i for i in range(n) if i not in bad]
    add([i for i in good if max(seq[i], default=0) != r["max_seqlen"][i]], "max_seqlen differs from max(seq_lens)")
    if sum(map(len, eids)) == sum(map(len, seq)):
        add([i for i in range(n) if any(e < 0 for e in eids[i])], "a negative example id")
    if limits.max_segments is not None:
        add([i for i in range(n) if len(seq[i]) > limits.max_segments],
            f"more than batch_size={limits.max_segments} segments")
    if limits.max_row_tokens is not None:
        add([i for i in range(n) if len(ids[i]) > limits.max_row_tokens],
            f"more than max_tokens={limits.max_row_tokens:,} tokens")
    if limits.max_segment_tokens is not None:
        # a row's pad counts where it has one a segment, else none (a miscounted row shifts no other's)
        def pad(i, j):
            return pads[i][j] if pads and len(pads[i]) == len(seq[i]) else 0
        add([i for i in range(n) if any(s - pad(i, j) > limits.max_segment_tokens for j, s in enumerate(seq[i]))],
            f"a segment longer than max_len={limits.max_segment_tokens:,}")
    if not tokens:
        return out
    bits = 8 * r["pos_type"].byte_width
    if bits < 32 and any(seq):
        add([i for i in good if any(s > 1 << bits for s in seq[i])],
            f"a segment longer than its {r['pos_type']} position_ids can count ({1 << bits:,})")
    starts = {i: [sum(seq[i][:j]) for j in range(len(seq[i]))] for i in good}
    # positions count 0, 1, ... inside each segment, as their type counts (wrapping at its top)
    add([i for i in good if [p % (1 << bits) for p in pos[i]] != [t % (1 << bits) for s in seq[i] for t in range(s)]],
        "position_ids do not run 0..len-1 inside each segment (they must restart at 0 exactly at the seq_lens "
        "boundaries)")
    add([i for i in good if any(trained[i][s] for s in starts[i])],
        "a label is not -100 at a segment start: a label crosses an example boundary")
    if r["loss_name"] == "labels":
        add([i for i in good if any(x not in (schema.IGNORE_INDEX, t) for x, t in zip(loss[i], ids[i], strict=True))],
            "a label is neither -100 nor the input id at its position")
    add([i for i in good if sum(trained[i]) != r["num_loss_tokens"][i]],
        "num_loss_tokens differs from the count of labels ≠ -100")
    if vocab is not None:
        add([i for i in good if any(not 0 <= t < vocab for t in ids[i])],
            f"token ids outside [0, {vocab:,}) (the tokenizer's vocab size)")
    if pads is not None:
        add([i for i in good if any(trained[i][s + seq[i][j] - pads[i][j] : s + seq[i][j]].count(True)
                                    for j, s in enumerate(starts[i]))], "a padding token is trained")
    return out


LAYOUT_DAMAGE = ["seq sum", "seq zero", "empty row"]
DAMAGE = ["position", "positions shifted", "positions run on", "label at a start", "num_loss_tokens", "vocab", "negative id", "label not the id",
          "max_seqlen", "negative example id", "example_ids length", "position_ids length", "loss length",
          "pad too long", "padding trained", "negative pad", "pad count missing", "pad count extra", *LAYOUT_DAMAGE]


def _random_rows(rng: np.random.Generator, fmt: int, padded: bool, vocab: int) -> dict:
    """Per row, sound columns as Python lists: random segments (some long enough to span many mask bytes),
    completion-like trained tokens, never at a segment start nor on padding."""
    r = {k: [] for k in ("ids", "pos", "loss", "seq", "eids", "pads", "num_loss_tokens", "max_seqlen")}
    for _ in range(int(rng.integers(1, 7))):
        seq = rng.integers(1, 300 if rng.random() < 0.2 else 25, int(rng.integers(1, 5))).tolist()
        pads = [int(rng.integers(0, s)) for s in seq] if padded else []
        trained = []
        for s, p in zip(seq, pads or [0] * len(seq), strict=True):
            flags = (rng.random(s) < rng.random()).tolist()
            trained += [False] + flags[1 : s - p] + [False] * p
        ids = rng.integers(0, vocab, len(trained)).tolist()
        r["ids"].append(ids)
        r["pos"].append([t for s in seq for t in range(s)])
        r["loss"].append(trained if fmt == 2 else [t if f else schema.IGNORE_INDEX for t, f in zip(ids, trained,
                                                                                                    strict=True)])
        r["seq"].append(seq)
        r["eids"].append(rng.integers(0, 50, len(seq)).tolist())
        r["pads"].append(pads)
        r["num_loss_tokens"].append(sum(trained))
        r["max_seqlen"].append(max(seq))
    return r


def _damage(r: dict, rng: np.random.Generator, what: str, fmt: int, vocab: int) -> None:
    """Break one thing in one random row (the rows stay lists of the right Python types)."""
    i = int(rng.integers(0, len(r["ids"])))
    n, seq = len(r["ids"][i]), r["seq"][i]
    t = int(rng.integers(0, n)) if n else 0
    j = int(rng.integers(0, len(seq))) if seq else 0
    start = sum(seq[:j])
    trained = fmt == 2 and r["loss"][i] or None
    if what == "position" and n:
        r["pos"][i][t] = (r["pos"][i][t] + int(rng.integers(1, 3))) % 60000
    elif what == "positions shifted" and start < n:  # every step right, the start's position not 0
        for k in range(start, min(start + seq[j], n)):
            r["pos"][i][k] += 1
    elif what == "positions run on":  # not restarting at the segment boundaries
        r["pos"][i] = list(range(n))
    elif what == "label at a start" and start < n:
        r["loss"][i][start] = True if trained else r["ids"][i][start]
        r["num_loss_tokens"][i] += int(rng.integers(0, 2))  # counted, or not
    elif what == "num_loss_tokens":
        r["num_loss_tokens"][i] += int(rng.choice([-1, 1]))
    elif what == "vocab" and n:
        r["ids"][i][t] = vocab + int(rng.integers(0, 100))
    elif what == "negative id" and n and fmt == 1:
        r["ids"][i][t] = -int(rng.integers(1, 200))
    elif what == "label not the id" and n and fmt == 1:
        r["loss"][i][t] = r["ids"][i][t] + int(rng.integers(1, 5))
    elif what == "max_seqlen":
        r["max_seqlen"][i] += 1
    elif what == "negative example id" and r["eids"][i]:
        r["eids"][i][int(rng.integers(0, len(r["eids"][i])))] = -1
    elif what == "example_ids length" and r["eids"][i]:
        r["eids"][i].pop()
    elif what in ("position_ids length", "loss length"):
        col = r["pos" if what == "position_ids length" else "loss"][i]
        col.append(col[-1]) if rng.random() < 0.5 or not col else col.pop()
    elif what == "pad too long" and r["pads"][i]:
        r["pads"][i][j] = seq[j]
    elif what == "negative pad" and r["pads"][i]:
        r["pads"][i][j] = -int(rng.integers(1, 3))
    elif what == "pad count missing" and r["pads"][i]:  # the column's total no longer the segments'
        r["pads"][i].pop()
    elif what == "pad count extra" and r["pads"][i] is not None:
        r["pads"][i].append(0)
    elif what == "padding trained" and r["pads"][i] and r["pads"][i][j]:
        r["loss"][i][start + seq[j] - 1] = True if trained else r["ids"][i][start + seq[j] - 1]
    elif what == "seq sum" and seq:
        seq[j] += int(rng.choice([-1, 1]))
    elif what == "seq zero" and seq:
        seq[j] = -int(rng.integers(0, 2))
    elif what == "empty row":
        for key in ("seq", "eids", "pads"):
            r[key][i] = []


def _arrow(r: dict, fmt: int, id_type: pa.DataType, bit_offset: int, padded: bool) -> pa.RecordBatch:
    """The rows as a record batch of the row schema; format 2's mask values start ``bit_offset`` bits into
    their bitmap (as a slice's do)."""
    def lists(key, type_):
        return pa.array(r[key], pa.list_(type_))

    cols = {"input_ids": lists("ids", id_type), "position_ids": lists("pos", r["pos_type"])}
    if fmt == 1:
        cols["labels"] = lists("loss", pa.int32())
    else:
        flat = pa.array([False] * bit_offset + [x for row in r["loss"] for x in row], pa.bool_()).slice(bit_offset)
        offsets = pa.array(np.concatenate([[0], np.cumsum([len(x) for x in r["loss"]])]), pa.int32())
        cols[schema.LOSS_MASK] = pa.ListArray.from_arrays(offsets, flat)
    cols |= {"seq_lens": lists("seq", pa.int32()), "example_ids": lists("eids", pa.int64()),
             "num_loss_tokens": pa.array(r["num_loss_tokens"], pa.int32()),
             "max_seqlen": pa.array(r["max_seqlen"], pa.int32())}
    if padded:
        cols[schema.PAD_COLUMN] = lists("pads", pa.int32())
    return pa.RecordBatch.from_pydict(cols)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), fmt=st.sampled_from([1, 2]), padded=st.booleans(),
       damage=st.lists(st.sampled_from(DAMAGE), max_size=4), bit_offset=st.integers(0, 23), cut=st.integers(0, 2),
       limits=st.sampled_from([rows.Limits()] * 4 + [rows.Limits(3, 200, 20), rows.Limits(max_segment_tokens=9)]),
       vocab=st.sampled_from([60, 60, 60, None]), tokens=st.sampled_from([True, True, True, False]))
def test_check_rows_finds_what_the_rules_read_row_by_row_find(seed, fmt, padded, damage, bit_offset, cut, limits,
                                                              vocab, tokens):
    """Sound and damaged batches of both formats, mask bits at any offset, batches sliced (offsets not at 0):
    check_rows's problems, rows and messages in order, are the textbook's."""
    rng = np.random.default_rng(seed)
    r = _random_rows(rng, fmt, padded, 60)
    id_type = {1: pa.int32(), 2: pa.uint16() if seed % 3 else pa.uint32()}[fmt]
    r["pos_type"] = {1: pa.int32(), 2: pa.uint16() if seed % 5 else pa.uint32()}[fmt]
    r["loss_name"] = "labels" if fmt == 1 else schema.LOSS_MASK
    for what in damage:  # a broken row never shifts another row's padding (RowBatch.padding() would)
        _damage(r, rng, what, fmt, 60)
    if not padded:
        r["pads"] = None
    batch = _arrow(r, fmt, id_type, bit_offset, padded)
    cut = min(cut, batch.num_rows - 1)
    r = {k: v[cut:] if isinstance(v, list) else v for k, v in r.items()}
    found = rows.check_arrow(batch.slice(cut), vocab, limits, tokens=tokens)
    assert [(p.rows.tolist(), p.message) for p in found] == _textbook(r, vocab, limits, tokens)
