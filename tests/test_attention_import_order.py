"""Every packer module imports first in a fresh interpreter: no import cycle hides behind import order
(attention.py and guard.py once imported each other, and importing packer.training.guard first failed)."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import packer

# One interpreter, each module imported with no packer module loaded before it (third-party modules stay
# loaded: the cycle this guards against is packer's own, and a fresh torch import per module costs seconds).
CHECK = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "packer" or m.startswith("packer.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_imports_first():
    names = sorted(m.name for m in pkgutil.walk_packages(packer.__path__, "packer.") if ".data" not in m.name)
    assert {"packer.training.attention", "packer.training.guard", "packer.training.loader"} <= set(names)
    root = str(Path(packer.__file__).parent.parent)
    done = subprocess.run([sys.executable, "-c", CHECK, *names], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": root}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_prepare_is_exported_from_packer():
    from packer.training.guard import prepare

    assert packer.prepare is prepare
