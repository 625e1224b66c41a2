"""--overlong truncate-left: an over-long example loses prompt tokens from its start, so its answer and
EOS stay whole; an answer longer than --max-len alone is cut on the right, as --overlong truncate does.

The reference is the same data built with no truncation at all (every example whole): a left-truncated
example must be the last max_len tokens of its whole self (TRL's ``keep_end``), with every trained token
of it still trained; the others must be what --overlong truncate makes of them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SHARED_DATA, shard_rows

from packer import BuildConfig, build, render
from packer.checking import inspect_
from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema
from packer.errors import ConfigError
from packer.planning.plan import answer_lengths, plan

IGNORE = schema.IGNORE_INDEX


def _segments(out) -> dict[int, tuple[list[int], list[int]]]:
    """example id -> (ids, labels) of its one segment."""
    found = {}
    for entry in schema.read_manifest(out).shards:
        for row in shard_rows(out / entry.file):
            ids, labels, lens, exids = row["input_ids"], row["labels"], row["seq_lens"], row["example_ids"]
            at = 0
            for n, ex in zip(lens, exids, strict=True):
                assert ex not in found, "one segment per example"
                found[ex] = (ids[at:at + n], labels[at:at + n])
                at += n
    return found


CASES = {
    # the bundled sample and tokenizer (always there), and GSM8K with Llama 2's tokenizer (../shared/data)
    "bundled": dict(source="flan", limit=300, max_len=384),
    "gsm8k-llama2": dict(source=str(SHARED_DATA / "gsm8k_train.jsonl"), recipe="gsm8k",
                         tokenizer=str(SHARED_DATA / "llama2-tokenizer"), limit=300, max_len=160),
}


@pytest.mark.parametrize("case", CASES)
def test_left_truncation_keeps_the_answer_whole(tmp_path, case):
    options = dict(CASES[case])
    if case != "bundled" and not (SHARED_DATA / "gsm8k_train.jsonl").is_file():
        pytest.skip("../shared/data is absent")
    max_len = options.pop("max_len")
    whole = _build(tmp_path / "whole", max_len=8192, **options)
    right = _build(tmp_path / "right", max_len=max_len, **options)
    cli = CliRunner().invoke(main, ["build", options.pop("source"), "--out", str(tmp_path / "left"), "-q",
                                    "--max-len", str(max_len), "--overlong", "truncate-left",
                                    *[a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", str(v))]])
    assert cli.exit_code == 0, cli.output
    left = tmp_path / "left"
    full, cut_left, cut_right = _segments(whole), _segments(left), _segments(right)
    assert schema.read_manifest(whole).stats.examples_truncated == 0

    n_left = n_long = 0
    for ex, (ids, labels) in full.items():
        got_ids, got_labels = cut_left[ex]
        if len(ids) <= max_len:
            assert (got_ids, got_labels) == (ids, labels)
            continue
        trained = [i for i, label in enumerate(labels) if label != IGNORE]
        answer = len(ids) - trained[0]
        if answer <= max_len:  # the last max_len tokens; the answer's tokens all trained, EOS last
            n_left += 1
            assert got_ids == ids[-max_len:]
            assert got_labels[1:] == labels[-max_len + 1:] and got_labels[0] == IGNORE
            if answer < max_len:
                assert sum(label != IGNORE for label in got_labels) == len(trained)
        else:  # the answer alone is over max_len: cut on the right, as --overlong truncate does
            n_long += 1
            assert (got_ids, got_labels) == cut_right[ex] and got_ids == ids[:max_len]
    assert n_left > 0

    stats = schema.read_manifest(left).stats
    assert (stats.examples_truncated_left, stats.examples_answer_too_long) == (n_left, n_long)
    assert stats.examples_truncated == n_left + n_long == schema.read_manifest(right).stats.examples_truncated
    assert stats.tokens_truncated == schema.read_manifest(right).stats.tokens_truncated
    assert stats.loss_tokens > schema.read_manifest(right).stats.loss_tokens
    assert f"{n_left:,} at the prompt's start (answer and EOS whole) · {n_long:,} whose answer alone" in cli.output
    summary = "\n".join(render.summary_lines(inspect_.summary(left, compare=False), color=False))
    assert f"truncated    {n_left:,} at the prompt's start" in summary
    report = verify(left, source=CASES[case]["source"])
    assert report.ok, report.problems
    # a manifest that miscounts the two cases is caught against the source
    data = json.loads((left / schema.MANIFEST_NAME).read_text())
    data["stats"]["examples_truncated_left"] -= 1
    data["stats"]["examples_answer_too_long"] += 1
    (left / schema.MANIFEST_NAME).write_bytes(schema.dump_manifest(data))
    problems = [str(p) for p in verify(left, source=CASES[case]["source"]).problems]
    assert any("examples_truncated_left here" in p for p in problems), problems


def _build(out, **options):
    build(BuildConfig(out=str(out), **options))
    return out


def test_plan_truncate_left_against_a_loop():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 500)
    answers = np.minimum(lengths, rng.integers(0, 200, 500))
    max_len = 120
    p = plan(lengths, mode="bfd", max_len=max_len, overlong="truncate-left", answers=answers, seed=1)
    seg = {int(e): (int(s), int(n)) for e, s, n in zip(p.example, p.start, p.length, strict=True)}
    for k, (n, a) in enumerate(zip(lengths.tolist(), answers.tolist(), strict=True)):
        if n <= max_len:
            want = (0, n)
        elif a <= max_len:
            want = (n - max_len, max_len)
        else:
            want = (0, max_len)
        assert seg[k] == want, (k, n, a)
    over = lengths > max_len
    assert p.stats["examples_truncated_left"] == int((over & (answers <= max_len)).sum())
    assert p.stats["examples_answer_too_long"] == int((over & (answers > max_len)).sum())
    assert p.stats["examples_truncated"] == int(over.sum())


def test_answer_lengths_read_the_first_trained_token():
    #              example 0 (5 tokens)  example 1 (3)   example 2 (6, nothing trained)
    trained = np.array([0, 0, 1, 1, 1,     0, 1, 1,        0, 0, 0, 0, 0, 0], np.uint8)
    assert answer_lengths(trained, np.array([5, 3, 6]), 4).tolist() == [3, 0, 6]  # only examples over 4


def test_truncate_left_without_answers_is_a_config_error():
    with pytest.raises(ConfigError, match="answer_lengths"):
        plan([10, 20], mode="batch", batch_size=2, max_len=8, overlong="truncate-left")
