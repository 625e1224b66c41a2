"""The wheel: what `pip install packer` gives must carry the bundled sample and tokenizer and find them.

One wheel per session, built offline from a copy of the package's sources (so the checkout gets no
build/ folder, whose stale files setuptools would put in the next wheel). "Installed" is the wheel
unpacked into a folder on PYTHONPATH, which is what pip does with a wheel (a platform one where the
loader's C kernel compiled); `.ci/run` does the full install into a fresh venv.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT
from test_digests import FLAN_1000

PACKAGE_DATA = ROOT / "packer" / "data"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src)
    # not the checkout's own compiled kernel: the wheel's must be the one its build compiles
    shutil.copytree(ROOT / "packer", src / "packer", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist)], check=True)
    (found,) = dist.glob("packer-*.whl")
    return found


@pytest.fixture(scope="session")
def installed(wheel, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def _python(site: Path, cwd: Path, *args: str) -> str:
    """Run ``python ARGS`` in ``cwd`` where packer can be imported only from ``site``; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_wheel_carries_the_package_data_and_the_typed_marker(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    bundled = {p.relative_to(ROOT).as_posix() for p in PACKAGE_DATA.rglob("*") if p.is_file()}
    assert {"packer/data/flan_sample.jsonl.gz", "packer/data/tokenizer/tokenizer.json"} <= bundled
    assert bundled <= names, sorted(bundled - names)
    assert "packer/py.typed" in names
    assert not any(n.startswith(("data/", "tests/", "benchmarks/")) for n in names), sorted(names)


def test_an_installed_wheel_builds_the_bundled_default_from_anywhere_with_the_pinned_bytes(installed, tmp_path):
    found = _python(installed, tmp_path, "-c", "import packer.contract.recipes as r; print(r.BUNDLED_SAMPLE)")
    assert Path(found.strip()).is_relative_to(installed)
    _python(installed, tmp_path, "-m", "packer", "build", "flan", "--limit", "1000", "--out", "shards")
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "shards").iterdir()}
    assert digests == FLAN_1000  # the editable install's bytes, pinned in test_digests


def test_the_wheel_carries_the_compiled_kernel_where_a_compiler_is(wheel, installed, tmp_path):
    """The row decoder's C kernel is built into the wheel, and the installed package decodes with it
    (packer/training/decode.py); without a compiler the wheel is pure Python and numpy decodes."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the wheel has no kernel, numpy decodes")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("packer/training/_rowkernel.") and n.endswith(".so") for n in names), names
    found = _python(installed, tmp_path, "-c", "from packer.training import decode; print(decode.KERNEL.__file__)")
    assert Path(found.strip()).is_relative_to(installed)


def test_an_installed_wheel_says_its_version(wheel, installed, tmp_path):
    version = wheel.name.split("-")[1]  # the wheel's metadata version
    assert _python(installed, tmp_path, "-m", "packer", "--version").strip() == f"packer, version {version}"
