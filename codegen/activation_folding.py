"""Fold an activation into the matmul before it: ``addmm → [view] → gelu(tanh) | relu`` becomes
one ``_addmm_activation`` library call, which cuBLASLt runs with a bias+activation epilogue
(off CUDA the loader runs it as addmm followed by the same activation, ``aot.aten.OFF_CUDA``:
ATen's CPU kernel applies the exact GELU). One kernel launch fewer per MLP block.

Runs on the ATen program before fusion; only rewrites when every intermediate has one consumer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from aot.program import producer_of, step_reads
from aot.schema import Program

_ACTIVATIONS = {"aten.relu.default": False, "aten.gelu.default": True}


def fold_activations(program: Program) -> tuple[Program, int]:
    """Returns the rewritten program and how many activations were folded."""
    uses = Counter(name for s in program.steps for name in step_reads(s))
    uses.update(program.outputs)
    steps = list(program.steps)
    producer = producer_of(steps)
    folded = 0
    for i, act in enumerate(steps):
        if act is None or act.kind != "aten" or act.target not in _ACTIVATIONS:
            continue
        if act.target == "aten.gelu.default" and act.kwargs.get("approximate") != "tanh":
            continue  # the epilogue computes the tanh approximation only
        (src,) = step_reads(act)[:1] or (None,)
        j = producer.get(src)
        if j is None or uses[src] != 1 or steps[j] is None:
            continue
        view = None
        if steps[j].target == "aten.view.default":
            view, j = j, producer.get(step_reads(steps[j])[0])
            if j is None or steps[j] is None or uses[steps[j].outputs[0]] != 1:
                continue
        mm = steps[j]
        if mm.target != "aten.addmm.default" or mm.kwargs:
            continue
        steps[j] = replace(
            mm, target="aten._addmm_activation.default", kwargs={"use_gelu": _ACTIVATIONS[act.target]}
        )
        if view is not None:  # the view now yields the activation's result directly
            steps[view] = replace(steps[view], outputs=act.outputs)
        else:
            steps[j] = replace(steps[j], outputs=act.outputs)
        steps[i] = None
        folded += 1
    if not folded:
        return program, 0
    kept = [s for s in steps if s is not None]
    live = {o for s in kept for o in s.outputs if o}
    buffers = {k: v for k, v in program.buffers.items() if k in live}
    return replace(program, steps=tuple(kept), buffers=buffers), folded
