"""One system, one model, one fresh process: cold start, per-call latency per shape, memory.

Memory, in MiB (2**20 bytes):
- ``device_mem_mb``: device-level memory the system holds: free memory (cudaMemGetInfo) right after
  the CUDA context is created, minus the lowest free memory seen after loading and after each
  shape's timed calls. It counts everything the process allocates on the device, the caching
  allocator's reserve and memory taken outside it (AOTInductor's weights are plain cudaMalloc),
  and excludes the CUDA context itself.
- ``peak_alloc_mb``: ``torch.cuda.max_memory_allocated`` over the timed calls only (the allocator's
  live tensors; blind to memory allocated outside it).
Outputs are copied to the CPU before any conversion, so the harness adds no device copies.

    python bench/worker.py SYSTEM MODEL --spawned-at T --weights W --out DIR [--bundle B] [--package P]

Prints one JSON line. ``--spawned-at`` is the parent's ``time.time()`` just before it started this
process, so the cold start includes interpreter start and ``import torch``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system")
    ap.add_argument("model")
    ap.add_argument("--spawned-at", type=float, required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bundle")
    ap.add_argument("--package")
    args = ap.parse_args()

    import torch
    from common import SHAPES, build_module, make_inputs, shape_label, timed_calls

    result = {"system": args.system, "model": args.model}
    shapes = SHAPES[args.model]
    torch.cuda.init()
    torch.cuda.synchronize()
    free_after_context = torch.cuda.mem_get_info()[0]
    lowest_free = [free_after_context]

    def sample_free() -> None:
        torch.cuda.synchronize()
        lowest_free.append(torch.cuda.mem_get_info()[0])

    first_inputs = make_inputs(args.model, shapes[0])
    torch.cuda.synchronize()

    if args.system in ("aotpack", "aotpack-borrow"):
        from aot.loader import load

        # aotpack-borrow: outputs lent from the graph until the next call (no copy per call)
        outputs = "borrow" if args.system == "aotpack-borrow" else "copy"
        runner = load(args.bundle, device="cuda", outputs=outputs)
        fn = runner
    elif args.system == "aoti":
        import torch._inductor

        package = torch._inductor.aoti_load_package(args.package)
        fn = package
    else:
        module = build_module(args.model, args.weights)
        if args.system == "eager":
            fn = module
        elif args.system == "graph":
            fn = ManualGraphs(module)
        elif args.system == "compile":
            fn = torch.compile(module)
        elif args.system == "reduce-overhead":
            fn = torch.compile(module, mode="reduce-overhead")
        else:
            raise SystemExit(f"unknown system {args.system}")

    with torch.inference_mode():
        out = fn(*first_inputs)
        torch.cuda.synchronize()
        result["cold_start_s"] = time.time() - args.spawned_at
        sample_free()
        del out
        result["shapes"] = {}
        from safetensors.torch import save_file

        outputs = {}
        torch.cuda.reset_peak_memory_stats()
        for sizes in shapes:
            inputs = make_inputs(args.model, sizes)
            times = sorted(timed_calls(fn, inputs))
            sample_free()
            out = fn(*inputs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            outputs[shape_label(sizes)] = out.detach().cpu().float().contiguous()
            del out
            result["shapes"][shape_label(sizes)] = {
                "median_ms": times[len(times) // 2] * 1e3,
                "p90_ms": times[int(len(times) * 0.9)] * 1e3,
            }
        save_file(outputs, f"{args.out}/{args.model}.{args.system}.safetensors")
        result["peak_alloc_mb"] = torch.cuda.max_memory_allocated() / 2**20
    result["device_mem_mb"] = (free_after_context - min(lowest_free)) / 2**20
    print(json.dumps(result), flush=True)


class ManualGraphs:
    """Eager + torch.cuda.CUDAGraph captured per shape, as a user would write it."""

    def __init__(self, module):
        import torch

        self.module = module
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, x):
        import torch

        key = tuple(x.shape)
        if key not in self.graphs:
            static = x.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    self.module(static)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.module(static)
            self.graphs[key] = (g, static, out)
        g, static, out = self.graphs[key]
        static.copy_(x)
        g.replay()
        return out


if __name__ == "__main__":
    main()
