"""Embedding lookups without ATen kernels.

A GPU call that launches any ATen kernel makes the process load ATen's kernel images: on an H100
with torch 2.11 the first one took 92 MiB of device memory (``bench/memory_stages.py``'s probe), more
than gpt's activations. gpt's only ATen kernels were its two lookups, so:

- ``positions_as_slices``: ``embedding(W, arange(s, s + T))`` is ``W[s : s + T]``, a view of the
  table (learned positions); the kernel after it reads the rows in place. Also where the
  positions come as transformers makes them (``(arange(0, T) + 0).unsqueeze(0)``: an int added,
  shape-only views), the slice then viewed to the lookup's shape. Only where ``s + T`` stays
  within the table's rows over the declared ranges (else the lookup's index error would become a
  short slice); the steps that made the positions go with it when nothing else reads them.
- ``gather_kernels``: the remaining ``embedding(W, ids)`` of a weight table become one Triton
  kernel each, a row copy per id. An id outside the table gives a row of NaN, where ATen's kernel
  stops the process with a device-side assert: the call's results are visibly wrong, never a
  plausible answer, and the CPU path (the reference step) raises ``IndexError``.
"""

from __future__ import annotations

import sympy

from aot.codegen import index as ix
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.launch import max_value
from aot.codegen.render import Rendered
from aot.codegen.splice import consecutive_positions, spliced
from aot.codegen.triton_types import FLOAT_DTYPES
from aot.dtypes import ITEMSIZE
from aot.program import fresh_name, producer_of, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym, TensorSpec

EMBEDDING = "aten.embedding.default"
INDEX_DTYPES = ("int64", "int32")
MAX_BLOCK = 1024  # columns per program instance
HEURISTIC = "gather-rows-v1"


def positions_as_slices(program: Program, ranges: dict[str, tuple[int, int]]) -> tuple[Program, int]:
    """``program`` with each lookup of consecutive positions in a weight table made a slice of the
    table, viewed to the lookup's shape (module docstring); also how many. The steps that made
    the positions go too where nothing else reads them."""
    weights = {w.name: w.spec for w in program.weights}
    specs = tensor_specs(program)
    producer = producer_of(program.steps)
    replaced: dict[int, list[Step]] = {}
    buffers = dict(program.buffers)
    chains: set[int] = set()
    for i, s in enumerate(program.steps):
        if s.kind != StepKind.ATEN or s.target != EMBEDDING or len(s.args) < 2:
            continue
        table, ids = s.args[0], s.args[1]
        if not (isinstance(table, Buf) and isinstance(ids, Buf)) or table.name not in weights:
            continue
        spec = weights[table.name]
        found = consecutive_positions(ids.name, program, producer, specs)
        if found is None or len(spec.shape) != 2 or not all(d.isdigit() for d in spec.shape):
            continue
        start, end, walked = found
        if max_value(ix.parse_size(end), ranges) > int(spec.shape[0]):
            continue  # the lookup could fail at some declared size: keep it, and its error
        end_arg = Sym(end) if not end.lstrip("-").isdigit() else int(end)
        out = s.outputs[0]
        ids_shape = specs[ids.name].shape
        if len(ids_shape) == 1:  # [T] ids: the slice is the lookup
            replaced[i] = [Step(StepKind.ATEN, "aten.slice.Tensor", (table, 0, start, end_arg), {}, (out,))]
        else:  # [1, T] ids and the like: the slice viewed to the lookup's shape
            rows = fresh_name(f"{out}_rows", specs, buffers)
            buffers[rows] = TensorSpec(spec.dtype, (ix.size_text(ix.parse_size(end) - start), spec.shape[1]))
            shape = [Sym(d) if not d.isdigit() else int(d) for d in (*ids_shape, spec.shape[1])]
            replaced[i] = [
                Step(StepKind.ATEN, "aten.slice.Tensor", (table, 0, start, end_arg), {}, (rows,)),
                Step(StepKind.ATEN, "aten.view.default", (Buf(rows), shape), {}, (out,)),
            ]
        chains.update(walked)
    if not replaced:
        return program, 0
    return spliced(program, replaced, chains, buffers), len(replaced)


def _tables(program: Program) -> dict[str, tuple[str, int]]:
    """Lookup tables: each weight, and each slice of a weight's first rows (a padded table's real
    ones, ``weight_padding``), as (the weight, rows a lookup may read)."""
    specs = {w.name: w.spec for w in program.weights}
    tables = {n: (n, int(s.shape[0])) for n, s in specs.items() if s.shape and s.shape[0].isdigit()}
    for s in program.steps:
        if (
            s.kind == StepKind.ATEN
            and s.target == "aten.slice.Tensor"
            and len(s.args) in (4, 5)
            and isinstance(s.args[0], Buf)
            and s.args[0].name in specs
            and s.args[1:3] == (0, 0)
            and type(s.args[3]) is int
            and 0 < s.args[3] <= tables.get(s.args[0].name, ("", 0))[1]
            and (len(s.args) < 5 or s.args[4] == 1)
            and not s.kwargs
        ):
            tables[s.outputs[0]] = (s.args[0].name, s.args[3])
    return tables


def gather_sites(program: Program) -> list[Step]:
    """The ``embedding`` steps of a weight table (or of its first rows) by ids the gather kernel
    can replace."""
    specs = tensor_specs(program)
    tables = _tables(program)
    out = []
    for s in program.steps:
        if s.kind != StepKind.ATEN or s.target != EMBEDDING or len(s.args) < 2 or len(s.outputs) != 1:
            continue
        table, ids = s.args[0], s.args[1]
        if not (isinstance(table, Buf) and isinstance(ids, Buf)) or table.name not in tables:
            continue
        w, i, o = specs.get(tables[table.name][0]), specs.get(ids.name), specs.get(s.outputs[0])
        if w is None or i is None or o is None or len(w.shape) != 2 or not all(d.isdigit() for d in w.shape):
            continue
        if (
            w.dtype not in FLOAT_DTYPES
            or i.dtype not in INDEX_DTYPES
            or o.dtype != w.dtype
            or o.order
            or i.order
            or w.order
        ):
            continue
        out.append(s)
    return out


def lookup_of(program: Program, step: Step) -> tuple[str, str, int] | None:
    """(the weight, the ids' buffer, the rows a lookup may read) of a gather kernel's step
    (``render_gather``: its reference one ``embedding`` of a weight table); None for any other
    step. A GEMM whose norm prologue reads the lookup's rows reads them from the table instead
    (``gemm_sites.Gathered``)."""
    if step.kind != StepKind.KERNEL or len(step.reference) != 1 or len(step.args) != 3:
        return None
    ref, kernel = step.reference[0], next((k for k in program.kernels if k.id == step.target), None)
    if kernel is None or kernel.config.get("heuristic") != HEURISTIC or ref.target != EMBEDDING:
        return None
    table, ids = ref.args[0], step.args[1]
    found = _tables(program).get(table.name) if isinstance(table, Buf) else None
    if found is None or not isinstance(ids, Buf):
        return None
    return found[0], ids.name, found[1]


def render_gather(step: Step, program: Program, ranges: dict[str, tuple[int, int]]) -> Rendered:
    """The Triton kernel for one ``embedding(W, ids)`` step: ``out[r, :] = W[ids[r], :]``."""
    specs = tensor_specs(program)
    (table, rows_n), ids = _tables(program)[step.args[0].name], step.args[1].name
    w, i = specs[table], specs[ids]
    cols = int(w.shape[1])  # a table of a weight's first rows reads the weight: a root, rows < ROWS
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
