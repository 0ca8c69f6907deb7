"""Element gathers (``aten.gather``) as Triton kernels, for library-free programs
(``aot.codegen.library_free``).

``gather(x, d, idx)`` gives ``out[i] = x[i with its d-th coordinate replaced by idx[i]]`` over
``idx``'s shape: RoBERTa and its family (XLM-R, CamemBERT) gather their buffered token types by
the positions they compute from the padding (``gather(zeros.expand(B, P), 1, positions)``). Here
each becomes one kernel step after fusion: one program per block of ``out``'s elements, each
element's coordinates unravelled from its flat index, ``idx`` and ``x`` read in place through
their views (``cache_writes.strided_view``: a base buffer, an offset and strides, passed as sizes
the call evaluates), ``out`` written row-major.

An index outside ``0 <= idx < size`` (ATen's kernel stops the process with a device-side assert;
the CPU path, the reference step, raises) gives NaN, or -1 for an integer ``x``: an embedding
lookup by it then gives a row of NaN (``codegen/embeddings.py``). The ``gather`` step is the
kernel's reference, what the CPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from aot.codegen import index as ix
from aot.codegen.cache_writes import Strided, strided_view
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.launch import max_value
from aot.codegen.render import Rendered, steps_as_kernels
from aot.codegen.triton_types import FLOAT_DTYPES, STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, StepKind, Sym

GATHER = "aten.gather.default"
INDEX_DTYPES = ("int64", "int32")
MAX_RANK = 4
BLOCK = 256  # output elements per program instance
HEURISTIC = "gather-v1"


@dataclass(frozen=True)
class GatherSite:
    step: int
    x: Strided
    dim: int
    index: Strided
    out: str
    dtype: str
    index_dtype: str


def find_gather_sites(program: Program) -> list[GatherSite]:
    """The ``gather`` steps the kernel covers: ``x`` and the indices strided views of buffers of
    one rank (at most ``MAX_RANK``), integer indices, a row-major result of ``x``'s dtype."""
    specs = tensor_specs(program)
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != GATHER or len(step.args) != 3:
            continue
        if step.kwargs.keys() - {"sparse_grad"} or len(step.outputs) != 1 or step.outputs[0] is None:
            continue
        x, dim, idx = step.args
        if not isinstance(x, Buf) or not isinstance(idx, Buf) or type(dim) is not int:
            continue
        out, xs, ids = specs.get(step.outputs[0]), specs.get(x.name), specs.get(idx.name)
        if out is None or xs is None or ids is None or out.order or ids.dtype not in INDEX_DTYPES:
            continue
        if xs.dtype != out.dtype or out.dtype not in STORAGE or not 1 <= len(out.shape) <= MAX_RANK:
            continue
        vx, vi = strided_view(x.name, program), strided_view(idx.name, program)
        if vx is None or vi is None or not len(vx.shape) == len(vi.shape) == len(out.shape):
            continue
        sites.append(GatherSite(i, vx, dim % len(out.shape), vi, step.outputs[0], out.dtype, ids.dtype))
    return sites


def render_gather(site: GatherSite, ranges: dict[str, tuple[int, int]]) -> Rendered:
    """The kernel of one site (module docstring): grid (blocks of ``out``'s elements,)."""
    shape, rank = site.index.shape, len(site.index.shape)
    numel = ix.numel(tuple(shape))

    def reach(v: Strided) -> sympy.Expr:
        return sum((s - 1) * st for s, st in zip(v.shape, v.strides)) + v.offset + 1

    biggest = max(max_value(sympy.expand(e), ranges) for e in (numel, reach(site.x), reach(site.index)))
    index = "i64" if biggest >= 2**31 - 1 else "i32"
    wide = ".to(tl.int64)" if index == "i64" else ""
    names = ["N", "XD", "X_OFF", "I_OFF"]
    values = [numel, site.x.shape[site.dim], site.x.offset, site.index.offset]
    for k in range(rank):
        names += [f"S{k}", f"I{k}", f"X{k}"]
        values += [shape[k], site.index.strides[k], site.x.strides[k]]
    params = (
        KernelParam("x_ptr", ParamKind.PTR, site.dtype),
        KernelParam("idx_ptr", ParamKind.PTR, site.index_dtype),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        *(KernelParam(n, ParamKind(index), "") for n in names),
    )
    args = (
        Buf(site.x.base),
        Buf(site.index.base),
        Buf(site.out),
        *(Sym(ix.size_text(sympy.expand(v))) for v in values),
    )
    signature = signature_of(params, index)
    outside = "float('nan')" if site.dtype in FLOAT_DTYPES else "-1"
    body = [
        f"o = tl.program_id(0){wide} * BLOCK + tl.arange(0, BLOCK)",
        "m = o < N",
        "rest = o",
        "at = I_OFF + o * 0",
        "xat = X_OFF + o * 0",
    ]
    for k in reversed(range(rank)):
        body += [f"c = rest % S{k}", f"rest = rest // S{k}", f"at += c * I{k}"]
        if k != site.dim:
            body.append(f"xat += c * X{k}")
    body += [
        "i = tl.load(idx_ptr + at, mask=m, other=0).to(tl.int64)",
        "inside = (i >= 0) & (i < XD)",
        f"v = tl.load(x_ptr + xat + tl.where(inside, i, 0) * X{site.dim}, mask=m & inside)",
        f"v = tl.where(inside, v, {outside})",
        f"tl.store(out_ptr + o, v.to({TL_TYPE[STORAGE[site.dtype]]}), mask=m)",
    ]
    grid = (f"({ix.size_text(numel)} + {BLOCK - 1})//{BLOCK}",)
    doc = [
        f"Gather along dim {site.dim}: out[i] = x[i with coordinate {site.dim} = idx[i]], "
        f"[{', '.join(ix.size_text(s) for s in shape)}] {site.dtype}.",
        "",
        "x and idx read in place through their views: at X_OFF + sum(c_k * X_k), I_OFF + sum(c_k * I_k);",
        f"an index outside 0 <= idx < XD gives {outside}. out row-major.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, {"BLOCK": BLOCK}, "gather", signature, body)
    traffic = numel * (2 * ITEMSIZE[site.dtype] + ITEMSIZE[site.index_dtype])
    return Rendered(
        name="gather",
        source=source,
        signature=signature,
        params=params,
        args=args,
        outputs=(site.out,),
        grid=grid,
        num_warps=4,
        num_stages=1,
        config={"kind": "gather", "BLOCK": BLOCK, "heuristic": HEURISTIC},
        ops=(GATHER,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def gather_kernels(
    program: Program,
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each ``gather`` a kernel covers run by it (module docstring); one whose
    kernel fails to compile stays the library call."""
    sites = find_gather_sites(program)
    if not sites:
        return program, {}
    rendered = [render_gather(s, ranges) for s in sites]
    return steps_as_kernels(program, [s.step for s in sites], rendered, archs, compile_kernels, say, "gather")
