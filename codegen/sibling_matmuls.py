"""Sibling matmuls become one: projections that read the same activation (a transformer's q, k
and v; a gated MLP's gate and up) run as one GEMM on their weights stacked at build time.

Each sibling's result becomes a column slice of the one product: a view, which the kernels that
read it fold into their indexing (RoPE, SiLU(gate) * up) and library calls take as a strided
tensor. One launch instead of two or three, and one wider GEMM, which uses the GPU better at
the small row counts of decoding. The stacked weight replaces the siblings' weights in the
bundle (no extra memory); a weight read anywhere else (tied, or also an output) is left alone.

A site is ``permute(W, [1, 0]) → mm(A, ·)`` or ``addmm(bias, A, ·)``, with ``W`` a 2-D weight of
static shape read by nothing else; siblings read the same ``A`` (the same buffer, or identical
views of one buffer, as export writes one view per projection), have the same kind, dtype and
inner size.

Every build stacks siblings, one with GEMM candidates (``--gemm-candidates``) too: the stacked GEMM
is then a site of its own, and the library steps stay the default build's. ``--keep-siblings``
keeps them apart, for a gated MLP's dual-GEMM candidate (``SiLU(gate) * up`` in the epilogue); its
library steps launch one GEMM per sibling, which on an H200 made Llama-0.58B's untuned forward 18%
slower at batch 1 x seq 128 and its tuned decode step slower than the stacked default's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.program import RESHAPE_VIEWS, producer_of, readers_of
from aot.schema import Buf, NamedTensor, Program, Step, StepKind, TensorSpec

MIN_SIBLINGS = 2


def fuse_sibling_matmuls(program: Program, weights: dict[str, Any]) -> tuple[Program, dict[str, Any], int]:
    """The rewritten program, its weights, and how many sibling groups became one matmul."""
    groups = _sibling_groups(program)
    if not groups:
        return program, weights, 0
    specs = {w.name: w.spec for w in program.weights}
    weights = dict(weights)
    buffers = dict(program.buffers)
    new_specs = dict(specs)
    dropped: set[int] = set()
    inserted: dict[int, list[Step]] = {}
    for sites in groups.values():
        sites.sort()
        inserted[sites[0][0]] = _stack(program.steps, sites, specs, weights, buffers, new_specs, dropped)
    flat: list[Step] = []
    for i, s in enumerate(program.steps):
        flat.extend(inserted.get(i, ()))
        if i not in dropped:
            flat.append(s)
    # the stacked weight takes the place of its first sibling in the weights' order
    order: list[NamedTensor] = []
    for w in program.weights:
        if w.name in new_specs:
            order.append(w)
    for name, spec in new_specs.items():
        if name not in {w.name for w in order}:
            order.append(NamedTensor(name, spec))
    for name in set(specs) - set(new_specs):
        weights.pop(name, None)  # stacked into another weight
    program = replace(program, steps=tuple(flat), buffers=buffers, weights=tuple(order))
    return program, weights, len(groups)


def _sibling_groups(program: Program) -> dict[tuple, list[tuple[int, int, str]]]:
    """Matmuls of one activation by weights that nothing else reads, grouped by that activation,
    op, dtype and K (groups of ``MIN_SIBLINGS`` or more): (mm step index, permute step index,
    weight name) each."""
    steps = program.steps
    producer = producer_of(steps)
    readers = readers_of(steps)
    specs = {w.name: w.spec for w in program.weights}
    outputs = set(program.outputs)

    def activation_key(name: str) -> tuple:
        """Equal for one buffer and for identical views of one buffer."""
        i = producer.get(name)
        if i is not None and steps[i].target in RESHAPE_VIEWS and steps[i].kind == StepKind.ATEN:
            return ("view", repr(steps[i].args), repr(sorted(steps[i].kwargs.items())))
        return ("buffer", name)

    groups: dict[tuple, list[tuple[int, int, str]]] = {}
    for i, s in enumerate(steps):
        if s.kind != StepKind.ATEN or s.kwargs or len(s.outputs) != 1 or s.outputs[0] in outputs:
            continue
        if s.target == "aten.mm.default" and len(s.args) == 2:
            bias, a, b = None, s.args[0], s.args[1]
        elif s.target == "aten.addmm.default" and len(s.args) == 3:
            bias, a, b = s.args
        else:
            continue
        if not all(isinstance(x, Buf) for x in (a, b)) or (bias is not None and not isinstance(bias, Buf)):
            continue
        p = producer.get(b.name)
        if p is None or steps[p].target != "aten.permute.default" or list(steps[p].args[1:]) != [[1, 0]]:
            continue
        w = steps[p].args[0]
        if not isinstance(w, Buf) or w.name not in specs or w.name in outputs:
            continue
        spec = specs[w.name]
        if len(spec.shape) != 2 or not all(d.isdigit() for d in spec.shape):
            continue
        if readers.get(w.name) != [p] or readers.get(b.name) != [i]:
            continue  # the weight (or its transpose) is read elsewhere: leave it as it is
        if bias is not None:
            bspec = specs.get(bias.name)
            if bspec is None or bspec.shape != (spec.shape[0],) or readers.get(bias.name) != [i]:
                continue
        key = (activation_key(a.name), s.target, spec.dtype, spec.shape[1])
        groups.setdefault(key, []).append((i, p, w.name))
    return {k: v for k, v in groups.items() if len(v) >= MIN_SIBLINGS}


def _stack(
    steps: tuple[Step, ...],
    sites: list[tuple[int, int, str]],
    specs: dict[str, TensorSpec],
    weights: dict[str, Any],
    buffers: dict[str, TensorSpec],
    new_specs: dict[str, TensorSpec],
    dropped: set[int],
) -> list[Step]:
    """One group's weights (and biases) stacked, in ``weights`` / ``new_specs`` / ``buffers``, its
    steps marked ``dropped``; the steps that stand in for them: one transpose and one matmul of
    the stacked weight, then a slice per sibling."""
    import torch

    first = steps[sites[0][0]]
    names = [w for _, _, w in sites]
    fused = f"{names[0]}.stacked{len(names)}"  # after the first sibling: unique, and readable
    ns = [int(specs[w].shape[0]) for w in names]
    k = specs[names[0]].shape[1]
    dtype = specs[names[0]].dtype
    weights[fused] = torch.cat([weights[w] for w in names], 0).contiguous()
    new_specs[fused] = TensorSpec(dtype, (str(sum(ns)), k))
    transposed = f"{fused}.t"
    product = f"{first.outputs[0]}_siblings"
    rows = buffers[first.outputs[0]].shape[0]
    buffers[transposed] = TensorSpec(dtype, (k, str(sum(ns))))
    buffers[product] = TensorSpec(buffers[first.outputs[0]].dtype, (rows, str(sum(ns))))
    new = [Step(StepKind.ATEN, "aten.permute.default", (Buf(fused), [1, 0]), {}, (transposed,))]
    if first.target == "aten.addmm.default":
        bias = f"{fused}.bias"
        bnames = [steps[i].args[0].name for i, _, _ in sites]
        weights[bias] = torch.cat([weights[b] for b in bnames], 0).contiguous()
        new_specs[bias] = TensorSpec(new_specs[bnames[0]].dtype, (str(sum(ns)),))
        new.append(
            Step(
                StepKind.ATEN,
                "aten.addmm.default",
                (Buf(bias), first.args[1], Buf(transposed)),
                {},
                (product,),
            )
        )
        for b in bnames:
            del new_specs[b]
    else:
        new.append(Step(StepKind.ATEN, "aten.mm.default", (first.args[0], Buf(transposed)), {}, (product,)))
    start = 0
    for (i, p, w), n in zip(sites, ns):
        out = steps[i].outputs[0]
        new.append(Step(StepKind.ATEN, "aten.slice.Tensor", (Buf(product), 1, start, start + n), {}, (out,)))
        start += n
        dropped.update((i, p))
        del new_specs[w]
        buffers.pop(steps[p].outputs[0], None)
    return new
