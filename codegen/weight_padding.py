"""Pad a matmul weight whose output dim is not a multiple of ``PAD_TO``.

cuBLAS picks fast Hopper/Ampere kernels only for aligned leading dimensions: GPT-2's tied
vocabulary projection (N = 50257) ran in a legacy sm_75 CUTLASS kernel that took more than half
of a B=8 T=128 forward. The build pads such a weight with zero rows to a multiple of ``PAD_TO``
(+72 KB for GPT-2), computes ``mm`` into the padded width and slices the real columns back out
(a view). Only weights whose every use is ``permute([1, 0]) → mm`` (or ``addmm`` whose bias is a
weight [N] that it alone reads: the bias is padded with zeros too; a LayerNorm's shift folded
into a head, ``tracer.norm_scales``, makes one) or ``embedding`` are padded, so nothing else can
see the extra rows; a lookup reads a slice of the real rows (a view), so an id
past the vocabulary is refused as before (``IndexError`` on the CPU, a row of NaN from the gather
kernel), never a zero row from the padding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.program import fresh_name, readers_of, step_reads
from aot.schema import Buf, NamedTensor, Program, Step, StepKind, TensorSpec

PAD_TO = 64
MIN_N = 1024  # small matrices are not worth it


def pad_matmul_weights(program: Program, weights: dict[str, Any]) -> tuple[Program, dict[str, Any], int]:
    """Returns the rewritten program, its weights, and how many weights were padded."""
    import torch

    readers = readers_of(program.steps)
    steps: list[Step | tuple[Step, ...]] = list(program.steps)
    buffers = dict(program.buffers)
    specs = {w.name: w.spec for w in program.weights}
    weights = dict(weights)
    padded = 0
    for name, spec in specs.items():
        if len(spec.shape) != 2 or not spec.shape[0].isdigit() or name in program.outputs:
            continue
        n, k = int(spec.shape[0]), spec.shape[1]
        if n < MIN_N or n % PAD_TO == 0:
            continue
        uses = [program.steps[i] for i in readers.get(name, [])]
        mms, lookups = [], []
        ok = bool(uses)
        for u in uses:
            if u.target == "aten.embedding.default" and step_reads(u)[:1] == [name]:
                lookups.append(u)
                continue
            if u.target == "aten.permute.default" and list(u.args[1:]) == [[1, 0]]:
                consumers = [program.steps[i] for i in readers.get(u.outputs[0], [])]
                if (
                    consumers
                    and all(_padded_reader(c, u.outputs[0], n, specs, readers, program) for c in consumers)
                    and u.outputs[0] not in program.outputs
                ):
                    mms += [(u, c) for c in consumers]
                    continue
            ok = False
        if not ok or not mms:
            continue
        npad = -(-n // PAD_TO) * PAD_TO
        w = weights[name]
        weights[name] = torch.cat([w, w.new_zeros(npad - n, w.shape[1])]).contiguous()
        specs[name] = TensorSpec(spec.dtype, (str(npad), k))
        for perm, mm in mms:
            if mm.target == "aten.addmm.default":  # its bias padded with zeros (read by this addmm alone)
                bias = step_reads(mm)[0]
                weights[bias] = torch.cat([weights[bias], weights[bias].new_zeros(npad - n)]).contiguous()
                specs[bias] = TensorSpec(specs[bias].dtype, (str(npad),))
            buffers[perm.outputs[0]] = TensorSpec(spec.dtype, (k, str(npad)))
            out = mm.outputs[0]
            wide = f"{out}_padded"
            m = buffers[out].shape[0]
            buffers[wide] = TensorSpec(buffers[out].dtype, (m, str(npad)))
            i = program.steps.index(mm)
            steps[i] = (
                replace(mm, outputs=(wide,)),
                Step(StepKind.ATEN, "aten.slice.Tensor", (Buf(wide), 1, 0, n), {}, (out,)),
            )
        if lookups:
            rows = fresh_name(f"{name}_rows", buffers, specs)
            buffers[rows] = TensorSpec(spec.dtype, (str(n), k))
            first = min(program.steps.index(u) for u in lookups)
            head = Step(StepKind.ATEN, "aten.slice.Tensor", (Buf(name), 0, 0, n), {}, (rows,))
            for u in lookups:
                i = program.steps.index(u)
                lookup = replace(u, args=(Buf(rows), *u.args[1:]))
                steps[i] = (head, lookup) if i == first else lookup
        padded += 1
    if not padded:
        return program, weights, 0
    flat: list[Step] = []
    for s in steps:
        flat.extend(s if isinstance(s, tuple) else (s,))
    new_weights = tuple(NamedTensor(w.name, specs[w.name]) for w in program.weights)
    return replace(program, steps=tuple(flat), buffers=buffers, weights=new_weights), weights, padded


def _padded_reader(step: Step, wt: str, n: int, specs: dict, readers: dict, program: Program) -> bool:
    """Whether ``step`` reads the transposed weight ``wt`` only as a matmul's right operand whose
    output columns may run past ``n``: ``mm(a, wt)``, or ``addmm(bias, a, wt)`` with a 1-D weight
    bias of ``n`` that no other step reads and no output is."""
    reads = step_reads(step)
    if step.kwargs:
        return False
    if step.target == "aten.mm.default":
        return len(reads) == 2 and reads[1] == wt and reads[0] != wt
    if step.target != "aten.addmm.default" or len(reads) != 3 or reads[2] != wt or wt in reads[:2]:
        return False
    bias = reads[0]
    return (
        bias in specs
        and tuple(specs[bias].shape) == (str(n),)
        and len(readers.get(bias, [])) == 1
        and bias not in program.outputs
    )
