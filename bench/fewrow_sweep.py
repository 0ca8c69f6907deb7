"""Sweep few-row GEMMs (decode at batch 2-16) on the GPU, with cold weights: Triton tensor-core
forms against cuBLAS.

A decode step at batch B multiplies B rows by every weight matrix. From 2 rows on, the default
build runs cuBLAS (``codegen/gemm_defaults.py``'s few-row entry, ``FEW_ROWS``, is off until
measured); this sweep decides that entry. Every form is a ``tl.dot`` over a tile of BLOCK_M = 16 rows (the
rows past M masked off: their loads read nothing, their products are dropped), W read as stored
([N, K], K contiguous), K in BLOCK_K steps pipelined over ``num_stages`` stages, and K cut into
1, 2 or 4 slices: the slices' fp32 partials added atomically into a zeroed fp32 output
(``atomic``; the zeroing timed with it, the output left in fp32) or written to a workspace that
a second kernel sums into the bf16 output (``pass``, as the codegen's split-K forms do).

Each form is timed as a bundle runs it (``gemv_sweep``'s helpers: back to back in one CUDA graph,
every launch reading its own copy of W, the copies together over twice L2; A the same each
launch). With BLOCK_M = 16 a form runs the same instructions at every M up to 16 (only A's masked
loads differ), so every form is timed at ``--full-m`` (8) and the fastest ``--top`` of them again
at the other row counts. The codegen's own forms of 16 rows (``codegen/gemm_forms.py``:
``gemv_16x16x256`` ..., and the built-in table's few-row forms) are points of this grid, labelled
so, and are also timed at every row count as the codegen renders them for a bundle (``codegen
<name>``: N and K constants, split-K's slices summed by its second kernel). At a Llama's q/k/v
and gate/up (an RMSNorm of the residual sum feeds them) the few-row forms are also timed with the
norm, apart from the ranking: their ``_rms`` form (the norm in the GEMM's prologue, the sum
written by the first N tile) against the plain form after a norm kernel (``with_norm``), which
decides ``gemm_defaults.FEW_ROWS_PROLOGUE``.

``--chain``: a decode step's GEMMs (every layer its own weights, the LM head last) in one graph
at each row count, cuBLAS against the fastest form of each shape, and against one form for every
site (each shape's leader, chained at every site; a codegen form that makes no kernel at a site
leaves it to cuBLAS).

With ``--chain`` also the decode step's GEMMs as a bundle runs them (``table_us``): the RMSNorms of
a Llama included (the ``_rms`` forms, or the norm kernel before cuBLAS), cuBLAS against the
built-in table's few-row entries of ``TABLES`` (the forms of the 2026-11-29 decode; ``fewe_``:
W's first K steps before the dependent-launch wait and the one-pass ``_rms`` forms; ``fewp_``: the
one pass alone), each plainly and under programmatic dependent launch (``pdl``).

``--check``: compile every form for sm_90 without a GPU (``triton.compile`` to a cubin).

    python3 bench/fewrow_sweep.py --chain --json out/fewrow.json           # ~4 min on an H200
    python3 bench/fewrow_sweep.py --quick --chain --json out/fewrow-quick.json
    python3 bench/fewrow_sweep.py --check [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_sweep import MODELS, copies_of, graph_us  # noqa: E402  (the one-row sweep, beside this file)

ROWS = (2, 4, 8, 16)
BLOCK_M = 16
EPS = 1e-5  # the RMSNorm's (Llama's)
NORM_SITES = ("qkv", "gate_up")  # a Llama's GEMMs an RMSNorm (of the residual sum) feeds
SHARED = 227 << 10  # sm_90's opt-in shared memory per block
MODES = ("store", "atomic", "pass")  # split 1; split > 1 atomically; split > 1 with a second kernel
# The codegen's skinny dot forms (codegen/gemm_forms.py) as points of this grid: (BN, BK, warps,
# stages, split-K written as "pass": the codegen sums the slices in a second kernel).
CODEGEN = {
    (16, 256, 4, 3, "store"): "gemv_16x16x256",
    (32, 128, 4, 4, "store"): "gemv_16x32x128",
    (64, 128, 4, 4, "store"): "tile_16x64x128",
    (16, 256, 4, 3, "pass"): "splitk_16x16x256",
    (64, 128, 4, 3, "pass"): "splitk_16x64x128",
}

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def codegen_configs() -> list:
    """The codegen's tensor-core forms of 16 rows (``gemm_forms.CONFIGS``, and the few-row forms of
    the built-in table where this checkout has them)."""
    from aot.codegen import gemm_forms

    configs = [*gemm_forms.CONFIGS, *getattr(gemm_forms, "FEW_ROW_CONFIGS", ())]
    return [c for c in configs if c.dot and c.block_m == BLOCK_M]


@functools.cache
def rendered(n: int, k: int, dtype: str, name: str, norm: bool = False, pdl: bool = False) -> tuple:
    """The codegen's kernels of config ``name`` for a plain GEMM [M, K] x [N, K]^T (no epilogue),
    as ``render_candidates`` writes them for a bundle, M = ``s0`` up to 16: a tuple of (jit
    function, Rendered, config, workspaces); () where the config makes no form at this shape.
    ``norm``: its ``_rms`` form instead, A = RMSNorm(x + y) * v as Llama computes it (the sum h
    written by the first N tile), as ``gemm_prologue`` lowers the norm kernel's steps (with its
    factored form, which the one-pass forms take). ``pdl``: the kernels' ``GDC`` on (they wait
    for the kernel before under programmatic dependent launch, as a bundle's sm_90 cubins do)."""
    from aot.codegen.compile import load_function
    from aot.codegen.gemm_prologue import RowNorm
    from aot.codegen.gemm_render import render_candidates
    from aot.codegen.gemm_sites import Prologue, Site
    from aot.codegen.render import kernel_id
    from aot.schema import Buf, Step, StepKind, TensorSpec

    site = Site(
        id="fewrow", library=(0,), a="a", weights=("w",), biases=(None,), activation="",
        gemm_outputs=("o",), m="s0", n=n, k=k, dtype=dtype, outputs=("o", "h") if norm else ("o",),
    )  # fmt: skip
    rows = TensorSpec(dtype, ("s0", str(k)))
    buffers = {"a": rows, "o": TensorSpec(dtype, ("s0", str(n))), "x": rows, "y": rows, "h": rows}
    known = {"w": TensorSpec(dtype, (str(n), str(k))), "v": TensorSpec(dtype, (str(k),))}
    if norm:
        t = {"bfloat16": "tl.bfloat16", "float16": "tl.float16"}[dtype]
        load = (
            "tl.load({}_ptr + rm[:, None] * "
            + str(k)
            + " + rk@[None, :], mask=kmask@, other=0.0).to(tl.float32)"
        )
        rms = RowNorm(
            inputs=(("x", dtype), ("y", dtype)),
            vectors=(("v", dtype),),
            row_ops=(
                ("x0_@", load.format("x0"), False),
                ("x1_@", load.format("x1"), False),
                ("r0_@", f"(x0_@ + x1_@).to({t}).to(tl.float32)", False),
                ("r1_@", "(r0_@ * r0_@)", False),
                ("v0_@", f"tl.load(v0_ptr + rk@, mask=rk@ < {k}, other=0.0).to(tl.float32)[None, :]", False),
                ("r2_@", f"(r0_@ * s2[:, None]).to({t}).to(tl.float32)", True),
                ("r3_@", f"(v0_@ * r2_@).to({t}).to(tl.float32)", True),
            ),
            reduced="r1_@",
            stat_ops=(
                ("s_mean", f"(s_sum / {k})"),
                ("s1", f"(s_mean + {EPS!r})"),
                ("s2", "(1.0 / tl.sqrt(s1))"),
            ),
            out="r3_@",
            sum_out=("h", "r0_@", dtype),
            factored=("(v0_@ * r0_@)", "s2"),  # r3 = v0 * (r0 * s2) = (v0 * r0) * s2
        )
        kernel = Step(
            kind=StepKind.KERNEL, target="norm", args=(Buf("x"), Buf("y"), Buf("v")), kwargs={},
            outputs=("a", "h"), grid=("s0",),
        )  # fmt: skip
        site = replace(site, prologue=Prologue("x", "y", None, None, EPS, "h", kernel, "a", norm=rms))
    configs = tuple(c for c in codegen_configs() if c.name == name)
    out = []
    for cfg, kernels, extra, _ in render_candidates(site, buffers, known, {"s0": (1, BLOCK_M)}, configs):
        if norm != cfg.name.endswith("_rms"):
            continue
        for r in kernels:
            fn = load_function(kernel_id(r.source, r.signature, r.config), r.name, r.source, pdl)
            out.append((fn, r, cfg, extra))
    return tuple(out)


def rendered_launches(kernels, bufs: dict, sizes: dict, pdl: bool) -> list:
    """One launch each of ``kernels`` ((jit function, Rendered) pairs, as the codegen renders
    them for a bundle): their buffer arguments from ``bufs``, their size arguments and grid at
    ``sizes``; ``pdl``: launched under programmatic dependent launch."""
    from aot.schema import Buf, Sym
    from aot.symexpr import evaluate

    run = []
    for fn, r in kernels:
        assert all(isinstance(a, (Buf, Sym)) for a in r.args)
        args = [bufs[a.name] if isinstance(a, Buf) else evaluate(a.text, sizes) for a in r.args]
        grid = tuple(evaluate(g, sizes) for g in r.grid)
        kw = {"num_warps": r.num_warps, "num_stages": r.num_stages}
        if pdl:
            kw["launch_pdl"] = True
        run.append(lambda fn=fn, grid=grid, args=args, kw=kw: fn[grid](*args, **kw))
    return run


def codegen_forms(n: int, k: int, dtype: str, norm: bool = False) -> list[dict]:
    """The codegen's forms at (N, K); ``norm``: also, per config with a row-norm variant, its
    ``_rms`` form (``norm: "fused"``) and the plain form after an RMSNorm kernel (``"kernel"``)."""
    forms = []
    for c in codegen_configs():
        kernels = rendered(n, k, dtype, c.name)
        if not kernels:
            continue
        cfg = kernels[0][2]
        form = {
            "rendered": cfg.name, "config": c.name, "bn": cfg.block_n, "bk": cfg.block_k, "warps": cfg.num_warps,
            "stages": cfg.num_stages, "split": cfg.split_k, "mode": "pass" if cfg.split_k > 1 else "store",
        }  # fmt: skip
        forms.append(form)
        if norm and c.row_norm and rendered(n, k, dtype, c.name, True):
            forms.append({**form, "rendered": cfg.name + "_rms", "norm": "fused"})
            forms.append({**form, "rendered": "norm kernel + " + cfg.name, "norm": "kernel"})
    return forms


@triton.jit(do_not_specialize=["K"])
def _rms_of_sum(x_ptr, y_ptr, v_ptr, h_ptr, a_ptr, K, EPS: tl.constexpr, B: tl.constexpr):
    """One row: h = x + y; A = v * (h * rsqrt(mean(h^2) + EPS)), rounded as Llama's RMSNorm
    rounds (the program's norm kernel before a GEMM, standing alone)."""
    row = tl.program_id(0)
    rk = tl.arange(0, B)
    mask = rk < K
    x = tl.load(x_ptr + row * K + rk, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * K + rk, mask=mask, other=0.0).to(tl.float32)
    h = (x + y).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * K + rk, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / K + EPS)
    a = (hf * rstd).to(a_ptr.dtype.element_ty).to(tl.float32)
    v = tl.load(v_ptr + rk, mask=mask, other=0.0).to(tl.float32)
    tl.store(a_ptr + row * K + rk, (v * a).to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "N"])
def _few(a_ptr, w_ptr, o_ptr, M, N, K, KS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         MODE: tl.constexpr):  # fmt: skip
    """O[:M, n-tile] (+)= A[:M, k-slice] @ W[n-tile, k-slice]^T; grid (N tiles, K slices).
    MODE 0: O in A's dtype; 1: fp32 atomics into O; 2: the slice's fp32 partial to O[slice]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_n = rn < N
    k0 = pid_k * KS
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, KS, BK):
        rk = k0 + kk + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=mask_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    mask = mask_m[:, None] & mask_n[None, :]
    at = rm[:, None] * N + rn[None, :]
    if MODE == 0:
        tl.store(o_ptr + at, acc.to(o_ptr.dtype.element_ty), mask=mask)
    elif MODE == 1:
        tl.atomic_add(o_ptr + at, acc, mask=mask, sem="relaxed")
    else:
        tl.store(o_ptr + pid_k * M * N + at, acc, mask=mask)


@triton.jit(do_not_specialize=["MN"])
def _sum_slices(ws_ptr, o_ptr, MN, SPLIT: tl.constexpr, B: tl.constexpr, GDC: tl.constexpr = False):
    """O = the sum of the SPLIT fp32 partials ws[s], in O's dtype (GDC: after the wait for the
    kernel before, under dependent launch)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0) * B + tl.arange(0, B)
    mask = i < MN
    acc = tl.zeros((B,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * MN + i, mask=mask, other=0.0)
    tl.store(o_ptr + i, acc.to(o_ptr.dtype.element_ty), mask=mask)


def configs(quick: bool):
    """(BN, BK, warps, stages) whose pipelined tiles fit sm_90's shared memory."""
    grid = (
        ((16, 32, 64), (128, 256, 512), (4,), (3, 4))
        if quick
        else ((16, 32, 64), (128, 256, 512), (2, 4, 8), (2, 3, 4, 5))
    )
    for bn, bk, warps, stages in itertools.product(*grid):
        if stages * (BLOCK_M * bk + bk * bn) * 2 <= SHARED:
            yield bn, bk, warps, stages


def forms(k: int, quick: bool):
    """Every form that runs at ``k``: a config and a split (K cut in whole BK steps)."""
    for bn, bk, warps, stages in configs(quick):
        for split, mode in ((1, "store"), (2, "atomic"), (2, "pass"), (4, "atomic"), (4, "pass")):
            if k % (split * bk):
                continue
            form = {"bn": bn, "bk": bk, "warps": warps, "stages": stages, "split": split, "mode": mode}
            name = CODEGEN.get((bn, bk, warps, stages, "store" if split == 1 else mode))
            if name:
                form["codegen"] = name
            yield form


def key(form: dict) -> tuple:
    return (
        form.get("rendered"),
        form["bn"],
        form["bk"],
        form["warps"],
        form["stages"],
        form["split"],
        form["mode"],
    )


class Shape:
    """One (N, K) at M rows: W's copies, A, the outputs and workspaces each form writes."""

    def __init__(self, n: int, k: int, dtype, l2: int):
        self.n, self.k, self.dtype = n, k, dtype
        self.ws = copies_of(n, k, dtype, l2)
        self.a_full = torch.randn(max(ROWS), k, device="cuda", dtype=dtype)
        self.bytes = n * k * dtype.itemsize
        self.scratch = {}

    def at(self, m: int) -> None:
        self.m = m
        self.a = self.a_full[:m].contiguous()
        self.ref = self.a.float() @ self.ws[0].float().t()
        self.outs = [torch.empty(m, self.n, device="cuda", dtype=self.dtype) for _ in self.ws]
        self.out32 = [torch.zeros(m, self.n, device="cuda", dtype=torch.float32) for _ in self.ws]
        self.part = [torch.empty(4, m, self.n, device="cuda", dtype=torch.float32) for _ in self.ws]
        # the row norm's inputs (x + y, weight v), its sum and its output (A of "norm kernel +")
        g = torch.Generator(device="cuda").manual_seed(m)
        self.x = torch.randn(m, self.k, device="cuda", dtype=self.dtype, generator=g)
        self.y = torch.randn(m, self.k, device="cuda", dtype=self.dtype, generator=g)
        self.v = (1.0 + 0.1 * torch.randn(self.k, device="cuda", generator=g)).to(self.dtype)
        self.h = torch.empty_like(self.x)
        self.a_norm = torch.empty_like(self.x)
        hf = (self.x + self.y).float()
        a = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(self.dtype)
        self.ref_norm = (self.v * a).float() @ self.ws[0].float().t()

    def launches(self, form: dict, i: int) -> list:
        """The launches one GEMM takes with ``form`` on copy ``i`` of W."""
        if "rendered" in form:
            return self._rendered_launches(form, i)
        n, k, m, split, mode = self.n, self.k, self.m, form["split"], form["mode"]
        kw = {"num_warps": form["warps"], "num_stages": form["stages"]}
        grid = (triton.cdiv(n, form["bn"]), split)
        code = MODES.index(mode)
        w, a = self.ws[i], self.a
        out = {"store": self.outs, "atomic": self.out32, "pass": self.part}[mode][i]
        run = [
            lambda: _few[grid](a, w, out, m, n, k, k // split, BLOCK_M, form["bn"], form["bk"], code, **kw)
        ]
        if mode == "atomic":
            run.insert(0, out.zero_)
        elif mode == "pass":
            dst, mn = self.outs[i], m * n
            run.append(lambda: _sum_slices[(triton.cdiv(mn, 1024),)](out, dst, mn, split, 1024, num_warps=4))
        return run

    def _rendered_launches(self, form: dict, i: int) -> list:
        from aot.symexpr import evaluate

        sizes = {"s0": self.m}
        norm = form.get("norm")
        pdl = bool(form.get("pdl"))
        kernels = rendered(self.n, self.k, DTYPE_NAMES[self.dtype], form["config"], norm == "fused", pdl)
        bufs = {"a": self.a, "w": self.ws[i], "o": self.outs[i]}
        if norm:
            bufs.update(x=self.x, y=self.y, v=self.v, h=self.h)
        run = []
        if norm == "kernel":
            bufs["a"] = self.a_norm
            m, k, x, y, v, h, a = self.m, self.k, self.x, self.y, self.v, self.h, self.a_norm
            block = triton.next_power_of_2(k)
            run.append(lambda: _rms_of_sum[(m,)](x, y, v, h, a, k, EPS, block, num_warps=8))
        for name, spec in kernels[0][3].items():  # the split-K workspace: one per copy of W
            shape = [evaluate(d, sizes) for d in spec.shape]
            bufs[name] = self.scratch.setdefault((name, i, self.m), torch.empty(shape, device="cuda"))
        return run + rendered_launches([(fn, r) for fn, r, _, _ in kernels], bufs, sizes, pdl)

    def result(self, form: dict) -> torch.Tensor:
        if form["mode"] == "atomic":
            return self.out32[0]
        return self.outs[0]

    def cublas_us(self) -> float:
        runs = [lambda w=w, o=o: torch.mm(self.a, w.t(), out=o) for w, o in zip(self.ws, self.outs)]
        return graph_us(runs, len(self.ws))

    def time(self, form: dict) -> dict:
        try:
            self.h.fill_(float("nan"))
            for r in self.launches(form, 0):
                r()
            torch.cuda.synchronize()
            got = self.result(form).float()
            ref = self.ref_norm if form.get("norm") else self.ref
            if not torch.allclose(got, ref, atol=3e-2, rtol=3e-2):
                return {**form, "error": f"wrong result (max diff {(got - ref).abs().max().item():.3g})"}
            if form.get("norm") and not torch.equal(self.h, (self.x + self.y)):
                return {**form, "error": "wrong sum x + y"}
            us = graph_us([r for i in range(len(self.ws)) for r in self.launches(form, i)], len(self.ws))
        except Exception as e:  # a form that does not compile or launch here
            return {**form, "error": f"{type(e).__name__}: {str(e)[:120]}"}
        return {**form, "us": round(us, 2), "tb_s": round(self.bytes / us / 1e6, 3)}


def compile_ahead(shape: Shape, todo: list[dict]) -> None:
    """Compile every form first, in threads (ptxas runs in processes of its own)."""

    def one(form):
        try:
            for r in shape.launches(form, 0):
                r()
        except Exception:
            pass  # the timing loop reports it

    seen, first = set(), []
    for f in todo:  # one form per kernel: the split factor is an argument, not a constant
        kk = f.get("rendered") or (f["bn"], f["bk"], f["warps"], f["stages"], f["mode"])
        if kk not in seen:
            seen.add(kk)
            first.append(f)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, first))
    torch.cuda.synchronize()


def sweep_shape(site: str, n: int, k: int, dtype, l2: int, args, norm: bool = False) -> dict:
    """``norm``: an RMSNorm feeds the site; its few-row forms are also timed with the norm (their
    ``_rms`` form, and the plain form after a norm kernel), apart from the GEMMs' ranking."""
    shape = Shape(n, k, dtype, l2)
    row = {"site": site, "n": n, "k": k, "bytes": shape.bytes, "rows": {}}
    # the codegen's own forms, as rendered for a bundle, are timed at every row count
    codegen = codegen_forms(n, k, DTYPE_NAMES[dtype], norm)
    todo = [*forms(k, args.quick), *codegen]
    shape.at(args.full_m)
    compile_ahead(shape, todo)
    full = [shape.time(f) for f in todo]
    timed = sorted((f for f in full if "us" in f and "rendered" not in f), key=lambda f: f["us"])
    leaders = timed[: args.top]
    for m in args.rows:
        shape.at(m)
        results = full if m == args.full_m else [shape.time(f) for f in leaders + codegen]
        ok = sorted((f for f in results if "us" in f and "norm" not in f), key=lambda f: f["us"])
        normed = {f["rendered"]: f["us"] for f in results if "us" in f and "norm" in f}
        cublas = shape.cublas_us()
        entry = {
            "cublas_us": round(cublas, 2),
            "cublas_tb_s": round(shape.bytes / cublas / 1e6, 3),
            "best": ok[:5],
            "unsplit": next((f for f in ok if f["split"] == 1), None),
            "codegen": {f["codegen"]: f["us"] for f in ok if "codegen" in f},
            "rendered": {f["rendered"]: f["us"] for f in ok if "rendered" in f},
            "with_norm": normed,
            "errors": sum("error" in f for f in results),
        }
        if m == args.full_m:
            entry["forms"] = results
        row["rows"][str(m)] = entry
        b = ok[0] if ok else None
        print(
            f"{site:8s} N={n:6d} K={k:5d} M={m:2d}  cuBLAS {cublas:7.2f} µs ({entry['cublas_tb_s']:.2f} TB/s)"
            f"  best {b['us'] if b else '-':>7} µs ({b['tb_s'] if b else '-'} TB/s) {_label(b)}"
            f"  {cublas / b['us'] if b else 0:.2f}x",
            flush=True,
        )
        if normed:
            print(
                f"{'':8s} with the RMSNorm: " + ", ".join(f"{k} {v:.2f} µs" for k, v in normed.items()),
                flush=True,
            )
    del shape
    torch.cuda.empty_cache()
    return row


def _label(form: dict | None) -> str:
    if not form:
        return ""
    if "rendered" in form:
        return f"codegen {form['rendered']}"
    s = f"bn{form['bn']} bk{form['bk']} w{form['warps']} s{form['stages']} split{form['split']}"
    if form["split"] > 1:
        s += f"/{form['mode']}"
    return s + (f" [{form['codegen']}]" if "codegen" in form else "")


def _step_gemms(model: str, m: int, dtype):
    """(site, N, K, A, W) of each GEMM of one decode step of ``model`` at ``m`` rows, in order:
    A shared by the GEMMs of one K, each W its own (cold, as a step streams it)."""
    spec = MODELS[model]
    a_by_k = {}
    for site, n, k in [*spec["sites"]] * spec["layers"] + [spec["head"]]:
        a = a_by_k.setdefault(k, torch.randn(m, k, device="cuda", dtype=dtype))
        yield site, n, k, a, torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5


def _graph_us(runs: list, keep: list) -> float:
    """µs of ``runs`` in one graph; then ``keep``'s memory (the operands) handed back."""
    us = graph_us(runs, 1)
    keep.clear()
    torch.cuda.empty_cache()
    return us


def chain(model: str, m: int, pick, dtype) -> float:
    """µs of one decode step's GEMMs at ``m`` rows in one graph; ``pick(site)``: a form, or None
    for cuBLAS (also where a codegen form makes no kernel at that site's shape)."""
    runs, keep = [], []
    for site, n, k, a, w in _step_gemms(model, m, dtype):
        form = pick(site)
        if form is not None and "rendered" in form and not rendered(n, k, DTYPE_NAMES[dtype], form["config"]):
            form = None
        if form is None:
            o = torch.empty(m, n, device="cuda", dtype=dtype)
            runs.append(lambda a=a, w=w, o=o: torch.mm(a, w.t(), out=o))
            keep += [w, o]
            continue
        one = _Lone(n, k, m, a, w, dtype)
        runs += one.launches(form)
        keep.append(one)
    return _graph_us(runs, keep)


class _Lone(Shape):
    """One layer's GEMM in the chain: its own W, no copies."""

    def __init__(self, n, k, m, a, w, dtype, norm: bool = False):
        self.n, self.k, self.m, self.dtype, self.a, self.ws = n, k, m, dtype, a, [w]
        self.outs = [torch.empty(m, n, device="cuda", dtype=dtype)]
        self.out32 = [torch.zeros(m, n, device="cuda", dtype=torch.float32)]
        self.part = [torch.empty(4, m, n, device="cuda", dtype=torch.float32)]
        self.scratch = {}
        if norm:  # the row norm's inputs (x + y, weight v), its sum h, its output (the plain form's A)
            self.x, self.y = (
                torch.randn(m, k, device="cuda", dtype=dtype),
                torch.randn(m, k, device="cuda", dtype=dtype),
            )
            self.v = torch.ones(k, device="cuda", dtype=dtype)
            self.h, self.a_norm = torch.empty_like(self.x), torch.empty_like(self.x)

    def launches(self, form, i=0):
        return super().launches(form, i)


# The built-in table's few-row entries a chain compares (``AOTPACK_FEW_ROWS``: the form, the one at
# K >= LONG_K, the one at N >= WIDE_N): the forms of the 2026-11-29 decode, and the same tiles
# with W's first K steps loaded before the wait and the one-pass ``_rms`` forms.
TABLES = {
    "few": ("few_16x32x256", "few_splitk_16x64x128", "few_16x64x128"),
    "fewe": ("fewe_16x32x256", "fewe_splitk_16x64x128", "fewe_16x64x128"),
    "fewp+fewe": ("fewp_16x32x256", "fewe_splitk_16x64x128", "fewe_16x64x128"),
    # W's rows on the product's wide side (``fews_``, bench/swap_rows.py)
    "fews": ("fews_16x64x64", "fews_splitk_16x64x128", "fews_16x64x128"),
    "fewe+fews": ("fewe_16x32x256", "fews_splitk_16x64x128", "fews_16x64x128"),
    "fews split": ("fews_splitk_16x64x64", "fews_splitk_16x64x128", "fews_16x64x128"),
}


def table_chain(model: str, m: int, forms: tuple | None, dtype, pdl: bool) -> float:
    """µs of one decode step's GEMMs at ``m`` rows in one graph as a bundle with the few-row entry
    ``forms`` runs them (None: cuBLAS): at a Llama's q/k/v and gate/up the RMSNorm of the residual
    sum with them, as the ``_rms`` form (or, for cuBLAS or a form without one, the norm kernel
    before). ``pdl``: the forms' kernels launched under programmatic dependent launch, waiting
    for the kernel before as the bundle's sm_90 cubins do (cuBLAS and the norm kernel never)."""
    from aot.codegen.gemm_defaults import LONG_K, WIDE_N

    runs, keep = [], []
    for site, n, k, a, w in _step_gemms(model, m, dtype):
        norm = model.startswith("llama") and site in NORM_SITES
        one = _Lone(n, k, m, a, w, dtype, norm)
        keep.append(one)
        name = None
        if forms is not None:
            name = forms[1] if k >= LONG_K else forms[2] if n >= WIDE_N else forms[0]
            if not rendered(n, k, DTYPE_NAMES[dtype], name):
                name = None
        fused = norm and name is not None and bool(rendered(n, k, DTYPE_NAMES[dtype], name, True))
        if norm and not fused:  # the norm kernel before, into the GEMM's A
            one.a = one.a_norm
            block = triton.next_power_of_2(k)
            runs.append(
                lambda o=one, k=k, block=block: _rms_of_sum[(m,)](
                    o.x, o.y, o.v, o.h, o.a_norm, k, EPS, block, num_warps=8
                )
            )
        if name is None:
            runs.append(lambda o=one: torch.mm(o.a, o.ws[0].t(), out=o.outs[0]))
            continue
        form = {"config": name, "rendered": name, "pdl": pdl, **({"norm": "fused"} if fused else {})}
        runs += one.launches(form)
    return _graph_us(runs, keep)


def chains(model: str, rows: dict[tuple[int, int], dict], args, dtype) -> list[dict]:
    spec = MODELS[model]
    sites = {s: (n, k) for s, n, k in [*spec["sites"], spec["head"]]}
    out = []
    for m in args.chain_rows:
        best = {
            s: rows[nk]["rows"][str(m)]["best"][0]
            for s, nk in sites.items()
            if rows[nk]["rows"][str(m)]["best"]
        }
        entry = {"model": model, "m": m, "cublas_us": round(chain(model, m, lambda s: None, dtype), 1)}
        entry["best_us"] = round(chain(model, m, best.get, dtype), 1)
        entry["best_forms"] = {s: _label(f) for s, f in best.items()}
        # one form for every site: each shape's leader that runs at every site's K, chained alone
        uniform = {
            key(f): f
            for f in best.values()
            if "rendered" in f or all(k % (f["split"] * f["bk"]) == 0 for _, k in sites.values())
        }
        entry["uniform_us"] = {
            _label(f): round(chain(model, m, lambda s, f=f: f, dtype), 1) for f in uniform.values()
        }
        # as a bundle runs them: the norms included, cuBLAS against the table's entries, old and new
        entry["table_us"] = table_us(model, m, dtype)
        out.append(entry)
        print(
            f"{model} chain M={m}: {json.dumps({k: v for k, v in entry.items() if k != 'best_forms'})}",
            flush=True,
        )
    return out


def table_us(model: str, m: int, dtype) -> dict:
    """µs of ``table_chain`` at ``m`` rows on cuBLAS and on each TABLES entry, plainly and under
    dependent launch (``<entry> pdl``); an entry that does not compile or launch: its error."""
    out = {"cublas": round(table_chain(model, m, None, dtype, False), 1)}
    for label, forms in TABLES.items():
        for pdl in (False, True):
            try:
                us = round(table_chain(model, m, forms, dtype, pdl), 1)
            except Exception as e:  # a form that does not compile or launch here
                us = f"{type(e).__name__}: {str(e)[:120]}"
            out[label + (" pdl" if pdl else "")] = us
    return out


def tables(models: list[str], args, dtype) -> list[dict]:
    """``table_us`` alone: each model's decode GEMMs (the norms with them) at each of
    ``--chain-rows``."""
    out = []
    for model in models:
        for m in args.chain_rows:
            entry = {"model": model, "m": m, "table_us": table_us(model, m, dtype)}
            print(f"{model} table M={m}: {json.dumps(entry['table_us'])}", flush=True)
            out.append(entry)
    return out


def check(quick: bool) -> int:
    """Compile every form's kernels for sm_90 (no GPU needed): Triton through ptxas to a cubin; the
    grid's, the norm kernel, and the codegen's rendered forms at Llama-3.2-1B's shapes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 64)
    sig = {
        "a_ptr": "*bf16",
        "w_ptr": "*bf16",
        "o_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "KS": "i32",
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    attrs.update({(5,): [["tt.divisibility", 16]], (6,): [["tt.divisibility", 16]]})
    seen, failed, done = set(), [], 0
    for bn, bk, warps, stages in configs(quick):
        for mode in MODES:
            if (bn, bk, warps, stages, mode) in seen:
                continue
            seen.add((bn, bk, warps, stages, mode))
            s = dict(sig, o_ptr="*bf16" if mode == "store" else "*fp32")
            s.update(BM="constexpr", BN="constexpr", BK="constexpr", MODE="constexpr")
            consts = {(7,): BLOCK_M, (8,): bn, (9,): bk, (10,): MODES.index(mode)}
            try:
                c = triton.compile(
                    ASTSource(_few, signature=s, constexprs=consts, attrs=attrs),
                    target=target,
                    options={"num_warps": warps, "num_stages": stages},
                )
                assert c.asm["cubin"]
                done += 1
            except Exception as e:
                failed.append(f"bn{bn} bk{bk} w{warps} s{stages} {mode}: {type(e).__name__}: {str(e)[:200]}")
    for split in (2, 4):
        s = {"ws_ptr": "*fp32", "o_ptr": "*bf16", "MN": "i32", "SPLIT": "constexpr", "B": "constexpr"}
        s["GDC"] = "constexpr"
        triton.compile(
            ASTSource(_sum_slices, signature=s, constexprs={(3,): split, (4,): 1024, (5,): False}),
            target=target,
        )
        done += 1
    s = {"x_ptr": "*bf16", "y_ptr": "*bf16", "v_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16", "K": "i32"}
    s.update(EPS="constexpr", B="constexpr")
    for k in sorted({k for spec in MODELS.values() for _, _, k in [*spec["sites"], spec["head"]]}):
        consts = {(6,): EPS, (7,): triton.next_power_of_2(k)}
        triton.compile(
            ASTSource(_rms_of_sum, signature=s, constexprs=consts), target=target, options={"num_warps": 8}
        )
        done += 1
    # the codegen's forms as rendered at Llama-3.2-1B's shapes (and their _rms forms where a norm
    # feeds), the table's few-row forms also with GDC on (the wait under dependent launch)
    done += check_codegen(target, failed)
    print(f"fewrow_sweep --check: {done} kernels compiled for sm_90, {len(failed)} failed")
    for f in failed:
        print("  " + f)
    return 1 if failed else 0


def check_codegen(target, failed: list[str], only: str = "") -> int:
    """Compile the codegen's rendered forms at Llama-3.2-1B's shapes for ``target`` (those whose
    config name starts with ``only``); a failure is appended to ``failed``. The number compiled."""
    from triton.compiler import ASTSource

    from aot.codegen import gemm_forms

    few = {c.name for c in getattr(gemm_forms, "FEW_ROW_CONFIGS", ())}
    spec = MODELS["llama-3.2-1b"]
    done = 0
    for site, n, k in [*spec["sites"], spec["head"]]:
        for form in codegen_forms(n, k, "bfloat16", site in NORM_SITES):
            if form.get("norm") == "kernel" or not form["config"].startswith(only):
                continue
            for pdl in (False, True) if form["config"] in few else (False,):
                for fn, r, _, _ in rendered(
                    n, k, "bfloat16", form["config"], form.get("norm") == "fused", pdl
                ):
                    ptrs = {
                        (i,): [["tt.divisibility", 16]]
                        for i, t in enumerate(r.signature.values())
                        if t[0] == "*"
                    }
                    try:
                        c = triton.compile(
                            ASTSource(fn, signature=dict(r.signature), attrs=ptrs),
                            target=target,
                            options={"num_warps": r.num_warps, "num_stages": r.num_stages},
                        )
                        done += 1
                        if c.metadata.shared > SHARED:
                            failed.append(f"{site} {r.name}: {c.metadata.shared} bytes of shared memory")
                    except Exception as e:
                        failed.append(f"{site} {r.name} (GDC {pdl}): {type(e).__name__}: {str(e)[:200]}")
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=sorted(MODELS), help="models (default: all)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts M (at most 16)")
    p.add_argument("--full-m", type=int, default=8, help="the row count every form is timed at")
    p.add_argument("--top", type=int, default=12, help="forms timed again at the other row counts")
    p.add_argument(
        "--quick", action="store_true", help="4 warps, 3-4 stages only; llama-3.2-1b unless --model"
    )
    p.add_argument("--chain", action="store_true", help="also time each model's decode GEMMs in one graph")
    p.add_argument("--chain-rows", type=int, nargs="+", default=[2, 8, 16], help="row counts of --chain")
    p.add_argument("--check", action="store_true", help="compile every form for sm_90 and exit (no GPU)")
    p.add_argument(
        "--table-only",
        action="store_true",
        help="only the decode step's GEMMs as a bundle runs them (cuBLAS, the TABLES entries) at --chain-rows",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.check:
        return check(args.quick)
    if any(not 1 <= m <= BLOCK_M for m in args.rows) or args.full_m not in args.rows:
        p.error(f"--rows must lie in 1..{BLOCK_M} and include --full-m ({args.full_m})")
    if not set(args.chain_rows) <= set(args.rows):
        p.error("--chain-rows must be among --rows")
    if not torch.cuda.is_available():
        print("fewrow_sweep: needs a CUDA GPU (--check compiles without one)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 << 20)
    models = args.model or (["llama-3.2-1b"] if args.quick else sorted(MODELS))
    result = {
        "device": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "quick": args.quick,
        "block_m": BLOCK_M,
        "full_m": args.full_m,
        "shapes": [],
        "chains": [],
    }
    done: dict[tuple[int, int], dict] = {}
    if args.table_only:
        result["tables"] = tables(models, args, dtype)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    for model in models:
        spec = MODELS[model]
        for site, n, k in [*spec["sites"], spec["head"]]:
            if (n, k) not in done:
                norm = model.startswith("llama") and site in NORM_SITES
                row = sweep_shape(site, n, k, dtype, l2, args, norm)
                row["model"] = model
                done[(n, k)] = row
                result["shapes"].append(row)
        if args.chain:
            result["chains"] += chains(model, done, args, dtype)
        if args.json:  # as it goes: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
