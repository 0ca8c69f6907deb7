"""Build every model of the real-model zoo (tests/realmodels/zoo.py) and compare with eager.

    python bench/realmodels.py [--device cpu|cuda] [--dtype float32|float16] [--out DIR] [--bundles DIR]

Per model it prints and writes (``DIR/realmodels-<device>.json``): build seconds, programs,
kernels and launches, the worst error against eager over the zoo's sizes (batch 1, seq 1, odd
sizes, the maximum), and on CUDA the median latency at batch 1 of aotpack (CUDA graphs), eager,
and eager captured in a CUDA graph by hand. ``--bundles DIR`` loads bundles built elsewhere (a
CPU box) from DIR/<model>.tpk instead of building them here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aot.codegen import generate  # noqa: E402
from aot.loader import load  # noqa: E402
from aot.packager import pack  # noqa: E402
from aot.pytree import leaves  # noqa: E402
from aot.tracer import call_model, example_inputs, instantiate, trace  # noqa: E402
from tests.realmodels.zoo import ZOO  # noqa: E402

WARMUP, RUNS = 10, 100


def _median_ms(fn) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def _graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run(name: str, device: str, dtype: str, out: Path, bundles: Path | None) -> dict:
    case = ZOO[name]
    spec = case.spec()
    if dtype != spec.dtype:
        spec = replace(spec, dtype=dtype)
    row: dict = {"model": name, "device": device, "dtype": dtype}
    start = time.perf_counter()
    if bundles is not None:
        path = bundles / f"{name}.tpk"
        row["built_on"] = "elsewhere"
    else:
        traced = trace(spec)
        compiled = generate(traced, ("sm_80", "sm_90"))
        path = out / f"{name}-{dtype}.tpk"
        pack(compiled, path)
        row["build_s"] = round(time.perf_counter() - start, 2)
    runner = load(path, device=device)
    program = runner.program
    row["programs"] = len(runner.programs)
    row["kernels"] = len({k.id for p in (program, *program.variants) for k in p.kernels})
    row["launches"] = sum(s.kind == "kernel" for s in program.steps)
    row["library_calls"] = sum(s.kind == "aten" and "view" not in s.target for s in program.steps)
    module = instantiate(spec).to(device)
    worst = 0.0
    for sizes in case.sizes:
        inputs = {
            k: v.to(device) for k, v in example_inputs(spec, sizes, seed=7 + sum(sizes.values())).items()
        }
        with torch.no_grad():
            want = leaves(call_model(spec, module, inputs))
        got = leaves(runner(**inputs))
        for a, b in zip(got, want):
            scale = max(1.0, b.float().abs().max().item())
            worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    row["max_rel_err"] = worst
    if device == "cuda":
        sizes = dict(case.sizes[0])
        if "seq" in sizes:
            sizes["seq"] = 32
        inputs = {k: v.to(device) for k, v in example_inputs(spec, sizes, seed=1).items()}
        row["latency_sizes"] = sizes
        with torch.no_grad():
            row["aotpack_ms"] = _median_ms(lambda: runner(**inputs))
            row["eager_ms"] = _median_ms(lambda: call_model(spec, module, inputs))
            try:
                row["eager_graph_ms"] = _median_ms(_graphed(lambda: call_model(spec, module, inputs)))
            except Exception as e:  # some eager code does not capture (host syncs)
                row["eager_graph_ms"] = None
                row["eager_graph_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="out/realmodels")
    ap.add_argument("--bundles", default=None)
    ap.add_argument(
        "--json", default=None, help="where to write the rows [default: OUT/realmodels-DEVICE-DTYPE.json]"
    )
    ap.add_argument("models", nargs="*", default=list(ZOO))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        try:
            row = run(name, args.device, args.dtype, out, Path(args.bundles) if args.bundles else None)
        except Exception as e:
            row = {
                "model": name,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.json or out / f"realmodels-{args.device}-{args.dtype}.json").write_text(
        json.dumps(rows, indent=1)
    )


if __name__ == "__main__":
    main()
