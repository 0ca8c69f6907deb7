"""Embedding lookups without ATen kernels.

A GPU call that launches any ATen kernel makes the process load ATen's kernel images: on an H100
with torch 2.11 the first one took 92 MiB of device memory (``bench/memory_stages.py``'s probe), more
than gpt's activations. gpt's only ATen kernels were its two lookups, so:

- ``positions_as_slices``: ``embedding(W, arange(s, s + T))`` is ``W[s : s + T]``, a view of the
  table (learned positions); the kernel after it reads the rows in place. Only where ``s + T``
  stays within the table's rows over the declared ranges (else the lookup's index error would
  become a short slice); the ``arange`` goes with it when nothing else reads it.
- ``gather_kernels``: the remaining ``embedding(W, ids)`` of a weight table become one Triton
  kernel each, a row copy per id. An id outside the table gives a row of NaN, where ATen's kernel
  stops the process with a device-side assert: the call's results are visibly wrong, never a
  plausible answer, and the CPU path (the reference step) raises ``IndexError``.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from aot.codegen import index as ix
from aot.codegen.gemm import FLOAT_DTYPES
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.launch import max_value
from aot.codegen.render import Rendered
from aot.dtypes import ITEMSIZE
from aot.program import step_reads, tensor_specs
from aot.schema import Buf, DType, KernelParam, ParamKind, Program, Step, StepKind, Sym

EMBEDDING = "aten.embedding.default"
ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")
INDEX_DTYPES = ("int64", "int32")
MAX_BLOCK = 1024  # columns per program instance
HEURISTIC = "gather-rows-v1"


def _size_text(arg) -> str | None:
    if isinstance(arg, Sym):
        return ix.size_text(ix.parse_size(arg.text))
    if type(arg) is int:
        return str(arg)
    return None


def _arange_span(step: Step) -> tuple[int, str] | None:
    """(start, end as size text) of an ``arange`` of consecutive int64 values; None otherwise."""
    if step.kind != StepKind.ATEN or step.target not in ARANGES or len(step.outputs) != 1:
        return None
    args = list(step.args)
    if step.target == "aten.arange.default":
        args = [0, *args]
    start, end = (args + [None, None])[:2]
    step_by = args[2] if len(args) > 2 else 1
    if type(start) is not int or start < 0 or step_by != 1 or _size_text(end) is None:
        return None
    if set(step.kwargs) - {"dtype", "layout", "device", "pin_memory"}:
        return None  # a step (or anything else) given by keyword: not consecutive positions for sure
    dtype = step.kwargs.get("dtype")
    if dtype is not None and dtype != DType("int64"):
        return None
    return start, _size_text(end)


def positions_as_slices(program: Program, ranges: dict[str, tuple[int, int]]) -> tuple[Program, int]:
    """``program`` with each lookup of consecutive positions in a weight table made a slice of the
    table (module docstring); also how many."""
    weights = {w.name: w.spec for w in program.weights}
    producer = {o: i for i, s in enumerate(program.steps) for o in s.outputs if o is not None}
    readers: dict[str, list[int]] = {}
    for i, s in enumerate(program.steps):
        for r in dict.fromkeys(step_reads(s)):
            readers.setdefault(r, []).append(i)
    replaced: dict[int, Step] = {}
    for i, s in enumerate(program.steps):
        if s.kind != StepKind.ATEN or s.target != EMBEDDING or len(s.args) < 2:
            continue
        table, ids = s.args[0], s.args[1]
        if not (isinstance(table, Buf) and isinstance(ids, Buf)) or table.name not in weights:
            continue
        spec = weights[table.name]
        a = producer.get(ids.name)
        span = _arange_span(program.steps[a]) if a is not None else None
        if span is None or len(spec.shape) != 2 or not spec.shape[0].isdigit():
            continue
        start, end = span
        if max_value(ix.parse_size(end), ranges) > int(spec.shape[0]):
            continue  # the lookup could fail at some declared size: keep it, and its error
        end_arg = Sym(end) if not end.lstrip("-").isdigit() else int(end)
        replaced[i] = Step(
            kind=StepKind.ATEN,
            target="aten.slice.Tensor",
            args=(table, 0, start, end_arg),
            kwargs={},
            outputs=s.outputs,
        )
    if not replaced:
        return program, 0
    # an arange whose every reader became a slice goes too
    dead = set()
    for i, s in enumerate(program.steps):
        if _arange_span(s) is not None and readers.get(s.outputs[0]):
            if set(readers[s.outputs[0]]) <= set(replaced) and s.outputs[0] not in program.outputs:
                dead.add(i)
    steps = tuple(replaced.get(i, s) for i, s in enumerate(program.steps) if i not in dead)
    buffers = {
        k: v for k, v in program.buffers.items() if k not in {program.steps[i].outputs[0] for i in dead}
    }
    return replace(program, steps=steps, buffers=buffers), len(replaced)


def gather_sites(program: Program) -> list[Step]:
    """The ``embedding`` steps of a weight table by ids the gather kernel can replace."""
    specs = tensor_specs(program)
    weights = {w.name for w in program.weights}
    out = []
    for s in program.steps:
        if s.kind != StepKind.ATEN or s.target != EMBEDDING or len(s.args) < 2 or len(s.outputs) != 1:
            continue
        table, ids = s.args[0], s.args[1]
        if not (isinstance(table, Buf) and isinstance(ids, Buf)) or table.name not in weights:
            continue
        w, i, o = specs.get(table.name), specs.get(ids.name), specs.get(s.outputs[0])
        if w is None or i is None or o is None or len(w.shape) != 2 or not all(d.isdigit() for d in w.shape):
            continue
        if (
            w.dtype not in FLOAT_DTYPES
            or i.dtype not in INDEX_DTYPES
            or o.dtype != w.dtype
            or o.order
            or i.order
        ):
            continue
        out.append(s)
    return out


def render_gather(step: Step, program: Program, ranges: dict[str, tuple[int, int]]) -> Rendered:
    """The Triton kernel for one ``embedding(W, ids)`` step: ``out[r, :] = W[ids[r], :]``."""
    specs = tensor_specs(program)
    table, ids = step.args[0].name, step.args[1].name
    w, i = specs[table], specs[ids]
    rows_n, cols = int(w.shape[0]), int(w.shape[1])
    n = ix.numel(tuple(ix.parse_size(d) for d in i.shape))
    n_text = ix.size_text(n)
    block = min(MAX_BLOCK, 1 << max(4, (cols - 1).bit_length()))
    index = "i64" if max_value(n, ranges) * cols >= 2**31 - 1 or rows_n * cols >= 2**31 - 1 else "i32"
    name = "gather_rows"
    grid = (n_text, str(-(-cols // block)))
    params = (
        KernelParam("w_ptr", ParamKind.PTR, w.dtype),
        KernelParam("ids_ptr", ParamKind.PTR, i.dtype),
        KernelParam("out_ptr", ParamKind.PTR, w.dtype),
    )
    signature = signature_of(params, index)
    mask = ", mask=cols < COLS" if cols % block else ""
    doc = [
        f"Embedding lookup: out[r, :] = W[ids[r], :] for {n_text} ids into a [{rows_n}, {cols}] {w.dtype} table.",
        "",
        "An id outside the table gives a row of NaN (ATen's kernel would stop the process).",
        f"grid: ({', '.join(grid)},)",
    ]
    body = [
        f"r = tl.program_id(0){'.to(tl.int64)' if index == 'i64' else ''}",
        "cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)",
        "row = tl.load(ids_ptr + r).to(tl.int64)",
        "inside = (row >= 0) & (row < ROWS)",
        "safe = tl.where(inside, row, 0)",
        f"v = tl.load(w_ptr + safe * COLS + cols{mask})",
        "v = tl.where(inside, v, float('nan'))",
        f"tl.store(out_ptr + r * COLS + cols, v{mask})",
    ]
    source = kernel_module(doc, {"ROWS": rows_n, "COLS": cols, "BLOCK": block}, name, signature, body)
    traffic = n * (2 * cols * ITEMSIZE[w.dtype] + ITEMSIZE[i.dtype])
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=params,
        args=(Buf(table), Buf(ids), Buf(step.outputs[0])),
        outputs=(step.outputs[0],),
        grid=grid,
        num_warps=4,
        num_stages=1,
        config={"kind": "gather", "BLOCK": block, "heuristic": HEURISTIC, "num_warps": 4, "num_stages": 1},
        ops=(step.target,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )
