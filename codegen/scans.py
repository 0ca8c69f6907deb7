"""Cumulative sums as Triton kernels (``aten.cumsum``): EdgeNeXt's sine position encoding sums a
mask along the image's rows and columns, a padded batch's positions are a cumsum of its mask.

A row-major ``[outer..., L, inner...]`` tensor is ``outer * inner`` runs of ``L`` elements
``inner`` apart; a program scans ``BLOCK_R`` runs of one outer index at once, ``BLOCK_L`` of their
elements a step (``tl.cumsum`` over a ``[BLOCK_L, BLOCK_R]`` tile, the inner runs side by side so
their loads coalesce), each step's sums carried into the next: one step where ``L`` fits
``MAX_RUN``. Sums in fp32 for floats and bools (as ATen accumulates half types), int64 for
integers. Every dim may be symbolic: the scanned one (a padded batch's positions along the
sequence: RoBERTa's ``cumsum(mask, dim=1)``), those before it, and those after it (DETR's sine
position encoding sums its mask along the rows of an image of a declared range of sizes); their
sizes are then call-time arguments. Anything else stays ATen's.
"""

from __future__ import annotations

import sympy

from aot.codegen import index as ix
from aot.codegen.kernel_source import kernel_module, signature_of, size_arguments
from aot.codegen.launch import MAX_GRID_YZ, cdiv_text, max_value
from aot.codegen.render import Rendered
from aot.codegen.step_args import norm_dim
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.codegen.valuegraph import Unsupported
from aot.dtypes import ITEMSIZE
from aot.program import tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind

CUMSUM = "aten.cumsum.default"
MAX_RUN = 2048  # a run's elements a step, in registers at once
TILE = 4096  # elements of a program's tile
HEURISTIC = "cumsum-v1"
SCANNED = ("float16", "bfloat16", "float32", "bool", "int8", "uint8", "int16", "int32", "int64")


def _dim(step: Step, rank: int) -> int | None:
    dim = step.args[1] if len(step.args) > 1 else step.kwargs.get("dim")
    try:
        return norm_dim(dim, max(rank, 1))
    except Unsupported:
        return None


def scan_sites(program: Program) -> list[Step]:
    """The cumsum steps the kernel can replace (module docstring): a row-major input and output
    of a dtype it sums."""
    specs = tensor_specs(program)
    out = []
    for s in program.steps:
        if s.kind != StepKind.ATEN or s.target != CUMSUM or not s.args or not isinstance(s.args[0], Buf):
            continue
        if not s.outputs or s.outputs[0] is None or s.kwargs.keys() - {"dtype"}:
            continue
        x, o = specs.get(s.args[0].name), specs.get(s.outputs[0])
        if x is None or o is None or x.order or o.order or x.shape != o.shape:
            continue
        if x.dtype not in SCANNED or o.dtype not in SCANNED or o.dtype == "bool":
            continue
        dim = _dim(s, len(x.shape))
        if dim is None:
            continue
        if x.shape and x.shape[dim] == "0":
            continue
        out.append(s)
    return out


def render_scan(step: Step, program: Program, ranges: dict[str, tuple[int, int]]) -> Rendered | None:
    """The Triton kernel for one cumsum of ``scan_sites``; None where its grid passes CUDA's limit."""
    specs = tensor_specs(program)
    x, o = specs[step.args[0].name], specs[step.outputs[0]]
    dim = _dim(step, len(x.shape))
    run = ix.parse_size(x.shape[dim]) if x.shape else sympy.Integer(1)
    longest = max_value(run, ranges)
    inner = ix.numel(tuple(ix.parse_size(d) for d in x.shape[dim + 1 :]))
    outer = ix.numel(tuple(ix.parse_size(d) for d in x.shape[:dim]))
    most_inner = max_value(inner, ranges)
    block_l = max(2, min(MAX_RUN, 1 << max(0, (longest - 1).bit_length())))
    block_r = max(2, min(TILE // block_l, 1 << max(0, (most_inner - 1).bit_length())))
    if -(-most_inner // block_r) > MAX_GRID_YZ:
        return None
    index = "i64" if max_value(outer, ranges) * longest * most_inner >= 2**31 - 1 else "i32"
    floats = o.dtype in ("float16", "bfloat16", "float32")
    acc = "tl.float32" if floats else "tl.int64"
    name = "cumsum"
    consts, size_params, size_args = size_arguments({"L": run, "INNER": inner}, index)
    params = (
        KernelParam("x_ptr", ParamKind.PTR, x.dtype),
        KernelParam("out_ptr", ParamKind.PTR, o.dtype),
        *size_params,
    )
    signature = signature_of(params, index)
    grid = (ix.size_text(outer), cdiv_text(inner, block_r))
    doc = [
        f"Cumulative sum over dim {dim} of [{', '.join(x.shape)}] {x.dtype} -> {o.dtype}: "
        f"runs of {ix.size_text(run)} elements {ix.size_text(inner)} apart, {block_r} runs a program, "
        f"{block_l} elements a step, summed in {acc[3:]}.",
        f"grid: ({', '.join(grid)},)",
    ]
    consts = {**consts, "BLOCK_L": block_l, "BLOCK_R": block_r}
    wide = ".to(tl.int64)" if index == "i64" else ""
    body = [
        f"n = tl.program_id(0){wide}",
        f"i = tl.program_id(1){wide} * BLOCK_R + tl.arange(0, BLOCK_R)",
        f"carry = tl.zeros([BLOCK_R], dtype={acc})",
        "for start in range(0, L, BLOCK_L):",
        "    l = start + tl.arange(0, BLOCK_L)",
        "    offs = n * (L * INNER) + l[:, None] * INNER + i[None, :]",
        "    ok = (l < L)[:, None] & (i < INNER)[None, :]",
        f"    v = tl.load(x_ptr + offs, mask=ok, other=0).to({acc})",
        "    s = tl.cumsum(v, axis=0) + carry[None, :]",
        f"    tl.store(out_ptr + offs, s.to({TL_TYPE[STORAGE[o.dtype]]}), mask=ok)",
        "    carry += tl.sum(v, axis=0)",
    ]
    source = kernel_module(doc, consts, name, signature, body)
    traffic = outer * inner * run * (ITEMSIZE[x.dtype] + ITEMSIZE[o.dtype])
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=params,
        args=(step.args[0], Buf(step.outputs[0]), *size_args),
        outputs=(step.outputs[0],),
        grid=grid,
        num_warps=4,
        num_stages=1,
        config={"kind": "scan", "BLOCK_L": block_l, "BLOCK_R": block_r, "heuristic": HEURISTIC},
        ops=(step.target,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )
