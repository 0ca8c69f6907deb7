"""Matmul weights stored as the GEMV forms read them: ``[N, K]``, K contiguous.

transformers' ``Conv1D`` (GPT-2 and its kin) keeps its weight as ``[K, N]`` and computes
``addmm(bias, x, W)``. The one-row forms of a decode step (``gemm_forms``: ``vec_*``) stream each
row of W along K, contiguous where W is ``[N, K]`` and a stride of N elements apart where it is
``[K, N]``, so a site reading W as stored (``gemm_sites.Site.w_kn``) gets none of them: every
layer GEMM of GPT-2's decode step stayed a cuBLAS call, with its LayerNorm and GELU kernels
beside it. The build stores such a weight transposed, ``[N, K]`` and contiguous, and reads it
through ``permute(W_nk, [1, 0])`` (a view): ``A @ W_nk^T``, the form every GEMM site and the
sibling stacker take, which cuBLAS and the CPU run as before.

Only a 2-D weight of static shape whose every use is the ``mat2`` of ``mm``, ``addmm`` or
``_addmm_activation``, read as stored, is transposed; one read anywhere else (tied to a lookup,
an output of the program) keeps its layout. The transposed weight takes the original's place in
the program's weights (no extra memory) under a new name: a bundle's programs share their
weights by name, and one that kept the original layout must not read the transposed one, even
where the shapes agree (a square weight, GPT-2's attention output projection).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.program import fresh_name, readers_of, step_reads
from aot.schema import Buf, NamedTensor, Program, Step, StepKind

# where each GEMM op takes its mat2 (W) among its arguments
MAT2_AT = {"aten.mm.default": 1, "aten.addmm.default": 2, "aten._addmm_activation.default": 2}
SUFFIX = ".nk"  # the transposed weight's name: the original's, then this


def transpose_matmul_weights(
    program: Program, weights: dict[str, Any]
) -> tuple[Program, dict[str, Any], int]:
    """The rewritten program, its weights, and how many weights were transposed."""
    readers = readers_of(program.steps)
    specs = {w.name: w.spec for w in program.weights}
    taken = {*specs, *program.buffers, *(i.name for i in program.inputs)}
    renamed: dict[str, str] = {}  # original weight -> its transposed copy
    for name, spec in specs.items():
        uses = readers.get(name, [])
        if (
            len(spec.shape) != 2
            or not all(d.isdigit() for d in spec.shape)
            or spec.order
            or name in program.outputs
            or not uses
            or not all(_reads_as_mat2(program.steps[i], name) for i in uses)
        ):
            continue
        renamed[name] = fresh_name(name + SUFFIX, taken)
        taken.add(renamed[name])
    if not renamed:
        return program, weights, 0
    buffers = dict(program.buffers)
    steps: list[Step] = []
    for step in program.steps:
        at = MAT2_AT.get(step.target) if step.kind == StepKind.ATEN else None
        w = step.args[at] if at is not None and len(step.args) > at else None
        if not (isinstance(w, Buf) and w.name in renamed):
            steps.append(step)
            continue
        # w: [K, N] as stored; the view of its transposed copy W_nk [N, K] is [K, N] again
        view = fresh_name(f"{renamed[w.name]}.t", taken)
        taken.add(view)
        buffers[view] = specs[w.name]
        steps.append(Step(StepKind.ATEN, "aten.permute.default", (Buf(renamed[w.name]), [1, 0]), {}, (view,)))
        args = list(step.args)
        args[at] = Buf(view)
        steps.append(replace(step, args=tuple(args)))
    # each transposed weight takes its original's place, in the program and in the tensors
    weights = {renamed.get(k, k): v.t().contiguous() if k in renamed else v for k, v in weights.items()}
    new_weights = tuple(
        NamedTensor(renamed[w.name], replace(w.spec, shape=w.spec.shape[::-1])) if w.name in renamed else w
        for w in program.weights
    )
    program = replace(program, steps=tuple(steps), buffers=buffers, weights=new_weights)
    return program, weights, len(renamed)


def _reads_as_mat2(step: Step, name: str) -> bool:
    """``step`` is a GEMM that reads ``name`` once, as its ``mat2`` (W of ``A @ W``), directly."""
    at = MAT2_AT.get(step.target) if step.kind == StepKind.ATEN else None
    return (
        at is not None
        and len(step.args) == at + 1
        and step.args[at] == Buf(name)
        and step_reads(step).count(name) == 1
    )
