"""A decode step's GEMVs as one persistent kernel against one kernel per GEMV: what a megakernel
would gain on the weight stream alone (issue 31, lever 4), measured before building one.

Both run the same dependent chain, as a decode step does: every layer's q/k/v, o, gate/up and
down GEMVs (each reading the output of the one before as its input: the attention output, the
norms and SiLU·mul are left out, so the chain is the weight stream and its dependencies), then
the LM head, every layer its own weights, bfloat16, in one CUDA graph.

- ``kernels``: one launch per GEMV (the default table's dot-free form: two rows of W per block,
  K in steps of 1024), plainly and under programmatic dependent launch (each block loads its W
  rows before it waits for the kernel before), as ``bench/gemv_sweep.py --chain`` times them;
- ``persistent``: one launch of a grid that stays resident (``--blocks-per-sm`` per SM), each
  block taking row tiles of a GEMV in turn, all blocks meeting at a grid-wide barrier (an atomic
  counter) between GEMVs; with ``prefetch``, each block loads its first W tile of the next GEMV
  before it waits at the barrier, so the weight stream does not stop there.

The outputs of every variant are compared (the same fp32 sums in the same order: bitwise, or
within bf16 rounding). A barrier that does not complete (blocks not all resident) gives up after
a bounded number of polls and the run reports it instead of hanging.

    python3 bench/persistent_chain.py --json out/persistent.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from aot.verify import timing

# (N, K) of Llama-3.2-1B's decode GEMVs per layer, gate/up stacked; the LM head last.
LLAMA_1B = {
    "layers": 16,
    "sites": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "head": (128256, 2048),
}
MAX_POLLS = tl.constexpr(1 << 18)  # polls of the barrier before a block gives up (reported, never a hang)


@triton.jit
def _gemv_rows(w_ptr, a_ptr, o_ptr, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr):
    """One launch per GEMV: R rows of W per block, every K step's tile loaded before the wait."""
    rn = tl.program_id(0) * R + tl.arange(0, R)
    mask_n = rn < N
    part = tl.zeros((R, BK), dtype=tl.float32)
    for i in tl.static_range(0, K, BK):
        rk = i + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None], other=0.0)
        if GDC and i == 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(a_ptr + rk)
        part += w.to(tl.float32) * a.to(tl.float32)[None, :]
    tl.store(o_ptr + rn, tl.sum(part, axis=1).to(o_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _tile(w_ptr, a_ptr, o_ptr, t, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, w0):
    """Row tile ``t`` of a GEMV; ``w0``: its first K step's W tile, loaded already."""
    rn = t * R + tl.arange(0, R)
    mask_n = rn < N
    # A was written by other blocks in this launch: read through L2 (.cg), never a stale L1 line
    part = w0.to(tl.float32) * tl.load(a_ptr + tl.arange(0, BK), cache_modifier=".cg").to(tl.float32)[None, :]
    for i in tl.static_range(BK, K, BK):
        rk = i + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None], other=0.0)
        part += w.to(tl.float32) * tl.load(a_ptr + rk, cache_modifier=".cg").to(tl.float32)[None, :]
    tl.store(o_ptr + rn, tl.sum(part, axis=1).to(o_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _first(w_ptr, t, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    rn = t * R + tl.arange(0, R)
    rk = tl.arange(0, BK)
    return tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rn < N)[:, None], other=0.0)


@triton.jit
def _phase(w_ptr, a_ptr, o_ptr, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, G, w0,
           PREFETCH: tl.constexpr):  # fmt: skip
    """This block's row tiles of one GEMV (tiles pid, pid + G, ...); ``w0``: the first one's first
    W tile, loaded before the barrier (``PREFETCH``; else loaded here, after it)."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(N, R)
    if not PREFETCH:
        w0 = _first(w_ptr, pid, N, K, R, BK)
    if pid < tiles:
        _tile(w_ptr, a_ptr, o_ptr, pid, N, K, R, BK, w0)
    for t in range(pid + G, tiles, G):
        _tile(w_ptr, a_ptr, o_ptr, t, N, K, R, BK, _first(w_ptr, t, N, K, R, BK))


@triton.jit
def _barrier(bar_ptr, target, fail_ptr):
    """Every block of the grid has stored its tiles of this GEMV (``target``: blocks x barriers
    so far): arrive after this block's stores, then poll until all have arrived."""
    tl.debug_barrier()  # every thread's stores before the arrival
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < MAX_POLLS):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if polls >= MAX_POLLS:
        tl.atomic_max(fail_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _chain(x_ptr, wq_ptr, wo_ptr, wg_ptr, wd_ptr, wh_ptr, q_ptr, o_ptr, g_ptr, d_ptr, out_ptr, bar_ptr, fail_ptr,
           LAYERS: tl.constexpr, NQ: tl.constexpr, NO: tl.constexpr, NG: tl.constexpr, ND: tl.constexpr,
           NH: tl.constexpr, H: tl.constexpr, KD: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
           PREFETCH: tl.constexpr):  # fmt: skip
    """The whole chain in one grid: per layer q/k/v (A: the layer's input), o (A: q/k/v's first H
    outputs), gate/up (A: o's), down (A: gate/up's first KD), then the LM head (A: the last
    down's); a grid barrier after each GEMV."""
    G = tl.num_programs(0)
    pid = tl.program_id(0)
    a = x_ptr
    n = 0
    for layer in range(LAYERS):
        wq = wq_ptr + layer.to(tl.int64) * NQ * H
        wo = wo_ptr + layer.to(tl.int64) * NO * H
        wg = wg_ptr + layer.to(tl.int64) * NG * H
        wd = wd_ptr + layer.to(tl.int64) * ND * KD
        w0 = _first(wq, pid, NQ, H, R, BK)
        if layer > 0:
            n += 1
            _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wq, a, q_ptr, NQ, H, R, BK, G, w0, PREFETCH)
        w0 = _first(wo, pid, NO, H, R, BK)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wo, q_ptr, o_ptr, NO, H, R, BK, G, w0, PREFETCH)
        w0 = _first(wg, pid, NG, H, R, BK)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wg, o_ptr, g_ptr, NG, H, R, BK, G, w0, PREFETCH)
        w0 = _first(wd, pid, ND, KD, R, BK)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wd, g_ptr, d_ptr, ND, KD, R, BK, G, w0, PREFETCH)
        a = d_ptr
    w0 = _first(wh_ptr, pid, NH, H, R, BK)
    n += 1
    _barrier(bar_ptr, n * G, fail_ptr)
    _phase(wh_ptr, d_ptr, out_ptr, NH, H, R, BK, G, w0, PREFETCH)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks-per-sm", type=int, action="append", help="persistent grid sizes (default 2, 4)")
    p.add_argument("--layers", type=int, default=LLAMA_1B["layers"])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("persistent_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    (nq, h), (no, _), (ng, _), (nd, kd) = LLAMA_1B["sites"]
    nh = LLAMA_1B["head"][0]
    layers = args.layers
    w = {
        "q": torch.randn(layers * nq, h, device=dev, dtype=dt) / h**0.5,
        "o": torch.randn(layers * no, h, device=dev, dtype=dt) / h**0.5,
        "g": torch.randn(layers * ng, h, device=dev, dtype=dt) / h**0.5,
        "d": torch.randn(layers * nd, kd, device=dev, dtype=dt) / kd**0.5,
        "h": torch.randn(nh, h, device=dev, dtype=dt) / h**0.5,
    }
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    x = torch.randn(h, device=dev, dtype=dt)
    bufs = {
        k: torch.empty(n, device=dev, dtype=dt)
        for k, n in (("q", nq), ("o", no), ("g", ng), ("d", nd), ("out", nh))
    }
    bar = torch.zeros(1, device=dev, dtype=torch.int32)
    fail = torch.zeros(1, device=dev, dtype=torch.int32)
    r, bk = 2, 1024

    def per_gemv(pdl: bool):
        kw = {"num_warps": 2, "num_stages": 1, **({"launch_pdl": True} if pdl else {})}

        def one(wt, a, out, n, k):
            _gemv_rows[(triton.cdiv(n, r),)](wt, a, out, n, k, r, bk, pdl, **kw)

        def run():
            a = x
            for layer in range(layers):
                one(w["q"][layer * nq : (layer + 1) * nq], a, bufs["q"], nq, h)
                one(w["o"][layer * no : (layer + 1) * no], bufs["q"], bufs["o"], no, h)
                one(w["g"][layer * ng : (layer + 1) * ng], bufs["o"], bufs["g"], ng, h)
                one(w["d"][layer * nd : (layer + 1) * nd], bufs["g"], bufs["d"], nd, kd)
                a = bufs["d"]
            one(w["h"], bufs["d"], bufs["out"], nh, h)

        return run

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def persistent(blocks_per_sm: int, warps: int, prefetch: bool):
        def run():
            bar.zero_()
            _chain[(sms * blocks_per_sm,)](
                x, w["q"], w["o"], w["g"], w["d"], w["h"], bufs["q"], bufs["o"], bufs["g"], bufs["d"], bufs["out"],
                bar, fail, layers, nq, no, ng, nd, nh, h, kd, r, bk, prefetch, num_warps=warps, num_stages=1,
            )  # fmt: skip

        return run

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": layers,
        "weight_bytes": nbytes,
        "rows": [],
    }
    want = None
    variants = [("kernels", False, per_gemv(False)), ("kernels_pdl", True, per_gemv(True))]
    for b in args.blocks_per_sm or (2, 4):
        for warps in (2, 4):
            for prefetch in (True, False):
                name = f"persistent_{b}x{warps}w" + ("" if prefetch else "_no_prefetch")
                variants.append((name, None, persistent(b, warps, prefetch)))
    for name, _, run in variants:
        row = {"variant": name}
        try:
            fail.zero_()
            run()
            torch.cuda.synchronize()
            if fail.item():
                row["error"] = "a barrier gave up: the grid's blocks were not all resident"
            else:
                out = bufs["out"].float().clone()
                if want is None:
                    want = out
                row["max_abs_diff"] = float((out - want).abs().max())
                us = timing.graph_us(run, dev, 1, 20)
                row.update(us=us, tb_per_s=nbytes / us / 1e6)
        except Exception as e:  # one variant failing (a compile error) must not lose the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
