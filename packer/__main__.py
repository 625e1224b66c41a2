"""The ``packer`` command (and ``python -m packer``).

Ctrl-C while Python is still importing packer's dependencies (numpy, pyarrow, click: a few tenths of
a second) ends as a Ctrl-C at any later moment does: "interrupted", exit code 130, no traceback
(:func:`packer.interrupt.during_imports`).
"""

import sys

from .interrupt import during_imports


def main():
    with during_imports():
        from .cli import main as command
    return command()


if __name__ == "__main__":
    sys.exit(main())
