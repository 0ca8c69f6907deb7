"""Row gathers (``aten.index.Tensor`` with one index tensor) as Triton kernels, for library-free
programs (``aot.codegen.library_free``).

``x[..., idx, ...]`` with one index tensor on one dim ``d`` (``aten.index(x, [None] * d + [idx])``)
picks, for each index, the slice of ``x`` at that position along ``d``: transformers' causal LMs
keep only the last position's hidden state so (``hidden[:, logits_to_keep, :]`` with a tensor of
positions, which ``aot.hf``'s wrapper passes as ``arange(seq)[-1:]``). Here each becomes one kernel
step after fusion: ``out[p, j, q] = x[p, idx[j], q]`` over the dims before ``d`` (``p``), the
indices (``j``) and the dims after ``d`` (``q``, read contiguously). ``x`` is read in place through
its views (``cache_writes.strided_view``: a base buffer, an offset and strides, passed as sizes the
call evaluates). The indices are read the same way from their buffer, or, where they are a slice of
an ``arange`` that no kernel materializes (the wrapper's last position), computed in the kernel as
``start + stride * j``: the ``arange`` and ``slice`` steps join the kernel's reference.

As ATen does, a negative index counts from the end (``idx + size``). An index still outside
``0 <= idx < size`` gives a row of NaN, as the embedding gather does (``codegen/embeddings.py``):
ATen's kernel stops the process with a device-side assert and the CPU path (the reference steps)
raises ``IndexError``; a caller's input that indexes a weight is refused before the call by the
loader's value checks (``loader/values.py``). The ``index`` step is the kernel's reference, what
the CPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from aot.codegen import index as ix
from aot.codegen.cache_writes import Strided, strided_view
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.launch import max_value
from aot.codegen.render import Rendered, compile_site_kernels, kernel_step
from aot.codegen.splice import ARANGES
from aot.codegen.triton_types import FLOAT_DTYPES
from aot.dtypes import ITEMSIZE
from aot.program import producer_of, step_reads, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym

INDEX = "aten.index.Tensor"
SLICE = "aten.slice.Tensor"
INDEX_DTYPES = ("int64", "int32")
MAX_BLOCK = 1024  # elements of a row per program instance
HEURISTIC = "index-rows-v1"


@dataclass(frozen=True)
class Positions:
    """Indices computed, not read: ``start + stride * j`` (a slice of an ``arange``), and the
    steps that made them, in program order."""

    start: sympy.Expr
    stride: sympy.Expr
    steps: tuple[int, ...]


@dataclass(frozen=True)
class IndexSite:
    step: int
    dim: int  # the indexed dim of x
    x: Strided
    index: Strided | Positions  # 1-D
    count: sympy.Expr  # how many indices
    out: str  # row-major: x's dims before ``dim``, the indices, x's dims after
    dtype: str
    index_dtype: str
    ops: tuple[str, ...]  # the targets of the steps the kernel stands for


def _min_value(expr: sympy.Expr, ranges: dict[str, tuple[int, int]]) -> int:
    """Smallest value of ``expr`` over the corners of the declared dim ranges (``max_value`` of
    its negation)."""
    return -max_value(-expr, ranges) if expr.free_symbols else int(expr)


def _size(v) -> sympy.Expr | None:
    if isinstance(v, Sym):
        return ix.parse_size(v.text)
    if type(v) is int:
        return sympy.Integer(v)
    return None


def arange_positions(name: str, program: Program, ranges: dict[str, tuple[int, int]]) -> Positions | None:
    """The values of the 1-D int64 ``name`` as ``start + stride * j`` where it is an ``arange``
    (int start and step) sliced along its dim any number of times with int starts and positive
    steps (``arange(seq)[-1:]``); None otherwise, or where a negative start could pass the front
    at some declared size (ATen clamps it there, which no affine form says)."""
    specs = tensor_specs(program)
    producer = producer_of(program.steps)
    slices: list[int] = []
    here = name
    while True:
        i = producer.get(here)
        if i is None:
            return None
        step = program.steps[i]
        if (
            step.kind != StepKind.ATEN
            or len(step.outputs) != 1
            or set(step.kwargs)
            - {
                "dtype",
                "layout",
                "device",
                "pin_memory",
            }
        ):
            return None
        if step.target in ARANGES:
            break
        if step.target != SLICE or not step.args or not isinstance(step.args[0], Buf):
            return None
        slices.append(i)
        here = step.args[0].name
    arange = program.steps[i]
    spec = specs.get(arange.outputs[0])
    if spec is None or spec.dtype != "int64" or len(spec.shape) != 1:
        return None
    args = list(arange.args)
    if arange.target == "aten.arange.default":
        args = [0, *args]
    start, step_by = args[0], (args[2] if len(args) > 2 else 1)
    if type(start) is not int or type(step_by) is not int:
        return None
    first, stride = sympy.Integer(start), sympy.Integer(step_by)
    length = ix.parse_size(spec.shape[0])
    for j in reversed(slices):
        s = program.steps[j]
        a = [*s.args[1:], None, None, None, None][:4]
        dim, begin, every = a[0] if a[0] is not None else 0, a[1] if a[1] is not None else 0, a[3] or 1
        if dim not in (0, -1) or type(begin) is not int or type(every) is not int or every < 1:
            return None
        offset = sympy.Integer(begin)
        if begin < 0:
            offset = sympy.expand(length + begin)
            if _min_value(offset, ranges) < 0:
                return None
        first, stride = sympy.expand(first + stride * offset), stride * every
        out = specs.get(s.outputs[0])
        if out is None or len(out.shape) != 1:
            return None
        length = ix.parse_size(out.shape[0])
    return Positions(first, stride, (i, *reversed(slices)))


def _flat(view: Strided | None) -> Strided | None:
    """An index tensor's view as one run of its elements in row-major order (CodeGen's
    ``embed_positions[position_ids]`` by ``[1, S]`` positions: the output's rows are in that order
    too), or None where its elements are not evenly spaced so."""
    if view is None or not view.shape:
        return None
    kept = [(n, st) for n, st in zip(view.shape, view.strides) if not ix.same(n, 1)]
    if not kept:
        return Strided(view.base, view.offset, (sympy.Integer(1),), (sympy.Integer(0),))
    step = kept[-1][1]
    for k, (_, st) in enumerate(kept):
        if not ix.same(st, step * ix.numel(tuple(m for m, _ in kept[k + 1 :]))):
            return None
    return Strided(view.base, view.offset, (ix.numel(tuple(n for n, _ in kept)),), (step,))


def find_index_sites(program: Program, ranges: dict[str, tuple[int, int]]) -> list[IndexSite]:
    """The ``index`` steps with one integer index tensor (of any rank, read as its elements in
    row-major order) on one dim of a float tensor whose dims after it are contiguous, written
    row-major."""
    specs = tensor_specs(program)
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != INDEX or len(step.args) != 2 or step.kwargs:
            continue
        x, indices = step.args
        if not isinstance(x, Buf) or not isinstance(indices, (list, tuple)) or len(step.outputs) != 1:
            continue
        given = [(d, v) for d, v in enumerate(indices) if v is not None]
        if len(given) != 1 or not isinstance(given[0][1], Buf):
            continue
        dim, idx = given[0]
        xs, ids, out = specs.get(x.name), specs.get(idx.name), specs.get(step.outputs[0] or "")
        if xs is None or ids is None or out is None or out.order or ids.order:
            continue
        if xs.dtype not in FLOAT_DTYPES or out.dtype != xs.dtype or ids.dtype not in INDEX_DTYPES:
            continue
        if not ids.shape or dim >= len(xs.shape):
            continue
        view = strided_view(x.name, program)
        if view is None or len(view.shape) != len(xs.shape):
            continue
        inner = view.shape[dim + 1 :]
        if any(
            not ix.same(st, ix.numel(tuple(inner[k + 1 :]))) for k, st in enumerate(view.strides[dim + 1 :])
        ):
            continue  # the dims after the indexed one are not one contiguous run
        index = arange_positions(idx.name, program, ranges) if len(ids.shape) == 1 else None
        if index is None:
            index = _flat(strided_view(idx.name, program))
            if index is None:
                continue
        made = index.steps if isinstance(index, Positions) else ()
        ops = tuple(dict.fromkeys([*(program.steps[k].target for k in made), INDEX]))
        count = ix.numel(tuple(ix.parse_size(d) for d in ids.shape))
        sites.append(IndexSite(i, dim, view, index, count, step.outputs[0], xs.dtype, ids.dtype, ops))
    return sites


def render_index_rows(site: IndexSite, ranges: dict[str, tuple[int, int]]) -> Rendered:
    """The kernel of one site: ``out[p, j, q] = x[p, idx[j], q]`` (module docstring)."""
    x, d = site.x, site.dim
    outer, rows, inner = x.shape[:d], x.shape[d], ix.numel(tuple(x.shape[d + 1 :]))
    p = ix.numel(tuple(outer))
    cols = max(1, max_value(inner, ranges))
    block = min(MAX_BLOCK, 1 << max(4, (cols - 1).bit_length()))
    reach = sum((s - 1) * st for s, st in zip(x.shape, x.strides)) + x.offset + 1
    biggest = max(max_value(p * site.count * inner, ranges), max_value(sympy.expand(reach), ranges))
    computed = isinstance(site.index, Positions)
    if not computed:
        i_reach = (site.index.shape[0] - 1) * site.index.strides[0] + site.index.offset + 1
        biggest = max(biggest, max_value(sympy.expand(i_reach), ranges))
    index = "i64" if biggest >= 2**31 - 1 else "i32"
    wide = ".to(tl.int64)" if index == "i64" else ""
    names = ["Q", "N", "XD", "X_OFF", "COUNT"]
    values = [inner, rows, x.strides[d], x.offset, site.count]
    for k in range(len(outer)):
        names += [f"S{k}", f"T{k}"]
        values += [outer[k], x.strides[k]]
    if computed:
        names += ["I_START", "I_STRIDE"]
        values += [site.index.start, site.index.stride]
    else:
        names += ["I_OFF", "I_STRIDE"]
        values += [site.index.offset, site.index.strides[0]]
    params = (
        KernelParam("x_ptr", ParamKind.PTR, site.dtype),
        *(() if computed else (KernelParam("idx_ptr", ParamKind.PTR, site.index_dtype),)),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        *(KernelParam(n, ParamKind(index), "") for n in names),
    )
    args = (
        Buf(x.base),
        *(() if computed else (Buf(site.index.base),)),
        Buf(site.out),
        *(Sym(ix.size_text(sympy.expand(v))) for v in values),
    )
    signature = signature_of(params, index)
    body = [
        f"r = tl.program_id(0){wide}  # (p, j): a row of the output",
        f"q = tl.program_id(1){wide} * BLOCK + tl.arange(0, BLOCK)",
        "j = r % COUNT",
        "rest = r // COUNT",
        "base = X_OFF",
    ]
    for k in reversed(range(len(outer))):
        body += [f"base += (rest % S{k}) * T{k}", f"rest = rest // S{k}"]
    if computed:
        body.append("row = (I_START + I_STRIDE * j).to(tl.int64)")
    else:
        body.append("row = tl.load(idx_ptr + I_OFF + I_STRIDE * j).to(tl.int64)")
    body += [
        "row = tl.where(row < 0, row + N, row)",
        "inside = (row >= 0) & (row < N)",
        "safe = tl.where(inside, row, 0)",
        "v = tl.load(x_ptr + base + safe * XD + q, mask=q < Q)",
        "v = tl.where(inside, v, float('nan'))",
        "tl.store(out_ptr + r * Q + q, v, mask=q < Q)",
    ]
    grid = (ix.size_text(sympy.expand(p * site.count)), f"({ix.size_text(inner)} + {block - 1})//{block}")
    if computed:
        where = f"computed: I_START + I_STRIDE * j ({ix.size_text(site.index.start)} + {ix.size_text(site.index.stride)} * j)"
    else:
        where = "read from idx_ptr: idx[j] at I_OFF + I_STRIDE * j"
    doc = [
        f"Row gather on dim {d}: out[p, j, q] = x[p, idx[j], q], {ix.size_text(site.count)} indices into "
        f"{ix.size_text(rows)} rows of [{', '.join(ix.size_text(s) for s in x.shape)}] {site.dtype}.",
        "",
        f"Indices {where}; a negative one counts from the end, one still outside gives a row of NaN.",
        "x read in place: x[p, i, q] at X_OFF + sum(p_k * T_k) + i * XD + q; out row-major.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, {"BLOCK": block}, "index_rows", signature, body)
    traffic = p * site.count * inner * 2 * ITEMSIZE[site.dtype]
    return Rendered(
        name="index_rows",
        source=source,
        signature=signature,
        params=params,
        args=args,
        outputs=(site.out,),
        grid=grid,
        num_warps=4,
        num_stages=1,
        config={
            "kind": "index_rows",
            "BLOCK": block,
            "heuristic": HEURISTIC,
            "num_warps": 4,
            "num_stages": 1,
        },
        ops=site.ops,
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def index_row_kernels(
    program: Program,
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each ``index`` step a kernel covers run by it (module docstring): the steps
    that computed its positions join its reference and leave the program where nothing else reads
    them; one whose kernel fails to compile stays the library call."""
    sites = find_index_sites(program, ranges)
    if not sites:
        return program, {}
    rendered = [render_index_rows(s, ranges) for s in sites]
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, "row gather", "the library call stays"
    )
    steps: list[Step | None] = list(program.steps)
    folded: set[int] = set()
    done = 0
    for site, kid, r in zip(sites, built.ids, rendered):
        if kid in built.failed:
            continue
        made = site.index.steps if isinstance(site.index, Positions) else ()
        steps[site.step] = kernel_step(kid, r, (*(program.steps[k] for k in made), program.steps[site.step]))
        folded.update(made)
        done += 1
    # the position steps a kernel folded, where no other step (nor the program's outputs) reads them
    read = {b for k, s in enumerate(steps) if s is not None and k not in folded for b in step_reads(s)}
    read |= set(program.outputs)
    for k in sorted(folded, reverse=True):
        if not any(o in read for o in program.steps[k].outputs if o):
            steps[k] = None
        else:
            read.update(step_reads(program.steps[k]))
    if done:
        say(f"  {done} row gathers (aten.index) run as kernels")
    return built.program_with(program, steps), built.cubins
