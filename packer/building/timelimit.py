"""A wall-clock limit on a block of pure-Python work (a chat template's render), in any process.

In a thread that may take signals (the main thread of the CLI, of a pool worker, of a Ray worker) a
``setitimer`` alarm interrupts the work: two system calls per block, nothing per step. Elsewhere (a
thread other than the main one) a trace function checks the clock at every Python call the work makes:
slower, but a Jinja loop calls Python at each step, so an endless template still ends.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager


class TimeLimitExceeded(Exception):
    """The block ran past its limit."""


@contextmanager
def time_limit(seconds: float):
    """Raise :class:`TimeLimitExceeded` inside the block once it has run ``seconds``."""
    if threading.current_thread() is threading.main_thread():
        with _alarm(seconds):
            yield
    else:
        with _traced(seconds):
            yield


@contextmanager
def _alarm(seconds: float):
    armed = True

    def expire(signum, frame):
        if armed:  # a signal that lands after the block (a race at its very end) is ignored
            raise TimeLimitExceeded

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


@contextmanager
def _traced(seconds: float):
    deadline = time.monotonic() + seconds
    previous = sys.gettrace()

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise TimeLimitExceeded
        return None  # no line events: a check per call is enough and far cheaper

    sys.settrace(check)
    try:
        yield
    finally:
        sys.settrace(previous)
