"""Matmuls over an inner dim of one element, which are outer products, as pointwise multiplies.

A model computes rotary angles as ``inv_freq[None, :, None] @ position_ids[:, None, :]``
(transformers' Llama before 4.56 and the models that copied it): a ``bmm`` of ``[B, M, 1]`` by
``[B, 1, N]``, a cuBLAS launch (about 3.5 us on an H200 for a decode step's 32 x 1 angles) between
the kernels that cast its operands and the one that takes cos and sin of its result. Each output
element is one product, ``a[b, m, 0] * b[b, 0, n]``: the library rounds it once, as ``mul`` does,
so ``mul(a, b)`` (broadcast to ``[B, M, N]``) computes the same bits, and the fuser puts it in one
kernel with the casts before and the cos/sin after.
"""

from __future__ import annotations

from dataclasses import replace

from aot.dtypes import FLOATS
from aot.program import tensor_specs
from aot.schema import Buf, Program, Step, StepKind

MATMULS = ("aten.mm.default", "aten.bmm.default")


def outer_products_as_mul(program: Program) -> tuple[Program, int]:
    """``program`` with each ``mm``/``bmm`` whose inner dim is one element a ``mul``, and how many."""
    specs = tensor_specs(program)
    steps, n = list(program.steps), 0
    for i, step in enumerate(steps):
        if step.kind != StepKind.ATEN or step.target not in MATMULS or step.kwargs or len(step.args) != 2:
            continue
        a, b = step.args
        if not (isinstance(a, Buf) and isinstance(b, Buf) and a.name in specs and b.name in specs):
            continue
        sa, sb = specs[a.name], specs[b.name]
        rank = 2 if step.target == "aten.mm.default" else 3
        if len(sa.shape) != rank or len(sb.shape) != rank or sa.dtype != sb.dtype or sa.dtype not in FLOATS:
            continue
        if sa.shape[-1] != "1" or sb.shape[-2] != "1" or sa.shape[:-2] != sb.shape[:-2]:
            continue
        steps[i] = Step(StepKind.ATEN, "aten.mul.Tensor", (a, b), {}, step.outputs)
        n += 1
    return (replace(program, steps=tuple(steps)), n) if n else (program, 0)
