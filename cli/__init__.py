"""The ``aotpack`` command line.

Every failure is one line on stderr and a non-zero exit: ``AotError`` subclasses exit with their
``exit_code``; anything unexpected exits 3 as an internal error (``AOTPACK_DEBUG=1`` shows the
traceback).
"""

from __future__ import annotations

import os
import sys
import warnings

import click

from aot.cli.commands import cli
from aot.cli.options import output_options
from aot.errors import AotError, EnvError, printable

__all__ = ["cli", "main"]

for _command in (cli, *cli.commands.values()):
    _command.params.extend(output_options())


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore")
    try:
        cli.main(args=argv, prog_name="aotpack", standalone_mode=False)
    except AotError as e:
        click.echo(f"error: {printable(str(e))}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as e:
        if os.environ.get("AOTPACK_DEBUG"):
            raise
        if type(e).__name__ == "OutOfMemoryError":  # torch's, from a call no command foresaw
            first = ". ".join(printable(str(e)).split(". ")[:2])  # what ran out, and how much was asked
            click.echo(
                f"error: out of GPU memory: {first}; free the GPU of other processes or run smaller sizes",
                err=True,
            )
            sys.exit(EnvError.exit_code)
        click.echo(
            f"internal error: {type(e).__name__}: {printable(str(e))} (set AOTPACK_DEBUG=1 for a traceback)",
            err=True,
        )
        sys.exit(3)
    sys.exit(0)
