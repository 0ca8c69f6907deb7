"""Sweep Triton GEMM tile shapes against cuBLAS at one row count, on the GPU, with cold weights.

Used to decide which candidate forms ``codegen/gemm.py`` compiles for a row count (the bundles'
candidates must be written before any GPU is at hand). Every form is timed the way a bundle runs
it: back to back inside one CUDA graph, each launch reading a different copy of the weight so
that W comes from HBM, not L2 (a forward reads ~250 MB of weights, several times L2). A is the
same every launch (a bundle's A was just written by the kernel before).

Forms: a plain tile loop (``split`` 1), and split-K in one launch: every slice writes its fp32
partial, counts itself in on a per-tile counter, and the slice that arrives last sums the
partials and runs the epilogue (then zeroes the counter for the next launch). For the sites a
LayerNorm feeds, the best forms are timed again with the LayerNorm folded in: the rows' sums and
sums of squares gathered in the K loop (``STATS=1``) or in a pass of their own before it
(``STATS=2``), the epilogue turning the raw product into the normalized one with W's column sums.

``--chain``: a forward's GEMMs (12 layers of gpt's four, each layer its own weights) in one graph,
cuBLAS against the Triton forms launched plainly, with programmatic dependent launch (each kernel
waits inside for the one before), and with that plus an L2 prefetch of W before the wait.

    python3 bench/gemm_sweep.py --rows 128 --json out/sweep.json
    python3 bench/gemm_sweep.py --rows 128 --chain --json out/chain.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import sys

import torch
import triton
import triton.language as tl

from aot.verify.tune import graph_us


@triton.jit
def _gemm(
    a_ptr, w_ptr, b_ptr, c_ptr, o_ptr, ws_ptr, st_ptr, cnt_ptr, M,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLIT: tl.constexpr, STATS: tl.constexpr, GELU: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    KS: tl.constexpr = K // SPLIT
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    s1 = tl.zeros((BM,), dtype=tl.float32)
    s2 = tl.zeros((BM,), dtype=tl.float32)
    if PREFETCH:  # (lines per row, a power of two) W does not depend on the kernel before: bring this program's slice into L2 first
        # one address per 128-byte line of a row (a power of two of them: the last line repeats)
        lines = tl.minimum(tl.arange(0, PREFETCH) * 64, KS - 64)
        tl.inline_asm_elementwise(
            "mov.u32 $0, 0; prefetch.global.L2 [$1];",
            "=r,l",
            [w_ptr + rn[:, None] * K + pid_k * KS + lines[None, :]],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if STATS == 2:  # the rows' statistics in a pass of their own, before the product
        for c0 in tl.static_range(0, K, 256):
            rc = c0 + tl.arange(0, 256)
            af = tl.load(a_ptr + rm[:, None] * K + rc[None, :], mask=mask_m[:, None], other=0.0).to(
                tl.float32
            )
            s1 += tl.sum(af, axis=1)
            s2 += tl.sum(af * af, axis=1)
    for k0 in range(0, KS, BK):
        rk = pid_k * KS + k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + rk[:, None])
        acc = tl.dot(a, w, acc)
        if STATS == 1:
            af = a.to(tl.float32)
            s1 += tl.sum(af, axis=1)
            s2 += tl.sum(af * af, axis=1)
    rows = tl.num_programs(0) * BM
    if SPLIT > 1:
        tile = pid_m * tl.num_programs(1) + pid_n
        tl.store(ws_ptr + pid_k * rows * N + rm[:, None] * N + rn[None, :], acc)
        if STATS == 1:
            slot = (pid_k * tl.num_programs(1) + pid_n) * rows + rm  # this tile's own slice
            tl.store(st_ptr + slot * 2, s1)
            tl.store(st_ptr + slot * 2 + 1, s2)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if STATS == 1:
                s1 = tl.zeros((BM,), dtype=tl.float32)
                s2 = tl.zeros((BM,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(ws_ptr + s * rows * N + rm[:, None] * N + rn[None, :], cache_modifier=".cg")
                if STATS == 1:
                    slot = (s * tl.num_programs(1) + pid_n) * rows + rm
                    s1 += tl.load(st_ptr + slot * 2, cache_modifier=".cg")
                    s2 += tl.load(st_ptr + slot * 2 + 1, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            _epilogue(acc, s1, s2, rm, rn, mask_m, b_ptr, c_ptr, o_ptr, N, K, STATS, GELU)
    else:
        _epilogue(acc, s1, s2, rm, rn, mask_m, b_ptr, c_ptr, o_ptr, N, K, STATS, GELU)


@triton.jit
def _epilogue(
    acc, s1, s2, rm, rn, mask_m, b_ptr, c_ptr, o_ptr,
    N: tl.constexpr, K: tl.constexpr, STATS: tl.constexpr, GELU: tl.constexpr,
):  # fmt: skip
    if STATS:
        mean = s1 / K
        rstd = tl.rsqrt(s2 / K - mean * mean + 1e-5)
        csum = tl.load(c_ptr + rn)
        acc = rstd[:, None] * (acc - mean[:, None] * csum[None, :])
    acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    if GELU:
        t = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)))
    tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16), mask=mask_m[:, None])


SHAPES = {  # gpt (d 768) sites: N, K, GELU, LayerNorm before
    "qkv": (2304, 768, False, True),
    "attn_out": (768, 768, False, False),
    "fc": (3072, 768, True, True),
    "mlp_out": (768, 3072, False, False),
}


def forms(m: int, n: int, k: int):
    for bm, bn, bk, split, warps in itertools.product(
        (16, 32, 64, 128), (32, 64, 128), (64, 128, 256), (1, 2, 3, 4, 6, 8), (4, 8)
    ):
        if bm > max(16, triton.next_power_of_2(m)) or k % (bk * split) or k // split < 2 * bk:
            continue
        blocks = math.ceil(m / bm) * math.ceil(n / bn) * split
        if not 48 <= blocks <= 640 or (warps == 8 and bm * bn < 64 * 128):
            continue
        if bm * bk * 2 + bk * bn * 2 > 48 << 10:  # one stage's tiles
            continue
        if bk == 256 and (split > 1 or bm > 32):
            continue
        stages = 3 if bk == 256 else 4
        yield dict(BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)


def graph_time(fn, copies: int, replays: int = 20) -> float:
    """µs per launch: ``copies`` launches in one CUDA graph, each on its own weight copy (``fn(i)``
    for copy ``i``), timed as ``aotpack tune`` times a form (``aot.verify.tune.graph_us``)."""
    index = itertools.cycle(range(copies))  # the capture's ``copies`` calls take each copy once
    return graph_us(lambda: fn(next(index)), "cuda", copies, replays)


def sweep(name: str, m: int, n: int, k: int, gelu: bool, top: int, stats_pass: bool) -> dict:
    torch.manual_seed(0)
    dev = "cuda"
    copies = max(8, math.ceil((256 << 20) / (n * k * 2)))
    ws_ = [torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for _ in range(copies)]
    a = torch.randn(m, k, device=dev, dtype=torch.float16)
    bias = torch.randn(n, device=dev, dtype=torch.float16) * 0.1
    csums = [w.float().sum(1) for w in ws_]
    out = torch.empty(m, n, device=dev, dtype=torch.float16)
    act = "tanh" if gelu else "none"

    def lib(i):
        y = torch.nn.functional.linear(a, ws_[i], bias)
        return torch.nn.functional.gelu(y, approximate="tanh") if gelu else y

    def lib_fused(i):  # cuBLASLt's GELU epilogue, as addmm with an activation runs
        return torch._addmm_activation(bias, a, ws_[i].t(), use_gelu=True) if gelu else lib(i)

    rows = {"library": graph_time(lib, copies), "library_fused": graph_time(lib_fused, copies)}
    ref = lib(0).float()
    ref_ln = torch.nn.functional.linear(
        torch.nn.functional.layer_norm(a.float(), (k,)), ws_[0].float(), bias.float()
    )
    if gelu:
        ref_ln = torch.nn.functional.gelu(ref_ln, approximate="tanh")

    def launch_args(f):
        bm, bn, split = f["BM"], f["BN"], f["SPLIT"]
        mt = math.ceil(m / bm)
        grid = (mt, math.ceil(n / bn), split)
        ws = torch.empty(split * mt * bm * n if split > 1 else 1, device=dev, dtype=torch.float32)
        st = torch.empty(split * grid[1] * mt * bm * 2 if split > 1 else 1, device=dev, dtype=torch.float32)
        cnt = torch.zeros(grid[0] * grid[1], device=dev, dtype=torch.int32)
        return grid, ws, st, cnt

    def time_form(f, stats):
        grid, ws, st, cnt = launch_args(f)

        def run(i):
            _gemm[grid](a, ws_[i], bias, csums[i], out, ws, st, cnt, m, N=n, K=k, STATS=stats, GELU=gelu, **f)

        try:
            run(0)
            torch.cuda.synchronize()
            err = (out.float() - (ref_ln if stats else ref)).abs().max().item()
            t = graph_time(run, copies)
        except Exception as e:  # a form that does not compile or launch here
            print(f"  {name} {f} stats={stats}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
            return None
        return dict(form=f, stats=stats, us=t, err=err)

    def compile_ahead(todo):  # ptxas runs in subprocesses: compile in parallel before timing
        def one(item):
            f, stats = item
            grid, ws, st, cnt = launch_args(f)
            try:
                _gemm.warmup(
                    a,
                    ws_[0],
                    bias,
                    csums[0],
                    out,
                    ws,
                    st,
                    cnt,
                    m,
                    N=n,
                    K=k,
                    STATS=stats,
                    GELU=gelu,
                    grid=grid,
                    **f,
                )
            except Exception:
                pass

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(one, todo))

    plain = [(f, 0) for f in forms(m, n, k)]
    compile_ahead(plain)
    results = [r for f, s in plain if (r := time_form(f, s))]
    results.sort(key=lambda r: r["us"])
    if stats_pass:
        folded = [(r["form"], st) for r in results[:top] for st in (1, 2)]
        compile_ahead(folded)
        results += [r for f, s in folded if (r := time_form(f, s))]
        results.sort(key=lambda r: r["us"])
    results.sort(key=lambda r: r["us"])
    best = {s: next((r for r in results if r["stats"] == s), None) for s in (0, 1, 2)}
    print(
        f"{name}: M={m} N={n} K={k} act={act}  library {rows['library']:.2f} µs, "
        f"library fused {rows['library_fused']:.2f}; {len(results)} forms"
    )
    for r in results[:top]:
        print(f"    {r['us']:6.2f} µs  stats={r['stats']!s:5}  err {r['err']:.3g}  {r['form']}")
    for s, r in best.items():
        if r:
            print(
                f"  best stats={s}: {r['us']:.2f} µs ({r['us'] / rows['library']:.2f}× library) {r['form']}"
            )
    return dict(name=name, m=m, n=n, k=k, act=act, copies=copies, **rows, forms=results)


LAYER = {  # one gpt layer at 128 rows, in the forms the sweep found best on an H100
    "qkv": dict(BM=64, BN=64, BK=128, SPLIT=1, num_warps=4, num_stages=4),
    "attn_out": dict(BM=64, BN=32, BK=128, SPLIT=1, num_warps=4, num_stages=4),
    "fc": dict(BM=64, BN=64, BK=128, SPLIT=1, num_warps=4, num_stages=4),
    "mlp_out": dict(BM=64, BN=32, BK=128, SPLIT=2, num_warps=4, num_stages=4),
}


def chain(m: int, layers: int, stages: int | None) -> dict:
    """A forward's GEMMs (``layers`` x qkv, attention out, fc, mlp out; each layer its own weights)
    in one CUDA graph: the library's, Triton's, Triton's with programmatic dependent launch (each
    kernel waits for the one before inside, so it can be resident early), and that plus an L2
    prefetch of the weights before the wait (W does not depend on the kernel before)."""
    dev = "cuda"
    torch.manual_seed(0)
    ops = []
    for _ in range(layers):
        for name, f in LAYER.items():
            n, k, gelu, _ = SHAPES[name]
            f = dict(f, num_stages=stages or f["num_stages"])
            w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
            a = torch.randn(m, k, device=dev, dtype=torch.float16)
            bias = torch.zeros(n, device=dev, dtype=torch.float16)
            mt = math.ceil(m / f["BM"])
            grid = (mt, math.ceil(n / f["BN"]), f["SPLIT"])
            ws = torch.empty(max(1, f["SPLIT"] * mt * f["BM"] * n), device=dev, dtype=torch.float32)
            cnt = torch.zeros(grid[0] * grid[1], device=dev, dtype=torch.int32)
            out = torch.empty(m, n, device=dev, dtype=torch.float16)
            ops.append((name, f, n, k, gelu, w, a, bias, grid, ws, cnt, out))

    def lib(_):
        for _name, _f, _n, _k, gelu, w, a, bias, *_rest in ops:
            if gelu:
                torch._addmm_activation(bias, a, w.t(), use_gelu=True)
            else:
                torch.nn.functional.linear(a, w, bias)

    def tri(pdl, prefetch):
        def run(_):
            for _name, f, n, k, gelu, w, a, bias, grid, ws, cnt, out in ops:
                kw = dict(launch_pdl=True) if pdl else {}
                _gemm[grid](
                    a, w, bias, bias, out, ws, ws, cnt, m, N=n, K=k, STATS=0, GELU=gelu,
                    PDL=pdl, PREFETCH=prefetch and triton.next_power_of_2(k // f["SPLIT"] // 64), **f, **kw,
                )  # fmt: skip

        return run

    res = {"library": graph_time(lib, 1, 30)}
    for label, pdl, pre in (
        ("triton", False, False),
        ("triton_pdl", True, False),
        ("triton_pdl_prefetch", True, True),
    ):
        try:
            res[label] = graph_time(tri(pdl, pre), 1, 30)
        except Exception as e:
            print(f"  chain {label}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
    per = len(ops)
    print(
        f"chain M={m} layers={layers} stages={stages}: "
        + ", ".join(f"{k} {v:.1f} µs ({v / per:.2f}/GEMM)" for k, v in res.items())
    )
    return dict(m=m, layers=layers, stages=stages, gemms=per, us=res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[128])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json")
    p.add_argument("--chain", action="store_true", help="time a forward's GEMMs in one graph instead")
    args = p.parse_args()
    if args.chain:
        out = [chain(m, 12, st) for m in args.rows for st in (None, 3)]
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(device=torch.cuda.get_device_name(), chains=out), fh)
        return
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    report = []
    for m in args.rows:
        for name in args.shapes:
            n, k, gelu, ln = SHAPES[name]
            report.append(sweep(name, m, n, k, gelu, args.top, ln))
            sys.stdout.flush()
            if args.json:  # after every shape: a run cut short keeps what it measured
                with open(args.json, "w") as fh:
                    json.dump(
                        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sweeps=report), fh
                    )


if __name__ == "__main__":
    main()
