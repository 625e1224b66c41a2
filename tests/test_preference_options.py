"""Preference builds where the options meet (issue 31, §4 and §7): a reference stored once and read back
exactly as the reference model's values, the pair build's row budget, resume at one and two ranks, epochs,
context-parallel shares, format 1 against 2, the pack modes, and mixes with SFT data refused."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import BUNDLED_TOKENIZER, SHARED_DATA, make_build, need_shared

from packer.contract import schema
from packer.errors import ConfigError, ShardFormatError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOKENIZER = SHARED_DATA / "llama2-tokenizer"
PAIRS = 24
MAX_LEN = 40
WORDS = "the cat sat on a mat while two dogs ran past seven red cars and one blue bus".split()


def records() -> list[dict]:
    """PAIRS standard pairs of varied lengths (some over MAX_LEN), the same every run."""
    rng = random.Random(31)
    out = []
    for i in range(PAIRS):
        def words(n):
            return " ".join(rng.choice(WORDS) for _ in range(n))
        long = i % 7 == 3  # a few over MAX_LEN, truncated
        out.append({"prompt": f"Q{i}: {words(rng.randint(2, 8))}?\nA:", "chosen": " " + words(rng.randint(1, 8)),
                    "rejected": " " + words(30 if long else rng.randint(1, 10))})
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    need_shared(TOKENIZER)
    path = tmp_path_factory.mktemp("src") / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return path


@pytest.fixture(scope="module")
def builds(tmp_path_factory, source):
    """Lazily made builds of the same pairs, by options (each made once for the module)."""
    made = {}

    def get(**options):
        key = tuple(sorted(options.items()))
        if key not in made:
            opts = {"pack": "bfd", "max_len": MAX_LEN, "num_proc": 1, **options}
            made[key] = make_build(tmp_path_factory.mktemp("b"), str(source), tokenizer=str(TOKENIZER), **opts)
        return made[key]
    return get


@pytest.fixture(scope="module")
def models(builds):
    from transformers import LlamaConfig, LlamaForCausalLM

    from packer import prepare
    vocab = schema.read_manifest(builds()).tokenizer["vocab_size"]

    def tiny(seed):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return prepare(LlamaForCausalLM(config).float().eval(), max_tokens=512)
    return tiny(0), tiny(1)


def stream(out, **options):
    from packer.training.loader import PackedDataset
    return list(PackedDataset(out, **options))


def real(batch) -> bool:
    """A real row, not one of the loader's fillers (a copy whose labels are all -100)."""
    return bool((batch["labels"] != -100).any())


def kept_pairs(out) -> int:
    return schema.read_manifest(out).stats.pairs


# -- the row budget of a pair build ---------------------------------------------------------------


def test_default_row_budget_holds_a_pair(builds):
    from packer.checking.verify import verify
    out = builds()
    m = schema.read_manifest(out)
    assert m.config.max_tokens == 2 * MAX_LEN and m.stats.row_budget == 2 * MAX_LEN  # the SFT default, doubled
    assert m.stats.max_row_tokens > MAX_LEN  # rows do hold more than one sequence's budget
    assert verify(out).ok


def test_padded_default_holds_two_padded_sequences(builds):
    from packer.checking.verify import verify
    from packer.planning.context_parallel import Layout
    from packer.planning.pairs import pair_budget
    out = builds(cp_size=2)
    assert schema.read_manifest(out).config.max_tokens == 2 * MAX_LEN and verify(out).ok
    assert pair_budget(38, Layout(cp_size=2)) == 80  # two sequences of 38 padded to a multiple of 4 (zigzag, 2 x 2)


def test_a_given_budget_too_small_for_a_pair_is_one_line(tmp_path, source):
    with pytest.raises(ConfigError) as e:
        make_build(tmp_path / "o", str(source), tokenizer=str(TOKENIZER), pack="bfd", max_len=MAX_LEN, max_tokens=60)
    message = str(e.value)
    assert "\n" not in message and "pass --max-tokens 80 or more" in message and "--max-len to 30" in message
    assert not (tmp_path / "o" / schema.MANIFEST_NAME).exists()


def test_cli_refuses_a_small_budget_with_exit_2(tmp_path, source):
    from click.testing import CliRunner

    from packer.cli import main
    result = CliRunner().invoke(main, ["build", str(source), "--out", str(tmp_path / "o"), "--tokenizer",
                                       str(TOKENIZER), "--pack", "bfd", "--max-len", "40", "--max-tokens", "79"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "pass --max-tokens 80 or more" in result.output


# -- the reference, computed once -----------------------------------------------------------------


@pytest.fixture(scope="module")
def stored(builds, models, tmp_path_factory):
    from packer.training.preference import precompute_reference
    seen = []

    def progress(rows, total):
        seen.append(total)
        return rows
    path = tmp_path_factory.mktemp("ref") / "ref.arrow"
    ref = precompute_reference(models[1], builds(), path, progress=progress)
    assert seen == [schema.read_manifest(builds()).stats.rows]
    return ref


@pytest.mark.parametrize("world_size", [1, 2])
def test_stored_reference_is_the_reference_models_values(builds, models, stored, world_size):
    from packer.training.preference import dpo_step
    out = builds()
    policy, reference = models
    assert len(stored) == kept_pairs(out)
    seen, fillers = [], 0
    with torch.no_grad():
        for rank in range(world_size):
            for batch in stream(out, shuffle=True, seed=3, rank=rank, world_size=world_size, grad_accum=2):
                live, kept = dpo_step(policy, reference, batch), dpo_step(policy, stored, batch)
                assert torch.equal(live.loss, kept.loss) and torch.equal(live.losses, kept.losses)
                assert torch.equal(live.chosen_rewards, kept.chosen_rewards)
                assert torch.equal(live.rejected_rewards, kept.rejected_rewards)
                if real(batch):
                    seen += batch["pair_ids"].tolist()
                    assert kept.loss > 0
                else:  # a filler adds nothing, with either reference
                    fillers += 1
                    assert kept.loss == 0 and live.loss == 0
    rows = schema.read_manifest(out).stats.rows
    groups = -(-rows // world_size)  # the last group completed, then the last optimizer step (grad_accum 2)
    assert fillers == (groups + groups % 2) * world_size - rows
    assert sorted(seen) == sorted(stored.ids.tolist())  # every pair once over the ranks


def test_reference_of_another_build_is_refused(builds, stored, tmp_path):
    from packer.training.preference import StoredReference, precompute_reference
    other = builds(seed=1)
    with pytest.raises(ShardFormatError, match="another build") as e:
        StoredReference(stored.path, other)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="inside the build folder"):
        precompute_reference(None, other, other / "ref.arrow")
    (tmp_path / "x.arrow").write_bytes(b"not arrow")
    with pytest.raises(ConfigError, match="not a reference file"):
        StoredReference(tmp_path / "x.arrow", other)


def test_stored_reference_refuses_a_pair_it_lacks(builds, stored):
    batch = next(iter(stream(builds(), shuffle=False)))
    batch = {**batch, "pair_ids": batch["pair_ids"] + 10_000}
    with pytest.raises(ConfigError, match="no reference log-probs for pair"):
        stored.segment_logps(batch)


def test_dpo_loop_with_stored_reference_trains_as_with_the_model(builds, models, tmp_path):
    import copy

    from examples.dpo_loop import train
    out, path = builds(), tmp_path / "ref.arrow"

    def run(**options):  # each run from the same initial policy (train() trains the model it is given)
        return train(out, steps=2, grad_accum=2, model=copy.deepcopy(models[0]), **options)
    live = run()
    kept = run(reference_logps=path)  # computed, then stored
    again = run(reference_logps=path)  # read back
    assert live == kept == again and path.is_file()
    assert live[1]["loss"] != live[0]["loss"]


def elsewhere(device: str):
    """A tensor type as a batch moved to an accelerator holds it, on a CPU-only machine: numpy refuses it with
    CUDA's TypeError until ``.cpu()`` copies it to host memory, and it reports ``device``."""
    message = f"can't convert {device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."

    class Elsewhere(torch.Tensor):
        @property
        def device(self):
            return torch.device(device)

        def numpy(self, *args, **kwargs):
            raise TypeError(message)

        def __array__(self, *args, **kwargs):
            raise TypeError(message)

        def cpu(self, *args, **kwargs):
            return self.as_subclass(torch.Tensor)
    return Elsewhere


def test_stored_reference_reads_a_batch_on_another_device(builds, stored):
    rows = [b for b in stream(builds(), shuffle=False) if len(b["pair_ids"]) > 1][:3]
    for batch in rows:
        want = stored.segment_logps(batch)
        for device in ("cpu", "meta"):
            kind = elsewhere(device)
            moved = {k: v.as_subclass(kind) if torch.is_tensor(v) else v for k, v in batch.items()}
            with pytest.raises(TypeError):  # what a CUDA batch does to numpy: the case the lookup must avoid
                np.asarray(moved["pair_ids"])
            got = stored.segment_logps(moved)
            assert got.device == torch.device(device) and got.shape == want.shape and got.dtype == torch.float64
            if device == "cpu":
                assert torch.equal(got.as_subclass(torch.Tensor), want)


def test_stored_reference_refuses_batches_of_another_build(builds, stored):
    def row_lengths(b):  # each pair segment's tokens in a plain row
        return np.diff(b["cu_seq_lens_q"].numpy())[: len(b["pair_roles"])].tolist()
    lengths = {}  # the reference's build: each pair's (chosen, rejected) tokens
    for b in stream(builds(), shuffle=False):
        n = row_lengths(b)
        lengths.update(zip(b["pair_ids"].tolist(), zip(n[0::2], n[1::2], strict=True), strict=True))
    shorter = builds(max_len=30)  # the same records, so the same pair ids, some sequences cut shorter
    refused = passed = 0
    for b in stream(shorter, shuffle=False):
        n = row_lengths(b)
        differ = [(p, c, r) for p, c, r in zip(b["pair_ids"].tolist(), n[0::2], n[1::2], strict=True)
                  if lengths[p] != (c, r)]
        if not differ:  # the same sequences: the stored values are theirs
            stored.segment_logps(b)
            passed += 1
            continue
        with pytest.raises(ShardFormatError, match="the reference file is of another build") as e:
            stored.segment_logps(b)
        (p, c, r), message = differ[0], str(e.value)
        assert "\n" not in message and f"pair {p} is {c} + {r} tokens" in message
        assert "{} + {} in the build".format(*lengths[p]) in message
        refused += 1
    assert refused and passed  # both kinds of row were seen


@pytest.fixture(scope="module")
def stored_cp(builds, models, tmp_path_factory):
    """A reference stored for each CP layout's build (cp_size 2), by layout."""
    from packer.training.preference import precompute_reference
    made = {}

    def get(layout):
        if layout not in made:
            path = tmp_path_factory.mktemp("refcp") / "ref.arrow"
            made[layout] = precompute_reference(models[1], builds(cp_size=2, cp_layout=layout), path)
        return made[layout]
    return get


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_stored_reference_on_cp_shares_and_static_rows(builds, stored_cp, layout):
    out, stored = builds(cp_size=2, cp_layout=layout), stored_cp(layout)
    whole = stream(out, shuffle=False)
    views = [stream(out, shuffle=False, static_shapes=True)]
    views += [stream(out, shuffle=False, cp_rank=k, cp_size=2, static_shapes=s) for k in range(2) for s in (False, True)]
    for row, *parts in zip(whole, *views, strict=True):
        want = stored.segment_logps(row)
        for part in parts:  # every share and fixed shape is checked against the unsharded row's lengths
            assert torch.equal(stored.segment_logps(part), want)


def test_dpo_loss_on_cp_shares_gives_a_filler_row_no_loss(builds, models, stored_cp):
    from packer.planning.context_parallel import zigzag_indices
    from packer.training.preference import MODEL_KEYS, dpo_loss, share_logps
    out, stored = builds(cp_size=2), stored_cp("zigzag")
    policy, reference = models
    rows = schema.read_manifest(out).stats.rows
    options = {"shuffle": False, "grad_accum": rows + 1}  # one optimizer step: the rows, then one filler
    whole = stream(out, **options)
    shares = [stream(out, cp_rank=k, cp_size=2, **options) for k in range(2)]
    assert [real(b) for b in whole] == [True] * rows + [False]
    with torch.no_grad():
        for row, *parts in zip(whole, *shares, strict=True):
            logits = [m(**{k: row[k] for k in MODEL_KEYS}).logits for m in (policy, reference)]
            n = len(row["pair_roles"])
            got, ref, tokens = torch.zeros(n), torch.zeros(n), 0
            for k, part in enumerate(parts):  # the documented CP route: each share, then the all-reduce (a sum)
                idx = torch.from_numpy(zigzag_indices(row["cu_seq_lens_q"].numpy(), 2, k))
                got += share_logps(logits[0][:, idx], part["shift_labels"], part["seq_idx"], n)
                ref += share_logps(logits[1][:, idx], part["shift_labels"], part["seq_idx"], n)
                tokens += int((part["shift_labels"] != -100).sum())
            roles, items = row["pair_roles"], row["num_items_in_batch"]
            results = [dpo_loss(got, stored.segment_logps(parts[0]), roles, num_items=items),  # stored reference
                       dpo_loss(got, ref, roles, num_items=items),  # the reference model's shares
                       dpo_loss(got, ref, roles, num_items=items, loss_tokens=tokens)]  # the count, all-reduced
            if real(row):
                assert tokens > 0 and all(r.loss > 0 for r in results)
                assert torch.equal(results[1].losses, results[2].losses)
            else:  # without the rule: log 2 a pair against the model, another constant against the stored values
                assert tokens == 0
                for r in results:
                    assert r.loss == 0 and not r.losses.any() and not r.chosen_rewards.any()
                    assert not r.rejected_rewards.any()


def test_dpo_loss_filler_rule():
    from packer.training.preference import dpo_loss
    roles = torch.tensor([1, 0, 1, 0])
    policy, ref = torch.tensor([-3.0, -5.0, -2.0, -4.0], requires_grad=True), torch.tensor([-3.5, -4.5, -2.5, -3.0])
    real = dpo_loss(policy, ref, roles, num_items=2)
    assert real.loss > 0 and torch.equal(dpo_loss(policy, ref, roles, num_items=2, loss_tokens=7).loss, real.loss)
    stated = dpo_loss(policy, ref, roles, num_items=2, loss_tokens=torch.tensor(0))
    assert stated.loss == 0 and not stated.losses.any()
    stated.loss.backward()  # still a graph, so a loop's backward on a filler works (and adds nothing)
    assert not policy.grad.any()
    inferred = dpo_loss(torch.zeros(4), ref, roles, num_items=2)  # a sum over no trained token is exactly 0
    assert inferred.loss == 0 and not inferred.losses.any()


def _write_reference(path, table, meta):
    import pyarrow as pa
    t = table.replace_schema_metadata(meta)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, t.schema) as writer:
        writer.write_table(t)
    return path


def test_reference_file_versions(stored, builds, tmp_path, caplog):
    import pyarrow as pa

    from packer.training.preference import REFERENCE_VERSION, StoredReference
    with pa.OSFile(str(stored.path)) as f:
        table = pa.ipc.open_file(f).read_all()
    meta = table.schema.metadata
    assert meta[b"version"] == REFERENCE_VERSION.encode() == b"3" and len(meta[b"sha256"]) == 64
    assert table.schema.field("chosen_logps").type == pa.float64()  # dpo_step's float64 sums, kept whole
    old = table.select(["pair_id", "chosen_logps", "rejected_logps"])  # version 1: log-probs, no lengths
    for version, t in (("1", old), ("4", table)):
        path = _write_reference(tmp_path / f"v{version}.arrow", t, {**meta, b"version": version.encode()})
        with pytest.raises(ShardFormatError, match=f"version '{version}', this packer reads versions 2, 3") as e:
            StoredReference(path, builds())
        assert "\n" not in str(e.value)
    # version 2 (float32 log-probs, no checksum) is still read, with a warning that a change cannot be told
    v2 = table.cast(table.schema.set(1, pa.field("chosen_logps", pa.float32()))
                    .set(2, pa.field("rejected_logps", pa.float32())))
    v2_meta = {k: v for k, v in meta.items() if k != b"sha256"} | {b"version": b"2"}
    with caplog.at_level("WARNING", logger="packer"):
        read = StoredReference(_write_reference(tmp_path / "v2.arrow", v2, v2_meta), builds())
    assert "without a checksum" in caplog.text
    np.testing.assert_allclose(read.values, stored.values, rtol=1e-7)


def test_a_changed_or_non_finite_reference_file_is_refused(stored, builds, models, tmp_path):
    import pyarrow as pa

    from packer.training.preference import StoredReference
    with pa.OSFile(str(stored.path)) as f:
        table = pa.ipc.open_file(f).read_all()
    meta = table.schema.metadata
    raw = stored.path.read_bytes()
    values = table.column("chosen_logps").to_numpy()
    # one value's bytes changed in place (same size, a valid Arrow file): the checksum tells
    needle = values[1].tobytes()
    assert raw.count(needle) == 1
    changed = tmp_path / "changed.arrow"
    changed.write_bytes(raw.replace(needle, (values[1] + 0.5).tobytes()))
    with pytest.raises(ShardFormatError, match="not the ones precompute_reference wrote") as e:
        StoredReference(changed, builds())
    assert "\n" not in str(e.value)
    # the metadata changed (another model's name): the checksum covers it too
    renamed = _write_reference(tmp_path / "renamed.arrow", table, {**meta, b"model": b"another"})
    with pytest.raises(ShardFormatError, match="not the ones precompute_reference wrote"):
        StoredReference(renamed, builds())
    # a NaN or an infinity, in a file written with a matching checksum (or of version 2): refused, naming the pair
    from packer.training.preference import REFERENCE_COLUMNS, reference_checksum
    for bad in (np.nan, -np.inf):
        columns = [table.column(n).to_numpy().copy() for n in REFERENCE_COLUMNS]
        columns[2][0] = bad
        m = {k.decode(): v.decode() for k, v in meta.items()}
        m["sha256"] = reference_checksum(m, columns)
        t = pa.table(dict(zip(REFERENCE_COLUMNS, columns, strict=True)))
        path = _write_reference(tmp_path / "nan.arrow", t, m)
        with pytest.raises(ShardFormatError, match=rf"pair {columns[0][0]}'s stored reference log-probs are .* not "
                                                   "finite") as e:
            StoredReference(path, builds())
        assert "\n" not in str(e.value)
    # a reference model whose forward overflows: refused before any file is written
    import copy

    from packer.training.preference import precompute_reference
    broken = copy.deepcopy(models[1])
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(ShardFormatError, match="computed reference log-probs are nan"):
        precompute_reference(broken, builds(), tmp_path / "never.arrow")
    assert not list(tmp_path.glob("never.arrow*"))


def test_cp_shares_carry_pairs_and_reassemble_the_loss(builds, models, stored):
    from packer.planning.context_parallel import zigzag_indices
    from packer.training.preference import dpo_loss, segment_logps, share_logps
    out = builds(cp_size=2)
    policy, _ = models
    table = schema.open_shard(out / schema.read_manifest(out).shards[0].file).to_pylist()
    for r in table:  # both segments of every pair padded to the zigzag multiple (2 x cp_size)
        assert all(n % 4 == 0 for n in r["seq_lens"]) and len(r["pad_lens"]) == len(r[schema.PAIR_COLUMN])
    whole = stream(out, shuffle=False)
    shares = [stream(out, shuffle=False, cp_rank=k, cp_size=2) for k in range(2)]
    with torch.no_grad():
        for row, *parts in zip(whole, *shares, strict=True):
            logits = policy(input_ids=row["input_ids"], position_ids=row["position_ids"],
                            cu_seq_lens_q=row["cu_seq_lens_q"], cu_seq_lens_k=row["cu_seq_lens_k"],
                            max_length_q=row["max_length_q"], max_length_k=row["max_length_k"]).logits
            want = segment_logps(logits, row["labels"], row["cu_seq_lens_q"])[0]
            got = torch.zeros_like(want)
            for k, part in enumerate(parts):
                assert torch.equal(part["pair_roles"], row["pair_roles"]) and torch.equal(part["pair_ids"], row["pair_ids"])
                idx = torch.from_numpy(zigzag_indices(row["cu_seq_lens_q"].numpy(), 2, k))
                assert torch.equal(part["input_ids"][0], row["input_ids"][0, idx])  # the share is these tokens
                got += share_logps(logits[:, idx], part["shift_labels"], part["seq_idx"], want.numel())
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
            a = dpo_loss(want, want * 0.9, row["pair_roles"]).loss
            b = dpo_loss(got, want * 0.9, parts[0]["pair_roles"]).loss
            # the sums differ only in float32 order: 1e-6 of the log-probs (tens), beta times that in the loss
            torch.testing.assert_close(a, b, rtol=0, atol=0.1 * 1e-6 * float(want.abs().max()))


def test_static_shapes_rows_give_the_same_dpo_loss(builds, models, stored):
    from packer.training.preference import dpo_step
    out = builds()
    with torch.no_grad():
        for plain, fixed in zip(stream(out, shuffle=False), stream(out, shuffle=False, static_shapes=True), strict=True):
            assert fixed["input_ids"].shape[1] == 2 * MAX_LEN and torch.equal(fixed["pair_ids"], plain["pair_ids"])
            a, b = dpo_step(models[0], stored, plain), dpo_step(models[0], stored, fixed)
            torch.testing.assert_close(a.losses, b.losses, rtol=1e-5, atol=1e-6)


# -- format versions, pack modes, mixes -----------------------------------------------------------


def test_format_1_and_2_give_the_same_batches(builds):
    one, two = (stream(builds(format_version=v), seed=4) for v in (1, 2))
    assert len(one) == len(two)
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


@pytest.mark.parametrize("pack", ["batch", "bfd", "optimal"])
def test_every_pack_mode_keeps_pairs_whole(builds, pack):
    from packer.checking.verify import verify
    out = builds(pack=pack, batch_size=4) if pack == "batch" else builds(pack=pack)
    assert verify(out).ok
    ids = []
    for b in stream(out, shuffle=False):
        roles = b["pair_roles"].tolist()
        assert roles == [1, 0] * (len(roles) // 2) and len(b["pair_ids"]) == len(roles) // 2
        assert b["num_items_in_batch"] == len(roles) // 2
        ids += b["pair_ids"].tolist()
        if pack == "batch":
            assert len(roles) <= 8
        else:
            assert b["input_ids"].shape[1] <= 2 * MAX_LEN
    assert sorted(ids) == sorted(set(ids)) and len(ids) == kept_pairs(out)
    if pack == "optimal":
        assert schema.read_manifest(out).stats.rows <= schema.read_manifest(builds()).stats.rows


@pytest.mark.parametrize("options", [{"pack": "wrap"}, {"overlong": "split"}])
def test_options_that_would_cut_a_pair_are_refused(tmp_path, source, options):
    # wrap is refused where the data's kind is known (formatting.py, naming pairs), split by the planner
    with pytest.raises(ConfigError, match="preference pairs .* wrap would cut|cut a preference pair apart"):
        make_build(tmp_path / "o", str(source), tokenizer=str(TOKENIZER), max_len=MAX_LEN,
                   **{"pack": "bfd", **options})


def test_sft_then_pairs_mix_is_refused(tmp_path, source):
    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    mix = [{"source": str(tmp_path / "s.jsonl"), "weight": 1.0}, {"source": str(source), "weight": 1.0}]
    with pytest.raises(ConfigError, match="preference pairs and SFT") as e:
        make_build(tmp_path / "out", mix=mix, batch_size=2, tokenizer=str(TOKENIZER))
    assert "\n" not in str(e.value)


def test_a_mix_of_two_preference_sources_packs_pairs(tmp_path, source):
    other = tmp_path / "more.jsonl"
    other.write_text("".join(json.dumps({**r, "prompt": "Other " + r["prompt"]}) + "\n" for r in records()[:6]))
    mix = [{"source": str(source), "weight": 1.0}, {"source": str(other), "weight": 1.0}]
    out = make_build(tmp_path / "out", mix=mix, pack="bfd", max_len=MAX_LEN, tokenizer=str(TOKENIZER))
    ids = [p for b in stream(out, shuffle=False) for p in b["pair_ids"].tolist()]
    assert len(ids) == len(set(ids)) == kept_pairs(out) and np.all(np.asarray(ids) >= 0)


@pytest.mark.parametrize("overlong, says", [("truncate", "all 3 pairs have a prompt of --max-len 8 tokens or more"),
                                            ("drop", "all 3 pairs have a sequence longer than --max-len 8")])
def test_a_pair_build_that_packs_nothing_says_why_in_pairs(tmp_path, overlong, says):
    # the bundled tokenizer: the refusal does not depend on the tokenizer, and so runs on a fresh clone too
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps({"prompt": "word " * 40, "chosen": " yes", "rejected": " no"}) + "\n"
                           for _ in range(3)))
    with pytest.raises(ConfigError, match=says) as e:
        make_build(tmp_path / "o", str(src), tokenizer=str(BUNDLED_TOKENIZER), max_len=8, overlong=overlong)
    assert "\n" not in str(e.value)
