"""Every bad input through the real CLI: exit code 2, exactly one line on stderr (no traceback), naming the
file, line or record where it can and saying how to fix it."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import BUNDLED_TOKENIZER, make_build, one_line

from packer.cli import main
from packer.contract import schema

GOOD = [{"prompt": f"What is {i} + {i}?", "completion": f"It is {2 * i}."} for i in range(6)]


def jsonl(path: Path, records, raw_lines=()) -> Path:
    lines = [json.dumps(r) for r in records] + list(raw_lines)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def with_record(index: int, record: dict):
    rows = [dict(r) for r in GOOD]
    rows[index] = record
    return rows


def tokenizer_copy(tmp: Path, name: str, *, eos: bool = True, chat: bool = True) -> Path:
    folder = tmp / name
    shutil.copytree(BUNDLED_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if not eos:
        config["eos_token"] = None
    if not chat:
        config.pop("chat_template", None)
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# Each case: (id, make(tmp) -> argv after "build", substrings the one line must hold)
def _cases():
    c = []

    def case(name, make, *needles):
        c.append(pytest.param(make, needles, id=name))

    # -- records
    case("malformed_json_line", lambda t: [str(jsonl(t / "d.jsonl", GOOD[:2], ['{"prompt": "x", "completion": '])
                                           ), "--prompt-field", "prompt", "--completion-field", "completion"],
         "d.jsonl:3: malformed JSON", "fix or remove that line")
    case("malformed_json_gz", lambda t: [_gz(t / "d.jsonl.gz", '{"prompt": "a", "completion": "b"}\n{oops\n')],
         "d.jsonl.gz:2: malformed JSON")
    case("wrong_type_number", lambda t: [str(jsonl(t / "d.jsonl", with_record(3, {"prompt": "q", "completion": 7})))],
         "d.jsonl record 4", "'completion' is int, not text", "--on-error skip")
    case("wrong_type_list", lambda t: [str(jsonl(t / "d.jsonl", [{"prompt": ["a"], "completion": "b"}]))],
         "d.jsonl record 1", "'prompt' is list, not text", "--on-error skip")
    case("missing_field_in_record", lambda t: [str(jsonl(t / "d.jsonl", with_record(2, {"prompt": "q"})))],
         "d.jsonl record 3", "'completion'", "--on-error skip")
    case("missing_field_everywhere", lambda t: [str(jsonl(t / "d.jsonl", GOOD)), "--prompt-field", "prompt",
                                                "--completion-field", "answer"],
         "no field 'answer'", "columns are prompt, completion", "--completion-field")
    case("null_text", lambda t: [str(jsonl(t / "d.jsonl", with_record(4, {"prompt": None, "completion": "b"})))],
         "d.jsonl record 5", "'prompt' is null", "--on-error skip")
    case("empty_text", lambda t: [str(jsonl(t / "d.jsonl", with_record(1, {"prompt": "  ", "completion": "b"})))],
         "d.jsonl record 2", "'prompt' is empty", "--on-error skip")
    case("no_completion", lambda t: [str(jsonl(t / "d.jsonl", with_record(0, {"prompt": "q", "completion": ""})))],
         "d.jsonl record 1", "'completion' is empty")
    case("chat_without_assistant", lambda t: [str(jsonl(t / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]))],
         "c.jsonl record 1", "no assistant turn")
    case("chat_unknown_role", lambda t: [str(jsonl(t / "c.jsonl", [{"messages": [
        {"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]))],
         "c.jsonl record 1", "unknown role 'wizard'", "known: system, user, assistant")
    case("chat_turn_not_object", lambda t: [str(jsonl(t / "c.jsonl", [{"messages": ["hi", "there"]}]))],
         "c.jsonl record 1", "turn 0 is not a")
    case("invalid_utf8", lambda t: [_bytes(t / "d.jsonl", b'{"prompt": "caf\xe9", "completion": "b"}\n')],
         "d.jsonl:1: not UTF-8 text", "re-encode the file as UTF-8")
    case("csv_no_known_columns", lambda t: [_text(t / "d.csv", "a,b\n1,2\n")],
         "cannot tell which fields to train on", "columns are a, b", "--prompt-field")
    # -- budget
    case("budget_below_two_tokens", lambda t: ["flan", "--max-len", "1"], "--max-len must be at least 2")
    case("max_len_zero", lambda t: ["flan", "--max-len", "0"], "--max-len must be at least 1, got 0")
    case("max_tokens_zero", lambda t: ["flan", "--pack", "bfd", "--max-tokens", "0"], "--max-tokens must be at least 1")
    case("max_len_over_row_budget", lambda t: ["flan", "--pack", "bfd", "--max-len", "512", "--max-tokens", "256"],
         "--max-len 512 exceeds the row budget --max-tokens 256")
    case("every_record_overlong_dropped", lambda t: [str(jsonl(t / "d.jsonl", [{"prompt": "word " * 300, "completion": "x"}])),
                                                     "--max-len", "16", "--overlong", "drop"],
         "longer than --max-len 16", "--overlong")
    case("limit_zero", lambda t: ["flan", "--limit", "0"], "--limit must be at least 1")
    # -- options
    case("max_tokens_with_batch", lambda t: ["flan", "--max-tokens", "512"], "--max-tokens", "--pack batch", "drop one")
    case("batch_size_with_bfd", lambda t: ["flan", "--pack", "bfd", "--batch-size", "4"], "--batch-size applies to --pack batch")
    case("text_with_prompt_field", lambda t: ["flan", "--text-field", "t", "--prompt-field", "p"],
         "--text-field (plain text) cannot be combined")
    case("messages_with_prompt_field", lambda t: ["flan", "--messages-field", "m", "--prompt-field", "p"],
         "--messages-field cannot be combined")
    case("prompt_without_completion", lambda t: [str(jsonl(t / "d.jsonl", GOOD)), "--prompt-field", "prompt"],
         "give both --prompt-field and --completion-field")
    case("wrap_with_prompt_field", lambda t: ["flan", "--pack", "wrap", "--prompt-field", "inputs",
                                              "--completion-field", "targets"], "--pack wrap is for plain text")
    case("balance_without_world_size", lambda t: ["flan", "--balance", "tokens"], "--world-size")
    case("unknown_pack_mode", lambda t: ["flan", "--pack", "zigzag"], "--pack", "zigzag")
    case("split_on_local_file", lambda t: [str(jsonl(t / "d.jsonl", GOOD)), "--split", "test"],
         "--split 'test' applies to Hub datasets")
    case("recipe_conflicts_with_source", lambda t: ["flan", "--recipe", "gsm8k"], "recipe 'flan' but --recipe says 'gsm8k'")
    # -- tokenizers
    case("tokenizer_missing", lambda t: ["flan", "--tokenizer", str(t / "no-such-tok")], "no-such-tok: no such folder")
    case("tokenizer_without_eos", lambda t: ["flan", "--tokenizer", str(tokenizer_copy(t, "tok", eos=False))],
         "has no EOS token", "eos_token", "tokenizer_config.json")
    case("chat_on_tokenizer_without_template", lambda t: [
        str(jsonl(t / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])),
        "--tokenizer", str(tokenizer_copy(t, "tok", chat=False))], "no chat template", "--prompt-field")
    case("chat_recipe_on_tokenizer_without_template", lambda t: [
        str(jsonl(t / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])),
        "--recipe", "chat", "--tokenizer", str(tokenizer_copy(t, "tok", chat=False))], "no chat template")
    case("tokenizer_folder_without_files", lambda t: ["flan", "--tokenizer", str(_dir(t / "emptytok"))], "emptytok")
    # -- sources
    case("garbage_parquet", lambda t: [_bytes(t / "d.parquet", b"this is not parquet at all\n" * 10)],
         "d.parquet: cannot be read as parquet", "check the file")
    case("empty_jsonl", lambda t: [_text(t / "d.jsonl", "")], "d.jsonl", "no records")
    case("unknown_recipe", lambda t: ["flann"], "unknown recipe 'flann'", "known recipes: flan")
    case("unknown_recipe_option", lambda t: [str(jsonl(t / "d.jsonl", GOOD)), "--recipe", "nope"], "unknown recipe 'nope'")
    case("unknown_file_type", lambda t: [_text(t / "d.xyz", "hello")], "d.xyz: unknown file type")
    case("missing_input", lambda t: [str(t / "nope.jsonl")], "nope.jsonl: no such file or folder")
    case("folder_without_data", lambda t: [str(_dir(t / "empty"))], "folder holds no readable data files")
    case("glob_matches_nothing", lambda t: [str(t / "*.jsonl")], "the pattern matches no files")
    case("mixed_file_types", lambda t: [str(_mixed(t))], "mixes file types")
    case("json_array_malformed", lambda t: [_text(t / "d.json", '[{"prompt": "a", "completion": "b"},\n{"prompt": ]')],
         "d.json", "malformed JSON")
    return c


def _text(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _gz(path: Path, text: str) -> str:
    path.write_bytes(gzip.compress(text.encode()))
    return str(path)


def _dir(path: Path) -> Path:
    path.mkdir()
    (path / "README").write_text("nothing here")
    return path


def _mixed(tmp: Path) -> Path:
    folder = tmp / "mixed"
    folder.mkdir()
    jsonl(folder / "a.jsonl", GOOD)
    (folder / "b.csv").write_text("prompt,completion\nq,a\n")
    return folder


def build_cli(*args: str):
    return CliRunner().invoke(main, ["build", *args, "-q"])



@pytest.mark.parametrize(("make", "needles"), _cases())
def test_bad_input(tmp_path, make, needles):
    line = one_line(build_cli(*make(tmp_path), "--out", str(tmp_path / "out")))
    for needle in needles:
        assert needle in line, line
    assert not (tmp_path / "out" / schema.MANIFEST_NAME).exists()


def test_unreachable_hub_id_fails_fast(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # never resolves: no network either way
    began = time.perf_counter()
    line = one_line(build_cli("someone/no-such-dataset", "--out", str(tmp_path / "out")))
    assert time.perf_counter() - began < 10
    assert "cannot reach the Hugging Face Hub for 'someone/no-such-dataset'" in line and "local files" in line
    # huggingface_hub's command now (huggingface-cli is gone from it)
    assert "`hf download someone/no-such-dataset --repo-type dataset --local-dir DIR`" in line


def test_unreachable_hub_tokenizer_fails_fast(tmp_path, monkeypatch):
    """A tokenizer's Hub id (or a mistyped relative folder, which reads as one), no network, no
    HF_HUB_OFFLINE: one line at once, not huggingface_hub's ~24 s of retries first."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    for name in ("Qwen/Qwen3-0.6B", "tok/mistyped"):
        began = time.perf_counter()
        line = one_line(build_cli("flan", "--limit", "5", "--tokenizer", name, "--out", str(tmp_path / "out")))
        assert time.perf_counter() - began < 10
        assert f"--tokenizer {name}: not a local folder, and not in the Hub cache" in line, line


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return make_build(tmp_path_factory.mktemp("bad_out") / "out", limit=10)


def test_output_holds_another_build(finished):
    line = one_line(build_cli("flan", "--limit", "11", "--out", str(finished)))
    assert f"--out {finished}: holds another build" in line and "--overwrite" in line


def test_output_with_foreign_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("keep me")
    line = one_line(build_cli("flan", "--limit", "5", "--out", str(tmp_path / "out")))
    assert "thesis.tex" in line and "choose an empty or new folder" in line
    assert build_cli("flan", "--limit", "5", "--overwrite", "--out", str(tmp_path / "out")).exit_code == 0
    assert (tmp_path / "out" / "thesis.tex").read_text() == "keep me"  # built beside it, not over it


def test_verify_of_a_foreign_folder_is_a_problem_not_a_crash(tmp_path):
    (tmp_path / "thesis.tex").write_text("x")
    result = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and "not a finished build" in result.stdout
    assert "thesis.tex" in result.stderr  # noted as the user's: verify judges only what packer wrote


def test_on_error_skip_counts_skipped_records_by_reason(tmp_path):
    rows = [dict(r) for r in GOOD]
    rows += [{"prompt": None, "completion": "b"}, {"prompt": "q", "completion": ""}, {"prompt": "q", "completion": "  "},
             {"prompt": "q", "completion": "word " * 200}, {"prompt": 5, "completion": "b"}]
    src = jsonl(tmp_path / "d.jsonl", rows[:-1], ['{"prompt": "x", "completion": '])  # and a line that does not parse
    result = CliRunner().invoke(main, ["build", str(src), "--on-error", "skip", "--max-len", "32", "--overlong", "drop",
                                       "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "out" / schema.MANIFEST_NAME).read_text())["stats"]
    assert stats["dropped_by_reason"] == {"empty_text": 2, "null_field": 1, "overlong": 1, "malformed_json": 1}
    assert stats["records_skipped"] == 4 and stats["examples_read"] == len(rows)
    assert stats["examples"] + stats["records_skipped"] == stats["examples_read"]
    verify = CliRunner().invoke(main, ["verify", str(tmp_path / "out"), "--source", str(src)])
    assert verify.exit_code == 0, verify.output
