"""The CLI as a person and a program use it: summary, --json, --help, exit codes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from click.testing import CliRunner

from packer.cli import main
from packer.contract import schema


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_build_prints_a_summary_a_person_can_read(tmp_path):
    out = tmp_path / "shards"
    result = run("build", "flan", "--out", str(out), "--limit", "80", "--max-len", "600", "-q")
    assert result.exit_code == 0, result.output
    assert "synthetic FLAN-style" in result.output
    assert "80 read" in result.output and "truncated" in result.output
    assert "padded batches would hold" in result.output
    assert (out / schema.MANIFEST_NAME).is_file()
    again = run("build", "flan", "--out", str(out), "--limit", "80", "--max-len", "600", "-q")
    assert again.exit_code == 0 and "already holds this build" in again.output


def test_build_json_is_machine_readable(tmp_path):
    result = run("build", "flan", "--out", str(tmp_path / "o"), "--limit", "40", "--pack", "bfd",
                 "--max-tokens", "2048", "--max-len", "1024", "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["stats"]["examples_read"] == 40
    assert report["stats"]["rows"] == sum(s["rows"] for s in report["shards"])


def test_inspect_summary_and_row_json(flan_batch):
    summary = run("inspect", str(flan_batch), "--json")
    assert summary.exit_code == 0
    assert json.loads(summary.stdout)["stats"]["rows"] == schema.read_manifest(flan_batch).stats.rows
    row = run("inspect", str(flan_batch), "--row", "0", "--json")
    assert row.exit_code == 0
    view = json.loads(row.stdout)
    assert len(view["segments"]) == 4
    assert sum(seg["length"] for seg in view["segments"]) == view["tokens"]


def test_bad_option_is_one_line_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["build", "flan", "--out", str(tmp_path), "--pack", "zigzag"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--pack" in lines[0] and "--help" in lines[0]


def test_console_entry_runs_the_command_without_torch(tmp_path):
    """``python -m packer build``: packer/__main__.py run as ``-m`` runs it (its ``main`` is also the ``packer``
    console script) in a fresh interpreter, which ends with exit code 0 and the build made, and never imports
    torch. (One process for what were two: the entry, and the command without torch.)"""
    code = (
        "import runpy, sys; sys.argv=['packer','build','flan','--out',sys.argv[1],'--limit','20','-q']\ntry:\n"
        "    runpy.run_module('packer', run_name='__main__', alter_sys=True)\nexcept SystemExit as e:\n"
        "    assert e.code == 0, e.code\nassert 'torch' not in sys.modules, 'packer build imported torch'"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "o")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o" / "manifest.json").is_file()


def test_import_packer_is_light_and_its_names_still_resolve():
    code = ("import sys, packer\nheavy = [m for m in ('numpy', 'pyarrow', 'click', 'tokenizers') if m in sys.modules]\n"
            "assert not heavy, heavy\nfrom packer import BuildConfig, build, Plan, SourceError\n"
            "assert callable(build) and build.__module__ == 'packer.building.pipeline', build\n"
            "assert packer.build is build and 'build' in dir(packer)")
    subprocess.run([sys.executable, "-c", code], check=True)


def _ctrl_c_at_numpy_import(out, *args: str, **popen):
    """``packer build flan ARGS --out OUT`` through the console entry, with SIGINT sent to itself the
    moment numpy is first imported (in the middle of the command's heavy imports)."""
    code = (
        "import builtins, os, signal, sys\nreal = builtins.__import__\n"
        "def hook(name, *a, **k):\n"
        "    if name == 'numpy':\n        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = hook\n"
        "sys.argv = ['packer', 'build', 'flan', *sys.argv[2:], '--out', sys.argv[1]]\n"
        "from packer.__main__ import main\nmain()\n"
    )
    # Ctrl-C reaches Python only where it is not ignored, and a test run started as a background job
    # (`pytest &`, CI) has it ignored, which the child inherits: start the child as a terminal would
    popen.setdefault("preexec_fn", lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.run([sys.executable, "-c", code, str(out), *args], capture_output=True, text=True, **popen)


def test_ctrl_c_while_python_imports_the_command_is_one_line(tmp_path):
    """Before the console entry installed its handler first, Python printed a KeyboardInterrupt traceback."""
    done = _ctrl_c_at_numpy_import(tmp_path / "o")
    assert (done.returncode, done.stderr) == (130, "packer: interrupted\n"), (done.returncode, done.stderr)
    assert not (tmp_path / "o").exists()


def test_ctrl_c_inherited_ignored_stays_ignored(tmp_path):
    """A shell starts a background job with SIGINT ignored; Python keeps it so, and so does the command."""
    done = _ctrl_c_at_numpy_import(tmp_path / "o", "--limit", "30", "-q",
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o" / "manifest.json").is_file()
