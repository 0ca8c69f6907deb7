"""Where one forward call's time goes on a GPU, the host's part and the device's apart: a bundle
under the torch loader at one shape, its CUDA graph replayed.

    python bench/host_path.py mlp .bundles/mlp.tpk --sizes batch=1 --json out.json

Each figure is the median over ``--calls`` calls (µs), with the GPU idle before each where the
figure is the host's alone:

- ``call_sync``: the call and a synchronize (``bench/run.py``'s metric);
- ``call_host``: the call's host time alone (the GPU idle when it starts; synchronized after, untimed);
- ``sync_idle``: a synchronize with nothing queued;
- ``replay_sync``: the bucket's graph launched alone (no input copy, no output copy) and a synchronize;
- ``replay_gpu``: the graph's device time between two events around it;
- the call's phases, host time each, run back to back: binding and checking the inputs against
  the guards, the bucket's key, the inputs' copies into the graph's own, the graph's launch, the
  outputs' copies out of it;
- ``bound``: what the bucket's graph binds to the call's own tensors (``aot.loader.bindings``;
  none unless ``AOTPACK_DIRECT_BINDING=1``);
- with ``--ab``: ``call_sync`` with the graph's kernels pointed at the call's own tensors (the
  runner loaded with ``AOTPACK_DIRECT_BINDING=1``, ``aot.loader.bindings``) against the default
  runner, which copies them into and out of the graph, in alternating rounds of
  ``--calls`` calls each (``ab``: each round's median, µs): on the same input tensors every call,
  on one of 8 input tensors in turn (``*_fresh``: every call re-points the graph), and the call's
  host time alone (``*_host``).

The probe reads the runner's internals (``Runner._entries``, ``GraphRunner.graphs``) to time the
phases; it changes nothing in them.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--sizes", default="batch=1", help="symbol=value,... (the model's dims)")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--ab", type=int, default=0, help="rounds of driver copies against torch's")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    from common import make_inputs, median_us

    from aot.loader import load

    sizes = {k: int(v) for k, v in (item.split("=") for item in args.sizes.split(","))}
    runner = load(args.bundle, device="cuda")
    inputs = make_inputs(args.model, sizes, "cuda")
    sync = torch.cuda.synchronize
    out: dict[str, object] = {"model": args.model, "sizes": sizes, "calls": args.calls}
    with torch.inference_mode():
        for _ in range(50):
            runner(*inputs)
        sync()
        out["call_sync"] = median_us(lambda: (runner(*inputs), sync()), args.calls)
        out["call_host"] = median_us(lambda: runner(*inputs), args.calls, before=sync)
        sync()
        out["sync_idle"] = median_us(sync, args.calls)

        values = list(inputs)
        if len(runner._entries) == 1:
            entry, bound = runner._entries[0], runner.guards.check(values, runner.device)
        else:  # the program the call dispatches to (a one-token variant beside the general trace)
            entry, bound = runner._dispatch(values, None)
        graphs = entry.graphs
        key = graphs.bucket_for(dict(bound))
        captured = graphs.graphs[key]
        stream = torch.cuda.current_stream().cuda_stream
        out["replay_sync"] = median_us(lambda: (captured.graph.replay(stream), sync()), args.calls)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu = []
        for _ in range(args.calls):
            start.record()
            captured.graph.replay(stream)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
        gpu.sort()
        out["replay_gpu"] = gpu[len(gpu) // 2]

        statics = [captured.inputs[n] for n in runner.guards.names if n in captured.inputs]
        results = list(captured.outputs)

        def copies_in():
            for static, value in zip(statics, values):
                static.copy_(value)

        def copies_out():
            for r in results:
                r.clone()

        phases = {
            "bind_and_check": lambda: (
                runner.guards.check(runner.guards.bind(tuple(values), {}), runner.device)
                if len(runner._entries) == 1
                else runner._dispatch(runner.guards.bind(tuple(values), {}), None)
            ),
            "bucket_key": lambda: graphs.bucket_for(dict(bound)),
            "copies_in": copies_in,
            "graph_launch": lambda: captured.graph.replay(stream),
            "copies_out": copies_out,
        }
        out["phases"] = {name: median_us(fn, args.calls, before=sync) for name, fn in phases.items()}
        binds = captured.binds
        out["bound"] = {
            "inputs": sorted(binds.inputs) if binds else [],
            "outputs": sorted(binds.outputs) if binds else [],
        }
        sync()
        if args.ab:
            import itertools
            import os

            from aot.loader import bindings

            os.environ[bindings.DIRECT_BINDING_ENV] = "1"
            bound = load(args.bundle, device="cuda")
            del os.environ[bindings.DIRECT_BINDING_ENV]
            copied = runner
            for _ in range(50):
                bound(*inputs)
            turns = [make_inputs(args.model, sizes, "cuda") for _ in range(8)]
            ab: dict[str, list[float]] = {}
            for _ in range(args.ab):
                for how, r in (("bound", bound), ("copied", copied)):
                    turn = itertools.cycle(turns)
                    same = lambda r=r: (r(*inputs), sync())  # noqa: E731
                    fresh = lambda r=r, turn=turn: (r(*next(turn)), sync())  # noqa: E731
                    ab.setdefault(how, []).append(median_us(same, args.calls))
                    ab.setdefault(how + "_fresh", []).append(median_us(fresh, args.calls))
                    host = lambda r=r: r(*inputs)  # noqa: E731
                    ab.setdefault(how + "_host", []).append(median_us(host, args.calls, before=sync))
            out["ab"] = ab
    phases = out["phases"]
    print(
        f"{args.model} {sizes}: call+sync {out['call_sync']:.1f} µs, call's host time {out['call_host']:.1f}, "
        f"idle sync {out['sync_idle']:.1f}, graph alone+sync {out['replay_sync']:.1f} "
        f"(device {out['replay_gpu']:.1f}); phases: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
    )
    print(f"  bound to the call's tensors: {out['bound']}")
    if args.ab:
        med = {k: sorted(v)[len(v) // 2] for k, v in out["ab"].items()}
        wins = sum(b < c for b, c in zip(out["ab"]["bound"], out["ab"]["copied"]))
        print(
            f"  bound {med['bound']:.1f} µs a call, copied {med['copied']:.1f} (medians of {args.ab} rounds; "
            f"bound faster in {wins}); 8 inputs in turn: bound {med['bound_fresh']:.1f}, copied "
            f"{med['copied_fresh']:.1f}; the call's host time {med['bound_host']:.1f} against {med['copied_host']:.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
