"""Codegen stage: ``Traced`` → ``Compiled``.

Partitions the ATen program into fusion groups, renders each group as a Triton kernel, and
compiles it to a cubin per target arch (no GPU needed).
"""

from __future__ import annotations

from aot.stages import Compiled, Traced

DEFAULT_ARCHS = ("sm_80", "sm_90")


def generate(traced: Traced, archs: tuple[str, ...] = DEFAULT_ARCHS, progress=None) -> Compiled:
    """Without fusion every step stays an ATen library call."""
    return Compiled(traced=traced, program=traced.program, archs=tuple(archs))
