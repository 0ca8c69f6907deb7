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


SPLITS = ("aten.split_with_sizes.default", "aten.split.Tensor")


def split_weights_apart(program: Program, weights: dict[str, Any]) -> tuple[Program, dict[str, Any], int]:
    """Each weight that only a ``split`` reads (``nn.MultiheadAttention``'s ``in_proj_weight`` and
    bias split into the query's rows and the keys' and values', as SigLIP's pooling head computes
    its cross-attention) stored as its pieces, each a contiguous weight of its own named
    ``<weight>.<k>``: a GEMM site takes ``A @ piece^T`` as it takes any weight (``gemm_sites``),
    where a view of a split is none. The pieces take the original's place (no extra memory); a
    weight read anywhere else keeps its split. The rewritten program, its weights, and how many
    weights were split apart."""
    readers = readers_of(program.steps)
    specs = {w.name: w.spec for w in program.weights}
    taken = {*specs, *program.buffers, *(i.name for i in program.inputs)}
    pieces: dict[str, str] = {}  # a split's result -> the weight it becomes
    split_at: dict[str, tuple[int, int, list[str]]] = {}  # a weight split apart -> (step, dim, pieces)
    for i, step in enumerate(program.steps):
        w = step.args[0] if step.kind == StepKind.ATEN and step.target in SPLITS and step.args else None
        if (
            not isinstance(w, Buf)
            or w.name not in specs
            or w.name not in weights
            or readers.get(w.name) != [i]
        ):
            continue
        spec = specs[w.name]
        dim = step.args[2] if len(step.args) > 2 else step.kwargs.get("dim", 0)
        if (
            spec.order
            or not all(d.isdigit() for d in spec.shape)
            or type(dim) is not int
            or w.name in program.outputs
        ):
            continue
        if set(step.kwargs) - {"dim"} or not all(o and o in program.buffers for o in step.outputs):
            continue
        if any(o in program.outputs for o in step.outputs):
            continue
        names = [fresh_name(f"{w.name}.{k}", taken) for k in range(len(step.outputs))]
        taken.update(names)
        pieces.update(zip(step.outputs, names))
        split_at[w.name] = (i, dim, names)
    if not split_at:
        return program, weights, 0
    dropped = {i for i, _, _ in split_at.values()}
    steps = tuple(
        replace(s, args=_renamed(s.args, pieces), kwargs=_renamed(s.kwargs, pieces))
        for i, s in enumerate(program.steps)
        if i not in dropped
    )
    weights = dict(weights)
    new_weights: list[NamedTensor] = []
    for w in program.weights:
        if w.name not in split_at:
            new_weights.append(w)
            continue
        i, dim, names = split_at[w.name]
        step = program.steps[i]
        tensor = weights.pop(w.name)
        for out, name, piece in zip(step.outputs, names, tensor.split(step.args[1], dim), strict=True):
            weights[name] = piece.contiguous()
            new_weights.append(NamedTensor(name, program.buffers[out]))
    buffers = {k: v for k, v in program.buffers.items() if k not in pieces}
    program = replace(program, steps=steps, buffers=buffers, weights=tuple(new_weights))
    return program, weights, len(dropped)


def _renamed(value: Any, names: dict[str, str]) -> Any:
    """``value`` (a step's arguments) with each ``Buf`` of ``names`` the one it names."""
    if isinstance(value, Buf):
        return Buf(names.get(value.name, value.name))
    if isinstance(value, (list, tuple)):
        return type(value)(_renamed(v, names) for v in value)
    if isinstance(value, dict):
        return {k: _renamed(v, names) for k, v in value.items()}
    return value
