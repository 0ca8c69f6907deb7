"""One kernel per MLP block at batch 1, measured before building it: the up and down projections
of a block in one launch, against the two launches a default build runs (``vec_*`` GEMVs with the
norm in the up projection's prologue and the residual in the down projection's epilogue).

Each block of the fused kernel takes ``C`` hidden units: it norms the row, computes its units'
up projection (and activation; gate and up for a gated MLP), then their share of the down
projection, a ``[D]`` partial it adds into an fp32 accumulator with atomics (so the sums' order,
and the last bits, vary between runs). The down weight is stored transposed (``[H, D]``: each
block reads ``C`` whole rows). The next block's kernel (or the final norm) reads the previous
residual, the bias and the accumulator; block 0 stores the new residual and zeroes the
accumulator the kernel after it adds into. Every kernel launches early (programmatic dependent
launch) and loads its first weight tile before it waits.

Chains of every layer of a model's MLP blocks, each layer its own weights, and the final norm, in
one CUDA graph; µs per chain (median of replays), and the largest difference of the final output
against the two-kernel chain's (relative to its scale).

    python3 bench/fused_mlp.py --json out.json
    TRITON_INTERPRET=1 python3 bench/fused_mlp.py --check   # both chains against torch on the CPU

Measured on an H200 (torch 2.11, triton 3.6; ``bench/results/fused-mlp-h200-2026-11-30.json``):
slower everywhere, 1.5-1.6x the two-kernel chain at the best chunk (mlp 64.8 against 40.3 µs,
gpt2 136.4 against 89.3, llama-3.2-1b 704.4 against 464.5). A few hundred blocks each streaming
their units' rows tile after tile keep too few bytes in flight, as the persistent chains of
``persistent_chain.py`` did, and each block's ``D`` atomic adds come on top; the launch it saves
costs less. Not built into the codegen.
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

from aot.verify import timing  # noqa: E402

# d: model width, h: hidden units, norm: LayerNorm (with bias) or RMSNorm, act: 0 GELU (erf),
# 1 GELU (tanh), 2 SiLU (gated: SiLU(gate) * up)
MODELS = {
    "mlp": dict(d=1024, h=4096, layers=4, rms=False, act=0, gated=False, bias=True, dtype="float16"),
    "gpt2": dict(d=768, h=3072, layers=12, rms=False, act=1, gated=False, bias=True, dtype="float16"),
    "llama-3.2-1b": dict(
        d=2048, h=8192, layers=16, rms=True, act=2, gated=True, bias=False, dtype="bfloat16"
    ),
}
EPS = 1e-5
UP_ROWS, DOWN_ROWS, DOWN_BK = 2, 2, 1024  # the two-kernel chain: the default build's forms
TILE = 256  # the fused kernel's columns of D per step
CHUNKS = (16, 32, 64)  # hidden units per block of the fused kernel
# every kernel launched early (off in Triton's interpreter, which has no such launch)
DEPENDENT = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _act(y, ACT: tl.constexpr):
    if ACT == 0:
        out = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif ACT == 1:
        inner = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        out = 0.5 * y * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        out = y / (1.0 + tl.exp(-y))
    return out


@triton.jit
def _stats(r, mask, D: tl.constexpr, RMS: tl.constexpr, EPS: tl.constexpr):
    """(mean, 1 / std) of the row ``r`` (fp32, masked lanes 0); RMSNorm: (0, 1 / rms)."""
    if RMS:
        return 0.0, tl.rsqrt(tl.sum(r * r, 0) / D + EPS)
    mean = tl.sum(r, 0) / D
    c = tl.where(mask, r - mean, 0.0)
    return mean, tl.rsqrt(tl.sum(c * c, 0) / D + EPS)


@triton.jit
def _normed(r, mean, rstd, g_ptr, beta_ptr, cols, mask, RMS: tl.constexpr):
    """The row ``r`` (fp32) at columns ``cols`` normed with its (mean, 1 / std), the norm's weight
    (and LayerNorm's bias) applied; fp32."""
    y = (r - mean) * rstd * tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if not RMS:
        y += tl.load(beta_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _up(r_ptr, g_ptr, beta_ptr, w_ptr, b_ptr, h_ptr, H, D: tl.constexpr, BD: tl.constexpr,
        R: tl.constexpr, RMS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
        BIAS: tl.constexpr, EPS: tl.constexpr, GDC: tl.constexpr = True):  # fmt: skip
    rn = tl.program_id(0) * R + tl.arange(0, R)
    rd = tl.arange(0, BD)
    m = rd < D
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * D + rd[None, :], mask=m[None, :], other=0.0)
    if GATED:
        w2 = tl.load(w_ptr + (rn[:, None] + H).to(tl.int64) * D + rd[None, :], mask=m[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.load(r_ptr + rd, mask=m, other=0.0).to(tl.float32)
    mean, rstd = _stats(r, m, D, RMS, EPS)
    xn = _normed(r, mean, rstd, g_ptr, beta_ptr, rd, m, RMS)
    xn = tl.where(m, xn.to(h_ptr.dtype.element_ty).to(tl.float32), 0.0)
    y = tl.sum(w.to(tl.float32) * xn[None, :], 1)
    if BIAS:
        y += tl.load(b_ptr + rn).to(tl.float32)
    if GATED:
        y = _act(y, ACT) * tl.sum(w2.to(tl.float32) * xn[None, :], 1)
    else:
        y = _act(y, ACT)
    tl.store(h_ptr + rn, y.to(h_ptr.dtype.element_ty))


@triton.jit
def _down(h_ptr, w_ptr, b_ptr, res_ptr, out_ptr, D, H: tl.constexpr, BK: tl.constexpr,
          R: tl.constexpr, BIAS: tl.constexpr, GDC: tl.constexpr = True):  # fmt: skip
    rn = tl.program_id(0) * R + tl.arange(0, R)
    mn = rn < D
    part = tl.zeros((R, BK), dtype=tl.float32)
    for i in tl.static_range(0, H, BK):
        rk = i + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * H + rk[None, :], mask=mn[:, None], other=0.0)
        if GDC and i == 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        part += w.to(tl.float32) * tl.load(h_ptr + rk).to(tl.float32)[None, :]
    y = tl.sum(part, 1) + tl.load(res_ptr + rn, mask=mn, other=0.0).to(tl.float32)
    if BIAS:
        y += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _fused(rprev_ptr, bprev_ptr, accin_ptr, rout_ptr, zero_ptr, g_ptr, beta_ptr, wu_ptr, bu_ptr,
           wdt_ptr, accout_ptr, H, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
           C: tl.constexpr, FIRST: tl.constexpr, RMS: tl.constexpr, GATED: tl.constexpr,
           ACT: tl.constexpr, BIAS: tl.constexpr, EPS: tl.constexpr, GDC: tl.constexpr = True):  # fmt: skip
    pid = tl.program_id(0)
    rc = pid * C + tl.arange(0, C)
    rt = tl.arange(0, BT)
    dt = rout_ptr.dtype.element_ty
    # the first tile of the up weight before the wait (no kernel writes a weight)
    w0 = tl.load(wu_ptr + rc[:, None].to(tl.int64) * D + rt[None, :], mask=(rt < D)[None, :], other=0.0)
    if GATED:
        v0 = tl.load(
            wu_ptr + (rc[:, None] + H).to(tl.int64) * D + rt[None, :], mask=(rt < D)[None, :], other=0.0
        )
    else:
        v0 = w0
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rd = tl.arange(0, BD)
    m = rd < D
    r = tl.load(rprev_ptr + rd, mask=m, other=0.0).to(tl.float32)
    if not FIRST:  # the residual: the last one, its down projection's bias and the sums
        if BIAS:
            r += tl.load(bprev_ptr + rd, mask=m, other=0.0).to(tl.float32)
        r += tl.load(accin_ptr + rd, mask=m, other=0.0, cache_modifier=".cg")
        r = tl.where(m, r.to(dt).to(tl.float32), 0.0)
        if pid == 0:
            tl.store(rout_ptr + rd, r.to(dt), mask=m)
    if pid == 0:  # what the next kernel adds into: zero before it starts (it waits for this one)
        tl.store(zero_ptr + rd, tl.zeros((BD,), dtype=tl.float32), mask=m)
    mean, rstd = _stats(r, m, D, RMS, EPS)
    hu = tl.zeros((C,), dtype=tl.float32)
    hg = tl.zeros((C,), dtype=tl.float32)
    for t in tl.static_range(0, D, BT):
        cols = t + rt
        mt = cols < D
        if t == 0:
            w = w0
            v = v0
        else:
            w = tl.load(wu_ptr + rc[:, None].to(tl.int64) * D + cols[None, :], mask=mt[None, :], other=0.0)
            if GATED:
                v = tl.load(
                    wu_ptr + (rc[:, None] + H).to(tl.int64) * D + cols[None, :], mask=mt[None, :], other=0.0
                )
            else:
                v = w
        rt_ = tl.load(rprev_ptr + cols, mask=mt, other=0.0).to(tl.float32)
        if not FIRST:
            if BIAS:
                rt_ += tl.load(bprev_ptr + cols, mask=mt, other=0.0).to(tl.float32)
            rt_ += tl.load(accin_ptr + cols, mask=mt, other=0.0, cache_modifier=".cg")
            rt_ = rt_.to(dt).to(tl.float32)
        xn = _normed(rt_, mean, rstd, g_ptr, beta_ptr, cols, mt, RMS)
        xn = tl.where(mt, xn.to(dt).to(tl.float32), 0.0)
        hg += tl.sum(w.to(tl.float32) * xn[None, :], 1)
        if GATED:
            hu += tl.sum(v.to(tl.float32) * xn[None, :], 1)
    if BIAS:
        hg += tl.load(bu_ptr + rc).to(tl.float32)
    h = _act(hg, ACT) * hu if GATED else _act(hg, ACT)
    h = h.to(dt).to(tl.float32)  # the hidden row as the library rounds it
    for t in tl.static_range(0, D, BT):
        cols = t + rt
        mt = cols < D
        wd = tl.load(wdt_ptr + rc[:, None].to(tl.int64) * D + cols[None, :], mask=mt[None, :], other=0.0)
        tl.atomic_add(accout_ptr + cols, tl.sum(wd.to(tl.float32) * h[:, None], 0), mask=mt, sem="relaxed")


@triton.jit
def _final(r_ptr, b_ptr, acc_ptr, zero_ptr, g_ptr, beta_ptr, out_ptr, D: tl.constexpr,
           BD: tl.constexpr, RMS: tl.constexpr, FUSED: tl.constexpr, BIAS: tl.constexpr,
           EPS: tl.constexpr, GDC: tl.constexpr = True):  # fmt: skip
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rd = tl.arange(0, BD)
    m = rd < D
    r = tl.load(r_ptr + rd, mask=m, other=0.0).to(tl.float32)
    if FUSED:
        if BIAS:
            r += tl.load(b_ptr + rd, mask=m, other=0.0).to(tl.float32)
        r += tl.load(acc_ptr + rd, mask=m, other=0.0, cache_modifier=".cg")
        r = tl.where(m, r.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
        tl.store(zero_ptr + rd, tl.zeros((BD,), dtype=tl.float32), mask=m)  # the first layer's, next replay
    mean, rstd = _stats(r, m, D, RMS, EPS)
    y = _normed(r, mean, rstd, g_ptr, beta_ptr, rd, m, RMS)
    tl.store(out_ptr + rd, y.to(out_ptr.dtype.element_ty), mask=m)


class Chain:
    """A model's MLP blocks (each layer its own weights) and the buffers both chains use."""

    def __init__(self, cfg: dict, layers: int, device: str = "cuda"):
        self.cfg, self.layers = cfg, layers
        d, h = cfg["d"], cfg["h"]
        dt = getattr(torch, cfg["dtype"])
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

        up_rows = 2 * h if cfg["gated"] else h
        self.x = rand(d)
        self.norm_g = [1.0 + rand(d, scale=0.1) for _ in range(layers + 1)]
        self.norm_b = [rand(d, scale=0.1) for _ in range(layers + 1)]
        self.wu = [rand(up_rows, d, scale=d**-0.5) for _ in range(layers)]
        self.bu = [rand(up_rows, scale=0.1) for _ in range(layers)]
        self.wd = [rand(d, h, scale=h**-0.5) for _ in range(layers)]
        self.wdt = [w.t().contiguous() for w in self.wd]  # stored for the fused kernel: [H, D]
        self.bd = [rand(d, scale=0.1) for _ in range(layers)]
        self.hid = torch.empty(h, dtype=dt, device=device)
        self.res = [torch.empty(d, dtype=dt, device=device) for _ in range(layers + 1)]
        self.acc = [torch.zeros(d, dtype=torch.float32, device=device) for _ in range(layers)]
        self.out = torch.empty(d, dtype=dt, device=device)
        self.bd_ = triton.next_power_of_2(d)

    def two_kernels(self):
        c, d, h = self.cfg, self.cfg["d"], self.cfg["h"]
        flags = dict(RMS=c["rms"], EPS=EPS)
        r = self.x
        for i in range(self.layers):
            _up[(triton.cdiv(h, UP_ROWS),)](
                r, self.norm_g[i], self.norm_b[i], self.wu[i], self.bu[i], self.hid, h, d, self.bd_, UP_ROWS,
                GATED=c["gated"], ACT=c["act"], BIAS=c["bias"], num_warps=2, GDC=DEPENDENT, launch_pdl=DEPENDENT, **flags,
            )  # fmt: skip
            _down[(triton.cdiv(d, DOWN_ROWS),)](
                self.hid, self.wd[i], self.bd[i], r, self.res[i + 1], d, h, min(DOWN_BK, h), DOWN_ROWS,
                BIAS=c["bias"], num_warps=2, GDC=DEPENDENT, launch_pdl=DEPENDENT,
            )  # fmt: skip
            r = self.res[i + 1]
        _final[(1,)](
            r, r, self.acc[0], self.acc[0], self.norm_g[-1], self.norm_b[-1], self.out, d, self.bd_,
            FUSED=False, BIAS=c["bias"], num_warps=4, GDC=DEPENDENT, launch_pdl=DEPENDENT, **flags,
        )  # fmt: skip

    def fused(self, chunk: int, warps: int):
        c, d, h, n = self.cfg, self.cfg["d"], self.cfg["h"], self.layers
        # three layers at least: with two, layer 1 would zero acc[0] (the next replay's) while its
        # own blocks still read it as layer 0's sums
        assert n >= 3, "the fused chain rotates its accumulators over three layers or more"
        flags = dict(RMS=c["rms"], EPS=EPS)
        for i in range(n):
            # layer i adds into acc[i]; its residual r_i is r_{i-1} (the input, or res[i - 1], stored by
            # layer i - 1's block 0) plus layer i - 1's bias and sums, which its block 0 stores to
            # res[i]; it zeroes acc[i + 1] (the last layer: acc[0], which the next replay's first adds into)
            prev = self.x if i <= 1 else self.res[i - 1]
            _fused[(h // chunk,)](
                prev, self.bd[i - 1], self.acc[i - 1], self.res[i], self.acc[(i + 1) % n],
                self.norm_g[i], self.norm_b[i], self.wu[i], self.bu[i], self.wdt[i], self.acc[i],
                h, d, self.bd_, TILE, chunk, FIRST=i == 0, GATED=c["gated"], ACT=c["act"], BIAS=c["bias"],
                num_warps=warps, GDC=DEPENDENT, launch_pdl=DEPENDENT, **flags,
            )  # fmt: skip
        _final[(1,)](
            self.res[n - 1] if n > 1 else self.x, self.bd[n - 1], self.acc[n - 1], self.acc[0], self.norm_g[-1],
            self.norm_b[-1], self.out, d, self.bd_, FUSED=True, BIAS=c["bias"], num_warps=4, GDC=DEPENDENT, launch_pdl=DEPENDENT,
            **flags,
        )  # fmt: skip


def reference(chain: Chain) -> torch.Tensor:
    """The chain's output in torch, rounded where the kernels round (the normed row, the hidden
    units and each block's residual to the model's dtype; sums in fp32)."""
    c, dt = chain.cfg, chain.out.dtype

    def norm(r, i):
        r = r.float()
        if c["rms"]:
            y = r * torch.rsqrt((r * r).mean() + EPS) * chain.norm_g[i].float()
        else:
            y = (r - r.mean()) * torch.rsqrt(((r - r.mean()) ** 2).mean() + EPS) * chain.norm_g[i].float()
            y = y + chain.norm_b[i].float()
        return y

    def act(y):
        if c["act"] == 0:
            return torch.nn.functional.gelu(y)
        if c["act"] == 1:
            return torch.nn.functional.gelu(y, approximate="tanh")
        return torch.nn.functional.silu(y)

    r, h = chain.x, c["h"]
    for i in range(chain.layers):
        xn = norm(r, i).to(dt).float()
        up = chain.wu[i].float() @ xn + (chain.bu[i].float() if c["bias"] else 0.0)
        y = act(up[:h]) * (chain.wu[i].float()[h:] @ xn) if c["gated"] else act(up)
        down = (
            chain.wd[i].float() @ y.to(dt).float() + r.float() + (chain.bd[i].float() if c["bias"] else 0.0)
        )
        r = down.to(dt)
    return norm(r, chain.layers).to(dt)


def check() -> int:
    """Both chains of every model's block, at a small width (64 wide, 256 hidden units, three
    layers: the fused chain's accumulators rotate over the layers and need three), against
    ``reference`` (Triton's interpreter on the CPU, or a GPU); ok/WRONG each."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    bad = 0
    for name, cfg in MODELS.items():
        chain = Chain({**cfg, "d": 64, "h": 256}, 3, dev)
        want = reference(chain).float().cpu()
        chain.two_kernels()
        two = chain.out.float().cpu()
        for a in chain.acc:
            a.zero_()
        chain.fused(CHUNKS[0], 4)
        fused = chain.out.float().cpu()
        for form, got in (("two kernels", two), ("fused", fused)):
            err = float((got - want).abs().max() / want.abs().max())
            ok = err < 3e-2
            bad += not ok
            print(f"{name:<13} {form:<12} relative error {err:.2e} {'ok' if ok else 'WRONG'}")
    return int(bad > 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument(
        "--check", action="store_true", help="both chains against torch at a small width, and exit"
    )
    args = ap.parse_args()
    if args.check:
        raise SystemExit(check())
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    for name in args.models.split(","):
        cfg = MODELS[name]
        chain = Chain(cfg, cfg["layers"])
        dev = torch.device("cuda")
        base_us = timing.graph_us(chain.two_kernels, dev, 1, args.repeats)
        chain.two_kernels()
        torch.cuda.synchronize()
        want = chain.out.float().clone()
        row = {"layers": cfg["layers"], "two_kernels_us": round(base_us, 1), "fused": []}
        for chunk in CHUNKS:
            for warps in (4, 8):
                try:
                    us = timing.graph_us(
                        lambda c=chunk, w=warps, ch=chain: ch.fused(c, w), dev, 1, args.repeats
                    )
                    for a in chain.acc:
                        a.zero_()
                    chain.fused(chunk, warps)
                    torch.cuda.synchronize()
                    err = (chain.out.float() - want).abs().max().item() / max(1.0, want.abs().max().item())
                    row["fused"].append({"chunk": chunk, "warps": warps, "us": round(us, 1), "rel_err": err})
                except Exception as e:  # a form that does not compile or fit: reported, not fatal
                    row["fused"].append(
                        {"chunk": chunk, "warps": warps, "error": str(e).splitlines()[0][:200]}
                    )
                for a in chain.acc:
                    a.zero_()
        best = min((f for f in row["fused"] if "us" in f), key=lambda f: f["us"], default=None)
        print(f"{name}: two kernels a block {base_us:.1f} µs; fused: " + ", ".join(
            f"C{f['chunk']}/w{f['warps']} " + (f"{f['us']:.1f} µs (err {f['rel_err']:.1e})" if "us" in f else f["error"])
            for f in row["fused"]
        ) + (f"; best {best['us'] / base_us:.2f}x" if best else ""))  # fmt: skip
        results[name] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
