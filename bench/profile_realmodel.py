"""Top CUDA kernels of a model's bundle against eager captured in a CUDA graph, one GPU.

python bench/profile_realmodel.py MODEL [--dtype float16] [--batch 1] [--seq 32]

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
    from torch.profiler import ProfilerActivity, profile

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70)


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
    args = ap.parse_args()
    if args.model in ZOO:
        spec = replace(ZOO[args.model](), dtype=args.dtype or "float16")
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import load_spec

        spec = load_spec(args.model)
        spec = replace(spec, dtype=args.dtype) if args.dtype else spec
    path = Path("/tmp") / f"profile-{args.model}.tpk"
    pack(generate(trace(spec), ("sm_80", "sm_90")), path)
    runner = load(path, device="cuda")
    module = instantiate(spec).cuda()
    sizes = {d.name: {"batch": args.batch, "seq": args.seq}.get(d.name, d.max) for d in spec.dims()}
    inputs = {k: v.cuda() for k, v in example_inputs(spec, sizes, seed=1).items()}
    print(f"== aotpack {args.model} {sizes}")
    print(_top(lambda: runner(**inputs)))
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
