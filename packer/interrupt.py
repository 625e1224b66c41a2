"""Ctrl-C in the ``packer`` command: at any moment, one line ("packer: interrupted") and exit code 130.

Three places where Python would otherwise do something else:
- while Python still imports the command's dependencies (:func:`during_imports`): a traceback;
- inside a finaliser (``__del__``, a generator closed by the collector), where Python prints the
  KeyboardInterrupt as "ignored" and runs on (:func:`redeliver`: raised again in the main thread);
- once the outcome is decided (the build committed, the message printed, Python shutting down), where
  a late Ctrl-C would turn a success into a failure (:func:`ignore`).

Only the ``packer`` process itself changes its signal handling (:func:`own_process`); a caller that
runs the command in-process (click's test runner, a notebook) keeps its own.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_PROCESS = {"own": False}  # whether this process is the `packer` command, whose signals are ours
_REDELIVERIES: list[threading.Timer] = []  # cancelled once the outcome is decided
REDELIVERY_DELAY = 0.05  # seconds: the finaliser and this hook have returned by then


def _exit_interrupted(signum, frame) -> None:
    sys.stderr.write("packer: interrupted\n")
    os._exit(130)


def python_handles_ctrl_c() -> bool:
    """False where Ctrl-C was ignored when the process started (a shell's background job): it stays so."""
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


@contextmanager
def during_imports() -> Iterator[None]:
    """Ctrl-C while the command's modules are imported: nothing is read or written yet, so end at once."""
    if not python_handles_ctrl_c():
        yield
        return
    signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def own_process(own: bool) -> None:
    _PROCESS["own"] = own


def redeliver(unraisable) -> None:
    """``sys.unraisablehook`` while a command runs: a KeyboardInterrupt that landed in a finaliser is
    raised again in the main thread, from another thread a moment later (raised from here, it would
    land in this hook and be ignored); anything else goes to Python's own hook."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        timer = threading.Timer(REDELIVERY_DELAY, _thread.interrupt_main)
        timer.daemon = True
        _REDELIVERIES.append(timer)
        timer.start()
    else:
        sys.__unraisablehook__(unraisable)


@contextmanager
def redelivered() -> Iterator[None]:
    """Run a command with :func:`redeliver` as the unraisable hook."""
    previous = sys.unraisablehook
    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        sys.unraisablehook = previous
        _cancel_redeliveries()


def _cancel_redeliveries() -> None:
    for timer in _REDELIVERIES:
        timer.cancel()
    _REDELIVERIES.clear()


def ignore() -> None:
    """The outcome is decided: a Ctrl-C from now on must not change it."""
    _cancel_redeliveries()
    if _PROCESS["own"] and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
