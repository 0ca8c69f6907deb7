"""Codegen stage: ``Traced`` → ``Compiled``.

Partitions the ATen program into fusion groups, renders each group as a Triton kernel, and
compiles it to a cubin per target arch (no GPU needed).
"""

from __future__ import annotations

from aot.stages import Compiled, Traced

DEFAULT_ARCHS = ("sm_80", "sm_90")


def parse_archs(text: str) -> tuple[str, ...]:
    """``"sm_80,sm_90"`` → ``("sm_80", "sm_90")``, validated."""
    import re

    from aot.errors import CodegenError

    archs = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in archs if not re.fullmatch(r"sm_[0-9]{2,3}a?", a)]
    if bad or not archs:
        raise CodegenError(f"--arch expects a comma list like sm_80,sm_90; got {text!r}")
    return archs


def generate(traced: Traced, archs: tuple[str, ...] = DEFAULT_ARCHS, progress=None) -> Compiled:
    """Without fusion every step stays an ATen library call."""
    return Compiled(traced=traced, program=traced.program, archs=tuple(archs))
