"""Where a forward call's host time goes when each call brings a tensor of its own (a server's
case) against the same tensor every call (``bench/host_path.py``'s): a bundle under the torch
loader at one shape, its CUDA graph replayed; every figure the median over ``--calls`` calls (µs),
the GPU idle before each where it is the host's time alone.

    python bench/call_probe.py mlp .bundles/mlp.tpk --sizes batch=1 --json out.json

Rows (each ``same`` and ``fresh``: 8 input tensors in turn): the call and a synchronize, in
``inference_mode``, in ``no_grad`` and with neither (and on 8 inference tensors in turn); the call's host time; the guards' bind and
check; the graph runner's call alone (bucket known); and, where the bucket binds, re-pointing
its nodes (``Bindings.point``) and an output's allocation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("bundle")
    ap.add_argument("--sizes", default="batch=1")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    from common import make_inputs, median_us

    from aot.loader import load

    sizes = {k: int(v) for k, v in (item.split("=") for item in args.sizes.split(","))}
    import os

    from aot.loader import bindings

    os.environ[bindings.DIRECT_BINDING_ENV] = "1"  # the runner probed binds (off by default)
    runner = load(args.bundle, device="cuda")
    for _ in range(5):
        runner(*make_inputs(args.model, sizes, "cuda"))  # captured while the switch is on
    same = make_inputs(args.model, sizes, "cuda")
    turns = [[t.clone() for t in same] for _ in range(8)]
    sync = torch.cuda.synchronize
    for _ in range(50):
        runner(*same)
    sync()
    out: dict[str, object] = {"model": args.model, "sizes": sizes, "calls": args.calls}

    with torch.inference_mode():  # inference tensors (bench/host_path.py's --ab made its inputs so)
        inference_turns = [[t.clone() for t in same] for _ in range(8)]

    def pair(name, make_fn, before=None):
        for how, inputs in (("same", itertools.repeat(same)), ("fresh", itertools.cycle(turns))):
            out[f"{name}_{how}"] = median_us(make_fn(inputs), args.calls, before)

    out["call_sync_inference_tensors_fresh"] = median_us(
        (lambda it: lambda: (_inference(runner, next(it)), sync()))(itertools.cycle(inference_turns)),
        args.calls,
    )

    pair("call_sync_inference", lambda it: lambda: (_inference(runner, next(it)), sync()))
    pair("call_sync_no_grad", lambda it: lambda: (_no_grad(runner, next(it)), sync()))
    pair("call_sync_plain", lambda it: lambda: (runner(*next(it)), sync()))
    pair("call_host", lambda it: lambda: runner(*next(it)), before=sync)
    guards = runner.guards
    pair("bind_and_check", lambda it: lambda: guards.check(guards.bind(tuple(next(it)), {}), runner.device))
    entry = runner._entries[0]
    graphs = entry.graphs
    key = graphs.bucket_for(sizes)
    names = guards.names
    pair(
        "graph_runner_sync",
        lambda it: lambda: (graphs(key, dict(zip(names, next(it))), sizes), sync()),
    )
    captured = graphs.graphs[key]
    binds = captured.binds
    # a runner that copies its inputs and outputs (no bindings): by the driver, and by torch
    import aot.loader.gpu as gpu_module
    from aot.loader.cuda import copy_bytes, pack_params, raw_stream

    del os.environ[bindings.DIRECT_BINDING_ENV]
    copied = load(args.bundle, device="cuda")
    for _ in range(50):
        copied(*same)
    pair("copied_call_sync", lambda it: lambda: (copied(*next(it)), sync()))
    driver_copy = gpu_module.copy_bytes
    gpu_module.copy_bytes = lambda dst, src, stream: False
    pair("copied_by_torch_call_sync", lambda it: lambda: (copied(*next(it)), sync()))
    gpu_module.copy_bytes = driver_copy
    static = next(iter(captured.inputs.values()))
    stream = raw_stream(torch.cuda.current_device())
    pair("driver_copy_in_sync", lambda it: lambda: (copy_bytes(static, next(it)[0], stream), sync()))
    pair("torch_copy_in_sync", lambda it: lambda: (static.copy_(next(it)[0]), sync()))
    if binds is not None:
        launch = binds.launches[0]
        out["pack_params"] = median_us(lambda: pack_params(launch.values), args.calls)
        params, storage = pack_params(launch.values)
        out["set_kernel_args_one_node"] = median_us(
            lambda: captured.graph.set_kernel_args(launch.node, launch.fn, launch.grid, params), args.calls
        )
        out["args_of_first_node"] = len(launch.values)
        out["bound_nodes"] = len(
            {s.launch for _, slots in (*binds.inputs.values(), *binds.outputs.values()) for s in slots}
        )
        statics = {i: s for i, (s, _) in binds.outputs.items()}
        out["empty_like_output"] = median_us(
            lambda: [torch.empty_like(s) for s in statics.values()], args.calls
        )
        name = next(iter(binds.inputs), None)
        if name is not None:
            cycle = itertools.cycle(turns)
            out["point_input_each_call"] = median_us(
                lambda: binds.point(captured.graph, {("in", name): next(cycle)[0]}), args.calls
            )
            binds.point(captured.graph, {})
    sync()
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v:.1f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def _inference(runner, inputs):
    import torch

    with torch.inference_mode():
        return runner(*inputs)


def _no_grad(runner, inputs):
    import torch

    with torch.no_grad():
        return runner(*inputs)


if __name__ == "__main__":
    main()
