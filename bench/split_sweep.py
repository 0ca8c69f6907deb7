"""K slices of the swapped few-row forms (decode at 2-16 rows) against the GPU's wave of blocks.

The built-in table runs a large weight at 2-16 rows on the swapped forms (``gemm_forms``'
``fews_*``: 64 rows of W per block on the product's wide side), K in slices where its tiles are
few: as many slices as make ``SPLIT_TARGET_BLOCKS`` (128) blocks (``gemm_render.split_factor``).
On an H200's 132 SMs that is a full wave at 32 or 64 tiles, but 1.09 waves at 48 (q/k/v: 3
slices, 144 blocks) and 1.33 at 88 (a stacked gate/up of 2 x 5632: 2 slices, 176 blocks), where
the 0.58B Llama's gate/up at 8 rows took 17.4 us + 1.7 for the slices' sum against 13.9 at one
row (``bench/results/profiles`` of 2026-12-01). This bench times each site's form at other
targets, as the codegen renders it for a bundle (``render_candidates``, its sm_90 kernels waiting
for the kernel before under programmatic dependent launch), in a chain of the model's layers (one
CUDA graph, every layer its own cold weight, A the same), µs per GEMM, the split's second kernel
included; beside it the site's default form, and the whole (unsliced) swapped form. Then each
model's layers (q/k/v, o, gate/up, down in turn) as one chain, every site on the default build's
form against every site on its fastest, twice each, alternating.

    python3 bench/split_sweep.py --json out.json              # ~2 min on an H200
    python3 bench/split_sweep.py --compile-only 90            # every kernel to an sm_90 cubin, no GPU
    TRITON_INTERPRET=1 python3 bench/split_sweep.py --check   # small shapes against torch, on the CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aot.codegen.gemm_forms import SWAPPED  # noqa: E402
from bench.fewrow_sweep import rendered_launches  # noqa: E402  (a rendered form's launches)

ROWS = 8  # --rows: A's rows (17-32: the 32-row swapped forms, tune's tiles and the library beside)
# model -> (layers, [(site, N, K, halves)]): N is the output's width; a stacked gate/up is its two
# halves (W of 2N rows), here written as gate + up (``_both_halves``) where the build's epilogue
# writes SiLU(gate) * up: after the K loop, either way
SITES = {
    "llama-3.2-1b": (
        16,
        [("qkv", 3072, 2048, False), ("o", 2048, 2048, False), ("gate_up", 8192, 2048, True), ("down", 2048, 8192, False)],
    ),
    # Qwen3-0.6B's and Qwen2.5-0.5B's gate/up: 6-8 MiB a half, 12-17 MiB in all
    "qwen3-0.6b": (28, [("gate_up", 3072, 1024, True)]),
    "qwen2.5-0.5b": (24, [("gate_up", 4864, 896, True)]),
    "llama-0.58b": (
        10,
        [("qkv", 3072, 2048, False), ("o", 2048, 2048, False), ("gate_up", 5632, 2048, True), ("down", 2048, 5632, False)],
    ),
    # sites of at most 8 MiB (tune's tiles by default), float16: GPT-2's and the example mlp's
    "gpt2": (12, [("qkv", 2304, 768, False), ("o", 768, 768, False), ("fc", 3072, 768, False), ("proj", 768, 3072, False)]),
    "mlp": (4, [("up", 4096, 1024, False), ("down", 1024, 4096, False)]),
    # vocabulary heads (two cold copies): Llama-3.2-1B's and GPT-2's
    "llama-3.2-1b-head": (2, [("head", 128256, 2048, False)]),
    "gpt2-head": (2, [("head", 50257, 768, False)]),
}  # fmt: skip
FLOAT16 = ("gpt2", "mlp", "gpt2-head")  # models in float16; the rest bfloat16
# the swapped forms with A's 64 or 128 rows on the product's narrow side (33-128 rows): measured
# here, not built (on an H200 every one of them lost to cuBLAS and the tiles at 128 rows,
# 2026-12-02: gemm_defaults' note on MANY_ROWS; that run's JSON was not kept)
SWAPPED_128 = tuple(
    replace(c, name=c.name.replace("_16x", f"_{rows}x"), block_m=rows, min_m=33, max_m=128)
    for rows in (64, 128)
    for c in SWAPPED
)
LIBRARY = "library"  # torch.mm (cuBLAS), as a bundle's library step runs the GEMM
MAX_ROWS = 128  # the rows a rendered form is built for at most (--rows up to this)
# at 17-32 rows, beside the swapped forms: the 16-row swapped form (two row blocks) and tune's tiles
MANY_ROW_OTHERS = ("fews_16x64x128", "tile_16x64x128", "tile_64x32x128", "tile_64x64x128")
TARGETS = (0, 96, 132, 176, 264, 396, 528)  # blocks to aim for; 0: the build's SPLIT_TARGET_BLOCKS
WHOLE = "fews_16x64x128"  # the swapped form without slices
CHECK_TOLERANCE = 2e-2  # of the outputs' scale: fp16 inputs, fp32 sums in another order
CHECK_SITES = [("qkv", 192, 1024, False), ("gate_up", 160, 1024, True)]


def _site(n: int, k: int, halves: bool, dtype: str):
    from aot.codegen.gemm_sites import Site
    from aot.schema import TensorSpec

    g = 2 if halves else 1
    outs = tuple(f"o{i}" for i in range(g))
    site = Site(
        id="split", library=(0,), a="a", weights=("w",) * g, biases=(None,) * g, activation="",
        gemm_outputs=outs, m="s0", n=n, k=k, dtype=dtype, outputs=outs, halves=halves,
    )  # fmt: skip
    buffers = {"a": TensorSpec(dtype, ("s0", str(k))), **{o: TensorSpec(dtype, ("s0", str(n))) for o in outs}}
    known = {"w": TensorSpec(dtype, (str(n * g), str(k)))}
    return site, buffers, known


@functools.cache
def rendered(n: int, k: int, halves: bool, dtype: str, form: str, target: int, pdl: bool) -> tuple:
    """The codegen's kernels of config ``form`` (its split target ``target`` blocks; 0: the
    build's) at this site: (name, [(jit function or None, Rendered)], workspaces); None where the
    form makes no kernel here. ``pdl``: the kernels wait for the kernel before (sm_90 cubins);
    no function is loaded where ``pdl`` is None (compile-only)."""
    from aot.codegen.compile import load_function
    from aot.codegen.gemm_defaults import default_configs
    from aot.codegen.gemm_forms import CONFIGS
    from aot.codegen.gemm_render import render_candidates
    from aot.codegen.render import kernel_id

    cfg = next(c for c in (*default_configs(), *CONFIGS, *SWAPPED_128) if c.name == form)
    if target:
        cfg = replace(cfg, target_blocks=target)
    if cfg.swap and cfg.split_k != 1:  # a split form at any K here (the build's takes K >= min_k)
        cfg = replace(cfg, min_k=min(cfg.min_k, k))
    site, buffers, known = _site(n, k, halves, dtype)
    for got, kernels, extra, _ in render_candidates(site, buffers, known, {"s0": (1, MAX_ROWS)}, (cfg,)):
        if halves:
            changed = [replace(r, source=_both_halves(r.source)) for r in kernels]
            assert changed != kernels, "no store of the first half found"
            kernels = changed
        fns = [
            (
                None
                if pdl is None
                else load_function(kernel_id(r.source, r.signature, r.config), r.name, r.source, pdl),
                r,
            )
            for r in kernels
        ]
        return got.name, fns, extra
    return None


def _both_halves(source: str) -> str:
    """A halves site without an epilogue stores the first half only (the kernel that writes the
    output: the split's reduce), and Triton would drop the second's loads and products: store
    their sum."""
    lines = [
        line.replace("acc0.to(", "(acc0 + acc1).to(")
        if line.lstrip().startswith("tl.store(out0_ptr")
        else line
        for line in source.split("\n")
    ]
    return "\n".join(lines)


def forms_of(n: int, k: int, halves: bool, dtype: str) -> list[tuple[str, int]]:
    """(form, target) pairs a site is timed with: the default build's form (first), the form it
    took before a stacked gate/up was sized by its 2N rows where that differs, both swapped split
    forms (K steps of 64 and of 128) at each of TARGETS, and the whole swapped form."""
    from aot.codegen.gemm_defaults import default_form

    default = default_form(ROWS, k, dtype, n, halves) or LIBRARY
    out = [(default, 0)]
    if ROWS > 32:  # 33-128 rows: the swapped forms of A's 128 rows (and 64), whole and in K slices
        for split in ("fews_splitk_128x64x64", "fews_splitk_128x64x128"):
            out += [(split, t) for t in (0, 132) if (split, t) not in out]
        others = ("fews_128x64x64", "fews_128x64x128", "fews_splitk_64x64x64", "fews_64x64x128")
        others += ("tilem_64x32x128", "tilem_64x64x128", "tileme_64x32x128", "tileme_64x64x128", LIBRARY)
        return out + [(form, 0) for form in others if (form, 0) not in out]
    if ROWS > 16:  # the 32-row forms at the build's split and a wave or two, tune's tiles, the library
        for split in ("fews_splitk_32x64x64", "fews_splitk_32x64x128"):
            out += [(split, t) for t in (0, 132) if (split, t) not in out]
        others = ("fews_32x64x128", *MANY_ROW_OTHERS, LIBRARY)
        return out + [(form, 0) for form in others if (form, 0) not in out]
    before = default_form(ROWS, k, dtype, n)
    if before != default:
        out.append((before, 0))
    for split in ("fews_splitk_16x64x64", "fews_splitk_16x64x128"):
        out += [(split, t) for t in TARGETS if (split, t) not in out]
    out += [(whole, 0) for whole in (WHOLE, "fews_16x64x64") if (whole, 0) not in out]
    return out


class Layer:
    """One layer's GEMM: its own W (cold in the chain), A shared, its outputs and workspaces."""

    def __init__(self, n: int, k: int, halves: bool, a: torch.Tensor):
        g = 2 if halves else 1
        self.n, self.k, self.halves, self.a = n, k, halves, a
        self.w = torch.randn(n * g, k, device=a.device, dtype=a.dtype) / k**0.5
        self.outs = {f"o{i}": torch.empty(a.shape[0], n, device=a.device, dtype=a.dtype) for i in range(g)}
        self.scratch: dict[str, torch.Tensor] = {}

    def launches(self, kernels: list, extra: dict, pdl: bool) -> list:
        from aot.symexpr import evaluate

        if kernels == LIBRARY:  # one torch.mm into the outputs (a stacked W: both halves)
            out = self.scratch.setdefault(
                "mm", torch.empty(self.a.shape[0], self.w.shape[0], device=self.a.device, dtype=self.a.dtype)
            )
            return [lambda: torch.mm(self.a, self.w.t(), out=out)]

        sizes = {"s0": self.a.shape[0]}
        bufs = {"a": self.a, "w": self.w, **self.outs}
        for name, spec in extra.items():  # the split's workspace
            shape = [evaluate(d, sizes) for d in spec.shape]
            bufs[name] = self.scratch.setdefault(name, torch.empty(shape, device=self.a.device))
        return rendered_launches(kernels, bufs, sizes, pdl)

    def error(self) -> float:
        """Largest difference from torch's product over the outputs' scale."""
        w = self.w.float()
        if self.halves:  # gate + up (``_both_halves``)
            w = w[: self.n] + w[self.n :]
        ref = self.a.float() @ w.t()
        got = self.outs["o0"].float()
        if "mm" in self.scratch:  # the library's product: both halves, side by side
            mm = self.scratch["mm"].float()
            got = mm[:, : self.n] + mm[:, self.n :] if self.halves else mm
        return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def _graph_us(runs: list) -> float:
    from aot.verify import timing

    return timing.graph_us(lambda: [r() for r in runs], torch.device("cuda"), 1, 20)


def _kernels(n: int, k: int, halves: bool, dtype: str, form: str, target: int, pdl: bool | None):
    """``rendered``'s (name, kernels, workspaces), or the library's (``LIBRARY`` as its kernels)."""
    if form == LIBRARY:
        return LIBRARY, LIBRARY, {}
    return rendered(n, k, halves, dtype, form, target, pdl)


def time_site(layers: int, n: int, k: int, halves: bool, dtype: torch.dtype, form: str, target: int) -> dict:
    got = _kernels(n, k, halves, DTYPES[dtype], form, target, True)
    if got is None:
        return {"form": form, "target": target, "error": "no kernel at this shape"}
    label, kernels, extra = got
    a = torch.randn(ROWS, k, device="cuda", dtype=dtype)
    chain = [Layer(n, k, halves, a) for _ in range(layers)]
    runs = [r for layer in chain for r in layer.launches(kernels, extra, True)]
    us = _graph_us(runs) / layers
    err = chain[0].error()
    blocks = 0
    if kernels != LIBRARY:
        blocks = 1
        for g in kernels[0][1].grid:
            blocks *= int(g) if str(g).isdigit() else 1
    nbytes = n * k * (2 if halves else 1) * dtype.itemsize
    del chain
    torch.cuda.empty_cache()
    return {
        "form": label, "target": target, "blocks": blocks, "us": round(us, 3),
        "tb_s": round(nbytes / us / 1e6, 2), "max_rel_diff": round(err, 5),
    }  # fmt: skip


DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def layer_chain_us(layers: int, sites: list, picks: dict, dtype: torch.dtype) -> float:
    """µs of the model's layers' four GEMMs in turn (one graph, every GEMM its own cold weight),
    each site on its picked (form, target)."""
    runs, keep = [], []
    a_by_k: dict[int, torch.Tensor] = {}
    for _ in range(layers):
        for site, n, k, halves in sites:
            _, kernels, extra = _kernels(n, k, halves, DTYPES[dtype], *picks[site], True)
            a = a_by_k.setdefault(k, torch.randn(ROWS, k, device="cuda", dtype=dtype))
            layer = Layer(n, k, halves, a)
            keep.append(layer)
            runs += layer.launches(kernels, extra, True)
    us = _graph_us(runs)
    del keep
    torch.cuda.empty_cache()
    return us


def sweep(args) -> dict:
    rows, chains = [], []
    for model in args.models.split(","):
        layers, sites = SITES[model]
        dtype = torch.float16 if model in FLOAT16 else torch.bfloat16
        picks: dict[str, dict[str, tuple[str, int]]] = {"default": {}, "fastest": {}}
        for site, n, k, halves in sites:
            best = None
            for i, (form, target) in enumerate(forms_of(n, k, halves, DTYPES[dtype])):
                row = {"model": model, "site": site, "n": n, "k": k, "halves": halves, "rows": ROWS}
                try:
                    row.update(time_site(layers, n, k, halves, dtype, form, target))
                except Exception as e:  # a form that does not compile or launch here: its error
                    row.update(form=form, target=target, error=f"{type(e).__name__}: {str(e)[:160]}")
                print(json.dumps(row), flush=True)
                rows.append(row)
                if i == 0:
                    picks["default"][site] = (form, target)
                if "us" in row and (best is None or row["us"] < best[0]):
                    best = (row["us"], (form, target))
            picks["fastest"][site] = best[1]
        for turn in range(2):  # twice each, alternating
            for label, pick in picks.items():
                us = layer_chain_us(layers, sites, pick, dtype)
                entry = {"model": model, "chain": label, "turn": turn, "us": round(us, 1), "picks": pick}
                print(json.dumps(entry), flush=True)
                chains.append(entry)
    return {"rows": rows, "chains": chains}


def compile_only(arch: int) -> int:
    """Every kernel of every (site, form, target) to a cubin for sm_<arch>, no GPU needed."""
    from aot.codegen.compile import Job, compile_job
    from aot.codegen.render import kernel_id

    seen, failed = set(), 0
    for _, (_, sites) in SITES.items():
        for _, n, k, halves in sites:
            for form, target in forms_of(n, k, halves, "bfloat16"):
                if form == LIBRARY:
                    continue
                got = rendered(n, k, halves, "bfloat16", form, target, None)
                if got is None:
                    continue
                label, kernels, _ = got
                for _, r in kernels:
                    if r.source in seen:
                        continue
                    seen.add(r.source)
                    try:
                        kid = kernel_id(r.source, r.signature, r.config)
                        compile_job(
                            Job(kid, r.name, r.source, r.signature, r.num_warps, r.num_stages, f"sm_{arch}")
                        )
                    except Exception as e:  # report every kernel that fails, then fail
                        failed += 1
                        print(f"{label} ({n}x{k}): {type(e).__name__}: {str(e)[:200]}")
    print(f"{len(seen)} kernels compiled for sm_{arch}, {failed} failed")
    return 1 if failed else 0


def check() -> int:
    """In Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, float16): every (form, target)
    at small shapes against torch's product."""
    worst, count = 0.0, 0
    cases = []
    for _, n, k, halves in CHECK_SITES:
        tiles = -(-n // 64)  # targets of 2 and 3 slices, and the build's (K's limit: 8)
        forms = [("fews_splitk_16x64x64", t) for t in (0, 2 * tiles, 3 * tiles)] + [(WHOLE, 0)]
        cases += [(8, n, k, halves, form, target) for form, target in forms]
    n, k, halves = CHECK_SITES[0][1:]  # the 32-row forms at 20 rows: rows past A's masked
    cases += [
        (20, n, k, halves, form, 0)
        for form in ("fews_splitk_32x64x64", "fews_splitk_32x64x128", "fews_32x64x128")
    ]
    cases += [  # and those of 64 and 128 at 100 rows
        (100, n, k, halves, form, 0)
        for form in ("fews_splitk_128x64x64", "fews_128x64x128", "fews_splitk_64x64x64", "fews_64x64x128")
    ]
    for rows, n, k, halves, form, target in cases:
        got = rendered(n, k, halves, "float16", form, target, False)
        if got is None:
            continue
        label, kernels, extra = got
        a = torch.randn(rows, k, dtype=torch.float16)
        layer = Layer(n, k, halves, a)
        for run in layer.launches(kernels, extra, False):
            run()
        err = layer.error()
        worst, count = max(worst, err), count + 1
        verdict = "ok" if err < CHECK_TOLERANCE else "WRONG"
        print(f"{label:28s} {rows} x {n}x{k}{' halves' if halves else ''}: max rel diff {err:.2e}: {verdict}")
    print(f"{count} forms, worst {worst:.2e}")
    return 0 if count and worst < CHECK_TOLERANCE else 1


def main() -> None:
    global ROWS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--models", default=",".join(SITES), help=f"comma-separated, of {', '.join(SITES)}")
    ap.add_argument(
        "--rows",
        type=int,
        default=ROWS,
        help=f"A's rows [default: {ROWS}; 17-32: the 32-row forms; 33-{MAX_ROWS}: those of 64 and 128]",
    )
    ap.add_argument("--check", action="store_true", help="small shapes in the interpreter against torch")
    ap.add_argument("--compile-only", type=int, metavar="ARCH", help="compile every kernel for sm_ARCH")
    args = ap.parse_args()
    if not 1 <= args.rows <= MAX_ROWS:
        ap.error(f"--rows {args.rows}: expected 1-{MAX_ROWS}")
    ROWS = args.rows
    if args.check:
        sys.exit(check())
    if args.compile_only:
        sys.exit(compile_only(args.compile_only))
    out = sweep(args)
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "device": torch.cuda.get_device_name()}, indent=1))


if __name__ == "__main__":
    main()
