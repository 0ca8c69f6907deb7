"""Settings read from the environment: the one parser behind every ``AOTPACK_*`` switch.

A build setting (the codegen's forms, joins and rules) and a load-time one (the loaders' launch and
binding switches) alike take a value among a few choices; where it is set to anything else, the
build or the load stops with an error naming the variable, the value and the choices, instead of
running with a setting nobody asked for. This module imports nothing heavy: the torch-free runtime
reads its settings here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from aot.errors import AotError, EnvError


def setting(
    env: str,
    default: str | None,
    choices: tuple[str, ...],
    *,
    aliases: Mapping[str, str] | None = None,
    error: type[AotError] = EnvError,
) -> str | None:
    """The value of the environment variable ``env`` among ``choices`` (lower-case words or
    numbers): its text where set (stripped, in any case; a key of ``aliases`` reads as its value), else
    ``default`` (None: unset, for a rule of the caller's). Any other value raises ``error`` naming
    the choices."""
    given = os.environ.get(env, "").strip()
    text = given.lower()
    if not text:
        return default
    text = (aliases or {}).get(text, text)
    if text not in choices:
        expected = " or ".join((", ".join(repr(c) for c in choices[:-1]), repr(choices[-1])))
        raise error(f"{env}={given!r}: expected {expected}; unset it for the default")
    return text
