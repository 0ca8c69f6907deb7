"""Grouped GEMMs of Mixture-of-Experts layers as one Triton kernel each.

A Mixture-of-Experts layer (``aot.experts``) multiplies the routed rows, grouped by expert,
by their own expert's weights: ``aten._grouped_mm(rows, weights, offsets)`` with rows [S, K] whose
group e is ``offsets[e-1]..offsets[e]-1``, weights [E, K, N] and ``offsets`` int32 [E] computed on
the device. The library's CUDA kernel takes bfloat16 alone (other dtypes fall back to a loop that
reads the offsets on the host, which a CUDA graph cannot hold), so this pass replaces each such
step by a kernel of its own (the step its reference, what the CPU runs):

- a *site* is a ``_grouped_mm`` step without bias or ``out_dtype`` whose rows are a row-major
  [S, K] buffer, whose weights are a row-major [E, K, N] buffer or the ``permute(w, [0, 2, 1])`` /
  ``transpose`` view of a row-major [E, N, K] one (transformers' layout), and whose output is
  row-major [S, N], all of one float dtype;
- the grid is fixed by S: at most ``cdiv(S, BLOCK_M) + E`` row tiles (each group of n rows takes
  ``cdiv(n, BLOCK_M)``) by the column tiles. A program finds its group and tile by walking the
  offsets (E scalar loads), multiplies that tile's rows by that expert's weights alone,
  accumulating in fp32, and stores them; the programs past the last tile return. So the work is
  that of the rows' own experts (top-k of them per token) plus at most one partial tile per group,
  and a decode step's few rows spread over as many programs as experts they hit. Offsets are
  clamped to 0..S and made non-decreasing, and the last group ends at S, so no value of them reads
  outside the operands or leaves a row unwritten. ``BLOCK_M`` follows the rows per expert at the
  largest size (16 for decode, up to 64 for a long prefill);
- where the rows are ``aten.index(x, [index])`` of the tokens' hidden states (the gate/up
  projection's routed rows) and nothing else reads them, the kernel loads each row where its token
  lies (the index clamped to x's rows) and the gather step joins its reference: no [S, K] copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from aot.codegen import index as ix
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.render import Rendered, compile_site_kernels, kernel_step
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import VIEW_OPS, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym

GROUPED_MM = "aten._grouped_mm.default"
HEURISTIC = "grouped-gemm-v1"
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# Row tiles: a group of n rows takes cdiv(n, BLOCK_M) of them, so a decode step's few rows per
# expert want the smallest tile tl.dot takes; prefill's many reuse each weight tile BLOCK_M times.
BLOCK_M_CHOICES = (16, 32, 64)
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4
NUM_STAGES = 2
MAX_EXPERTS = 1024  # the walk over the groups is a loop of E scalar steps per program


@dataclass(frozen=True)
class GroupedSite:
    """One grouped GEMM: its step, operands (base buffers), sizes and the weights' layout."""

    step: int
    rows: str  # [S, K] row-major
    weights: str  # the base: [E, K, N] row-major, or [E, N, K] when ``transposed``
    offsets: str  # int32 [E]
    out: str  # [S, N] row-major
    s: str  # size text
    k: int
    n: int
    experts: int
    transposed: bool  # weights stored [E, N, K] (read as their transpose)
    dtype: str
    # rows gathered from a [T, K] buffer by an int64 [S] index (``aten.index``) that only this
    # GEMM reads: the kernel loads them where they lie, and the gather joins its reference
    gather_step: int | None = None
    source: str = ""  # [T, K] row-major
    index: str = ""  # int64 [S]
    t: str = ""  # size text


def find_grouped_sites(program: Program) -> list[GroupedSite]:
    """The ``_grouped_mm`` steps of ``program`` the kernel can stand for (see the module docstring)."""
    specs = tensor_specs(program)
    producer = {o: i for i, s in enumerate(program.steps) for o in s.outputs if o is not None}

    def view_step(name: str) -> Step | None:
        i = producer.get(name)
        s = program.steps[i] if i is not None else None
        return s if s is not None and s.kind == StepKind.ATEN and s.target in VIEW_OPS else None

    def materialized(name: str) -> bool:
        spec = specs.get(name)
        return spec is not None and not spec.order and view_step(name) is None

    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != GROUPED_MM or len(step.outputs) != 1:
            continue
        args = list(step.args) + [None] * (5 - len(step.args))
        rows, weights, offsets, bias, out_dtype = args[:5]
        if step.kwargs or bias is not None or out_dtype is not None:
            continue
        if not all(isinstance(x, Buf) for x in (rows, weights, offsets)):
            continue
        out = step.outputs[0]
        if not all(materialized(x) for x in (rows.name, offsets.name, out)):
            continue
        rs, ws, os_, outs = (specs[x].shape for x in (rows.name, weights.name, offsets.name, out))
        if len(rs) != 2 or len(ws) != 3 or len(os_) != 1 or len(outs) != 2:
            continue
        dtype = specs[rows.name].dtype
        if dtype not in FLOAT_DTYPES or {specs[weights.name].dtype, specs[out].dtype} != {dtype}:
            continue
        if specs[offsets.name].dtype != "int32" or not all(d.isdigit() for d in (*ws, *os_)):
            continue
        experts, k, n = (int(d) for d in ws)
        if int(os_[0]) != experts or experts > MAX_EXPERTS or rs[1] != str(k) or outs[1] != str(n):
            continue
        if not ix.same(ix.parse_size(rs[0]), ix.parse_size(outs[0])):
            continue
        base, transposed = weights.name, False
        if not materialized(base):
            v = view_step(base)
            swapped = v is not None and (
                (v.target == "aten.permute.default" and list(v.args[1]) == [0, 2, 1])
                or (v.target == "aten.transpose.int" and sorted(d % 3 for d in v.args[1:3]) == [1, 2])
            )
            if not swapped or not isinstance(v.args[0], Buf) or not materialized(v.args[0].name):
                continue
            base, transposed = v.args[0].name, True
            if specs[base].shape != (str(experts), str(n), str(k)):
                continue
        gather = _gather(program, specs, producer, materialized, rows.name, rs, i)
        sites.append(
            GroupedSite(
                step=i,
                rows=rows.name,
                weights=base,
                offsets=offsets.name,
                out=out,
                s=rs[0],
                k=k,
                n=n,
                experts=experts,
                transposed=transposed,
                dtype=dtype,
                **gather,
            )
        )
    return sites


def _gather(program: Program, specs, producer, materialized, rows: str, shape, at: int) -> dict:
    """The fields of a site whose rows are ``aten.index(x, [index])`` of a row-major [T, K] ``x``
    by a row-major int64 [S] ``index``, read by this GEMM alone; else none."""
    i = producer.get(rows)
    s = program.steps[i] if i is not None else None
    if s is None or s.kind != StepKind.ATEN or s.target != "aten.index.Tensor" or s.kwargs:
        return {}
    if len(s.args) != 2 or not isinstance(s.args[0], Buf) or not isinstance(s.args[1], (list, tuple)):
        return {}
    if len(s.args[1]) != 1 or not isinstance(s.args[1][0], Buf):
        return {}
    source, index = s.args[0].name, s.args[1][0].name
    xs = specs[source].shape if source in specs else ()
    v = program.steps[producer[source]] if not materialized(source) and source in producer else None
    flat = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
    if v is not None and v.kind == StepKind.ATEN and v.target in flat and isinstance(v.args[0], Buf):
        # hidden_states.view(-1, H) of a row-major [..., H] buffer: the same memory
        base = v.args[0].name
        if materialized(base) and len(xs) == 2 and specs[base].shape[-1:] == xs[1:]:
            source = base
    if not (materialized(source) and materialized(index)) or rows in program.outputs:
        return {}
    ids = specs[index]
    if len(xs) != 2 or xs[1] != shape[1] or ids.dtype != "int64" or len(ids.shape) != 1:
        return {}
    if not ix.same(ix.parse_size(ids.shape[0]), ix.parse_size(shape[0])):
        return {}
    readers = [
        j
        for j, st in enumerate(program.steps)
        if j != i and rows in (*_names(st.args), *_names(st.reference))
    ]
    if readers != [at]:
        return {}
    return {"gather_step": i, "source": source, "index": index, "t": xs[0]}


def _names(items) -> list[str]:
    out = []
    for a in items:
        if isinstance(a, Buf):
            out.append(a.name)
        elif isinstance(a, (list, tuple)):
            out += _names(a)
        elif isinstance(a, Step):
            out += _names(a.args) + _names(tuple(a.kwargs.values()))
    return out


def block_m(site: GroupedSite, ranges: dict[str, tuple[int, int]]) -> int:
    """The row tile for the rows per expert at the largest size (an even spread of the routing)."""
    from aot.symexpr import evaluate

    try:
        rows = evaluate(ix.size_text(ix.parse_size(site.s)), {k: hi for k, (lo, hi) in ranges.items()})
    except Exception:
        return BLOCK_M_CHOICES[-1]
    per_expert = -(-rows // site.experts)
    return next((b for b in BLOCK_M_CHOICES if b >= per_expert), BLOCK_M_CHOICES[-1])


def render_grouped_gemm(site: GroupedSite, block_rows: int = BLOCK_M_CHOICES[0]) -> Rendered:
    """The kernel of one site: grid (cdiv(S, block_rows) + E, cdiv(N, BLOCK_N))."""
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    # weight (e, k, n) of [E, K, N] at e*K*N + k*N + n; of [E, N, K] (read transposed) at e*N*K + n*K + k
    stride_k, stride_n = (1, site.k) if site.transposed else (site.n, 1)
    gathered = site.gather_step is not None
    name = f"grouped_gemm_e{site.experts}_k{site.k}_n{site.n}{'_t' if site.transposed else ''}{'_g' if gathered else ''}"
    if gathered:  # row r is x[index[r]]; an index outside x reads its nearest row, never past it
        gather_lines = [
            "        src = tl.load(idx_ptr + rm, mask=in_group, other=0)",
            "        src = tl.minimum(tl.maximum(src, 0), T - 1)",
        ]
    else:
        gather_lines = ["        src = rm"]
    body = [
        "pid_t = tl.program_id(0)  # a row tile of some group",
        "pid_n = tl.program_id(1).to(tl.int64)",
        "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "rk = tl.arange(0, BLOCK_K)",
        "tiles_before = pid_t * 0",
        "start = pid_t.to(tl.int64) * 0",
        "for e in range(0, EXPERTS):",
        "    # group e: rows start..end-1, the offsets clamped to 0..S, non-decreasing, the last at S",
        "    end = tl.minimum(tl.maximum(tl.load(offs_ptr + e).to(tl.int64), start), S)",
        "    end = tl.where(e == EXPERTS - 1, start * 0 + S, end)",
        "    tiles = ((end - start + BLOCK_M - 1) // BLOCK_M).to(tl.int32)",
        "    if (pid_t >= tiles_before) & (pid_t < tiles_before + tiles):",
        "        rm = start + (pid_t - tiles_before).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)",
        "        in_group = rm < end",
        "        weights = w_ptr + e * (K * N)",
        *gather_lines,
        "        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "        for k0 in range(0, K, BLOCK_K):",
        "            kk = k0 + rk",
        "            a = tl.load(x_ptr + src[:, None] * K + kk[None, :], mask=in_group[:, None] & (kk < K)[None, :], other=0.0)",
        "            b = tl.load(weights + kk[:, None] * STRIDE_K + rn[None, :] * STRIDE_N, mask=(kk < K)[:, None] & (rn < N)[None, :], other=0.0)",
        f"            acc += tl.dot(a, b{precision})",
        f"        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to({tl_dtype}), mask=in_group[:, None] & (rn < N)[None, :])",
        "    tiles_before += tiles",
        "    start = end",
    ]
    params = [
        KernelParam("x_ptr", ParamKind.PTR, site.dtype),
        *([KernelParam("idx_ptr", ParamKind.PTR, "int64")] if gathered else []),
        KernelParam("w_ptr", ParamKind.PTR, site.dtype),
        KernelParam("offs_ptr", ParamKind.PTR, "int32"),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        KernelParam("S", ParamKind("i32"), ""),
        *([KernelParam("T", ParamKind("i32"), "")] if gathered else []),
    ]
    s_text = ix.size_text(ix.parse_size(site.s))
    t_text = ix.size_text(ix.parse_size(site.t)) if gathered else ""
    rows_args = (Buf(site.source), Buf(site.index)) if gathered else (Buf(site.rows),)
    args = (
        *rows_args,
        Buf(site.weights),
        Buf(site.offsets),
        Buf(site.out),
        Sym(s_text),
        *((Sym(t_text),) if gathered else ()),
    )
    signature = signature_of(params, "i32")
    consts = {
        "BLOCK_M": block_rows,
        "BLOCK_N": BLOCK_N,
        "BLOCK_K": BLOCK_K,
        "EXPERTS": site.experts,
        "K": site.k,
        "N": site.n,
        "STRIDE_K": stride_k,
        "STRIDE_N": stride_n,
    }
    grid = (f"({s_text} + {block_rows - 1})//{block_rows} + {site.experts}", str(-(-site.n // BLOCK_N)))
    layout = f"[{site.experts}, {site.n}, {site.k}] read transposed" if site.transposed else "row-major"
    doc = [
        "Grouped GEMM: out[r] = x[r] @ w[e] for the rows r of each expert e's group (offsets), fp32 accumulation.",
        "",
        (
            f"x: [T, {site.k}], row r of the group order x[idx[r]] (T = {t_text})"
            if gathered
            else f"x: [S, {site.k}]"
        )
        + f" grouped by expert; w: [{site.experts}, {site.k}, {site.n}] ({layout}); "
        f"offs: int32 [{site.experts}]; S = {s_text}, {site.dtype}.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, consts, name, signature, body)
    elem = ITEMSIZE[site.dtype]
    rows = ix.parse_size(site.s)
    # at most one weight tile per group and row tile: bounded by the rows' own experts' weights
    traffic = (rows * (site.k + site.n) + site.experts * site.k * site.n) * elem
    config = {
        "kind": "grouped_gemm",
        "BLOCK_M": block_rows,
        "BLOCK_N": BLOCK_N,
        "BLOCK_K": BLOCK_K,
        "heuristic": HEURISTIC,
        "num_warps": NUM_WARPS,
        "num_stages": NUM_STAGES,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=args,
        outputs=(site.out,),
        grid=grid,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        config=config,
        ops=(("aten.index.Tensor",) if gathered else ()) + (GROUPED_MM,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def grouped_gemm_kernels(
    program: Program,
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each grouped GEMM site run by its kernel (the ``_grouped_mm`` step its
    reference); a site whose kernel fails to compile stays the library call."""
    sites = find_grouped_sites(program)
    if not sites:
        return program, {}
    rendered = [render_grouped_gemm(s, block_m(s, ranges)) for s in sites]
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, "grouped GEMM", "_grouped_mm stays"
    )
    ids, failed = built.ids, built.failed
    at = {s.step: (kid, r, s) for s, kid, r in zip(sites, ids, rendered) if kid not in failed}
    steps: list[Step | None] = list(program.steps)
    for i, (kid, r, site) in at.items():
        reference = (program.steps[i],)
        if site.gather_step is not None:  # the gather runs inside the kernel: its step moves here
            reference = (program.steps[site.gather_step], *reference)
            steps[site.gather_step] = None
        steps[i] = kernel_step(kid, r, reference)
    if at:
        say(f"  {len(at)} grouped GEMMs of Mixture-of-Experts layers run as grouped GEMM kernels")
    return built.program_with(program, steps), built.cubins
