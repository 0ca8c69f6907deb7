"""What every verb shares: ``-q/--quiet`` and ``-v/--verbose``, and the parsers of size options."""

from __future__ import annotations

import os

import click

from aot.cli.progress import PROGRESS


def _output_mode(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value:
        return
    chosen = ctx.find_root().meta.setdefault("aotpack.output", set())
    chosen.add(param.name)
    if chosen == {"quiet", "verbose"}:
        raise click.UsageError("--quiet and --verbose contradict each other; give one")
    if param.name == "quiet":
        PROGRESS.quiet = True
    else:
        os.environ["AOTPACK_VERBOSE"] = "1"  # read by the tracer's quiet_torch


def output_options() -> list[click.Option]:
    """``-q/--quiet`` and ``-v/--verbose``, taken before or after the command name."""
    return [
        click.Option(
            ["-q", "--quiet"],
            is_flag=True,
            expose_value=False,
            callback=_output_mode,
            help="print results, warnings and errors only (no progress)",
        ),
        click.Option(
            ["-v", "--verbose"],
            is_flag=True,
            expose_value=False,
            callback=_output_mode,
            help="also show torch's own logs and graph dumps while tracing",
        ),
    ]


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """``"2GiB"`` → 2147483648; a number with an optional unit (B, KB, MB, GB, TB, KiB, ... TiB)."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number) :].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _BYTE_UNITS or not 0 < value * _BYTE_UNITS[unit] < 2**63:
        raise click.BadParameter(f"expected a size such as 2GiB, 512MB or 1000000, got {text!r}")
    return int(value * _BYTE_UNITS[unit])


def parse_sizes(text: str) -> dict[str, int]:
    """``"batch=3,seq=77"`` → ``{"batch": 3, "seq": 77}``."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if not name.strip().isidentifier() or not value.strip().isdigit():
            raise click.UsageError(f"--sizes expects name=N,... (e.g. batch=3,seq=77); got {part!r}")
        out[name.strip()] = int(value)
    if not out:
        raise click.UsageError("--sizes expects name=N,... (e.g. batch=3,seq=77)")
    return out


def _trust(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    """``--trust`` replaces ``$AOTPACK_TRUST`` for this command and the processes it starts (the
    server of ``serve``): every bundle the command opens is then checked against it. Every key is
    read now, so a bad key file, or one that would block (a FIFO), is refused before any work."""
    from aot.signature import TRUST_ENV, trusted_keys

    if value:
        os.environ[TRUST_ENV] = os.pathsep.join(os.path.abspath(v) for v in value)
    trusted_keys(None)


def trust_option(command):
    """``--trust KEY.pub`` (repeatable) for a verb that reads bundles."""
    return click.option(
        "--trust",
        multiple=True,
        type=click.Path(dir_okay=False),
        expose_value=False,
        callback=_trust,
        help="public key file (KEY.pub of `aotpack keygen`); repeatable: read only bundles signed by one "
        "of them [default: $AOTPACK_TRUST, os.pathsep-separated]",
    )(command)
