"""Every packer module imports first, with no packer module loaded before it: no import cycle hides behind import
order (attention.py and guard.py once imported each other, and importing packer.training.guard first failed)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import signal
import sys

import packer


def _import_each_first(names: list[str]) -> list[str]:
    """Each module imported with no packer module loaded before it; the failures, one line each."""
    failed = []
    for name in names:
        for loaded in [m for m in sys.modules if m == "packer" or m.startswith("packer.")]:
            del sys.modules[loaded]
        try:
            importlib.import_module(name)
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    return failed


def test_each_module_imports_first():
    """In a fork of this process: third-party modules stay loaded (the cycle this guards against is packer's own,
    and a fresh interpreter would spend seconds importing torch and transformers again), packer's are removed
    before each import, and this process's own packer modules are left as they are."""
    names = sorted(m.name for m in pkgutil.walk_packages(packer.__path__, "packer.") if ".data" not in m.name)
    assert {"packer.training.attention", "packer.training.guard", "packer.training.loader"} <= set(names)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what failed and leaves at once (no pytest in it from here)
        code = 1
        try:
            os.close(read)
            signal.alarm(300)  # a hang ends the child (SIGALRM), and the parent sees it killed
            os.write(write, "\n".join(_import_each_first(names)).encode() or b"-")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert (status, report) == (0, "-"), (status, report)


def test_prepare_is_exported_from_packer():
    from packer.training.guard import prepare

    assert packer.prepare is prepare
