"""Top CUDA kernels of a model's bundle against eager captured in a CUDA graph, one GPU, and per
call: the synchronized wall time, the GPU's kernel time and the number of kernels.

python bench/profile_realmodel.py MODEL [--dtype float16] [--batch 1] [--seq 32] [--bundle B.tpk]

MODEL is a real-model suite case (``tests/realmodels/zoo.py``, small configs) or, failing that, a
bench model file's name (``bench/models``, ``models``: the benchmarked sizes, at the file's dtype).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _top(fn, runs: int = 50) -> str:
    import statistics
    import time

    from torch.profiler import ProfilerActivity, profile

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(200):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / runs  # µs of kernels (and copies) per call
    launches = sum(e.count for e in events if e.self_device_time_total > 0) / runs
    head = (
        f"per call: wall {statistics.median(walls) * 1e3:.3f} ms (synchronized, median of 200), "
        f"GPU busy {busy / 1e3:.3f} ms in {launches:.0f} kernels and copies\n"
    )
    return head + events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)


def _host(fn, runs: int = 200) -> str:
    """Where a synchronized call's time goes: until ``fn`` returns (the host's work: guards,
    copies, launches; the GPU runs meanwhile), and the wait after it; medians, µs."""
    import statistics
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host, wait = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wait.append(t2 - t1)
    return (
        f"host until the call returns {statistics.median(host) * 1e6:.1f} µs, "
        f"then the wait for the GPU {statistics.median(wait) * 1e6:.1f} µs"
    )


def main() -> None:
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import call_model, example_inputs, instantiate, trace
    from tests.realmodels.zoo import ZOO

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default=None, help="the zoo's cases: float16 unless given")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--bundle", help="a bundle already built (else built here, default options)")
    ap.add_argument("--no-eager", action="store_true", help="the bundle only")
    args = ap.parse_args()
    if args.model in ZOO:
        spec = replace(ZOO[args.model](), dtype=args.dtype or "float16")
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import load_spec

        spec = load_spec(args.model)
        spec = replace(spec, dtype=args.dtype) if args.dtype else spec
    path = Path(args.bundle) if args.bundle else Path("/tmp") / f"profile-{args.model}.tpk"
    if not args.bundle:
        pack(generate(trace(spec), ("sm_80", "sm_90")), path)
    runner = load(path, device="cuda")
    sizes = {d.name: {"batch": args.batch, "seq": args.seq}.get(d.name, d.max) for d in spec.dims()}
    inputs = {k: v.cuda() for k, v in example_inputs(spec, sizes, seed=1).items()}
    print(f"== aotpack {args.model} {sizes}")
    print(_top(lambda: runner(**inputs)))
    print(_host(lambda: runner(**inputs)))
    try:
        empty = torch.cuda.CUDAGraph()
        with torch.cuda.graph(empty):
            pass  # a graph of nothing: a replay's launch and sync cost alone
        print("== an empty CUDA graph")
        print(_top(empty.replay).splitlines()[0])
        print(_host(empty.replay))
    except RuntimeError as e:
        print(f"== an empty CUDA graph: {e}")
    if args.no_eager:
        return
    module = instantiate(spec).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            call_model(spec, module, inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        call_model(spec, module, inputs)
    print(f"== eager + CUDA graph {args.model} {sizes}")
    print(_top(graph.replay))


if __name__ == "__main__":
    main()
