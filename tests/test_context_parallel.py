"""Context-parallel-ready rows and static shapes (packer.planning.context_parallel), proved on CPU.

Builds of the bundled sample padded for a CP group; the loader hands each CP rank its share. The CP
group is emulated in one process: every rank's tokens are gathered (the all-gather of a real group),
each rank's queries attend to all keys/values under the mask of packer's boundaries and positions, and
the reassembled outputs and the sum of the ranks' losses are compared with the unsplit row."""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_build, shard_rows
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

from packer.contract import schema
from packer.contract.config import BuildConfig
from packer.errors import ConfigError
from packer.planning import context_parallel as cp
from packer.training.attention import packed_attention
from packer.training.guard import prepare
from packer.training.loader import PackedDataset

GROUP = 12  # a build for a CP group of 12 serves groups of 1, 2, 3 and 4 (each divides it)
SIZES = (1, 2, 3, 4)
LAYOUTS = cp.LAYOUTS


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, object]:
    """One build per layout: bfd rows of <= 600 tokens, over-long examples split at 97 tokens (odd
    lengths), every token but a segment's first trained (so a label at a rank's edge is trained)."""
    out = {}
    for layout in LAYOUTS:
        out[layout] = make_build(tmp_path_factory.mktemp(layout), limit=40, pack="bfd", max_len=97,
                                 max_tokens=600, overlong="split", train_on="all", cp_size=GROUP, cp_layout=layout)
    return out


def rows_of(directory, **options) -> list[dict]:
    return list(PackedDataset(directory, shuffle=False, **options))


# -- the layout rules ---------------------------------------------------------------------------------


def test_zigzag_shares_are_chunks_r_and_2n_minus_1_minus_r_of_every_segment():
    cu = np.array([0, 8, 12, 28])  # segments of 8, 4 and 16 tokens, N = 2: chunks of 2, 1 and 4
    assert cp.zigzag_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 15, 24, 25, 26, 27]
    assert cp.zigzag_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 16, 17, 18, 19, 20, 21, 22, 23]
    for n in SIZES:  # the shares partition the row, equally
        cu = np.array([0, 2 * n, 6 * n, 16 * n])
        shares = [cp.zigzag_indices(cu, n, r) for r in range(n)]
        assert sorted(np.concatenate(shares).tolist()) == list(range(16 * n))
        assert len({s.size for s in shares}) == 1


def test_cu_seqlens_on_rank_counts_the_real_tokens_of_each_share():
    """As TransformerEngine's get_cu_seqlens_on_cp_rank: per segment, the rank's unpadded tokens."""
    lens, pads = np.array([5, 1, 12, 7]), np.array([3, 7, 4, 1])
    cu = np.concatenate([[0], np.cumsum(lens + pads)])
    cu_real = np.concatenate([[0], np.cumsum(lens)])
    real = np.concatenate([np.arange(p) < n for n, p in zip(lens, lens + pads, strict=True)])
    seg = np.repeat(np.arange(lens.size), lens + pads)
    for r in range(2):
        idx = cp.zigzag_indices(cu, 2, r)
        want = np.concatenate([[0], np.cumsum(np.bincount(seg[idx], weights=real[idx], minlength=lens.size))])
        assert cp.cu_seqlens_on_rank(cu_real, cu // 2, 2, r).tolist() == want.astype(int).tolist()


def test_padding_rules_compose():
    zig = cp.Layout(cp_size=3, cp_layout="zigzag", multiple=4)
    assert zig.segment_multiple == 12 and zig.row_multiple == 12 and zig.budget(100) == 96
    lens = np.array([5, 12, 13, 1])
    assert zig.padding(lens, np.array([0, 2, 4])).tolist() == [7, 0, 11, 11]
    con = cp.Layout(cp_size=3, cp_layout="contiguous", multiple=2)
    assert con.segment_multiple == 2 and con.row_multiple == 6
    pad = con.padding(lens, np.array([0, 2, 4]))
    assert pad.tolist() == [1, 0, 1, 3]  # segments even, then the row's last segment fills to 6: 18 and 18
    assert cp.shift_labels(np.array([[-100, 5, 6, -100, 7]])).tolist() == [[5, 6, -100, 7, -100]]
    assert cp.pad_token_id({"pad_token_id": None, "eos_token_id": 2}) == 2  # Llama 2: no pad token, eos
    assert cp.pad_token_id({"pad_token_id": 0, "eos_token_id": 2}) == 0
    with pytest.raises(ConfigError, match="neither a pad nor an eos"):
        cp.pad_token_id({"pad_token_id": None, "eos_token_id": None})


# -- the build ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_build_pads_segments_untrained_with_positions_continuing(builds, layout):
    directory = builds[layout]
    manifest = schema.read_manifest(directory)
    assert manifest.config.cp_size == GROUP and manifest.config.cp_layout == layout
    assert manifest.stats.pad_token_id == manifest.tokenizer["pad_token_id"] is not None
    table = schema.open_shard(directory / manifest.shards[0].file)
    assert table.schema.names[-1] == schema.PAD_COLUMN
    pad_total = 0
    for row in shard_rows(directory / manifest.shards[0].file):
        cu = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        assert cu[-1] <= 600 and cu[-1] % GROUP == 0
        if layout == "zigzag":
            assert all(n % (2 * GROUP) == 0 for n in row["seq_lens"])
        ids, pos, labels = (np.array(row[k]) for k in ("input_ids", "position_ids", "labels"))
        for lo, hi, pad in zip(cu[:-1], cu[1:], row[schema.PAD_COLUMN], strict=True):
            assert pos[lo:hi].tolist() == list(range(hi - lo))  # positions continue through the padding
            assert (labels[hi - pad : hi] == -100).all() and (ids[hi - pad : hi] == manifest.stats.pad_token_id).all()
            assert pad < hi - lo  # at least one real token
        assert row["num_loss_tokens"] == int((labels != -100).sum())
        pad_total += sum(row[schema.PAD_COLUMN])
    assert pad_total == manifest.stats.pad_tokens > 0
    assert manifest.shards[0].tokens == manifest.stats.tokens + manifest.stats.pad_tokens


def test_options_that_cannot_hold_are_refused():
    with pytest.raises(ConfigError, match="pads to 24, more than the row budget of 12"):
        BuildConfig(source="flan", out="x", pack="bfd", max_len=20, max_tokens=20, cp_size=6)
    with pytest.raises(ConfigError, match="give --cp-size"):
        BuildConfig(source="flan", out="x", cp_layout="contiguous")
    with pytest.raises(ConfigError, match="wrap"):
        BuildConfig(source="flan", out="x", pack="wrap", text_field="text", cp_size=2)
    assert BuildConfig(source="flan", out="x", pad_to_multiple_of=16).identity()["pad_to_multiple_of"] == 16
    assert "cp_size" not in BuildConfig(source="flan", out="x").identity()  # unset: not recorded, bytes kept


# -- the loader -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_gets_its_share_of_the_same_row(builds, layout):
    whole = rows_of(builds[layout])
    for n in (2, 4):
        ranks = [rows_of(builds[layout], cp_rank=r, cp_size=n) for r in range(n)]
        for k, row in enumerate(whole):
            shares = [rank[k] for rank in ranks]
            cu = row["cu_seq_lens_q"].numpy()
            idx = [cp.zigzag_indices(cu, n, r) if layout == "zigzag" else
                   np.arange(r * cu[-1] // n, (r + 1) * cu[-1] // n) for r in range(n)]
            shifted = cp.shift_labels(row["labels"].numpy())
            for r, share in enumerate(shares):
                assert share["input_ids"][0].tolist() == row["input_ids"][0, idx[r]].tolist()
                assert share["position_ids"][0].tolist() == row["position_ids"][0, idx[r]].tolist()
                assert share["shift_labels"][0].tolist() == shifted[0, idx[r]].tolist()
                assert share["num_items_in_batch"] == row["num_items_in_batch"]
            if layout == "zigzag":
                assert shares[0]["cu_seq_lens_q"].tolist() == (cu // n).tolist()
            else:
                assert shares[0]["cu_seq_lens_q"].tolist() == cu.tolist()


def test_a_cp_size_the_build_does_not_divide_is_refused(builds, flan_bfd):
    with pytest.raises(ConfigError, match="rebuild with --cp-size 5"):
        PackedDataset(builds["zigzag"], cp_size=5)
    with pytest.raises(ConfigError, match="no --cp-size"):
        PackedDataset(flan_bfd, cp_size=2)
    with pytest.raises(ConfigError, match="cp_rank 2 with cp_size 2"):
        PackedDataset(builds["zigzag"], cp_size=2, cp_rank=2)


def test_static_shapes_give_one_shape(builds, flan_bfd):
    for directory, n in ((flan_bfd, 1), (builds["zigzag"], 2), (builds["contiguous"], 3)):
        shapes = {(tuple(b["input_ids"].shape), tuple(b["cu_seq_lens_q"].shape), b["max_length_q"])
                  for b in rows_of(directory, static_shapes=True, cp_size=n)}
        assert len(shapes) == 1, shapes
    whole = rows_of(flan_bfd)
    static = rows_of(flan_bfd, static_shapes=True)
    budget = schema.read_manifest(flan_bfd).stats.row_budget
    for row, fixed in zip(whole, static, strict=True):
        t = row["input_ids"].shape[1]
        assert fixed["input_ids"].shape[1] == budget
        assert fixed["input_ids"][0, :t].tolist() == row["input_ids"][0].tolist()
        assert (fixed["labels"][0, t:] == -100).all()
        assert fixed["cu_seq_lens_q"][: row["cu_seq_lens_q"].numel()].tolist() == row["cu_seq_lens_q"].tolist()


# -- the CP group, emulated -------------------------------------------------------------------------


def _segments(share: dict, layout: str, n: int, r: int) -> torch.Tensor:
    """Each token's segment number, from the rank's own boundaries (local cu_seqlens for zigzag, the
    row's for contiguous, offset by the rank's slice)."""
    cu, t = share["cu_seq_lens_q"].long(), share["input_ids"].shape[1]
    at = torch.arange(t) + (0 if layout == "zigzag" or n == 1 else r * t)
    return torch.searchsorted(cu, at, right=True) - 1


def _gathered(shares, layout, n):
    """The all-gather: every rank's tokens, positions and segment numbers, rank after rank."""
    cat = {k: torch.cat([s[k] for s in shares], dim=1)[0] for k in ("input_ids", "position_ids")}
    cat["segment"] = torch.cat([_segments(s, layout, n, r) for r, s in enumerate(shares)])
    return cat


def _mask(seg_q, pos_q, seg_k, pos_k) -> torch.Tensor:
    """Packer's boundaries: a query sees the keys of its own segment at its position or before."""
    return (seg_q[:, None] == seg_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])


@functools.cache
def _tables(heads=4, dim=8, vocab=2**15, positions=1024):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, vocab, heads, dim, generator=gen), torch.randn(3, positions, heads, dim, generator=gen)


def _qkv(ids, pos):
    """Queries, keys and values a rank computes from its own tokens alone: [H, T, D]."""
    table, pos_table = _tables()
    return [(table[i, ids % table.shape[1]] + pos_table[i, pos]).transpose(0, 1) for i in range(3)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
def test_ranks_attention_reassembled_equals_unsplit_attention(builds, layout, n):
    row = rows_of(builds[layout])[0]
    shares = [rows_of(builds[layout], cp_rank=r, cp_size=n)[0] for r in range(n)]
    ids, pos = row["input_ids"][0], row["position_ids"][0]
    q, k, v = _qkv(ids, pos)
    unsplit = packed_attention(torch.nn.Module(), q[None], k[None], v[None], None, cu_seq_lens_q=row["cu_seq_lens_q"],
                               max_length_q=row["max_length_q"])[0][0]  # [T, H, D]
    g = _gathered(shares, layout, n)
    _, kg, vg = _qkv(g["input_ids"], g["position_ids"])
    outs, keys = [], []
    for r, share in enumerate(shares):
        qr = _qkv(share["input_ids"][0], share["position_ids"][0])[0]
        seg_q, pos_q = _segments(share, layout, n, r), share["position_ids"][0]
        mask = _mask(seg_q, pos_q, g["segment"], g["position_ids"])
        outs.append(F.scaled_dot_product_attention(qr, kg, vg, attn_mask=mask).transpose(0, 1))
        keys.append(seg_q * 10**6 + pos_q)
    # reassemble by (segment, position), which names every token of the row once
    order = torch.argsort(torch.cat(keys))
    reassembled = torch.cat(outs)[order]
    seg_row = torch.searchsorted(row["cu_seq_lens_q"].long(), torch.arange(ids.numel()), right=True) - 1
    assert torch.equal(torch.sort(seg_row * 10**6 + pos).values, torch.cat(keys)[order])
    diff = (reassembled - unsplit).abs().max().item()
    assert diff < 1e-5, diff


def _emulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cp_group=None,
                        **kwargs):
    """A transformers attention function for the gathered row of a CP group: each rank's queries
    against every rank's keys/values, masked by packer's boundaries (segment numbers and positions)."""
    seg, pos = cp_group
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=_mask(seg, pos, seg, pos), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("cp_emulation", _emulated_attention)


@pytest.fixture(scope="module")
def tiny_llamas(builds):
    """The same tiny Llama twice: packed by packer (the unsplit row), and on the emulated CP group."""
    vocab = schema.read_manifest(builds["zigzag"]).tokenizer["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    models = []
    for attn in ("sdpa", "cp_emulation"):  # each its own config: prepare() sets the attention on it
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn,
                                                       dtype=torch.float32).eval())
    prepare(models[0])
    return models


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
def test_ranks_losses_sum_to_the_unsplit_loss(builds, tiny_llamas, layout, n):
    whole = rows_of(builds[layout])
    k = max(range(len(whole)), key=lambda i: whole[i]["num_items_in_batch"])
    row = whole[k]
    shares = [rows_of(builds[layout], cp_rank=r, cp_size=n)[k] for r in range(n)]
    packed, model = tiny_llamas
    with torch.no_grad():
        expected = packed(**row).loss
        g = _gathered(shares, layout, n)
        logits = model(input_ids=g["input_ids"][None], position_ids=g["position_ids"][None],
                       cp_group=(g["segment"], g["position_ids"]), use_cache=False).logits
        right, wrong, at = 0.0, 0.0, 0
        for share in shares:
            t = share["input_ids"].shape[1]
            mine, at = logits[:, at : at + t], at + t
            common = dict(vocab_size=model.config.vocab_size, num_items_in_batch=share["num_items_in_batch"])
            # a group of 1 is the plain loader's row, which has no shift_labels: shift it whole
            shifted = share.get("shift_labels", torch.from_numpy(cp.shift_labels(share["labels"].numpy())))
            right += model.loss_function(logits=mine, labels=share["labels"], shift_labels=shifted, **common)
            wrong += model.loss_function(logits=mine, labels=share["labels"], **common)  # shifted after the split
    assert math.isclose(right.item(), expected.item(), rel_tol=1e-5), (right.item(), expected.item())
    if n > 1:  # the shares' edges lose (or misplace) labels: must not pass for the exact loss
        assert not math.isclose(wrong.item(), expected.item(), rel_tol=1e-3), (wrong.item(), expected.item())


def test_verify_accepts_padding_and_finds_trained_padding(builds, tmp_path):
    import shutil

    import pyarrow as pa

    from packer.checking.verify import verify

    directory = shutil.copytree(builds["zigzag"], tmp_path / "copy")
    assert verify(directory, source="flan").ok
    path = directory / schema.read_manifest(directory).shards[0].file
    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all().combine_chunks()
    loss = table.column(schema.LOSS_MASK).chunk(0)  # format 2: the mask
    values = loss.values.to_numpy(zero_copy_only=False).copy()
    cu = np.cumsum(table.column("seq_lens").chunk(0).values.to_numpy())
    pads = table.column(schema.PAD_COLUMN).chunk(0).values.to_numpy()
    at = int(cu[np.flatnonzero(pads)[0]]) - 1  # the last token of a padded segment: padding
    values[at] = True
    table = table.set_column(2, table.schema.field(2), pa.ListArray.from_arrays(loss.offsets, pa.array(values)))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    messages = [p.message for p in verify(directory).problems]
    assert "a padding token is trained" in messages, messages


def test_cli_builds_padded_rows_and_shows_their_cost(tmp_path):
    from click.testing import CliRunner

    from packer.cli import main

    out = tmp_path / "cli"
    result = CliRunner().invoke(main, ["build", "flan", "--out", str(out), "--limit", "30", "--pack", "bfd",
                                       "--max-len", "200", "--max-tokens", "512", "--cp-size", "2",
                                       "--cp-layout", "contiguous", "--pad-to-multiple-of", "8", "-q"])
    assert result.exit_code == 0, result.output
    stats = schema.read_manifest(out).stats
    line = f"{stats.pad_tokens:,} tokens"
    assert any(x.startswith("padding") and line in x and "a CP group of 2 (contiguous)" in x
               for x in result.output.splitlines()), result.output
    shown = CliRunner().invoke(main, ["inspect", str(out)])
    assert any(x.strip().startswith("padding") and line in x for x in shown.output.splitlines()), shown.output
    bad = CliRunner().invoke(main, ["build", "flan", "--out", str(tmp_path / "bad"), "--cp-layout", "zigzag"])
    assert bad.exit_code == 2 and "give --cp-size" in bad.output


# -- where CP meets the rest: a mix over planned epochs, ranks, grad_accum, workers and resume ------


@pytest.fixture(scope="module")
def mixed_epochs(tmp_path_factory):
    """A zigzag build for a CP group of 4 of a two-source mix over 2 planned epochs, balanced for 2 ranks."""
    import json

    d = tmp_path_factory.mktemp("cpmix")
    with open(d / "qa.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"It is {2 * i}."}) + "\n")
    out = d / "out"
    from click.testing import CliRunner

    from packer.cli import main

    result = CliRunner().invoke(main, ["build", "flan", str(d / "qa.jsonl"), "--mix", "0.6,0.4", "--limit", "60",
                                       "-q", "-j", "1", "--pack", "bfd", "--max-len", "97", "--max-tokens", "600",
                                       "--overlong", "split", "--epochs", "2", "--cp-size", "4",
                                       "--pad-to-multiple-of", "3", "--world-size", "2", "--balance", "tokens",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _stream(directory, epoch, cut=None, state=None, **options):
    """The batches of one pass (to ``cut`` batches, then the state), set at ``epoch`` or resumed."""
    from packer.training.loader import make_dataloader

    loader = make_dataloader(directory, seed=3, **options)
    loader.load_state_dict(state) if state else loader.set_epoch(epoch)
    got = []
    for batch in loader:
        got.append({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        if len(got) == cut:
            return got, loader.state_dict()
    return got, None


@pytest.mark.filterwarnings("ignore:.*replays planned epoch")
@pytest.mark.parametrize(("epoch", "static", "workers"), [(1, False, 2), (2, True, 0), (0, True, 2)])
def test_cp_shares_of_a_mix_over_epochs_resume_on_every_rank_with_workers(mixed_epochs, epoch, static, workers):
    """Each CP rank's stream is its share of the unsplit stream of its data-parallel rank (same rows,
    same num_items_in_batch), and a pass cut inside an optimizer step and resumed with workers
    continues it exactly."""
    options = {"world_size": 2, "grad_accum": 2, "static_shapes": static}
    for rank in (0, 1):
        whole, _ = _stream(mixed_epochs, epoch, rank=rank, **options)
        for r in range(2):
            share = {"rank": rank, "cp_rank": r, "cp_size": 2, **options}
            full, _ = _stream(mixed_epochs, epoch, **share)
            assert len(full) == len(whole)
            for row, mine in zip(whole, full, strict=True):
                cu = np.asarray(row["cu_seq_lens_q"])
                if not static:
                    idx = cp.zigzag_indices(cu, 2, r)
                    assert mine["input_ids"][0] == np.asarray(row["input_ids"][0])[idx].tolist()
                    assert mine["cu_seq_lens_q"] == (cu // 2).tolist()
                assert mine["num_items_in_batch"] == row["num_items_in_batch"]
            head, state = _stream(mixed_epochs, epoch, cut=3, num_workers=workers, **share)
            assert state["micro_done"] == 1  # cut inside an optimizer step
            rest, _ = _stream(mixed_epochs, epoch, state=state, num_workers=workers, **share)
            assert head + rest == full


def test_verify_and_inspect_count_a_padded_mix_over_epochs_alike(mixed_epochs):
    """The modes table of a padded build counts its segments with their padding: its header's tokens
    are what the ``batch`` mode computes (every segment once, nothing padded to the longest)."""
    import re

    from click.testing import CliRunner

    from packer.cli import main

    assert CliRunner().invoke(main, ["verify", str(mixed_epochs)]).exit_code == 0
    shown = CliRunner().invoke(main, ["inspect", str(mixed_epochs)]).output
    header = re.search(r"the modes on these [\d,]+ segments \(([\d,]+) tokens", shown)
    batch = next(line.split() for line in shown.splitlines() if line.split()[:1] == ["batch"])
    stats = schema.read_manifest(mixed_epochs).stats
    assert header and header[1] == batch[4] == f"{stats.tokens + stats.pad_tokens:,}", shown


def test_plot_data_counts_examples_without_their_padding(mixed_epochs):
    from packer.checking import inspect_

    stats = schema.read_manifest(mixed_epochs).stats
    assert int(inspect_.plot_data(mixed_epochs).example_tokens.sum()) == stats.tokens // stats.epoch_count


def test_inspect_compares_the_modes_in_the_padded_budget(tmp_path):
    """A padded build packs into max_tokens rounded down to its padding multiple (610 -> 608 for a zigzag
    group of 4): ``inspect``'s bfd and optimal rows are planned in that budget too, not in max_tokens."""
    from packer.checking import inspect_

    out = make_build(tmp_path / "b", limit=30, pack="bfd", max_len=97, max_tokens=610, overlong="split", cp_size=4)
    budget = schema.read_manifest(out).stats.row_budget
    assert budget == 608
    modes = {m.mode: m for m in inspect_.summary(out).modes}
    assert modes["bfd"].peak_row_tokens == modes["optimal"].peak_row_tokens == budget
    # verify holds the rows to the same budget: a row of 609 or 610 tokens is not one this build makes
    from packer.contract.rows import build_limits as limits

    assert limits(schema.read_manifest(out).config).max_row_tokens == budget


@pytest.mark.parametrize("overlong", ["truncate", "split"])
def test_find_example_gives_a_padded_builds_examples_their_own_lengths(tmp_path, overlong):
    """``inspect --example`` on a padded build: the same pieces, lengths and truncation as the unpadded
    build of the same examples (the padding is not the example's)."""
    from packer.checking import inspect_

    common = dict(limit=30, pack="bfd", max_len=97, max_tokens=610, overlong=overlong)
    plain = make_build(tmp_path / "plain", **common)
    padded = make_build(tmp_path / "padded", cp_size=4, **common)
    seen = set()
    for example in range(30):
        want, got = inspect_.find_example(plain, example), inspect_.find_example(padded, example)
        assert (got.tokens, got.split, got.truncated) == (want.tokens, want.split, want.truncated), example
        assert sorted(p.length for p in got.pieces) == sorted(p.length for p in want.pieces), example
        seen.add((want.split, want.truncated))
    assert (True, False) in seen if overlong == "split" else (False, True) in seen
