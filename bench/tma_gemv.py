"""Batch-1 GEMVs whose weights stream through the tensor memory accelerator (TMA), against the
default table's dot-free form and against the GPU's streaming-read ceiling, measured before the
codegen and the loaders learn tensor descriptors (issue 31: the lever the persistent chains of
``persistent_chain.py`` and ``persistent_resident.py`` lacked: deep asynchronous weight pipelines).

Every row is a chain of GEMVs in one CUDA graph, bfloat16, every GEMV its own weights (cold: the
weights are 2.47 GB at Llama-3.2-1B's shapes, far beyond L2), each reading the output of the one
before (``chain``: every layer's q/k/v, o, gate/up and down, then the LM head; ``q``, ``o``,
``g``, ``d``, ``h``: the 16 layers' GEMVs of one site alone, or the head 4 times):

- ``stream``: no GEMV: one kernel per weight reading it and keeping a sum, 16 KiB per block and
  step: the bandwidth a plain read reaches on this GPU, the ceiling for every row below;
- ``vec``: the default table's form (two rows of W per block, K in steps of 1024, every W tile
  loaded before the wait for the kernel before under dependent launch);
- ``tma_<BN>x<BK>_s<S>``: one block per ``BN`` rows, W tiles of ``BN x BK`` loaded by TMA from a
  host-side tensor descriptor (``CUtensorMap``, 128 bytes by value), ``S`` tiles in flight
  (Triton's software pipeline: mbarriers, shared memory), the first tile loaded before the wait;
- ``tmap_<BN>x<BK>_s<S>_<B>``: a resident grid (``B`` blocks per SM), each block taking row
  tiles in turn in one pipelined loop over (tile, K step), so its pipeline does not drain
  between tiles.

Each variant plainly and under programmatic dependent launch (``_pdl``). Outputs are compared
with ``vec``'s (fp32 sums in another order: within bf16 rounding).

    python3 bench/tma_gemv.py --json out.json
    TRITON_INTERPRET=1 python3 bench/tma_gemv.py --check   # the kernels against torch, on the CPU
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

from bench.persistent_chain import (  # noqa: E402
    LLAMA_1B,
    _gemv_rows,
    llama_1b_site_chains,
    llama_1b_site_weights,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
STREAM_BLOCK, STREAM_STEPS = 8192, 8  # the ceiling's reads: elements per block and step, steps


@triton.jit
def _stream(w_ptr, o_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr, GDC: tl.constexpr):
    """Sums BLOCK * STEPS elements of w per block (one fp32 per block): a plain streaming read."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(STEPS):
        rk = base + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + rk, mask=rk < n, other=0.0).to(tl.float32)
    tl.store(o_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _gemv_tma(w_desc, a_ptr, o_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              STAGES: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    """BN rows of W per block, BN x BK tiles by TMA, STAGES in flight; the first before the wait."""
    n0 = tl.program_id(0) * BN
    w0 = w_desc.load([n0, 0])
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = w0.to(tl.float32) * tl.load(a_ptr + tl.arange(0, BK)).to(tl.float32)[None, :]
    for k in tl.range(BK, K, BK, num_stages=STAGES):
        w = w_desc.load([n0, k])
        acc += w.to(tl.float32) * tl.load(a_ptr + k + tl.arange(0, BK)).to(tl.float32)[None, :]
    tl.store(o_ptr + n0 + tl.arange(0, BN), tl.sum(acc, axis=1).to(o_ptr.dtype.element_ty))


@triton.jit
def _gemv_tma_resident(w_desc, a_ptr, o_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       STAGES: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    """A resident grid: row tiles pid, pid + grid, ... in one pipelined loop over (tile, K step)."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    kt: tl.constexpr = K // BK
    mine = tl.cdiv(tl.cdiv(N, BN) - pid, grid)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for i in tl.range(0, mine * kt, num_stages=STAGES):
        n0 = (pid + (i // kt) * grid) * BN
        k = (i % kt) * BK
        w = w_desc.load([n0, k])
        acc += w.to(tl.float32) * tl.load(a_ptr + k + tl.arange(0, BK)).to(tl.float32)[None, :]
        if i % kt == kt - 1:
            tl.store(o_ptr + n0 + tl.arange(0, BN), tl.sum(acc, axis=1).to(o_ptr.dtype.element_ty))
            acc = tl.zeros((BN, BK), dtype=tl.float32)


def _descriptor(w: torch.Tensor, bn: int, bk: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w, [bn, bk])


def _allocator() -> None:
    """Triton's global-scratch allocator (TMA kernels may ask for one)."""

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.int8)

    triton.set_allocator(alloc)


class Gemv:
    """One form: ``__call__(w, desc, a, out, n, k, pdl)`` launches it on one GEMV."""

    def __init__(self, kind: str, bn: int = 0, bk: int = 0, stages: int = 0, per_sm: int = 0, warps: int = 4):
        self.kind, self.bn, self.bk, self.stages, self.per_sm, self.warps = (
            kind,
            bn,
            bk,
            stages,
            per_sm,
            warps,
        )
        self.sms = (
            torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
        )

    @property
    def name(self) -> str:
        if self.kind in ("vec", "stream"):
            return self.kind
        tail = f"_{self.per_sm}" if self.kind == "tmap" else ""
        return f"{self.kind}_{self.bn}x{self.bk}_s{self.stages}{tail}" + (
            f"_w{self.warps}" if self.warps != 4 else ""
        )

    def descriptor(self, w: torch.Tensor):
        return _descriptor(w, self.bn, self.bk) if self.kind.startswith("tma") else None

    def __call__(self, w, desc, a, out, n: int, k: int, pdl: bool) -> None:
        kw = {"launch_pdl": True} if pdl and not INTERPRET else {}
        gdc = pdl and not INTERPRET
        if self.kind == "vec":
            _gemv_rows[(triton.cdiv(n, 2),)](w, a, out, n, k, 2, 1024, gdc, num_warps=2, num_stages=1, **kw)
        elif self.kind == "stream":
            per = STREAM_BLOCK * STREAM_STEPS
            _stream[(triton.cdiv(w.numel(), per),)](
                w, out, w.numel(), STREAM_BLOCK, STREAM_STEPS, gdc, num_warps=8, **kw
            )
        elif self.kind == "tma":
            _gemv_tma[(n // self.bn,)](
                desc, a, out, k, self.bn, self.bk, self.stages, gdc, num_warps=self.warps, **kw
            )
        else:
            grid = min(n // self.bn, self.sms * self.per_sm)
            _gemv_tma_resident[(grid,)](
                desc, a, out, n, k, self.bn, self.bk, self.stages, gdc, num_warps=self.warps, **kw
            )


def forms(quick: bool) -> list[Gemv]:
    out = [Gemv("stream"), Gemv("vec")]
    for bn, bk in ((16, 256), (32, 128), (8, 256)) if not quick else ((16, 256),):
        for stages in (3, 5) if not quick else (4,):
            out.append(Gemv("tma", bn, bk, stages))
    for bn, bk, stages, per_sm in ((16, 256, 4, 2), (16, 256, 6, 1), (32, 128, 6, 2)) if not quick else ():
        out.append(Gemv("tmap", bn, bk, stages, per_sm))
    return out


def check() -> int:
    """The TMA kernels against torch at small shapes (Triton's interpreter on the CPU, or a GPU)."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    _allocator()
    torch.manual_seed(0)
    bad = 0
    for n, k in ((64, 1024), (96, 2048)):  # K a multiple of vec's step of 1024
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
        a = torch.randn(k, dtype=torch.bfloat16, device=dev)
        want = (w.float() @ a.float()).cpu()
        for f in (Gemv("vec"), Gemv("tma", 16, 256, 2), Gemv("tma", 32, 128, 3), Gemv("tmap", 16, 256, 3, 1)):
            out = torch.empty(n, dtype=torch.bfloat16, device=dev)
            f(w, f.descriptor(w), a, out, n, k, False)
            err = float((out.float().cpu() - want).abs().max() / want.abs().max())
            ok = err < 2e-2
            bad += not ok
            print(f"{f.name:<22} n={n} k={k}: relative error {err:.2e} {'ok' if ok else 'WRONG'}")
    return int(bad > 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--layers", type=int, default=LLAMA_1B["layers"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="one TMA form, the whole chain only")
    p.add_argument("--check", action="store_true", help="check the kernels against torch and exit")
    args = p.parse_args()
    if args.check:
        return check()
    if not torch.cuda.is_available():
        print("tma_gemv: needs a CUDA GPU (or --check under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from bench.common import chain_row

    _allocator()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    shape, w = llama_1b_site_weights(args.layers, dev, dt)
    big = max(max(n, k) for n, k in shape.values())
    bufs = [torch.randn(big, device=dev, dtype=dt) for _ in range(2)]
    sink = torch.empty(1 << 20, device=dev, dtype=torch.float32)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": args.layers,
        "rows": [],
    }
    names = (
        list(llama_1b_site_chains(args.layers))
        if not args.quick
        else [next(iter(llama_1b_site_chains(args.layers)))]
    )
    want: dict[str, torch.Tensor] = {}
    for f in forms(args.quick):
        try:
            descs = {s: [f.descriptor(t) for t in ts] for s, ts in w.items()}
        except Exception as e:
            print(json.dumps({"form": f.name, "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
            continue
        for chain, seq in names:
            nbytes = sum(w[s][i].numel() * 2 for s, i in seq)
            for pdl in (False, True):
                row = {"form": f.name, "chain": chain, "pdl": pdl, "gemvs": len(seq), "bytes": nbytes}

                def run(seq=seq, pdl=pdl, f=f, descs=descs):
                    for j, (s, i) in enumerate(seq):
                        n, k = shape[s]
                        a, out = bufs[j % 2], bufs[(j + 1) % 2]
                        f(w[s][i], descs[s][i], a, sink if f.kind == "stream" else out, n, k, pdl)

                bufs[0].copy_(torch.linspace(-1, 1, big, device=dev, dtype=dt))

                def diff(seq=seq, chain=chain):
                    got = bufs[len(seq) % 2][: shape[seq[-1][0]][0]].float().clone()
                    ref = want.setdefault(chain, got)
                    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

                chain_row(
                    row,
                    run,
                    args.repeats,
                    None if f.kind == "stream" else diff,
                    lambda us, nbytes=nbytes: {"tb_per_s": round(nbytes / us / 1e6, 3)},
                )
                result["rows"].append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
