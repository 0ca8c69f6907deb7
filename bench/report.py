"""Turn benchmark result files into a markdown report with ratios.

python bench/report.py OUT/results-*.json > bench/RESULTS.md

Beside each latency row, the physical floor of one call: the bytes it must move (every weight
once, the inputs, the outputs, at the model's dtype) over the device's memory bandwidth (by name:
``bench/decode.py``'s ``BANDWIDTH``). Result files from before the harness recorded those bytes
get them from the model file (``floor_bytes_from_model``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAMES = {
    "eager": "eager",
    "graph": "eager + CUDA graph",
    "compile": "torch.compile",
    "reduce-overhead": "reduce-overhead",
    "aoti": "AOTInductor",
    "aotpack": "aotpack",
    "aotpack-tuned": "aotpack tuned",
    "aotpack-borrow": "aotpack (borrowed outputs)",
}
ORDER = list(NAMES)


def load(paths: list[str]) -> tuple[dict, list[dict], dict]:
    meta, runs = {}, []
    extra = {
        "bundle_bytes": {},
        "weights_bytes": {},
        "weight_tensor_bytes": {},
        "builds": {},
        "import_torch_s": [],
    }
    for p in paths:
        data = json.load(open(p))
        meta = data["device"]
        runs += data["runs"]
        for key in ("bundle_bytes", "weights_bytes", "weight_tensor_bytes", "builds"):
            extra[key].update(data.get(key, {}))
        extra["import_torch_s"].append(data["import_torch_s"])
        extra["smoke"] = extra.get("smoke") or data.get("smoke", False)
        extra["calls"], extra["warmup"] = data.get("calls", 200), data.get("warmup", 20)
    return meta, runs, extra


def bandwidth(meta: dict) -> float | None:
    """Bytes/s of the device's memory: recorded by the run, else by the device's name."""
    if meta.get("bandwidth_bytes_per_s"):
        return meta["bandwidth_bytes_per_s"]
    from decode import BANDWIDTH

    return next((bw for key, bw in BANDWIDTH.items() if key in meta.get("gpu", "")), None)


def floor_bytes_from_model(model: str, shape: str) -> tuple[int, int] | None:
    """(input bytes, output bytes) at a shape label, for result files that predate the worker
    recording them: the model file's module run on the meta device (no weights, no compute).
    None where that cannot run (transformers' masks read values)."""
    try:
        import torch
        from common import GPU_SHAPES, first_tensor, load_spec, make_inputs, parameters_on_meta, shape_label

        sizes = next(s for s in GPU_SHAPES[model] if shape_label(s) == shape)
        spec = load_spec(model)
        with parameters_on_meta():
            module = spec.module()
        inputs = make_inputs(model, sizes, "meta")
        with torch.device("meta"), torch.no_grad():
            out = first_tensor(module.to(getattr(torch, spec.dtype)).to("meta")(*inputs))
        return sum(x.numel() * x.element_size() for x in inputs), out.numel() * out.element_size()
    except Exception:
        return None


def floor_ms(
    runs: list[dict], extra: dict, model: str, shape: str, bw: float | None
) -> tuple[float | None, bool]:
    """Every weight once + the inputs + the outputs, over the bandwidth, in ms; and whether the
    inputs' and outputs' bytes came from the model file rather than the run."""
    weights = extra["weight_tensor_bytes"].get(model) or extra["weights_bytes"].get(model)
    shapes = [r["shapes"][shape] for r in runs if r["model"] == model and shape in r.get("shapes", {})]
    recorded = [(v["input_bytes"], v["output_bytes"]) for v in shapes if "input_bytes" in v]
    io = recorded[0] if recorded else floor_bytes_from_model(model, shape)
    if not (weights and io and bw):
        return None, False
    return (weights + sum(io)) / bw * 1e3, not recorded


def pick(runs, model, system, run=None):
    for r in runs:
        if r["model"] == model and r["system"] == system and (run is None or r["run"] == run):
            return r
    return None


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "—"


def fmt(v, unit=""):
    return "—" if v is None else f"{v:.3f}{unit}" if v < 10 else f"{v:.1f}{unit}"


def worst_err(run: dict | None) -> float | None:
    errs = [v["max_abs_err"] for v in (run or {}).get("shapes", {}).values() if "max_abs_err" in v]
    return max(errs) if errs else None


def build_time(record: dict | None) -> str:
    if not record:
        return "—"
    if "error" in record:
        return "failed"
    return fmt(record["seconds"], " s") + (f" ({record['at_once']})" if record.get("at_once", 1) > 1 else "")


def main(paths: list[str]) -> None:
    meta, runs, extra = load(paths)
    models = list(dict.fromkeys(r["model"] for r in runs))
    bw = bandwidth(meta)
    order = [s for s in ORDER if any(r["system"] == s for r in runs)]  # the systems this run measured
    derived: list[str] = []  # models whose floors took their bytes from the model file
    smi = f" ({meta['nvidia_smi']})" if meta.get("nvidia_smi") else ""
    here = [m for m in models if "aotpack" in extra["builds"].get(m, {})]
    prebuilt = [m for m in models if m not in here]
    built = (
        f"aotpack bundles of {', '.join(prebuilt)} were built on a CPU-only machine. " if prebuilt else ""
    ) + (f"Bundles of {', '.join(here)} were built on this machine (see Build). " if here else "")
    out = [
        "# aotpack benchmark",
        "",
        f"{meta['gpu']}{smi}, torch {meta['torch']}, triton {meta['triton']}, "
        f"Python {meta['python']}, {meta['date']}. fp16, random weights loaded from safetensors, every system "
        f"in its own fresh process. {built}",
        "",
        f'`python -c "import torch"`: {min(extra["import_torch_s"]):.2f} s (the floor under every cold start).',
        "",
    ]
    if extra.get("smoke"):
        out += [
            "**Smoke run** (`--smoke`: tiny shapes and configs, a few calls): the timings mean nothing.",
            "",
        ]
    out += [
        f"## Per-call latency, median ms (p90), synchronized, {extra['calls']} calls after {extra['warmup']} warm-up calls",
        "",
        "floor: the bytes a call must move (every weight once, the inputs, the outputs, at the model's "
        f"dtype) over the memory bandwidth ({bw / 1e12:.2f} TB/s): a memory floor, which rows bound by "
        "compute (convolutions at batch 8) or by kernel launches sit far above."
        if bw
        else "floor: no bandwidth known for this device.",
        "",
        "| model | shape | floor | "
        + " | ".join(NAMES[s] for s in order)
        + " | aotpack / best other | / reduce-overhead | / CUDA graph | aotpack / floor |",
        "|---" * (len(order) + 7) + "|",
    ]
    for m in models:
        shapes = []
        for r in runs:
            if r["model"] == m and "shapes" in r:
                shapes += [k for k in r["shapes"] if k not in shapes]
        for shape in shapes:
            cells, med = [], {}
            for s in order:
                r = pick(runs, m, s, "warm") if s in ("compile", "reduce-overhead") else pick(runs, m, s)
                v = r["shapes"].get(shape) if r and "shapes" in r else None
                if v:
                    med[s] = v["median_ms"]
                    cells.append(f"{v['median_ms']:.3f} ({v['p90_ms']:.3f})")
                else:
                    cells.append("—" if r is None or not r.get("error") else "failed")
            a = med.get("aotpack")
            others = [v for s, v in med.items() if not s.startswith("aotpack")]
            floor, from_model = floor_ms(runs, extra, m, shape, bw)
            if from_model and m not in derived:
                derived.append(m)
            out.append(
                f"| {m} | {shape} | {'—' if floor is None else f'{floor:.3f}'} | "
                + " | ".join(cells)
                + f" | {_ratio(a, min(others) if others else None)} | "
                f"{_ratio(a, med.get('reduce-overhead'))} | {_ratio(a, med.get('graph'))} | {_ratio(a, floor)} |"
            )
    if derived:
        out += [
            "",
            f"Floors of {', '.join(derived)}: the inputs' and outputs' bytes come from the model files "
            "(their result files predate the harness recording them), the weights' from the weights file's size.",
        ]
    out += [
        "",
        "## Cold start (process spawn → first correct output), s",
        "",
        "| model | eager | eager + graph | compile cold / warm | reduce-overhead cold / warm | AOTInductor load | aotpack | "
        "aotpack tuned | aotpack / eager | aotpack / best warm compile |",
        "|---" * 10 + "|",
    ]
    for m in models:

        def cs(system, run=None, model=m):
            return (pick(runs, model, system, run) or {}).get("cold_start_s")

        a, e = cs("aotpack"), cs("eager")
        warm = [v for v in (cs("compile", "warm"), cs("reduce-overhead", "warm")) if v]
        out.append(
            f"| {m} | {fmt(e)} | {fmt(cs('graph'))} | {fmt(cs('compile', 'cold'))} / {fmt(cs('compile', 'warm'))} | "
            f"{fmt(cs('reduce-overhead', 'cold'))} / {fmt(cs('reduce-overhead', 'warm'))} | {fmt(cs('aoti'))} | {fmt(a)} | "
            f"{fmt(cs('aotpack-tuned'))} | {f'{a / e:.2f}' if a and e else '—'} | {f'{a / min(warm):.2f}' if a and warm else '—'} |"
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
        + " | ".join(NAMES[s] for s in order)
        + " | aotpack / best other | max abs err vs eager: aotpack, tuned (eager's largest abs output) |",
        "|---" * (len(order) + 3) + "|",
    ]
    for m in models:
        mem, alloc = {}, {}
        for s in order:
            r = pick(runs, m, s, "warm") if s in ("compile", "reduce-overhead") else pick(runs, m, s)
            if r and r.get("device_mem_mb") is not None:
                mem[s], alloc[s] = r["device_mem_mb"], r.get("peak_alloc_mb")
        errs = {s: worst_err(pick(runs, m, s)) for s in ("aotpack", "aotpack-tuned")}
        scales = [
            v["ref_scale"]
            for r in runs
            if r["model"] == m
            for v in r.get("shapes", {}).values()
            if "ref_scale" in v
        ]
        others = [v for s, v in mem.items() if not s.startswith("aotpack")]
        mem_ratio = f"{mem['aotpack'] / min(others):.2f}" if "aotpack" in mem and others else "—"
        out.append(
            f"| {m} | "
            + " | ".join(
                f"{mem[s]:.0f} ({alloc[s]:.0f})" if s in mem and alloc[s] is not None else "—" for s in order
            )
            + f" | {mem_ratio} | "
            + ", ".join("—" if e is None else f"{e:.3g}" for e in errs.values())
            + (f" ({max(scales):.3g})" if scales else "")
            + " |"
        )
    out += [
        "",
        "## Build and artifact",
        "",
        "Seconds of each build on the benchmark machine, wall clock of its own process; in brackets "
        "up to how many builds ran at once (the run builds on every core before it times anything). aotpack "
        "tuned: the build with `--gemm-candidates`, then `aotpack tune` at the measured shapes only "
        "(at every bucket for mlp, cnn, resnet50 and convnext_tiny, so tune may keep them free of cuBLAS).",
        "",
        "| model | AOTInductor build | aotpack build | aotpack tuned: build + tune | aotpack bundle + weights | "
        "fp16 weights | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in models:
        builds = extra["builds"].get(m, {})
        aoti = pick(runs, m, "aoti") or {}
        b, w = extra["bundle_bytes"].get(m), extra["weights_bytes"].get(m)
        size = f"{b / 1e6:.1f} MB | {w / 1e6:.1f} MB | {b / w:.3f}" if b and w else "— | — | —"
        tuned = (
            f"{build_time(builds.get('aotpack-gemm'))} + {build_time(builds.get('tune'))}"
            if "tune" in builds
            else "—"
        )
        aoti_s = build_time(builds["aoti"]) if "aoti" in builds else fmt(aoti.get("build_s"), " s")
        out.append(
            f"| {m} | {aoti_s} | {build_time(builds.get('aotpack')) if 'aotpack' in builds else 'prebuilt'} | "
            f"{tuned} | {size} |"
        )
    errors = [r for r in runs if r.get("error")]
    if errors:
        out += ["", "## Failures", ""] + [
            f"- {r['model']} {r['system']} ({r['run']}): {r['error']}" for r in errors
        ]
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
