"""Accounting: every example's fate counted once per epoch, from the plan and the lengths, and the
per-source counts of a mix adding up to the totals (with any number of epochs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.contract import schema
from packer.planning.accounting import account
from packer.planning.plan import plan_epochs

KEYS = ("examples", "examples_packed", "examples_split", "examples_truncated")


def _reference(p, lengths, epochs: int, keep=None) -> dict[str, int]:
    """Each example's segments looked at one by one, in every epoch; each epoch must agree. ``keep``
    (bool[n]): count only those examples (one source of a mix)."""
    per_epoch = p.num_rows // epochs
    seen = []
    for e in range(epochs):
        lo, hi = int(p.row_splits[e * per_epoch]), int(p.row_splits[(e + 1) * per_epoch])
        pieces: dict[int, list[tuple[int, int]]] = {}
        for ex, st, ln in zip(p.example[lo:hi].tolist(), p.start[lo:hi].tolist(), p.length[lo:hi].tolist()):
            pieces.setdefault(ex, []).append((st, ln))
        c = dict(whole=0, split=0, truncated=0, truncated_left=0, dropped=0, tokens=0)
        for ex, n in enumerate(lengths.tolist()):
            if keep is not None and not keep[ex]:
                continue
            segs = pieces.get(ex, [])
            covered = sum(ln for _, ln in segs)
            c["tokens"] += covered
            if not segs:
                c["dropped"] += 1
            elif len(segs) > 1:
                c["split"] += 1
            elif covered == n:
                c["whole"] += 1
            else:
                c["truncated"] += 1
                c["truncated_left"] += segs[0][0] > 0
        seen.append(c)
    assert all(c == seen[0] for c in seen)
    return seen[0]


@pytest.mark.parametrize("mode,overlong,epochs", [
    (mode, overlong, epochs) for mode, overlong in (("batch", "truncate"), ("batch", "split"), ("bfd", "drop"),
                                                    ("bfd", "truncate-left"), ("optimal", "split"))
    for epochs in (1, 3)] + [("wrap", "truncate", 1)])  # wrap plans one epoch
def test_account_matches_a_per_example_reference_and_the_parts_add_up(mode, overlong, epochs):
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(1, 60))
        lengths = rng.integers(1, 40, n)
        answers = np.where(lengths > 16, rng.integers(1, 30, n), 0) if overlong == "truncate-left" else None
        options = dict(batch_size=4) if mode == "batch" else dict(max_tokens=24 if mode == "wrap" else 32)
        p = plan_epochs(lengths, epochs=epochs, mode=mode, max_len=16, overlong=overlong, seed=int(rng.integers(9)),
                        answers=answers, **options)
        if p.num_rows == 0:
            continue
        source = rng.integers(0, 3, n)
        a = account(p, lengths, source=source, parts=3)
        ref = _reference(p, lengths, epochs)
        got = a.total
        assert (got.whole, got.split, got.truncated, got.truncated_left, got.dropped, got.tokens) == (
            ref["whole"], ref["split"], ref["truncated"], ref["truncated_left"], ref["dropped"], ref["tokens"])
        assert got.examples == n and got.tokens_in == int(lengths.sum())
        assert got.tokens + got.tokens_truncated + got.tokens_dropped == got.tokens_in
        assert a.epochs == epochs and got.tokens * epochs == int(p.length.sum())
        for k in range(3):  # each part is the plan of its own examples
            part, ref_k = a.parts[k], _reference(p, lengths, epochs, keep=source == k)
            assert part.examples == int((source == k).sum())
            assert (part.whole, part.split, part.truncated, part.truncated_left, part.dropped, part.tokens) == (
                ref_k["whole"], ref_k["split"], ref_k["truncated"], ref_k["truncated_left"], ref_k["dropped"],
                ref_k["tokens"])
        s = p.stats
        assert (s["examples_packed"], s["examples_split"], s["examples_truncated"], s["examples_dropped"]) == (
            got.whole, got.split, got.truncated, got.dropped)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_mix_counts_each_source_per_epoch_adding_up_to_the_totals(tmp_path, epochs):
    src = tmp_path / "qa.jsonl"
    src.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"It is {2 * i}."}) + "\n"
                           for i in range(40)))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", "flan", str(src), "--mix", "0.5,0.5", "--limit", "60", "--epochs",
                                       str(epochs), "--max-len", "4096", "-q", "--out", str(out)])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / schema.MANIFEST_NAME).read_text())["stats"]
    parts = stats["sources"]
    for key in KEYS:
        assert sum(p[key] for p in parts) == stats[key], key
    assert sum(p["tokens"] for p in parts) == stats["tokens"]
    assert stats["examples_packed"] == stats["examples"]  # nothing is over 4,096 tokens: all whole
    assert all(p["examples_split"] == p["examples_truncated"] == 0 for p in parts)
