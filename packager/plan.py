"""The memory plan: buffer liveness over the program, resolved at each CUDA-graph bucket.

A buffer lives from the step that writes it to the last step that reads it or any view of it
(view ops alias their input and allocate nothing). The loader frees every buffer after its last
use, so inside a capture the graph pool hands that memory to later buffers; this plan is the
peak the program needs at each bucket's sizes, recorded in the manifest so ``aotpack inspect``
shows what a capture will hold and ``aotpack load`` can report it against what was reserved.
"""

from __future__ import annotations

import itertools

from aot.schema import Bucket, Program
from aot.symexpr import compile_expr

VIEW_OPS = {
    "aten.view.default", "aten._unsafe_view.default", "aten.permute.default", "aten.expand.default",
    "aten.slice.Tensor", "aten.select.int", "aten.split_with_sizes.default", "aten.split.Tensor",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.t.default",
    "aten.transpose.int", "aten.alias.default", "aten.as_strided.default", "aten.unbind.int",
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
            "int32": 4, "int64": 8, "bool": 1}


def _reads(a, out: list[str]) -> list[str]:
    if isinstance(a, dict):
        if "buf" in a:
            out.append(a["buf"])
        else:
            for v in a.values():
                _reads(v, out)
    elif isinstance(a, (list, tuple)):
        for v in a:
            _reads(v, out)
    return out


def liveness(program: Program) -> list[tuple[str, int, int]]:
    """(buffer, first step, last step) for every buffer that owns memory."""
    root: dict[str, str] = {}
    born: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, step in enumerate(program.steps):
        reads = _reads(list(step.args) + [step.kwargs], [])
        for r in reads:
            last[root.get(r, r)] = i
        for o in step.outputs:
            if o is None:
                continue
            if step.kind == "aten" and step.target in VIEW_OPS and reads:
                root[o] = root.get(reads[0], reads[0])
            else:
                born[o] = i
                last.setdefault(o, i)
    for o in program.outputs:
        last[root.get(o, o)] = len(program.steps)
    return [(b, born[b], last[b]) for b in born]


def peak_bytes(program: Program, sizes: dict[str, int]) -> int:
    events: list[tuple[int, int]] = []
    for name, first, end in liveness(program):
        spec = program.buffers[name]
        n = ITEMSIZE.get(spec.dtype, 4)
        for s in spec.shape:
            n *= compile_expr(s)(sizes)
        events += [(first, n), (end + 1, -n)]
    peak = live = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta
        peak = max(peak, live)
    return peak


def memory_plan(program: Program, buckets: tuple[Bucket, ...]) -> dict[str, int]:
    """Peak activation bytes per bucket (``"batch=8,seq=128"`` → bytes), largest bucket first."""
    order = [s.symbol for s in program.symbols]
    by_symbol = {b.symbol: b.sizes for b in buckets}
    if any(s not in by_symbol for s in order):
        return {}
    plan = {}
    for key in sorted(itertools.product(*(by_symbol[s] for s in order)), key=lambda k: [-v for v in k]):
        sizes = dict(zip(order, key))
        plan[",".join(f"{k}={v}" for k, v in sizes.items())] = peak_bytes(program, sizes)
    return plan
