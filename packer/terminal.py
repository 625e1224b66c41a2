"""The `packer` command at the terminal: how an outcome ends (one line on stderr and an exit code,
never a traceback) and how lines are printed (colour only where it shows).

Exit codes: 0 success; 1 a check found problems (verify); 2 bad input or usage; 130 Ctrl-C.
"""

from __future__ import annotations

import os
import sys

import click

from . import interrupt
from .errors import PackerError


class Interrupted(Exception):
    """Ctrl-C, carried past click (which would take it for an aborted prompt)."""


class OneLineErrors(click.Group):
    """Usage errors and PackerErrors become one line on stderr and exit code 2; Ctrl-C is
    "interrupted", exit code 130 (128 + SIGINT, as a shell reports it)."""

    def invoke(self, ctx: click.Context):
        try:
            with interrupt.redelivered():
                return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None
        except EOFError as e:  # click would take it for Ctrl-C at a prompt ("aborted")
            raise PackerError(f"an input ended unexpectedly ({type(e).__name__}: {e}); check it is complete") from e

    def main(self, *args, **kwargs):
        # the `packer` process itself (not a caller's, like click's test runner, which passes args)
        interrupt.own_process(not args and kwargs.get("args") is None)
        try:
            self._main(*args, **kwargs)
        finally:
            interrupt.ignore()  # the outcome is decided: Ctrl-C while Python shuts down must not change it

    def _main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except (Interrupted, KeyboardInterrupt, click.Abort):
            interrupt.ignore()  # the outcome is decided: a second Ctrl-C must not change it
            # a build's staging and token spill stay for the rerun to resume; the lock is released
            click.echo("packer: interrupted", err=True)
            sys.exit(130)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else "packer"
            click.echo(f"{command}: {e.format_message()} (see `{command} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"packer: {e.format_message()}", err=True)
            sys.exit(2)
        except PackerError as e:
            click.echo(f"packer: error: {e}", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)


# Colour: click.echo strips ANSI when stdout is not a terminal; NO_COLOR (https://no-color.org) turns it off too.
def use_color() -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.color is not None:
        return bool(ctx.color)
    return not click.utils.should_strip_ansi(sys.stdout)


def echo(lines: list[str]) -> None:
    for line in lines:
        click.echo(line, color=use_color())
