"""Turn benchmark result files into a markdown report with ratios.

python bench/report.py OUT/results-*.json > bench/RESULTS.md
"""

from __future__ import annotations

import json
import sys

NAMES = {
    "eager": "eager",
    "graph": "eager + CUDA graph",
    "compile": "torch.compile",
    "reduce-overhead": "reduce-overhead",
    "aoti": "AOTInductor",
    "aotpack": "aotpack",
    "aotpack-borrow": "aotpack (borrowed outputs)",
}
ORDER = list(NAMES)


def load(paths: list[str]) -> tuple[dict, list[dict], dict]:
    meta, runs, extra = {}, [], {"bundle_bytes": {}, "weights_bytes": {}, "import_torch_s": []}
    for p in paths:
        data = json.load(open(p))
        meta = data["device"]
        runs += data["runs"]
        extra["bundle_bytes"].update(data.get("bundle_bytes", {}))
        extra["weights_bytes"].update(data.get("weights_bytes", {}))
        extra["import_torch_s"].append(data["import_torch_s"])
    return meta, runs, extra


def pick(runs, model, system, run=None):
    for r in runs:
        if r["model"] == model and r["system"] == system and (run is None or r["run"] == run):
            return r
    return None


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "—"


def fmt(v, unit=""):
    return "—" if v is None else f"{v:.3f}{unit}" if v < 10 else f"{v:.1f}{unit}"


def main(paths: list[str]) -> None:
    meta, runs, extra = load(paths)
    models = list(dict.fromkeys(r["model"] for r in runs))
    out = [
        "# aotpack benchmark",
        "",
        f"{meta['gpu']} ({meta['nvidia_smi']}), torch {meta['torch']}, triton {meta['triton']}, "
        f"Python {meta['python']}, {meta['date']}. fp16, random weights loaded from safetensors, every system "
        "in its own fresh process. aotpack bundles were built on a CPU-only machine (torch 2.13, triton 3.9).",
        "",
        f'`python -c "import torch"`: {min(extra["import_torch_s"]):.2f} s (the floor under every cold start).',
        "",
        "## Per-call latency, median ms (p90), synchronized, 200 calls after warm-up",
        "",
        "| model | shape | "
        + " | ".join(NAMES[s] for s in ORDER)
        + " | aotpack / best other | / reduce-overhead | / CUDA graph |",
        "|---" * (len(ORDER) + 5) + "|",
    ]
    for m in models:
        shapes = []
        for r in runs:
            if r["model"] == m and "shapes" in r:
                shapes += [k for k in r["shapes"] if k not in shapes]
        for shape in shapes:
            cells, med = [], {}
            for s in ORDER:
                r = pick(runs, m, s, "warm") if s in ("compile", "reduce-overhead") else pick(runs, m, s)
                v = r["shapes"].get(shape) if r and "shapes" in r else None
                if v:
                    med[s] = v["median_ms"]
                    cells.append(f"{v['median_ms']:.3f} ({v['p90_ms']:.3f})")
                else:
                    cells.append("—" if r is None or not r.get("error") else "failed")
            a = med.get("aotpack")
            others = [v for s, v in med.items() if not s.startswith("aotpack")]
            out.append(
                f"| {m} | {shape} | "
                + " | ".join(cells)
                + f" | {_ratio(a, min(others) if others else None)} | "
                f"{_ratio(a, med.get('reduce-overhead'))} | {_ratio(a, med.get('graph'))} |"
            )
    out += [
        "",
        "## Cold start (process spawn → first correct output), s",
        "",
        "| model | eager | eager + graph | compile cold / warm | reduce-overhead cold / warm | AOTInductor load | aotpack | "
        "aotpack / eager | aotpack / best warm compile |",
        "|---" * 9 + "|",
    ]
    for m in models:

        def cs(system, run=None, model=m):
            return (pick(runs, model, system, run) or {}).get("cold_start_s")

        a, e = cs("aotpack"), cs("eager")
        warm = [v for v in (cs("compile", "warm"), cs("reduce-overhead", "warm")) if v]
        out.append(
            f"| {m} | {fmt(e)} | {fmt(cs('graph'))} | {fmt(cs('compile', 'cold'))} / {fmt(cs('compile', 'warm'))} | "
            f"{fmt(cs('reduce-overhead', 'cold'))} / {fmt(cs('reduce-overhead', 'warm'))} | {fmt(cs('aoti'))} | {fmt(a)} | "
            f"{f'{a / e:.2f}' if a and e else '—'} | {f'{a / min(warm):.2f}' if a and warm else '—'} |"
        )
    out += [
        "",
        "## GPU memory (MiB) and accuracy",
        "",
        "Device memory: free memory right after the CUDA context was created minus the lowest free "
        "memory after load and after each shape's timed calls (everything the process holds on the "
        "device, memory taken outside the caching allocator included; the context excluded). In "
        "brackets: torch.cuda.max_memory_allocated over the timed calls. Outputs are copied to the "
        "CPU before conversion.",
        "",
        "| model | "
        + " | ".join(NAMES[s] for s in ORDER)
        + " | aotpack / best other | aotpack max abs err vs eager |",
        "|---" * (len(ORDER) + 3) + "|",
    ]
    for m in models:
        mem, alloc = {}, {}
        for s in ORDER:
            r = pick(runs, m, s, "warm") if s in ("compile", "reduce-overhead") else pick(runs, m, s)
            if r and r.get("device_mem_mb") is not None:
                mem[s], alloc[s] = r["device_mem_mb"], r.get("peak_alloc_mb")
        a = pick(runs, m, "aotpack") or {}
        errs = [
            v.get("max_abs_err") for v in a.get("shapes", {}).values() if v.get("max_abs_err") is not None
        ]
        others = [v for s, v in mem.items() if not s.startswith("aotpack")]
        mem_ratio = f"{mem['aotpack'] / min(others):.2f}" if "aotpack" in mem and others else "—"
        out.append(
            f"| {m} | "
            + " | ".join(
                f"{mem[s]:.0f} ({alloc[s]:.0f})" if s in mem and alloc[s] is not None else "—" for s in ORDER
            )
            + f" | {mem_ratio} | "
            + (f"{max(errs):.3g}" if errs else "—")
            + " |"
        )
    out += [
        "",
        "## Build and artifact",
        "",
        "| model | AOTInductor build (GPU box) | aotpack bundle + weights | fp16 weights | ratio |",
        "|---|---|---|---|---|",
    ]
    for m in models:
        aoti = pick(runs, m, "aoti") or {}
        b, w = extra["bundle_bytes"].get(m), extra["weights_bytes"].get(m)
        out.append(
            f"| {m} | {fmt(aoti.get('build_s'), ' s')} | {b / 1e6:.1f} MB | {w / 1e6:.1f} MB | {b / w:.3f} |"
            if b and w
            else f"| {m} | — | — | — | — |"
        )
    errors = [r for r in runs if r.get("error")]
    if errors:
        out += ["", "## Failures", ""] + [
            f"- {r['model']} {r['system']} ({r['run']}): {r['error']}" for r in errors
        ]
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
