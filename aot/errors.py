"""The one exception family of aotpack.

Every user-facing failure is one of these; the CLI prints ``str(err)`` as one line and exits
non-zero. Messages say what was expected, what was got, and what to do.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` safe to show on a terminal or in a one-line message: control and other
    non-printable characters (newlines, escape sequences, bidi overrides) become visible escapes
    as ``repr`` writes them (``\\n``, ``\\x1b``, ``\\u202e``). For strings read from a bundle."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def counted(n: int, one: str, many: str | None = None) -> str:
    """``counted(1, "kernel")`` → "1 kernel", ``counted(3, "kernel")`` → "3 kernels": progress and
    report lines read right at every count."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


class AotError(Exception):
    """Root of every aotpack error. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class SpecError(AotError):
    """The model file is malformed: missing spec, bad dims, bad inputs."""


class TraceError(AotError):
    """The model could not be exported; names the user's file:line and what to change."""


class GuardError(AotError):
    """A call's inputs fall outside the bundle's guards."""


class BundleError(AotError):
    """The bundle is corrupt, truncated, hostile, or of another schema version."""


class SignatureError(BundleError):
    """A loader with a trust list refused the bundle: unsigned, signed by a key it does not trust,
    or changed after signing."""


class EnvError(AotError):
    """The environment cannot run this bundle (no cubin for this arch, missing op, old driver), or
    cannot hold the one being built (disk full, read-only folder)."""


class CodegenError(AotError):
    """A kernel could not be generated or compiled."""


class BundleWarning(UserWarning):
    """A bundle loads, but something about it deserves a look: a signature that no longer matches
    its manifest when no trust list is set. The CLI prints it as one ``warning:`` line."""
