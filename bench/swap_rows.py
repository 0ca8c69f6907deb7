"""Few-row GEMMs (decode at batch 2-16) with the weight as the tensor-core product's wide side,
against cuBLAS and the codegen's 16-row tiles, in a decode step's chain (issue 31: batch 8 at
most 1.1x batch 1).

At 8 rows a decode step's GEMMs are the same weight stream as at one row; what batch 8 costs
today (Llama-3.2-1B: 0.980 ms a token against 0.788) is cuBLAS streaming the layers' weights at
2.1-3.7 TB/s where the one-row forms reach 3.7-4.5, and the codegen's few-row tiles
(``gemm_forms.FEW_ROW_CONFIGS``) streaming slower still (RESULTS.md, 2026-11-29 afternoon). Those
tiles put A's rows on the product's M side (16 rows, 8 of them idle), which on an H100/H200 is the
warp-level ``mma`` with W loaded through registers. Here the product is turned around, as
cuBLAS's ``nvjet ... 64x8`` kernels turn it: ``O^T[n-tile, :] = W[n-tile, :] @ A^T``, so a tile
of ``BN`` weight rows is the M side of a Hopper warpgroup product (``wgmma``, M = 64 per
warpgroup) read from shared memory where the pipeline put it, and A's 16 rows (8 live) are the
narrow N side. Forms (every one under programmatic dependent launch: W's first tile loaded
before the wait, the rest pipelined over ``S`` stages, A read after it):

- ``swap_<BN>x<BK>_s<S>_w<W>``: W tiles by plain loads (Triton's ``cp.async`` pipeline);
- ``swapt_...``: W tiles by TMA from a host-side tensor descriptor;
- each with K in slices where a site has too few tiles to fill the GPU (the slice count per
  site: the fewest that make ``TARGET`` blocks, ``_t<blocks>`` where another target), the slices'
  fp32 partials summed by the slice that arrives last at a per-tile counter (``serial``) or by a
  second kernel (``pass``); ``_e<K>``: a slice's first K elements of W loaded before the wait.

Baselines in the same command: cuBLAS (``torch.mm``; no dependent launch), ``few``: the
non-swapped 16-row tile (``fewrow_sweep._few``: A's rows as M, the codegen's few-row tile shape
16 x 32 x 256), and at one row the default table's dot-free ``vec`` form. ``--set small``: the
candidates for q/k/v and o (more slices, more of W before the wait) instead of the grid; ``--set
mma``: narrow tiles of W (16-32 rows) on one or two warps, the warp-level ``mma``;
``--pick q=FORM,o=FORM,g=FORM,d=FORM,h=FORM``: a chain with a form per site (cuBLAS where left out).
The codegen's forms of this kind are ``gemm_forms``' ``fews_*`` (``TileConfig.swap``).

Every row is a chain in one CUDA graph, bfloat16, every GEMM its own cold weights (Llama-3.2-1B:
2.47 GB), each reading the output of the one before: ``chain`` (a decode step's q/k/v, o, gate/up,
down per layer, then the LM head), or one site's 16 GEMMs alone (``q``, ``o``, ``g``, ``d``; the
head 4 times: ``h``). Outputs are compared with cuBLAS's (fp32 sums in another order).

    python3 bench/swap_rows.py --json out.json [--rows 1,8,16] [--quick]          # ~80 s on an H200
    python3 bench/swap_rows.py --set small --rows 8 --chains chain,q,o --pick q=...,o=...,g=...
    TRITON_INTERPRET=1 python3 bench/swap_rows.py --check    # the kernels against torch, on the CPU
    python3 bench/swap_rows.py --compile-only 90              # every form to an sm_90 cubin, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fewrow_sweep import _sum_slices  # noqa: E402  (the slices' sum, GDC on here)
from bench.persistent_chain import (  # noqa: E402
    LLAMA_1B,
    _gemv_rows,
    llama_1b_site_chains,
    llama_1b_site_weights,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BM = 16  # A's rows in the product's N side (the rows past M masked off)
TARGET = 128  # blocks a site's slices aim for (an H200 has 132 SMs)
SPLIT_MODES = ("serial", "pass")


@triton.jit
def _swap(a_ptr, w_ptr, w_desc, o_ptr, ws_ptr, cnt_ptr, M, N, K, KS,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
          SPLIT: tl.constexpr, MODE: tl.constexpr, TMA: tl.constexpr, GDC: tl.constexpr,
          EK: tl.constexpr = 0):  # fmt: skip
    """O[:M, n-tile] = A[:M, :] @ W[n-tile, :]^T as acc[BN, BM] = W_tile @ A^T, K slice
    ``program_id(1)`` of SPLIT. MODE 0: one slice, stored in O's dtype; 1 (serial): each slice's
    fp32 partial to ws[slice], the last slice at the tile's counter sums them into O and zeroes
    the counter; 2 (pass): the partial to ws[slice] (a second kernel sums)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BN
    rn = n0 + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    mask_n = rn < N
    mask_m = rm < M
    k0 = pid_k * KS
    # the slice's first step (or its first EK of K, in one plain load) before the wait
    r0 = k0 + tl.arange(0, EK if EK > 0 else BK)
    if TMA and EK == 0:
        w0 = w_desc.load([n0, k0])
    else:
        w0 = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + r0[None, :], mask=mask_n[:, None], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a0 = tl.load(a_ptr + rm[None, :] * K + r0[:, None], mask=mask_m[None, :], other=0.0)
    acc = tl.dot(w0, a0)
    for kk in tl.range(k0 + max(EK, BK), k0 + KS, BK, num_stages=STAGES):
        rk = kk + tl.arange(0, BK)
        if TMA:
            w = w_desc.load([n0, kk])
        else:
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None], other=0.0)
        a = tl.load(a_ptr + rm[None, :] * K + rk[:, None], mask=mask_m[None, :], other=0.0)
        acc = tl.dot(w, a, acc)
    at = rm[None, :] * N + rn[:, None]
    mask = mask_m[None, :] & mask_n[:, None]
    if MODE == 0:
        tl.store(o_ptr + at, acc.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + at, acc, mask=mask)
        if MODE == 1:
            tl.debug_barrier()  # every thread's partial stored before the count (released below)
            seen = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if seen == SPLIT - 1:
                total = tl.zeros((BN, BM), dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(ws_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(o_ptr + at, total.to(o_ptr.dtype.element_ty), mask=mask)
                tl.store(cnt_ptr + pid_n, 0)


@triton.jit
def _few(a_ptr, w_ptr, o_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         STAGES: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    """The non-swapped tile: acc[BM, BN] = A[:BM] @ W[n-tile]^T, W's first tile before the wait."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    mask_n = rn < N
    mask_m = rm < M
    rk = tl.arange(0, BK)
    w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=mask_n[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=mask_m[:, None], other=0.0)
    acc = tl.dot(a, w)
    for kk in tl.range(BK, K, BK, num_stages=STAGES):
        rk = kk + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=mask_n[None, :], other=0.0)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=mask_m[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=mask)


def _descriptor(w: torch.Tensor, bn: int, bk: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w, [bn, bk])


def split_of(n: int, k: int, bn: int, bk: int, target: int = TARGET) -> int:
    """The fewest K slices (1, 2, 4, 8) that make ``target`` blocks, each slice whole BK steps."""
    split = 1
    while triton.cdiv(n, bn) * split < target and k % (2 * split * bk) == 0 and split < 8:
        split *= 2
    return split


class Form:
    """One form: ``launches(w, desc, a, out, m, n, k, pdl)`` -> the launches of one GEMM."""

    def __init__(
        self,
        kind: str,
        bn: int = 0,
        bk: int = 0,
        stages: int = 0,
        warps: int = 4,
        mode: str = "serial",
        target: int = TARGET,
        early: int = 0,
    ):
        self.kind, self.bn, self.bk, self.stages, self.warps, self.mode = kind, bn, bk, stages, warps, mode
        self.target = target  # blocks the K slices aim for
        self.early = early  # K elements of each slice loaded before the wait (0: one BK step)
        self.scratch: dict = {}

    @property
    def name(self) -> str:
        if self.kind in ("cublas", "vec"):
            return self.kind
        tail = f"_{self.mode}" if self.kind != "few" else ""
        tail += f"_t{self.target}" if self.target != TARGET else ""
        tail += f"_e{self.early}" if self.early else ""
        return f"{self.kind}_{self.bn}x{self.bk}_s{self.stages}_w{self.warps}{tail}"

    def descriptor(self, w: torch.Tensor):
        return _descriptor(w, self.bn, self.bk) if self.kind == "swapt" else None

    def _scratch(self, name: str, size: int, dtype, device) -> torch.Tensor:
        """One workspace and one counter array for every GEMM of a chain: a kernel writes them only
        after its wait for the kernel before (dependent launch waits for the whole grid), and the
        last slice of a tile zeroes its counter."""
        t = self.scratch.get(name)
        if t is None or t.numel() < size:
            t = torch.zeros(max(size, 1 << 20), device=device, dtype=dtype)
            self.scratch[name] = t
        return t

    def launches(self, w, desc, a, out, m: int, n: int, k: int, pdl: bool) -> list:
        kw = {"launch_pdl": True} if pdl and not INTERPRET else {}
        gdc = pdl and not INTERPRET
        if self.kind == "cublas":
            return [lambda: torch.mm(a, w.t(), out=out)]
        if self.kind == "vec":
            assert m == 1
            return [
                lambda: _gemv_rows[(triton.cdiv(n, 2),)](w, a, out, n, k, 2, 1024, gdc, num_warps=2, **kw)
            ]
        opts = {"num_warps": self.warps, **kw}
        if self.kind == "few":
            grid = (triton.cdiv(n, self.bn),)
            return [lambda: _few[grid](a, w, out, m, n, k, BM, self.bn, self.bk, self.stages, gdc, **opts)]
        split = split_of(n, k, self.bn, self.bk, self.target)
        mode = 0 if split == 1 else 1 + SPLIT_MODES.index(self.mode)
        ws = self._scratch("ws", split * m * n, torch.float32, w.device) if split > 1 else out
        cnt = self._scratch("cnt", triton.cdiv(n, self.bn), torch.int32, w.device) if mode == 1 else out
        grid = (triton.cdiv(n, self.bn), split)
        tma = self.kind == "swapt"
        early = min(self.early, k // split)
        if (k // split - early) % self.bk:
            raise ValueError(f"{self.name}: a slice of {k // split} less {early} early is not whole steps")
        args = (a, w, desc if tma else w, out, ws, cnt, m, n, k, k // split)
        consts = (BM, self.bn, self.bk, self.stages, split, mode, tma, gdc, early)
        run = [lambda: _swap[grid](*args, *consts, **opts)]
        if mode == 2:
            mn = m * n
            run.append(
                lambda: _sum_slices[(triton.cdiv(mn, 1024),)](
                    ws, out, mn, split, 1024, gdc, num_warps=4, **kw
                )
            )
        return run


def forms(quick: bool) -> list[Form]:
    out = [Form("cublas"), Form("few", 32, 256, 4)]
    grid = (
        [(64, 128, 4, 4), (128, 64, 4, 4)]
        if quick
        else [(bn, bk, s, w) for bn in (64, 128) for bk in (64, 128, 256) for s in (3, 4, 6) for w in (4, 8)]
    )
    for bn, bk, stages, warps in grid:
        if stages * (bn * bk + bk * BM) * 2 > 200 << 10 or (bn == 64 and warps == 8):
            continue
        for kind in ("swap", "swapt"):
            out.append(Form(kind, bn, bk, stages, warps, "serial"))
    # the two-kernel sum at the leading shapes only
    for bn, bk, stages in ((64, 128, 4), (128, 128, 4)):
        out.append(Form("swapt", bn, bk, stages, 4, "pass"))
    return out


def small_forms() -> list[Form]:
    """The small sites' candidates (q/k/v, o: 32-48 tiles of 64 rows): more slices, and each
    slice's W loaded before the wait (all of it, or its first 256)."""
    out = [Form("cublas"), Form("few", 32, 256, 4), Form("swap", 64, 64, 6), Form("swap", 64, 128, 4)]
    for target in (256, 512):
        out += [Form("swap", 64, 64, 6, target=target), Form("swap", 64, 128, 4, target=target)]
    for target in (128, 256, 512):
        for warps in (4, 8):
            out.append(Form("swap", 64, 128, 3, warps, target=target, early=2048))
    out.append(Form("swap", 64, 128, 4, 4, target=128, early=256))
    out.append(Form("swap", 64, 128, 4, 8, target=256, early=256))
    out.append(Form("swap", 64, 64, 6, 4, target=128, early=128))
    out.append(Form("swapt", 64, 64, 6, 4, target=128, early=128))
    return out


def mma_forms() -> list[Form]:
    """Narrow tiles of W (16 or 32 rows) on one or two warps: the warp-level ``mma`` (m16n8k16,
    W's rows its M side, A's rows its N side) instead of a warpgroup's ``wgmma`` (64 rows of W at
    least), so that q/k/v's and o's 2048-3072 rows make 64-192 tiles without K slices, and more
    blocks with them (``_t<blocks>``)."""
    out = [Form("cublas")]
    for bn, bk, stages, warps in (
        (16, 256, 4, 1),
        (16, 128, 6, 1),
        (32, 256, 3, 2),
        (32, 128, 4, 1),
        (32, 128, 4, 2),
    ):
        for target in (128, 256, 512):
            out.append(Form("swap", bn, bk, stages, warps, target=target))
    out.append(Form("swap", 16, 256, 4, 1, mode="pass", target=512))
    out.append(Form("swap", 16, 256, 4, 1, target=256, early=512))
    return out


class Picked(Form):
    """A form per site (by the GEMM's N and K)."""

    def __init__(self, by_shape: dict):
        super().__init__("pick")
        self.by_shape = by_shape

    @property
    def name(self) -> str:
        return "pick:" + ",".join(f"{n}x{k}={f.name}" for (n, k), f in self.by_shape.items())

    def descriptor(self, w):
        return self.by_shape[tuple(w.shape)].descriptor(w)

    def launches(self, w, desc, a, out, m, n, k, pdl):
        return self.by_shape[(n, k)].launches(w, desc, a, out, m, n, k, pdl)


def check() -> int:
    """The kernels against torch at small shapes (Triton's interpreter on the CPU, or a GPU)."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    # float16: the interpreter's bfloat16 products are wrong for every form, the reference's too
    DT = torch.float16 if INTERPRET else torch.bfloat16
    torch.manual_seed(0)
    bad = 0
    # (n, k): one tile of W rows and a ragged one; K cut in slices (serial and pass) at the first
    for n, k, m in ((64, 512, 8), (96, 256, 3), (128, 1024, 16)):
        w = torch.randn(n, k, dtype=DT, device=dev)
        a = torch.randn(m, k, dtype=DT, device=dev)
        want = (a.float() @ w.float().t()).cpu()
        for f in (
            Form("few", 32, 128, 2),
            Form("swap", 64, 128, 2),
            Form("swapt", 64, 64, 2),
            Form("swap", 64, 64, 3, mode="pass"),
            Form("swap", 64, 64, 2, early=128),  # a slice's first 128 (or all of it) before the wait
        ):
            if f.kind == "swapt" and n % f.bn:
                continue
            out = torch.zeros(m, n, dtype=DT, device=dev)
            for target, label in ((1, "whole K"), (16, f"{split_of(n, k, f.bn, f.bk, 16)} slices")):
                f.target = target
                out.zero_()
                for r in f.launches(w, f.descriptor(w), a, out, m, n, k, False):
                    r()
                err = float((out.float().cpu() - want).abs().max() / want.abs().max())
                ok = err < 2e-2
                bad += not ok
                print(
                    f"{f.name:<28} m={m} n={n} k={k} {label}: relative error {err:.2e} {'ok' if ok else 'WRONG'}"
                )
                if f.kind == "few":
                    break
    return int(bad > 0)


def compile_only(arch: int, quick: bool) -> int:
    """Every swapped form (each mode, both loads) to a cubin for ``arch``, no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failed, done = [], 0
    for f in [*forms(quick), *small_forms(), *mma_forms()]:
        if f.kind not in ("swap", "swapt"):
            continue
        for split, mode in ((1, 0), (4, 1 + SPLIT_MODES.index(f.mode))):
            sig = {
                "a_ptr": "*bf16", "w_ptr": "*bf16",
                "w_desc": f"tensordesc<bf16[{f.bn}, {f.bk}]>" if f.kind == "swapt" else "*bf16",
                "o_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
                "M": "i32", "N": "i32", "K": "i32", "KS": "i32",
            }  # fmt: skip
            consts = dict(
                BM=BM,
                BN=f.bn,
                BK=f.bk,
                STAGES=f.stages,
                SPLIT=split,
                MODE=mode,
                TMA=f.kind == "swapt",
                GDC=True,
                EK=min(f.early, 512),
            )
            sig.update({c: "constexpr" for c in consts})
            names = list(sig)
            try:
                c = triton.compile(
                    ASTSource(
                        _swap, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()}
                    ),
                    target=target,
                    options={"num_warps": f.warps},
                )
                wgmma = "wgmma" in c.asm.get("ptx", "")
                done += 1
                print(f"{f.name} split {split}: {c.metadata.shared} B shared, wgmma {wgmma}")
            except Exception as e:
                failed.append(
                    f"{f.name} split {split}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
                )
    print(f"swap_rows --compile-only {arch}: {done} compiled, {len(failed)} failed")
    for line in failed:
        print("  " + line)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--layers", type=int, default=LLAMA_1B["layers"])
    p.add_argument("--rows", default="8,1,16", help="row counts (comma-separated)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="two swapped tiles")
    p.add_argument("--whole-only", action="store_true", help="the whole chain only, not each site alone")
    p.add_argument("--chains", help="the chains to run (comma-separated: chain,q,o,g,d,h; default all)")
    p.add_argument(
        "--set",
        default="grid",
        choices=("grid", "small", "mma"),
        help="the grid, the small sites' forms, or the narrow warp-level forms",
    )
    p.add_argument(
        "--pick",
        action="append",
        default=[],
        help="a form per site, q=NAME,o=NAME,g=NAME,d=NAME,h=NAME (a site left out: cuBLAS); repeatable",
    )
    p.add_argument("--check", action="store_true", help="check the kernels against torch and exit")
    p.add_argument("--compile-only", type=int, metavar="ARCH", help="compile every form for sm_ARCH and exit")
    args = p.parse_args()
    if args.check:
        return check()
    if args.compile_only:
        return compile_only(args.compile_only, args.quick)
    if not torch.cuda.is_available():
        print("swap_rows: needs a CUDA GPU (or --check under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from bench.common import chain_row

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    shape, w = llama_1b_site_weights(args.layers, dev, dt)
    kd = shape["d"][1]  # the longest K: the chain's first input is this wide
    big = max(max(n, k) for n, k in shape.values())
    rows = [int(r) for r in args.rows.split(",")]
    bufs = [torch.randn(max(rows) * big, device=dev, dtype=dt) for _ in range(2)]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": args.layers,
        "rows": [],
    }

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    names = list(llama_1b_site_chains(args.layers))
    if args.whole_only:
        names = names[:1]
    if args.chains:
        names = [(c, seq) for c, seq in names if c in args.chains.split(",")]
    todo = {"grid": lambda: forms(args.quick), "small": small_forms, "mma": mma_forms}[args.set]()
    known = {f.name: f for f in [*forms(False), *small_forms(), *mma_forms()]}
    for pick in args.pick:
        chosen = dict(item.split("=", 1) for item in pick.split(","))
        todo.append(Picked({shape[c]: known[chosen.get(c, "cublas")] for c in "qogdh"}))
    first = torch.linspace(-1, 1, max(rows) * kd, device=dev, dtype=dt)
    want: dict = {}
    for m in rows:
        for f in [Form("vec")] * (m == 1) + todo:
            if m > BM and f.kind not in ("cublas",):
                continue
            try:
                descs = {s: [f.descriptor(t) for t in ts] for s, ts in w.items()}
            except Exception as e:
                print(
                    json.dumps({"form": f.name, "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True
                )
                continue
            for chain, seq in names:
                nbytes = sum(w[s][i].numel() * 2 for s, i in seq)
                pdl = f.kind != "cublas"
                row = {"form": f.name, "m": m, "chain": chain, "pdl": pdl, "gemms": len(seq), "bytes": nbytes}
                launches = []
                for j, (s, i) in enumerate(seq):
                    n, k = shape[s]
                    a = bufs[j % 2][: m * k].view(m, k)
                    out = bufs[(j + 1) % 2][: m * n].view(m, n)
                    launches += f.launches(w[s][i], descs[s][i], a, out, m, n, k, pdl)

                def run(launches=launches, m=m):
                    bufs[0][: m * kd].copy_(first[: m * kd])
                    for r in launches:
                        r()

                def diff(seq=seq, chain=chain, m=m):
                    n = shape[seq[-1][0]][0]
                    got = bufs[len(seq) % 2][: m * n].float().clone()
                    ref = want.setdefault((chain, m), got)
                    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

                chain_row(
                    row,
                    run,
                    args.repeats,
                    diff,
                    lambda us, nbytes=nbytes: {"tb_per_s": round(nbytes / us / 1e6, 3)},
                )
                result["rows"].append(row)
            f.scratch.clear()
            save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
