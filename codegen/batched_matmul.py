"""Batched matrix products (``aten.bmm``) as Triton kernels, for library-free programs
(``aot.codegen.library_free``).

Attention written out as matmuls (``q @ k.transpose(-1, -2)``, ``weights @ v``), einsums and
other batched products reach the program as ``bmm`` of views (``expand``, ``transpose``,
``view``...) that a default build leaves to cuBLAS. Here each becomes one kernel step after
fusion: both operands are read in place through their views, resolved to a base buffer, an offset
and strides (``cache_writes.strided_view``; the strides and sizes are call-time values, so
symbolic sizes cost nothing), the product accumulates in float32 (IEEE for float32 operands) and
is written row-major, rounded once. One program per (batch, block of rows, block of columns).
The ``bmm`` step is the kernel's reference, what the CPU runs.
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

BMM = "aten.bmm.default"
HEURISTIC = "bmm-tiles-v1"
BLOCK_K = 32


@dataclass(frozen=True)
class BmmSite:
    step: int
    a: Strided  # [B, M, K]
    b: Strided  # [B, K, N]
    out: str  # [B, M, N] row-major
    dtype: str


def find_bmm_sites(program: Program) -> list[BmmSite]:
    specs = tensor_specs(program)
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != BMM or len(step.args) != 2 or step.kwargs:
            continue
        a, b = step.args
        if (
            not isinstance(a, Buf)
            or not isinstance(b, Buf)
            or len(step.outputs) != 1
            or step.outputs[0] is None
        ):
            continue
        out = specs.get(step.outputs[0])
        if out is None or out.order or out.dtype not in FLOAT_DTYPES or len(out.shape) != 3:
            continue
        if any(specs.get(x.name) is None or specs[x.name].dtype != out.dtype for x in (a, b)):
            continue
        va, vb = strided_view(a.name, program), strided_view(b.name, program)
        if va is None or vb is None or len(va.shape) != 3 or len(vb.shape) != 3:
            continue
        sites.append(BmmSite(i, va, vb, step.outputs[0], out.dtype))
    return sites


def _block(n: sympy.Expr, ranges) -> int:
    top = max_value(n, ranges)
    return 16 if top <= 16 else 32 if top <= 32 else 64


def render_bmm(site: BmmSite, ranges: dict[str, tuple[int, int]]) -> Rendered:
    batch, m, k = site.a.shape
    n = site.b.shape[2]
    bm, bn = _block(m, ranges), _block(n, ranges)
    biggest = max(
        max_value(batch * m * n, ranges),
        max_value(
            sum((s - 1) * st for s, st in zip(site.a.shape, site.a.strides)) + site.a.offset + 1, ranges
        ),
        max_value(
            sum((s - 1) * st for s, st in zip(site.b.shape, site.b.strides)) + site.b.offset + 1, ranges
        ),
    )
    index = "i64" if biggest >= 2**31 - 1 else "i32"
    cast = ".to(tl.int64)" if index == "i64" else ""
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    names = ["M", "N", "K", "A0", "A1", "A2", "A_OFF", "B0", "B1", "B2", "B_OFF"]
    values = [m, n, k, *site.a.strides, site.a.offset, *site.b.strides, site.b.offset]
    params = (
        KernelParam("a_ptr", ParamKind.PTR, site.dtype),
        KernelParam("b_ptr", ParamKind.PTR, site.dtype),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        *(KernelParam(p, ParamKind(index), "") for p in names),
    )
    args = (
        Buf(site.a.base),
        Buf(site.b.base),
        Buf(site.out),
        *(Sym(ix.size_text(sympy.expand(v))) for v in values),
    )
    signature = signature_of(params, index)
    body = [
        f"z = tl.program_id(0){cast}",
        f"rm = tl.program_id(1){cast} * BLOCK_M + tl.arange(0, BLOCK_M)",
        f"rn = tl.program_id(2){cast} * BLOCK_N + tl.arange(0, BLOCK_N)",
        "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "for k0 in range(0, K, BLOCK_K):",
        "    rk = k0 + tl.arange(0, BLOCK_K)",
        "    a = tl.load(a_ptr + A_OFF + z * A0 + rm[:, None] * A1 + rk[None, :] * A2, mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)",
        "    b = tl.load(b_ptr + B_OFF + z * B0 + rk[:, None] * B1 + rn[None, :] * B2, mask=(rk < K)[:, None] & (rn < N)[None, :], other=0.0)",
        f"    acc = tl.dot(a, b, acc{precision})",
        f"tl.store(out_ptr + z * M * N + rm[:, None] * N + rn[None, :], acc.to({tl_dtype}), mask=(rm < M)[:, None] & (rn < N)[None, :])",
    ]
    grid = (
        ix.size_text(batch),
        f"({ix.size_text(m)} + {bm - 1})//{bm}",
        f"({ix.size_text(n)} + {bn - 1})//{bn}",
    )
    doc = [
        f"Batched matrix product out[z] = a[z] @ b[z]: [{ix.size_text(batch)}, {ix.size_text(m)}, {ix.size_text(k)}] x "
        f"[.., {ix.size_text(n)}], {site.dtype}, float32 accumulation.",
        "",
        "a and b read in place through their views: a[z, i, k] at A_OFF + z * A0 + i * A1 + k * A2 (b alike);",
        "out row-major.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK_K}, "bmm", signature, body)
    traffic = batch * (m * k + k * n + m * n) * ITEMSIZE[site.dtype]
    return Rendered(
        name="bmm",
        source=source,
        signature=signature,
        params=params,
        args=args,
        outputs=(site.out,),
        grid=grid,
        num_warps=4,
        num_stages=2,
        config={"kind": "bmm", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK_K, "heuristic": HEURISTIC},
        ops=(BMM,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def bmm_kernels(
    program: Program,
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each ``bmm`` a kernel covers run by it (module docstring); one whose
    kernel fails to compile stays the library call."""
    sites = find_bmm_sites(program)
    if not sites:
        return program, {}
    rendered = [render_bmm(s, ranges) for s in sites]
    return steps_as_kernels(
        program, [s.step for s in sites], rendered, archs, compile_kernels, say, "batched matmul"
    )
