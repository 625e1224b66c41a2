"""The ``packer`` command (and ``python -m packer``).

Ctrl-C while Python is still importing packer's dependencies (numpy, pyarrow, click: a few tenths of
a second) ends as a Ctrl-C at any later moment does: "interrupted", exit code 130, no traceback.
Nothing has been read or written by then, so there is nothing to clean up.
"""

import os
import signal
import sys


def _interrupted(signum, frame) -> None:
    sys.stderr.write("packer: interrupted\n")
    os._exit(130)


def main():
    # Only where Ctrl-C is Python's to handle: a shell starts a background job with it ignored, and so it stays
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        from .cli import main as command

        return command()
    signal.signal(signal.SIGINT, _interrupted)  # until the command's own handling is in place
    from .cli import main as command

    signal.signal(signal.SIGINT, signal.default_int_handler)
    return command()


if __name__ == "__main__":
    sys.exit(main())
