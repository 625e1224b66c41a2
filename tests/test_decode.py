"""The loader's row decoder (packer/training/decode.py): the compiled kernel and numpy give the same
arrays, both equal to the textbook rule (ids and positions widened, the id where the row trains and
-100 elsewhere, each token's segment, the cumulative lengths), for either format and every stored
type, at every bit offset of the mask; the kernel refuses a bad argument in one error and never reads
outside the row it is given; and a whole epoch of real builds is the same tensors by both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import make_build
from hypothesis import given, settings
from hypothesis import strategies as st

from packer.contract import rows
from packer.training import decode

KERNEL = decode._rowkernel
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the C kernel is not built (no C compiler at install)")


def test_the_kernel_is_built_where_a_compiler_is():
    """A silent fallback would hide a kernel that no longer compiles: where the install had a compiler,
    the kernel must be there (``pip install -e .`` builds it in place)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: numpy decodes")
    assert KERNEL is not None, "packer/training/_rowkernel.c did not build: run `pip install -e .` and read its log"
    assert decode.KERNEL is KERNEL


GARBAGE = 2**31 - 1  # around the row in its buffers: a read outside [o0, o1) shows in the values


def _batch(draw_lens, ids_dtype, pos_dtype, version, bit_offset, runs, data):
    """A RowBatch of rows of segments, its flat columns slices of larger buffers (so their values start
    past a buffer's start), the mask at ``bit_offset`` bits into its bitmap."""
    seg_counts = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    seg_lens = [draw_lens() for _ in range(sum(seg_counts))]
    tokens = sum(seg_lens)
    top = {np.uint16: 2**16, np.uint32: 2**32, np.int32: 2**31}[ids_dtype]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))  # values by a seed: drawing each is slow
    ids = rng.integers(0, top, tokens, dtype=np.int64)
    ids[rng.random(tokens) < 0.1] = top - 1  # the type's top, where a sign would show
    pos = np.concatenate([np.arange(n) for n in seg_lens]).astype(np.int64)
    if runs:  # a loss mask as chat and prompt/completion make it: runs
        edges = sorted(data.draw(st.lists(st.integers(0, tokens), max_size=8)))
        mask = np.zeros(tokens, bool)
        for a, b in zip(edges[::2], edges[1::2]):
            mask[a:b] = True
    else:
        mask = rng.random(tokens) < 0.5

    def padded(values, dtype):  # values inside a larger buffer of garbage
        fill = np.iinfo(dtype).max if dtype != np.int32 else GARBAGE
        buf = np.full(values.size + 11, fill, dtype)
        buf[5 : 5 + values.size] = values
        return buf[5 : 5 + values.size]

    row_tokens = np.add.reduceat(seg_lens, np.r_[0, np.cumsum(seg_counts)[:-1]]) if seg_lens else np.zeros(0)
    offsets = np.r_[0, np.cumsum(row_tokens)].astype(np.int64)
    seg_offsets = np.r_[0, np.cumsum(seg_counts)].astype(np.int64)
    labels = loss_mask = None
    if version == 1:
        labels = rows.Column(padded(np.where(mask, ids, -100), np.int32), offsets)
    else:
        arrow = pa.array([True] * bit_offset + mask.tolist() + [True] * 9, pa.bool_()).slice(bit_offset, tokens)
        loss_mask = rows.Column(rows.Bits.of(arrow), offsets)
    batch = rows.RowBatch(
        input_ids=rows.Column(padded(ids, ids_dtype), offsets),
        position_ids=rows.Column(padded(pos, pos_dtype), offsets),
        labels=labels, seq_lens=rows.Column(padded(np.array(seg_lens), np.int32), seg_offsets),
        example_ids=None, num_loss_tokens=None,
        max_seqlen=np.array([max(seg_lens[a:b]) for a, b in zip(seg_offsets[:-1], seg_offsets[1:])], np.int32),
        loss_mask=loss_mask)
    return batch, ids, pos, mask, seg_lens, offsets, seg_offsets


def _textbook(ids, pos, mask, seg_lens, offsets, seg_offsets, j, filler):
    o0, o1, s0, s1 = offsets[j], offsets[j + 1], seg_offsets[j], seg_offsets[j + 1]
    lens = seg_lens[s0:s1]
    labels = [-100 if filler or not m else int(i) for i, m in zip(ids[o0:o1], mask[o0:o1])]
    seq_idx = [k for k, n in enumerate(lens) for _ in range(n)]
    cu = [sum(lens[:k]) for k in range(len(lens) + 1)]
    return ids[o0:o1].tolist(), pos[o0:o1].tolist(), labels, seq_idx, cu


# (version, ids, positions) as builds store them: format 1 all int32, format 2 each uint16 or uint32
FORMATS = st.sampled_from([(1, np.int32, np.int32)] + [(2, i, p) for i in (np.uint16, np.uint32)
                                                       for p in (np.uint16, np.uint32)])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(FORMATS, st.integers(0, 23), st.booleans(), st.integers(1, 70), st.data())
def test_both_implementations_give_the_textbook_arrays(stored, bit_offset, runs, longest, data):
    version, ids_dtype, pos_dtype = stored
    batch, ids, pos, mask, seg_lens, offsets, seg_offsets = _batch(
        lambda: data.draw(st.integers(1, longest)), ids_dtype, pos_dtype, version, bit_offset, runs, data)
    bounds = decode.row_bounds(batch)
    for j in range(batch.num_rows):
        for filler in (False, True):
            want = _textbook(ids, pos, mask, seg_lens, offsets, seg_offsets, j, filler)
            where = decode.spans(batch)[j]
            got = [decode.numpy_row(batch, j, where, filler, bounds)]
            if KERNEL is not None:
                got.append(decode.kernel_row(decode.kernel_columns(batch), where, filler))
            for arrays in got:
                n = offsets[j + 1] - offsets[j]
                shapes = [(1, n)] * 4 + [(seg_offsets[j + 1] - seg_offsets[j] + 1,)]
                assert [a.shape for a in arrays] == shapes
                assert [a.dtype for a in arrays] == [np.int64] * 3 + [np.int32] * 2
                assert [a.ravel().tolist() for a in arrays] == list(want)


@needs_kernel
def test_a_row_of_thousands_of_tokens_in_long_runs_is_the_textbook_row():
    """The whole-byte copies and fills: long runs of set and clear bits, a row that starts mid-byte."""
    data_ids = np.random.default_rng(0).integers(0, 2**16, 20_000)
    mask = np.zeros(20_000, bool)
    for a in range(0, 20_000, 1_337):
        mask[a + 3 : a + 900] = True
    arrow = pa.array([False] * 5 + mask.tolist(), pa.bool_()).slice(5)
    offsets = np.array([0, 7, 20_000])
    batch = rows.RowBatch(
        input_ids=rows.Column(data_ids.astype(np.uint16), offsets),
        position_ids=rows.Column(np.r_[np.arange(7), np.arange(19_993)].astype(np.uint16), offsets),
        labels=None, seq_lens=rows.Column(np.array([7, 19_993], np.int32), np.array([0, 1, 2])),
        example_ids=None, num_loss_tokens=None, max_seqlen=np.array([7, 19_993], np.int32),
        loss_mask=rows.Column(rows.Bits.of(arrow), offsets))
    ids, _, labels, seq_idx, cu = decode.kernel_row(decode.kernel_columns(batch), decode.spans(batch)[1], False)
    assert labels.ravel().tolist() == np.where(mask, data_ids, -100)[7:].tolist()
    assert ids.ravel().tolist() == data_ids[7:].tolist() and not seq_idx.any() and cu.tolist() == [0, 19_993]


def _args(n=6, **change):
    """A valid call's arguments for a row of ``n`` tokens in one segment (format 2), then ``change``."""
    args = dict(ids=np.arange(n, dtype=np.uint16), positions=np.arange(n, dtype=np.uint16),
                labels=np.full(2, 0xFF, np.uint8), bit_start=0, seq_lens=np.array([n], np.int32), o0=0, o1=n,
                s0=0, s1=1, out_ids=np.empty(n, np.int64), out_positions=np.empty(n, np.int64),
                out_labels=np.empty(n, np.int64), seq_idx=np.empty(n, np.int32), cu=np.empty(2, np.int32))
    args.update(change)
    return list(args.values())


TYPES = "must be uint16, uint32 or int32"
SHORT = "is shorter than the row's end"
BAD = {  # (error, what its message says, the change): each check of the kernel, by the message it gives
    "float ids": (TypeError, f"ids {TYPES}", dict(ids=np.arange(6, dtype=np.float32))),
    "int64 ids": (TypeError, f"ids {TYPES}", dict(ids=np.arange(6, dtype=np.int64))),
    "byte-swapped ids": (TypeError, f"ids {TYPES}", dict(ids=np.arange(6, dtype=">u2"))),
    "strided ids": ((BufferError, ValueError), "", dict(ids=np.arange(12, dtype=np.uint16)[::2])),
    "ids short of o1": (ValueError, f"ids {SHORT}", dict(ids=np.arange(5, dtype=np.uint16))),
    "positions short of o1": (ValueError, f"positions {SHORT}", dict(positions=np.arange(5, dtype=np.uint16))),
    "bitmap short of o1": (ValueError, "bitmap is shorter", dict(labels=np.zeros(0, np.uint8))),
    "bitmap start past it": (ValueError, "bitmap is shorter", dict(bit_start=11)),
    "a huge bit start": (ValueError, "bitmap is shorter", dict(bit_start=2**62)),
    "a bit start at the top": (ValueError, "bitmap is shorter", dict(bit_start=2**63 - 8)),
    "the largest bit start": (ValueError, "bitmap is shorter", dict(bit_start=2**63 - 1)),
    "int32 labels given a bit start": (TypeError, "bitmap must be uint8", dict(labels=np.zeros(6, np.int32))),
    "uint8 labels without a bit start": (TypeError, "labels must be int32", dict(bit_start=-1)),
    "int32 labels short of o1": (ValueError, f"labels {SHORT}", dict(labels=np.zeros(5, np.int32), bit_start=-1)),
    "int64 seq_lens": (TypeError, "seq_lens must be int32", dict(seq_lens=np.array([6], np.int64))),
    "seq_lens short of s1": (ValueError, "seq_lens is shorter", dict(s1=2, cu=np.empty(3, np.int32))),
    "seq_lens not summing": (ValueError, "do not sum", dict(seq_lens=np.array([5], np.int32))),
    "a negative seq_len": (ValueError, "negative length",
                           dict(seq_lens=np.array([7, -1], np.int32), s1=2, cu=np.empty(3, np.int32))),
    "o1 before o0": (ValueError, "need 0 <= o0 <= o1", dict(o0=3, o1=2)),
    "a negative o0": (ValueError, "need 0 <= o0 <= o1", dict(o0=-1)),
    "a row of 2**31 tokens": (ValueError, "fewer than 2**31 tokens", dict(o1=2**31)),
    "out_ids too short": (ValueError, "out_ids must hold", dict(out_ids=np.empty(5, np.int64))),
    "out_labels too long": (ValueError, "out_labels must hold", dict(out_labels=np.empty(7, np.int64))),
    "out_labels int32": (TypeError, "out_labels must be int64", dict(out_labels=np.empty(6, np.int32))),
    "read-only out_positions": ((BufferError, ValueError), "", dict(out_positions=np.frombuffer(bytes(48), np.int64))),
    "seq_idx int64": (TypeError, "seq_idx must be int32", dict(seq_idx=np.empty(6, np.int64))),
    "seq_idx too short": (ValueError, "seq_idx must hold", dict(seq_idx=np.empty(5, np.int32))),
    "cu too short": (ValueError, "cu_seq_lens must hold", dict(cu=np.empty(1, np.int32))),
    "cu of the wrong size": (ValueError, "cu_seq_lens must hold", dict(cu=np.empty(3, np.int32))),
    "a float offset": (TypeError, "", dict(o1=6.0)),
    "ids not a buffer": (TypeError, "", dict(ids=[0, 1, 2, 3, 4, 5])),
}


@needs_kernel
@pytest.mark.parametrize("case", BAD)
def test_the_kernel_refuses_a_bad_argument_and_writes_nothing(case):
    error, says, change = BAD[case]
    args = _args(**change)
    outs = [a.copy() for a in args[9:]]
    with pytest.raises(error) as raised:
        KERNEL.decode(*args)
    if says:  # numpy's own refusals (a view it cannot give) say nothing of decode
        assert str(raised.value).startswith("decode: ") and says in str(raised.value), raised.value
    assert all(np.array_equal(a, b) for a, b in zip(args[9:], outs) if a.flags.writeable)


@needs_kernel
def test_an_output_overlapping_seq_lens_is_refused_before_a_write():
    """cu_seq_lens laid over seq_lens: its writes would change lengths already checked; refused before
    anything is written (guard words after seq_idx and seq_lens itself unchanged)."""
    for segments in (4, 30):
        base = np.zeros(segments + 2, np.int32)
        base[0] = 2  # seq_lens [2, 0, 0, ...]: a valid row of 2 tokens
        guarded = np.full(2 + 16, -7, np.int32)
        before = base.copy()
        with pytest.raises(ValueError, match="cu_seq_lens overlaps seq_lens"):
            KERNEL.decode(np.arange(2, dtype=np.uint16), np.arange(2, dtype=np.uint16), None, -1, base, 0, 2, 0,
                          segments, np.empty(2, np.int64), np.empty(2, np.int64), np.empty(2, np.int64),
                          guarded[:2], base[1:])
        assert (guarded == -7).all() and np.array_equal(base, before)


OVERLAPS = {  # (the output, what it is laid over): each refused, whichever byte they share
    "out_ids over out_labels": (10, 11), "out_labels over out_ids": (11, 9), "out_positions over out_ids": (10, 9),
    "out_ids over ids": (9, 0), "out_labels over the bitmap": (11, 2), "seq_idx over positions": (12, 1),
    "cu_seq_lens over seq_idx": (13, 12),
}


@needs_kernel
@pytest.mark.parametrize("case", OVERLAPS)
def test_an_output_sharing_memory_with_another_buffer_is_refused(case):
    """Outputs laid over each other or over an input (views of one buffer, sharing a few bytes at the
    edge): the copies would be undefined behaviour (AddressSanitizer's memcpy-param-overlap), so the
    call is refused, naming both, before anything is written."""
    out, over = OVERLAPS[case]
    args = _args(n=8)
    base = np.zeros(4096, np.uint8)
    target = args[over]
    shared = base[1000 : 1000 + target.nbytes]
    shared[...] = target.view(np.uint8)
    args[over] = shared.view(target.dtype)
    # the output ends a word into the other (aligned, as a real output is): its first bytes shared alone
    size = args[out].nbytes
    args[out] = base[1008 - size : 1008].view(args[out].dtype)
    snapshot = base.copy()
    with pytest.raises(ValueError, match="overlaps"):
        KERNEL.decode(*args)
    assert np.array_equal(base, snapshot)


@needs_kernel
def test_the_kernel_releases_every_buffer_it_takes():
    """A buffer still held after a call (on success or on any refusal) cannot be resized: array.array's
    append raises BufferError then."""
    import array

    def held(*arrays):
        for a in arrays:
            a.append(a[-1])  # BufferError while a view of it is held
            a.pop()

    ids, pos = array.array("H", range(6)), array.array("H", range(6))
    bits, seg = array.array("B", [0xFF, 0xFF]), array.array("i", [6])
    outs = [array.array("q", [0] * 6) for _ in range(3)] + [array.array("i", [0] * 6), array.array("i", [0, 0])]
    KERNEL.decode(ids, pos, bits, 0, seg, 0, 6, 0, 1, *outs)
    assert list(outs[2]) == list(range(6)) and list(outs[4]) == [0, 6]
    held(ids, pos, bits, seg, *outs)
    for bad_cu in (array.array("i", [0]), array.array("q", [0, 0])):  # refused at the last buffer's check
        with pytest.raises((TypeError, ValueError)):
            KERNEL.decode(ids, pos, bits, 0, seg, 0, 6, 0, 1, *outs[:4], bad_cu)
        held(ids, pos, bits, seg, *outs[:4], bad_cu)
    with pytest.raises(ValueError):  # refused before any buffer is taken
        KERNEL.decode(ids, pos, bits, 0, seg, 3, 2, 0, 1, *outs)
    held(ids, pos, bits, seg, *outs)


def test_a_checkouts_compiled_kernel_is_not_older_than_its_source():
    """An editable install compiles the kernel once, into the checkout: an edit of the source since
    then would be tested against the old binary. Rebuild with `pip install -e .`."""
    if KERNEL is None:
        pytest.skip("the C kernel is not built")
    source = Path(decode.__file__).with_name("_rowkernel.c")
    if not source.is_file():  # an installed wheel: its kernel was compiled with it
        pytest.skip("not a checkout")
    assert Path(KERNEL.__file__).stat().st_mtime >= source.stat().st_mtime, \
        f"{KERNEL.__file__} is older than {source.name}: rebuild it with `pip install -e .`"


@needs_kernel
def test_the_kernel_takes_exactly_fourteen_arguments():
    KERNEL.decode(*_args())
    with pytest.raises(TypeError, match="14 arguments"):
        KERNEL.decode(*_args()[:13])


torch = pytest.importorskip("torch")


def _epoch(directory, kernel, monkeypatch, **options):
    from packer.training.loader import make_dataloader

    monkeypatch.setattr(decode, "KERNEL", kernel)
    return list(make_dataloader(directory, seed=3, **options))


@needs_kernel
@pytest.mark.parametrize("case", ["format 1", "format 2", "cp-padded", "pairs"])
def test_a_whole_epoch_is_the_same_tensors_by_both(tmp_path, monkeypatch, case):
    """Real builds read by the loader with each implementation; fillers (world size 3, grad_accum 2),
    a context-parallel share of padded rows, and preference pairs included."""
    options = {"format 1": dict(format_version=1), "format 2": {},
               "cp-padded": dict(pack="bfd", max_tokens=1024, cp_size=2), "pairs": None}[case]
    if options is None:
        from test_preference_options import records  # pairs of varied lengths, some truncated

        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("".join(json.dumps(r) + "\n" for r in records()))
        out = make_build(tmp_path / "b", str(pairs), pack="bfd", max_len=40)
        reads = [dict(world_size=2, grad_accum=2)]
    else:
        out = make_build(tmp_path / "b", limit=60, max_len=256, **options)
        reads = [dict(world_size=3, grad_accum=2, rank=2)]
        if case == "cp-padded":
            reads.append(dict(cp_rank=1, cp_size=2))
    for read in reads:
        numpy_batches, kernel_batches = _epoch(out, None, monkeypatch, **read), _epoch(out, KERNEL, monkeypatch, **read)
        assert len(numpy_batches) == len(kernel_batches) > 0
        for a, b in zip(numpy_batches, kernel_batches, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                if torch.is_tensor(a[k]):
                    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
                else:
                    assert a[k] == b[k], k
        if "world_size" in read:
            assert any(not (b["labels"] != -100).any() for b in kernel_batches)  # a filler was read
