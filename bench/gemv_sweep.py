"""Sweep one-row GEMV shapes (decode at batch 1) on the GPU, with cold weights, against cuBLAS and
a plain read of the same bytes.

Decides the built-in one-row table (``codegen/gemm_defaults.py``) and the shape of the dot-free
forms (``codegen/gemm_forms.py``): rows per block, K step, warps, K slices. Each form is timed as
a bundle runs it: back to back in one CUDA graph, every launch reading its own copy of W (the copies
together over twice L2), A the same each launch. ``read`` is a kernel that only sums W's bytes
with the same grid shape rules: the bandwidth a GEMV of that size can reach at most.

``--chain``: a decode step's GEMVs (every layer its own weights, the LM head last) in one graph,
cuBLAS against the best form of each shape, launched plainly and with programmatic dependent
launch (each kernel's W loads start before it waits for the kernel before).

    python3 bench/gemv_sweep.py --json out/gemv.json
    python3 bench/gemv_sweep.py --model llama-3.2-1b --chain --json out/chain.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from aot.verify import timing

# (site, N, K) of each model's decode GEMVs; gate/up stacked as one GEMM, as the build fuses them.
MODELS = {
    "llama-3.2-1b": {
        "layers": 16,
        "sites": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
        "head": ("lm_head", 128256, 2048),
    },
    "llama-0.58b": {
        "layers": 10,
        "sites": [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)],
        "head": ("lm_head", 32000, 2048),
    },
    "gpt2": {
        "layers": 12,
        "sites": [("qkv", 2304, 768), ("o", 768, 768), ("fc", 3072, 768), ("proj", 768, 3072)],
        "head": ("lm_head", 50257, 768),
    },
}


@triton.jit
def _gemv(a_ptr, w_ptr, o_ptr, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
          SPLIT: tl.constexpr, GDC: tl.constexpr, LATE: tl.constexpr = False):  # fmt: skip
    """R rows of W per block, K in SPLIT slices (atomics into fp32 when SPLIT > 1), every K step
    unrolled and its W tile loaded before the wait (GDC: dependent launch; LATE: the kernel after
    may start once every block stored, not once every block waited)."""
    rn = tl.program_id(0) * R + tl.arange(0, R)
    mask_n = rn < N
    KS: tl.constexpr = K // SPLIT
    k0 = tl.program_id(1) * KS
    part = tl.zeros((R, BK), dtype=tl.float32)
    for i in tl.static_range(0, KS, BK):
        rk = k0 + i + tl.arange(0, BK)
        mask_k = rk < k0 + KS
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        if GDC and i == 0:
            tl.extra.cuda.gdc_wait()
            if not LATE:
                tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(a_ptr + rk, mask=mask_k, other=0.0)
        part += w.to(tl.float32) * a.to(tl.float32)[None, :]
    acc = tl.sum(part, axis=1)
    if SPLIT == 1:
        tl.store(o_ptr + rn, acc.to(o_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.atomic_add(o_ptr + rn, acc, mask=mask_n, sem="relaxed")
    if GDC and LATE:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _read(w_ptr, o_ptr, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Sums R rows of W: the bytes a GEMV reads, and nothing else."""
    rn = tl.program_id(0) * R + tl.arange(0, R)
    mask_n = rn < N
    part = tl.zeros((R, BK), dtype=tl.float32)
    for i in tl.static_range(0, K, BK):
        rk = i + tl.arange(0, BK)
        part += tl.load(
            w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None], other=0.0
        ).to(tl.float32)
    tl.store(o_ptr + rn, tl.sum(part, axis=1), mask=mask_n)


def graph_us(runs, per: int, repeats: int = 20) -> float:
    """Median µs of ``runs`` (callables, each launching once) captured in one graph, divided by
    ``per`` (the launches one form's time stands for)."""
    return timing.graph_us(lambda: [r() for r in runs], torch.device("cuda"), 1, repeats) / per


def forms(k: int):
    for r, bk, warps, split in itertools.product(
        (1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8), (1, 2, 4)
    ):
        steps = -(-(k // split) // bk)
        if k % split or steps > 8 or r * bk > 16384 or (bk > k // split and bk > 256):
            continue
        yield {"rows": r, "block_k": bk, "warps": warps, "split": split}


def table_form(k: int) -> dict:
    """The default build's one-row form at ``k`` (``aot.codegen.gemm_defaults.default_form``)."""
    if k <= 1024:
        return {"rows": 2, "block_k": 512, "warps": 4, "split": 1}
    if k >= 4096:
        return {"rows": 1, "block_k": 1024, "warps": 8, "split": 1}
    return {"rows": 1, "block_k": 2048 if k % 2048 == 0 else 512, "warps": 4, "split": 1}


def launcher(form, a, w, out, n, k, pdl=False):
    """``pdl``: False, True (the kernel after may start once every block waited) or "late" (once
    every block stored)."""
    grid = (triton.cdiv(n, form["rows"]), form["split"])
    kw = {"num_warps": form["warps"], "num_stages": 1}
    if pdl:
        kw["launch_pdl"] = True
    gdc, late = bool(pdl), pdl == "late"
    return lambda: _gemv[grid](a, w, out, n, k, form["rows"], form["block_k"], form["split"], gdc, late, **kw)


def compile_ahead(todo, a, w, out, n, k):
    """Compile every form first, in threads (ptxas runs in processes of its own)."""

    def one(form):
        try:
            _gemv.warmup(a, w, out, n, k, form["rows"], form["block_k"], form["split"], False,
                         num_warps=form["warps"], num_stages=1, grid=(1,))  # fmt: skip
        except Exception:
            pass  # the timing loop reports it

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, todo))


def copies_of(n: int, k: int, dtype, l2: int) -> list[torch.Tensor]:
    size = n * k * dtype.itemsize
    count = max(2, -(-2 * l2 // size) + 1)
    return [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(count)]


def sweep_shape(name: str, n: int, k: int, dtype, l2: int) -> dict:
    ws = copies_of(n, k, dtype, l2)
    a = torch.randn(k, device="cuda", dtype=dtype)
    ref = (ws[0].float() @ a.float()).to(dtype)
    bytes_ = n * k * dtype.itemsize
    row = {"site": name, "n": n, "k": k, "bytes": bytes_, "forms": []}
    outs = [torch.empty(n, device="cuda", dtype=dtype) for _ in ws]
    row["cublas_us"] = graph_us([lambda w=w, o=o: torch.mv(w, a, out=o) for w, o in zip(ws, outs)], len(ws))
    best_read = None
    for r, bk in ((4, 1024), (8, 512), (16, 256), (2, 2048)):
        if k % bk:
            continue
        grid = (triton.cdiv(n, r),)
        acc = [torch.empty(n, device="cuda", dtype=torch.float32) for _ in ws]
        us = graph_us(
            [
                lambda w=w, o=o, g=grid, r=r, bk=bk: _read[g](w, o, n, k, r, bk, num_warps=4)
                for w, o in zip(ws, acc)
            ],
            len(ws),
        )
        best_read = us if best_read is None else min(best_read, us)
    row["read_us"] = best_read
    compile_ahead(list(forms(k)), a, ws[0], outs[0], n, k)
    for form in forms(k):
        out32 = [torch.zeros(n, device="cuda", dtype=torch.float32) for _ in ws]
        dst = out32 if form["split"] > 1 else outs
        try:
            launcher(form, a, ws[0], dst[0], n, k)()
            torch.cuda.synchronize()
            got = dst[0].to(dtype) if form["split"] == 1 else None
            if got is not None and not torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2):
                row["forms"].append({**form, "error": "wrong result"})
                continue
            if form["split"] > 1:  # atomics: the zeroing is part of the form's cost
                runs = []
                for w, o in zip(ws, dst):
                    runs += [o.zero_, launcher(form, a, w, o, n, k)]
                us = graph_us(runs, len(ws))
            else:
                us = graph_us([launcher(form, a, w, o, n, k) for w, o in zip(ws, dst)], len(ws))
        except Exception as e:  # a form that does not compile or launch here
            row["forms"].append({**form, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        row["forms"].append({**form, "us": round(us, 2), "tb_s": round(bytes_ / us / 1e6, 3)})
    timed = [f for f in row["forms"] if "us" in f]
    timed.sort(key=lambda f: f["us"])
    row["best"] = timed[:5]
    del ws
    torch.cuda.empty_cache()
    return row


def chain(model: str, best: dict, dtype, pdl) -> float:
    """µs of one decode step's GEMVs in one graph. ``pdl``: None (cuBLAS), False, True, "late"
    (``launcher``'s), or a policy ``(blocks, blocks of the kernel before) -> bool`` deciding per
    kernel whether it launches early."""
    spec = MODELS[model]
    sites = [*spec["sites"]] * spec["layers"] + [spec["head"]]
    runs, keep, a_by_k, before = [], [], {}, 0
    for site, n, k in sites:
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        a = a_by_k.setdefault(k, torch.randn(k, device="cuda", dtype=dtype))
        o = torch.empty(n, device="cuda", dtype=dtype)
        keep += [w, o]
        blocks = -(-n // best[site + "/unsplit"]["rows"])
        early = pdl(blocks, before) if callable(pdl) else pdl
        runs.append(_one(best, site, n, k, a, w, o, early))
        before = blocks
    us = graph_us(runs, 1)
    del keep
    torch.cuda.empty_cache()
    return us


def _one(best, site, n, k, a, w, o, pdl):
    if pdl is None:
        return lambda: torch.mv(w, a, out=o)
    form = dict(best[site])
    if form["split"] > 1:  # the chain keeps to one launch per GEMV: the best unsplit form
        form = best[site + "/unsplit"]
    return launcher(form, a, w, o, n, k, pdl=pdl)


def policies() -> dict:
    """Dependent-launch policies the chain tries: early launch only for kernels of at most T
    blocks, only after kernels of at most T blocks, or both."""
    out = {}
    for t in (1056, 2112, 4224):
        out[f"self_le_{t}"] = lambda b, p, t=t: b <= t
        out[f"prev_le_{t}"] = lambda b, p, t=t: p <= t
        out[f"both_le_{t}"] = lambda b, p, t=t: b <= t and p <= t
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=sorted(MODELS), help="models (default: all)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--chain", action="store_true", help="also time each model's decode GEMVs in one graph")
    p.add_argument(
        "--chain-only", action="store_true", help="--chain with the default table's forms, no sweep"
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gemv_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 << 20)
    result = {
        "device": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "shapes": [],
        "chains": [],
    }
    models = args.model or sorted(MODELS)
    done = {}
    for model in models:
        spec = MODELS[model]
        best = {}
        for site, n, k in [*spec["sites"], spec["head"]]:
            if args.chain_only:
                best[site] = best[site + "/unsplit"] = table_form(k)
                continue
            if (n, k) not in done:
                row = sweep_shape(site, n, k, dtype, l2)
                row["model"] = model
                done[(n, k)] = row
                result["shapes"].append(row)
                b = row["best"][0] if row["best"] else None
                print(
                    f"{model:14s} {site:8s} N={n:6d} K={k:5d}  cuBLAS {row['cublas_us']:7.2f} µs  read {row['read_us']:7.2f}"
                    f"  best {b['us'] if b else '-':>7} µs {b if b else ''}",
                    flush=True,
                )
            row = done[(n, k)]
            timed = sorted((f for f in row["forms"] if "us" in f), key=lambda f: f["us"])
            best[site] = timed[0]
            best[site + "/unsplit"] = next(f for f in timed if f["split"] == 1)
        if args.chain or args.chain_only:
            entry = {"model": model, "cublas_us": chain(model, best, dtype, None)}
            entry["triton_us"] = chain(model, best, dtype, False)
            for key, pdl in (("triton_pdl_us", True), ("triton_pdl_late_us", "late")):
                try:
                    entry[key] = chain(model, best, dtype, pdl)
                except Exception as e:
                    entry[key.replace("_us", "_error")] = f"{type(e).__name__}: {str(e)[:200]}"
            if args.chain_only:
                for name, policy in policies().items():
                    entry[f"triton_pdl_{name}_us"] = chain(model, best, dtype, policy)
                two = {s: (f if f["block_k"] < 1024 else {"rows": 2, "block_k": 1024, "warps": 2, "split": 1})
                       for s, f in best.items()}  # fmt: skip
                entry["two_rows_us"] = chain(model, two, dtype, False)
                entry["two_rows_pdl_us"] = chain(model, two, dtype, True)
            entry["forms"] = {s: f for s, f in best.items() if "/" not in s}
            result["chains"].append(entry)
            print(
                f"{model} chain: {json.dumps({k: v for k, v in entry.items() if k != 'forms'})}", flush=True
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
