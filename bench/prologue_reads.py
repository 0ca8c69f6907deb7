"""What a one-row GEMV's norm prologue costs in reads beside its weights (issue 31, batch-1 decode).

At one row Llama's q/k/v and gate/up GEMVs compute the residual add and the RMSNorm in their
prologue (``gemm_render._vec_steps_norm``, factored: ``r * ((g * x) @ W^T)``): every block of two
rows of W loads the residual row and the sublayer's output row (``x0 + x1``, rounded as the
reference rounds the sum), and the norm's weight ``g``, 3 x 4 KiB at K 2048 beside its 8 KiB
(q/k/v) or 16 KiB (gate/up, both halves) of W, all from L2. This bench measures, before the
codegen changes, what reading less beside W buys in the step's chain:

- ``two rows``: the build's form today (the o and down GEMVs write their plain products);
- ``one row``: o and down add the residual in their epilogue and write the sum (one bf16 add per
  output: what the reference rounds), so the prologue loads one row (the same numbers, bit for bit);
- ``g folded``: and ``g`` multiplied into W's columns by the build (``W * g`` rounded to bf16), so
  the prologue loads no weight of the norm's.

Each row is Llama-3.2-1B's 16 layers of q/k/v, o, gate/up (SiLU product) and down in one CUDA
graph under programmatic dependent launch, every GEMV its own weights (2 GiB: cold), bfloat16.

    python3 bench/prologue_reads.py --json out.json
    TRITON_INTERPRET=1 python3 bench/prologue_reads.py --check     # the forms against torch
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _norm_gemv(x0_ptr, x1_ptr, sum_ptr, g_ptr, w_ptr, out_ptr, N, K: tl.constexpr,
               ROWS: tl.constexpr, G: tl.constexpr, HALVES: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    """Two rows of W a block (both halves of a stacked gate/up where ``HALVES``), all of K
    loaded before the wait (as the build's K steps are); the prologue sums ``ROWS`` input rows (the
    first block writing the sum, as the build's form does) and takes ``g`` where ``G``."""
    rn = tl.program_id(0) * 2 + tl.arange(0, 2)
    rk = tl.arange(0, K)
    w0 = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
    if HALVES:
        w1 = tl.load(w_ptr + (rn[:, None].to(tl.int64) + N) * K + rk[None, :])
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    r = tl.load(x0_ptr + rk).to(tl.float32)[None, :]
    if ROWS == 2:
        r = (r + tl.load(x1_ptr + rk).to(tl.float32)[None, :]).to(tl.bfloat16).to(tl.float32)
        if tl.program_id(0) == 0:
            tl.store(sum_ptr + rk[None, :], r.to(tl.bfloat16))
    a = r
    if G:
        a = tl.load(g_ptr + rk).to(tl.float32)[None, :] * r
    ss = r * r
    part0 = w0.to(tl.float32) * a
    if HALVES:
        part1 = w1.to(tl.float32) * a
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + 1e-5)
    acc0 = tl.sum(part0, axis=1) * rstd
    if HALVES:
        v = acc0.to(tl.bfloat16).to(tl.float32)
        v = (v * tl.sigmoid(v)).to(tl.bfloat16).to(tl.float32) * (tl.sum(part1, axis=1) * rstd)
        tl.store(out_ptr + rn, v.to(tl.bfloat16))
    else:
        tl.store(out_ptr + rn, acc0.to(tl.bfloat16))


@triton.jit
def _gemv(a_ptr, w_ptr, res_ptr, out_ptr, K: tl.constexpr, RES: tl.constexpr,
          GDC: tl.constexpr):  # fmt: skip
    """The default table's one-row form (two rows of W a block); ``RES``: the residual added to the
    rounded product in the epilogue (the sum the next prologue reads)."""
    rn = tl.program_id(0) * 2 + tl.arange(0, 2)
    rk = tl.arange(0, K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    part = w.to(tl.float32) * tl.load(a_ptr + rk).to(tl.float32)[None, :]
    y = tl.sum(part, axis=1).to(tl.bfloat16)
    if RES:
        y = (y.to(tl.float32) + tl.load(res_ptr + rn).to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + rn, y)


VARIANTS = {"two rows": (2, True), "one row": (1, True), "g folded": (1, False)}
LLAMA_1B = (2048, 8192, 3072)  # hidden, intermediate, q + k + v rows (32 + 8 + 8 heads of 64)
SMALL = (256, 512, 384)  # for the interpreter


def _weights(layers: int, dims, device: str) -> list[dict[str, torch.Tensor]]:
    d, ff, qkv = dims
    gen = torch.Generator(device="cpu").manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).to(device)

    out = []
    for _ in range(layers):
        g1 = (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(device)
        g2 = (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(device)
        lw = {"qkv": w(qkv, d), "o": w(d, d), "gu": w(2 * ff, d), "down": w(d, ff), "g1": g1, "g2": g2}
        # the build's folded weights: g in W's columns, rounded to bf16
        lw["qkv_g"] = (lw["qkv"].float() * g1.float()).to(torch.bfloat16)
        lw["gu_g"] = (lw["gu"].float() * g2.float()).to(torch.bfloat16)
        out.append(lw)
    return out


def _first_row(d: int, device: str) -> torch.Tensor:
    return (torch.randn(d, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16).to(device)


class Chain:
    """The layers' GEMVs of one variant over one set of buffers; ``out()`` the last layer's sum."""

    def __init__(self, weights, dims, variant: str, device: str):
        self.rows, self.g = VARIANTS[variant]
        self.w, self.dims = weights, dims
        d, ff, qkv = dims
        z = lambda n: torch.zeros(n, dtype=torch.bfloat16, device=device)  # noqa: E731
        self.h0 = _first_row(d, device)
        self.h, self.h1 = self.h0.clone(), z(d)  # the residual's sums, in turn
        self.qkv, self.o, self.act, self.d = z(qkv), z(d), z(ff), z(d)

    def __call__(self, pdl: bool) -> None:
        kw = {"launch_pdl": True} if pdl and not INTERPRET else {}
        gdc = pdl and not INTERPRET
        d, ff, nqkv = self.dims
        two = self.rows == 2
        h, h1 = self.h, self.h1
        for lw in self.w:
            # q/k/v of norm(h + d) (two rows: the prologue adds and writes the sum into h1) or of
            # norm(h) (one row: down added it)
            wq = lw["qkv"] if self.g else lw["qkv_g"]
            _norm_gemv[(nqkv // 2,)](h, self.d, h1, lw["g1"], wq, self.qkv, nqkv, d, self.rows, self.g,
                                     False, gdc, num_warps=2, num_stages=1, **kw)  # fmt: skip
            r = h1 if two else h  # the residual after this layer's first add
            # o (the attention's output stands in: the first d of q/k/v); one row: plus r, into h1
            _gemv[(d // 2,)](self.qkv, lw["o"], r, self.o if two else h1, d, not two, gdc,
                             num_warps=2, num_stages=1, **kw)  # fmt: skip
            wg = lw["gu"] if self.g else lw["gu_g"]
            # gate/up of norm(r + o) (two rows: writing the sum into h) or of norm(h1)
            x0 = r if two else h1
            _norm_gemv[(ff // 2,)](x0, self.o, h, lw["g2"], wg, self.act, ff, d, self.rows, self.g,
                                   True, gdc, num_warps=2, num_stages=1, **kw)  # fmt: skip
            # down: plain (two rows) or plus h1, into h (one row)
            _gemv[(d // 2,)](self.act, lw["down"], h1, self.d if two else h, ff, not two, gdc,
                             num_warps=2, num_stages=1, **kw)  # fmt: skip

    def out(self) -> torch.Tensor:
        if self.rows == 2:
            return (self.h.float() + self.d.float()).to(torch.bfloat16).float()
        return self.h.float()


def reference(weights, dims, variant: str, device: str) -> torch.Tensor:
    """The chain in torch, fp32 between the roundings the kernels make."""
    _, g = VARIANTS[variant]  # the same numbers whether the prologue or the GEMV before adds
    d, ff, _ = dims
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    h = _first_row(d, device).float()
    dn = torch.zeros(d, device=device)
    for lw in weights:
        r = bf(h + dn)
        rstd = 1 / torch.sqrt((r * r).mean() + 1e-5)
        qkv = bf(((lw["qkv"].float() * lw["g1"].float()) if g else lw["qkv_g"].float()) @ r * rstd)
        h1 = bf(r + bf(lw["o"].float() @ qkv[:d]))
        rstd = 1 / torch.sqrt((h1 * h1).mean() + 1e-5)
        both = ((lw["gu"].float() * lw["g2"].float()) if g else lw["gu_g"].float()) @ h1 * rstd
        v = bf(both[:ff])
        act = bf(bf(v * torch.sigmoid(v)) * both[ff:])
        h, dn = h1, bf(lw["down"].float() @ act)
    return bf(h + dn)


def check(device: str) -> None:
    dims = SMALL if INTERPRET else LLAMA_1B
    weights = _weights(2, dims, device)
    outs = {}
    for variant in VARIANTS:
        chain = Chain(weights, dims, variant, device)
        chain(pdl=False)
        outs[variant] = chain.out()
        want = reference(weights, dims, variant, device)
        err = ((outs[variant] - want).abs().max() / want.abs().max()).item()
        print(f"{variant}: largest difference {err:.2e} of the output's scale")
        assert err < 3e-2, variant
    # the same sums; the two-row chain's last add is torch's here (the interpreter's bf16 rounding
    # may differ from torch's by an ulp)
    assert torch.allclose(outs["two rows"], outs["one row"], rtol=2**-7, atol=0), (
        "the residual moved changed the sums"
    )


def measure(layers: int, rounds: int, pdl: bool) -> list[dict]:
    weights = _weights(layers, LLAMA_1B, "cuda")
    graphs = {}
    for variant in VARIANTS:
        chain = Chain(weights, LLAMA_1B, variant, "cuda")
        chain(pdl)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(pdl)
        graphs[variant] = graph
    times = {v: [] for v in VARIANTS}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):  # the variants alternate, round by round
        for variant, graph in graphs.items():
            graph.replay()
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            times[variant].append(start.elapsed_time(end) * 100 / layers)  # us a layer
    base = sorted(times["two rows"])[rounds // 2]
    rows = []
    for variant, ts in times.items():
        med = sorted(ts)[rounds // 2]
        rows.append({"variant": variant, "pdl": pdl, "us_per_layer": med, "of_two_rows": med / base})
        print(f"{variant:>9} pdl={pdl}: {med:.2f} us a layer ({med / base:.3f} of two rows)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.check or INTERPRET:
        check("cpu" if INTERPRET else "cuda")
        return
    rows = measure(args.layers, args.rounds, True) + measure(args.layers, args.rounds, False)
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
