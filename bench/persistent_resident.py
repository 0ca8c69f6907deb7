"""A decode step's GEMVs in one persistent kernel whose blocks hold their share of the next GEMV's
weights in registers across the grid barrier, against one kernel per GEMV (issue 31, lever 4):
measured before building a megakernel, at GPT-2's size (latency-bound: 2-4 µs per launch for
1-5 MB) and at Llama-3.2-1B's (bandwidth-bound).

``bench/persistent_chain.py`` measured a persistent chain whose blocks loaded only their first W
tile before a barrier polled with atomics (834-1228 µs against 647 for Llama-3.2-1B's chain under
dependent launch). Two things differ here:

- **resident stages**: where a block's rows of a GEMV (``cdiv(N, grid)`` rounded up to a power of
  two, every K) fit in ``--resident-kb``, the block loads all of them before it waits at the
  barrier, so the whole GEMV's weights are in flight while the GEMV before it finishes; the
  barrier's wait is then the only serial cost of the stage. Larger GEMVs (Llama's gate/up and
  down, the LM heads) take row tiles in turn, the first one loaded before the barrier.
- **the barrier's polls**: ``ld.acquire.gpu`` loads of the counter (``acquire`` variants) instead
  of atomic read-modify-writes, which L2 serializes on one address across hundreds of blocks.

Rows: ``kernels`` / ``kernels_pdl`` (one launch per GEMV, the built-in table's dot-free forms,
plainly and under programmatic dependent launch), ``persistent_{b}x{w}w[_resident][_acquire]``
(b blocks per SM, w warps), ``barriers_{b}x{w}w[_acquire]`` (the same grid meeting at as many
barriers with no work: a barrier's own cost). Every chain's output is compared with the
per-kernel chain's (fp32 sums; bf16/fp16 rounding between GEMVs). A barrier that does not
complete (blocks not all resident) gives up after a bounded number of polls and is reported.

Measured on an H200 (2026-11-30, ``bench/results/persistent-resident-*-h200-2026-11-30.json``;
``bench/RESULTS.md``): GPT-2's chain 134 µs one kernel per GEMV under dependent launch, 223 µs
the best persistent grid (2 blocks per SM, resident stages); Llama-3.2-1B's 647 against 1791; a
grid barrier alone 1.1 µs with atomic polls, 1.3-3.4 with ``ld.acquire`` polls.

    python3 bench/persistent_resident.py --model gpt2 --json out/resident-gpt2.json
    python3 bench/persistent_resident.py --compile-only 90   # every kernel for sm_90, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from aot.verify import timing

# (N, K) of each layer's decode GEMVs (q/k/v, o, the MLP's first and second), the LM head; the
# per-kernel forms (rows of W per block, K step) of the built-in table at one row
MODELS = {
    "gpt2": {
        "layers": 12,
        "sites": [(2304, 768), (768, 768), (3072, 768), (768, 3072)],
        "head": (50257, 768),
        "dtype": torch.float16,
        "forms": [(2, 1024), (2, 1024), (2, 1024), (1, 512)],
        "head_form": (4, 512),
        "tile": (4, 256),  # a persistent block's row tile where a stage is not resident
    },
    "llama-3.2-1b": {
        "layers": 16,
        "sites": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
        "head": (128256, 2048),
        "dtype": torch.bfloat16,
        "forms": [(2, 1024)] * 4,
        "head_form": (2, 1024),
        "tile": (2, 1024),
    },
}
MAX_POLLS = tl.constexpr(1 << 18)
CHUNKS = 4  # a resident stage's K in at most this many register tiles


@triton.jit
def _gemv(w_ptr, a_ptr, o_ptr, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr):
    """One launch per GEMV: R rows of W per block, every K step loaded before the wait."""
    rn = tl.program_id(0) * R + tl.arange(0, R)
    mask_n = rn < N
    part = tl.zeros((R, BK), dtype=tl.float32)
    for i in tl.static_range(0, K, BK):
        rk = i + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None] & (rk < K)[None, :],
                    other=0.0)  # fmt: skip
        if GDC and i == 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(a_ptr + rk, mask=rk < K, other=0.0)
        part += w.to(tl.float32) * a.to(tl.float32)[None, :]
    tl.store(o_ptr + rn, tl.sum(part, axis=1).to(o_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _ld_acquire(ptr):
    one = tl.arange(0, 1)
    v = tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr + one], dtype=tl.int32, is_pure=False, pack=1
    )
    return tl.max(v, axis=0)


@triton.jit
def _barrier(bar_ptr, target, fail_ptr, ACQUIRE: tl.constexpr):
    """Every block has stored its part of the stage (``target``: blocks x barriers so far)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    if ACQUIRE:
        seen = _ld_acquire(bar_ptr)
    else:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < MAX_POLLS):
        if ACQUIRE:
            seen = _ld_acquire(bar_ptr)
        else:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if polls >= MAX_POLLS:
        tl.atomic_max(fail_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _chunk(w_ptr, row0, N, K: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, j: tl.constexpr):
    rn = row0 + tl.arange(0, RB)
    rk = j * BK + tl.arange(0, BK)
    return tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rn < N)[:, None] & (rk < K)[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _dot(w, a_ptr, K: tl.constexpr, BK: tl.constexpr, j: tl.constexpr):
    rk = j * BK + tl.arange(0, BK)
    # A was written by other blocks of this launch: read through L2 (.cg), never a stale L1 line
    a = tl.load(a_ptr + rk, mask=rk < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1)


@triton.jit
def _load_stage(w_ptr, N, K: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, RES: tl.constexpr):
    """What a block loads of a stage before the barrier: its RB rows (every K chunk) where the
    stage is resident, else its first row tile's first K step (RB rows, BK wide)."""
    row0 = tl.program_id(0) * RB
    w0 = _chunk(w_ptr, row0, N, K, RB, BK, 0)
    w1 = w0
    w2 = w0
    w3 = w0
    if RES:
        if K > BK:
            w1 = _chunk(w_ptr, row0, N, K, RB, BK, 1)
        if K > 2 * BK:
            w2 = _chunk(w_ptr, row0, N, K, RB, BK, 2)
        if K > 3 * BK:
            w3 = _chunk(w_ptr, row0, N, K, RB, BK, 3)
    return w0, w1, w2, w3


@triton.jit
def _stage(w_ptr, a_ptr, o_ptr, N, K: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, RES: tl.constexpr,
           w0, w1, w2, w3):  # fmt: skip
    """A block's part of one GEMV after the barrier: its resident rows, or row tiles pid, pid + G,
    ... (RB rows, K in steps of BK; the first tile's first step loaded already)."""
    pid = tl.program_id(0)
    if RES:
        acc = _dot(w0, a_ptr, K, BK, 0)
        if K > BK:
            acc += _dot(w1, a_ptr, K, BK, 1)
        if K > 2 * BK:
            acc += _dot(w2, a_ptr, K, BK, 2)
        if K > 3 * BK:
            acc += _dot(w3, a_ptr, K, BK, 3)
        rn = pid * RB + tl.arange(0, RB)
        tl.store(o_ptr + rn, acc.to(o_ptr.dtype.element_ty), mask=rn < N)
    else:
        G = tl.num_programs(0)
        tiles = tl.cdiv(N, RB)
        t = pid
        first = w0
        while t < tiles:
            acc = _dot(first, a_ptr, K, BK, 0)
            for j in tl.static_range(1, (K + BK - 1) // BK):
                acc += _dot(_chunk(w_ptr, t * RB, N, K, RB, BK, j), a_ptr, K, BK, j)
            rn = t * RB + tl.arange(0, RB)
            tl.store(o_ptr + rn, acc.to(o_ptr.dtype.element_ty), mask=rn < N)
            t += G
            first = _chunk(w_ptr, t * RB, N, K, RB, BK, 0)


@triton.jit
def _chain(x_ptr, wq_ptr, wo_ptr, wg_ptr, wd_ptr, wh_ptr, q_ptr, o_ptr, g_ptr, d_ptr, out_ptr, bar_ptr, fail_ptr,
           LAYERS: tl.constexpr, NQ: tl.constexpr, NO: tl.constexpr, NG: tl.constexpr, ND: tl.constexpr,
           NH: tl.constexpr, H: tl.constexpr, KD: tl.constexpr,
           RQ: tl.constexpr, BQ: tl.constexpr, SQ: tl.constexpr, RO: tl.constexpr, BO: tl.constexpr, SO: tl.constexpr,
           RG: tl.constexpr, BG: tl.constexpr, SG: tl.constexpr, RD: tl.constexpr, BD: tl.constexpr, SD: tl.constexpr,
           RH: tl.constexpr, BH: tl.constexpr, ACQUIRE: tl.constexpr):  # fmt: skip
    """Per layer q/k/v (A: the layer's input), o (A: q/k/v's first H outputs), the MLP's first
    (A: o's) and second (A: the first's first KD), then the LM head; a grid barrier before each
    GEMV but the first, each block's part of the next GEMV loaded before it waits there.
    R*/B*/S*: each stage's rows per block, K step, resident or not."""
    G = tl.num_programs(0)
    a = x_ptr
    n = 0
    for layer in range(LAYERS):
        wq = wq_ptr + layer.to(tl.int64) * NQ * H
        wo = wo_ptr + layer.to(tl.int64) * NO * H
        wg = wg_ptr + layer.to(tl.int64) * NG * H
        wd = wd_ptr + layer.to(tl.int64) * ND * KD
        w0, w1, w2, w3 = _load_stage(wq, NQ, H, RQ, BQ, SQ)
        if layer > 0:
            n += 1
            _barrier(bar_ptr, n * G, fail_ptr, ACQUIRE)
        _stage(wq, a, q_ptr, NQ, H, RQ, BQ, SQ, w0, w1, w2, w3)
        w0, w1, w2, w3 = _load_stage(wo, NO, H, RO, BO, SO)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr, ACQUIRE)
        _stage(wo, q_ptr, o_ptr, NO, H, RO, BO, SO, w0, w1, w2, w3)
        w0, w1, w2, w3 = _load_stage(wg, NG, H, RG, BG, SG)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr, ACQUIRE)
        _stage(wg, o_ptr, g_ptr, NG, H, RG, BG, SG, w0, w1, w2, w3)
        w0, w1, w2, w3 = _load_stage(wd, ND, KD, RD, BD, SD)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr, ACQUIRE)
        _stage(wd, g_ptr, d_ptr, ND, KD, RD, BD, SD, w0, w1, w2, w3)
        a = d_ptr
    w0, w1, w2, w3 = _load_stage(wh_ptr, NH, H, RH, BH, False)
    n += 1
    _barrier(bar_ptr, n * G, fail_ptr, ACQUIRE)
    _stage(wh_ptr, d_ptr, out_ptr, NH, H, RH, BH, False, w0, w1, w2, w3)


@triton.jit
def _barriers(bar_ptr, fail_ptr, COUNT: tl.constexpr, ACQUIRE: tl.constexpr):
    """COUNT grid barriers and nothing else: what the chain's barriers cost alone."""
    G = tl.num_programs(0)
    for n in range(1, COUNT + 1):
        _barrier(bar_ptr, n * G, fail_ptr, ACQUIRE)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def stage_plan(n: int, k: int, grid: int, tile: tuple[int, int], resident_bytes: int, itemsize: int) -> tuple:
    """(rows per block, K step, resident) of one GEMV in a grid of ``grid`` blocks: every block's
    rows held at once where they fit in ``resident_bytes``, else ``tile``'s row tiles in turn."""
    rows = _pow2(-(-n // grid))
    step = _pow2(-(-k // CHUNKS))
    if rows * k * itemsize <= resident_bytes:
        return rows, step, True
    return tile[0], tile[1], False


def chain_constexprs(m: dict, grid: int, resident_bytes: int, itemsize: int) -> dict:
    (nq, h), (no, _), (ng, _), (nd, kd) = m["sites"]
    out = {}
    for key, (n, k) in zip("QOGD", m["sites"], strict=True):
        r, b, s = stage_plan(n, k, grid, m["tile"], resident_bytes, itemsize)
        out.update({f"R{key}": r, f"B{key}": b, f"S{key}": s})
    out.update(RH=m["tile"][0], BH=m["tile"][1])
    return out


def compile_only(arch: int) -> int:
    """Compile every chain and barrier kernel the bench launches for ``sm_<arch>`` (no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    for name, m in MODELS.items():
        ptr = "*fp16" if m["dtype"] == torch.float16 else "*bf16"
        (nq, h), (no, _), (ng, _), (nd, kd) = m["sites"]
        for grid in (132 * 2, 132 * 4):
            for resident in (0, 64 << 10):
                for acquire in (False, True):
                    sig = {p: ptr for p in ("x", "wq", "wo", "wg", "wd", "wh", "q", "o", "g", "d", "out")}
                    sig = {f"{p}_ptr": t for p, t in sig.items()} | {"bar_ptr": "*i32", "fail_ptr": "*i32"}
                    consts = {"LAYERS": m["layers"], "NQ": nq, "NO": no, "NG": ng, "ND": nd, "NH": m["head"][0],
                              "H": h, "KD": kd, **chain_constexprs(m, grid, resident, 2), "ACQUIRE": acquire}  # fmt: skip
                    full = {**sig, **{k: "constexpr" for k in consts}}
                    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
                    label = f"{name} grid {grid} resident {resident >> 10} KiB acquire {acquire}"
                    try:
                        compiled = triton.compile(
                            ASTSource(_chain, signature=full, constexprs=consts, attrs=aligned),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": 8, "num_stages": 1},
                        )
                    except Exception as e:
                        failed += 1
                        print(
                            f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                        )
                        continue
                    ptx = compiled.asm["ptx"]
                    ok = ("ld.acquire.gpu" in ptx) == acquire and "atom" in ptx
                    failed += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {label}: {len(compiled.asm['cubin'])} cubin bytes")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    p.add_argument("--blocks-per-sm", type=int, action="append", help="persistent grid sizes (default 1, 2)")
    p.add_argument("--warps", type=int, action="append", help="warps per persistent block (default 4, 8)")
    p.add_argument("--resident-kb", type=int, default=64, help="a block's resident W per stage, at most")
    p.add_argument("--repeats", type=int, default=20, help="graph replays per variant (median)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--compile-only", type=int, metavar="ARCH", help="compile for sm_ARCH (no GPU) and exit")
    args = p.parse_args()
    if args.compile_only:
        return compile_only(args.compile_only)
    if not torch.cuda.is_available():
        print("persistent_resident: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    m = MODELS[args.model]
    dev, dt = torch.device("cuda"), m["dtype"]
    (nq, h), (no, _), (ng, _), (nd, kd) = m["sites"]
    nh = m["head"][0]
    layers = m["layers"]
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
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def per_kernel(pdl: bool):
        def one(wt, a, out, n, k, form):
            r, bk = form
            kw = {
                "num_warps": 2 if bk >= 1024 else 4,
                "num_stages": 1,
                **({"launch_pdl": True} if pdl else {}),
            }
            _gemv[(triton.cdiv(n, r),)](wt, a, out, n, k, r, bk, pdl, **kw)

        def run():
            a = x
            for layer in range(layers):
                for key, (n, k), form, src in zip(
                    "qogd", m["sites"], m["forms"], (None, "q", "o", "g"), strict=True
                ):
                    one(
                        w[key][layer * n : (layer + 1) * n],
                        a if src is None else bufs[src],
                        bufs[key],
                        n,
                        k,
                        form,
                    )
                a = bufs["d"]
            one(w["h"], bufs["d"], bufs["out"], nh, h, m["head_form"])

        return run

    def persistent(grid: int, warps: int, resident_bytes: int, acquire: bool):
        consts = chain_constexprs(m, grid, resident_bytes, dt.itemsize)

        def run():
            bar.zero_()
            _chain[(grid,)](
                x, w["q"], w["o"], w["g"], w["d"], w["h"], bufs["q"], bufs["o"], bufs["g"], bufs["d"], bufs["out"],
                bar, fail, layers, nq, no, ng, nd, nh, h, kd, **consts, ACQUIRE=acquire, num_warps=warps, num_stages=1,
            )  # fmt: skip

        return run, consts

    def barriers(grid: int, warps: int, acquire: bool):
        def run():
            bar.zero_()
            _barriers[(grid,)](bar, fail, 4 * layers, acquire, num_warps=warps, num_stages=1)

        return run

    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": layers,
        "weight_bytes": nbytes,
        "barriers_per_chain": 4 * layers,
        "rows": [],
    }
    variants = [("kernels", True, {}, per_kernel(False)), ("kernels_pdl", True, {}, per_kernel(True))]
    for b in args.blocks_per_sm or (1, 2):
        for warps in args.warps or (4, 8):
            grid = sms * b
            for acquire in (False, True):
                tag = "_acquire" if acquire else ""
                variants.append((f"barriers_{b}x{warps}w{tag}", False, {}, barriers(grid, warps, acquire)))
                for resident in (0, args.resident_kb << 10):
                    run, consts = persistent(grid, warps, resident, acquire)
                    name = f"persistent_{b}x{warps}w" + ("_resident" if resident else "") + tag
                    variants.append((name, True, {"plan": consts}, run))
    want = None
    for name, compares, fields, run in variants:
        row = {"variant": name, **fields}
        try:
            fail.zero_()
            run()
            torch.cuda.synchronize()
            if fail.item():
                row["error"] = "a barrier gave up: the grid's blocks were not all resident"
            else:
                if compares:
                    out = bufs["out"].float().clone()
                    if want is None:
                        want = out
                    row["max_abs_diff"] = float((out - want).abs().max())
                us = timing.graph_us(run, dev, 1, args.repeats)
                row["us"] = us
                if compares:
                    row["tb_per_s"] = nbytes / us / 1e6
                else:
                    row["us_per_barrier"] = us / (4 * layers)
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
