"""GPU architectures, written once: how an arch is spelled (``sm_90``, ``sm_90a``, ``90``), its
compute capability, its order, and which of a bundle's cubin archs a device runs.

An ``a`` arch (``sm_90a``) carries features of exactly one compute capability: its cubins run on
that capability alone. A plain arch's cubins run on its major's later minors (``sm_80`` on 8.6).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ARCH = re.compile(r"(?:sm_)?([0-9]{2,3})(a?)")


@dataclass(frozen=True, order=True)
class Arch:
    """A CUDA arch: ``major.minor``, and whether it is the capability-specific ``a`` variant."""

    major: int
    minor: int
    specific: bool = False

    def __post_init__(self):
        if not (1 <= self.major <= 99 and 0 <= self.minor <= 9):
            raise ValueError(f"no CUDA arch has compute capability {self.major}.{self.minor}")

    @property
    def number(self) -> int:
        """``sm_90a`` → 90: what Triton's ``GPUTarget`` and the shared-memory tables take."""
        return self.major * 10 + self.minor

    @property
    def name(self) -> str:
        return f"sm_{self.number}{'a' if self.specific else ''}"

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether this arch's cubins run on a device of ``capability``."""
        major, minor = capability
        if self.specific:
            return (self.major, self.minor) == (major, minor)
        return self.major == major and self.minor <= minor


def parse_arch(text: str) -> Arch:
    """``"sm_90"``, ``"sm_90a"`` or ``"90"`` → its ``Arch``; ``ValueError`` for anything else."""
    m = _ARCH.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{str(text)[:40]!r} is not a CUDA arch such as sm_90, sm_90a or 90")
    number = int(m.group(1))
    return Arch(number // 10, number % 10, m.group(2) == "a")


def arch_number(text: str) -> int:
    """``"sm_90a"`` → 90."""
    return parse_arch(text).number


# Shared memory a block may use per arch (bytes, the opt-in maximum): a kernel that needs more
# compiles but never launches there. An arch not listed takes the smallest of the recent ones.
SHARED_LIMIT = {75: 64 << 10, 80: 163 << 10, 86: 99 << 10, 87: 163 << 10, 89: 99 << 10, 90: 227 << 10}
UNLISTED_SHARED_LIMIT = 99 << 10


def shared_limit(text: str) -> int:
    """The most shared memory a block may use on ``text``'s arch, in bytes (``SHARED_LIMIT``)."""
    return SHARED_LIMIT.get(arch_number(text), UNLISTED_SHARED_LIMIT)


def arch_of(capability: tuple[int, int]) -> str:
    """A device's own arch name: ``(9, 0)`` → ``"sm_90"``."""
    return Arch(*capability).name


def sort_key(text: str) -> tuple[int, bool, str]:
    """Order arch names by capability (``sm_80`` < ``sm_90`` < ``sm_90a`` < ``sm_100``); a name
    that is no arch sorts first, by its text."""
    try:
        arch = parse_arch(text)
    except ValueError:
        return (0, False, text)
    return (arch.number, arch.specific, text)


def best_arch(archs: tuple[str, ...], capability: tuple[int, int]) -> str | None:
    """The cubin arch of ``archs`` to load on a device of ``capability``: its own arch, else its
    ``a`` arch, else the newest of its major whose minor does not exceed the device's; None when
    none runs there."""
    parsed = {}
    for text in archs:
        try:
            parsed[text] = parse_arch(text)
        except ValueError:
            continue
    runs = [t for t, a in parsed.items() if a.runs_on(capability)]
    if not runs:
        return None
    own = Arch(*capability)
    for wanted in (own, Arch(own.major, own.minor, True)):
        exact = [t for t in runs if parsed[t] == wanted]
        if exact:
            return exact[0]
    return max(runs, key=lambda t: parsed[t])
