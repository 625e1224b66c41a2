"""Bad input that could end in a traceback, a blow-up or a wrong message: each is one line on stderr
naming the place and the fix, exit code 2, through the real CLI."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from conftest import BUNDLED_TOKENIZER, ROOT
from test_bad_inputs import GOOD, build_cli, jsonl, one_line

from packer.building.tokenization import MAX_RECORD_CHARS
from packer.contract import schema

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def _lines(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


GOOD_LINES = _lines(*(json.dumps(r) for r in GOOD))
GZ = gzip.compress(GOOD_LINES.encode())


def _tokenizer_with_huge_id(tmp: Path) -> str:
    folder = tmp / "tok"
    folder.mkdir()
    for f in BUNDLED_TOKENIZER.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["vocab"]["Ġthe"] = 2**31 + 5  # a common word's id beyond int32
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return str(folder)


def _source_folder_with_out(tmp: Path) -> list[str]:
    jsonl(tmp / "src" / "d.jsonl", GOOD) if (tmp / "src").mkdir() is None else None
    return [str(tmp / "src"), "--out", str(tmp / "src" / "shards")]


# (id, make(tmp) -> argv after "build" (an --out is added unless given), substrings of the one line)
CASES = [
    ("json_nested_3000_deep", lambda t: [_write(t / "d.jsonl", GOOD_LINES + '{"prompt": ' + "[" * 3000 + "]" * 3000
                                                + ', "completion": "b"}\n')],
     ["d.jsonl:7: JSON nested too deeply", "flatten or remove that record"]),
    ("gz_that_is_not_gzip", lambda t: [_write(t / "d.jsonl.gz", GOOD_LINES)],
     ["d.jsonl.gz: not gzip data", "drop the .gz suffix"]),
    ("gz_with_trailing_garbage", lambda t: [_write(t / "d.jsonl.gz", GZ + b"garbage!")],
     ["d.jsonl.gz: corrupt or extra data after the gzip data"]),
    ("gz_truncated", lambda t: [_write(t / "d.jsonl.gz", GZ[: len(GZ) // 2])],
     ["d.jsonl.gz: the gzip data ends early (a truncated file)"]),
    ("line_is_a_string", lambda t: [_write(t / "d.jsonl", GOOD_LINES + '"just text"\n')],
     ["d.jsonl:7: a string, not a record", "one JSON object"]),
    ("line_is_an_array", lambda t: [_write(t / "d.jsonl", GOOD_LINES + "[1, 2]\n")], ["d.jsonl:7: an array, not a record"]),
    ("lone_surrogate", lambda t: [_write(t / "d.jsonl", '{"prompt": "a", "completion": "b"}\n'
                                         '{"prompt": "x\\ud800y", "completion": "b"}\n')],
     ["d.jsonl:2: a \\uXXXX escape of half a surrogate pair"]),
    ("completion_of_zero_width_characters", lambda t: [str(jsonl(t / "d.jsonl", [*GOOD, {"prompt": "q",
                                                       "completion": "\u200b\u200d \ufeff"}]))],
     ["d.jsonl record 7: field 'completion' is empty", "--on-error skip"]),
    ("record_too_long", lambda t: [str(jsonl(t / "d.jsonl", [*GOOD, {"prompt": "q", "completion": "a" * (MAX_RECORD_CHARS + 1)}]))],
     ["d.jsonl record 7: holds 4,194,308 characters, over the 4,194,304", "split it into several records"]),
    ("token_id_beyond_int32", lambda t: [str(jsonl(t / "d.jsonl", [{"prompt": "the cat", "completion": "the dog"}])),
                                         "--tokenizer", _tokenizer_with_huge_id(t)],
     ["has a token id of 2,147,483,653, beyond the 2,147,483,647", "int32"]),
    ("max_tokens_beyond_a_row", lambda t: ["flan", "--pack", "bfd", "--max-tokens", "4294967296"],
     ["--max-tokens 4,294,967,296 is more than a row can hold: at most 2,147,483,647 tokens"]),
    ("max_len_beyond_a_row", lambda t: ["flan", "--max-len", "2147483648"], ["--max-len 2,147,483,648 is more than a row"]),
    ("shard_size_zero", lambda t: ["flan", "--shard-size", "0"], ["--shard-size must be at least 1, got 0"]),
    ("empty_source", lambda t: [""], ["SOURCE is empty"]),
    ("out_inside_the_source_folder", _source_folder_with_out, ["is inside the SOURCE folder", "outside it"]),
]


@pytest.mark.parametrize(("make", "needles"), [pytest.param(m, n, id=i) for i, m, n in CASES])
def test_bad_input_is_one_line(tmp_path, make, needles):
    argv = make(tmp_path)
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    line = one_line(build_cli(*argv))
    for needle in needles:
        assert needle in line, line
    out = Path(argv[argv.index("--out") + 1])
    assert not (out / schema.MANIFEST_NAME).exists()


def run_cli(*args: str, env=ENV, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=preexec)


def test_non_utf8_names_of_source_and_out(tmp_path):
    """Names of undecodable bytes reach Python as surrogate escapes: refused before anything is written."""
    raw = os.fsencode(tmp_path) + b"/caf\xe9"
    os.makedirs(os.fsencode(tmp_path) + b"/plain")
    with open(raw + b".jsonl", "w") as f:
        f.write(GOOD_LINES)
    with open(os.fsencode(tmp_path) + b"/plain/d\xff.jsonl", "w") as f:
        f.write(GOOD_LINES)
    name = os.fsdecode(raw + b".jsonl")
    # the SOURCE name given on a real command line (the interpreter decodes argv with surrogate escapes); the
    # other two as the same escaped text to the command in this process (a fresh interpreter each: ~1 s)
    proc = run_cli("build", name, "--out", str(tmp_path / "out"), "-q")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "SOURCE" in proc.stderr and "not UTF-8" in proc.stderr and "rename it" in proc.stderr, proc.stderr
    for args, needle in [([str(tmp_path / "plain"), "--out", str(tmp_path / "out")], "d\\xff.jsonl: the file name is not UTF-8"),
                         (["flan", "--limit", "5", "--out", os.fsdecode(raw + b"-out")], "--out")]:
        line = one_line(build_cli(*args))
        assert needle in line and "not UTF-8" in line and "rename it" in line, line
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"caf\xe9.jsonl", b"plain"]  # no --out was made


def test_hub_tokenizer_id_offline_is_not_a_missing_folder(tmp_path):
    proc = run_cli("build", "flan", "--limit", "5", "--tokenizer", "someone/no-such-tokenizer",
                   "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "packer: error: --tokenizer someone/no-such-tokenizer: not a local folder, and not in the Hub cache while "
        "offline (or the Hub is unreachable); download it where there is network (`hf download "
        "someone/no-such-tokenizer --local-dir DIR`) and pass the folder"
    ]


def test_a_build_without_torch_prints_no_transformers_advisory(tmp_path):
    """Where torch is absent (a user's venv; here hidden from find_spec), `import transformers` warns that
    only tokenizers can be used; a build, which uses only those, does not pass that line on."""
    hide = "import sys; sys.modules['torch'] = None; "
    control = subprocess.run([sys.executable, "-c", hide + "import transformers"], env=ENV, capture_output=True,
                             text=True, timeout=120)
    assert "PyTorch was not found" in control.stderr  # the message is there to drop
    proc = subprocess.run([sys.executable, "-c", hide + "from packer.__main__ import main; sys.exit(main())",
                           "build", "flan", "--limit", "20", "-j", "1", "--out", str(tmp_path / "out"), "-q"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch" not in proc.stderr and "transformers" not in proc.stderr, proc.stderr


def test_field_options_name_columns_never_format_specs(tmp_path):
    src = jsonl(tmp_path / "d.jsonl", [{"q!r": "What is 2 + 2?", "q.text": "It is 4."}] * 3)
    result = build_cli(str(src), "--prompt-field", "q!r", "--completion-field", "q.text", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    from packer.building.tokenization import load_tokenizer

    row = datasets.load_from_disk(str(tmp_path / "out"))[0]
    first = row["input_ids"][: row["seq_lens"][0]]
    assert load_tokenizer(str(BUNDLED_TOKENIZER)).decode(first, skip_special_tokens=True) == "What is 2 + 2?\n\nIt is 4."


def test_a_folder_on_disk_wins_over_a_recipe_of_its_name(tmp_path, monkeypatch):
    """`packer build gsm8k` where ./gsm8k exists reads that folder, formatted as the gsm8k recipe (as a
    path on disk wins over a Hub id); where it does not, the recipe (here: no network, one line)."""
    monkeypatch.chdir(tmp_path)
    line = one_line(build_cli("gsm8k", "--out", str(tmp_path / "hub")))
    assert "gsm8k" in line and "Hugging Face Hub" in line
    (tmp_path / "gsm8k").mkdir()
    jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(4)])
    result = build_cli("gsm8k", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / schema.MANIFEST_NAME).read_text())
    assert manifest["source"]["kind"] == "local" and manifest["stats"]["examples"] == 4
    assert manifest["source"]["files"][0]["path"].endswith("gsm8k/train.jsonl")
