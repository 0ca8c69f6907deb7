"""One system, one model, one fresh process: cold start, per-call latency per shape, memory.

Memory, in MiB (2**20 bytes), on a GPU:
- ``device_mem_mb``: device-level memory the system holds: free memory (cudaMemGetInfo) right after
  the CUDA context is created, minus the lowest free memory seen after loading and after each
  shape's timed calls. It counts everything the process allocates on the device, the caching
  allocator's reserve and memory taken outside it (AOTInductor's weights are plain cudaMalloc),
  and excludes the CUDA context itself.
- ``peak_alloc_mb``: ``torch.cuda.max_memory_allocated`` over the timed calls only (the allocator's
  live tensors; blind to memory allocated outside it).
Outputs are copied to the CPU before any conversion, a strided one as the memory it spans
(``common.to_host``), so the harness adds no device work. Per
shape it also records the bytes of the inputs and of the outputs (the model's first output, a
causal LM's logits), which with the weights make the physical floor of a call.

    python bench/worker.py SYSTEM MODEL --spawned-at T --weights W --out DIR [--bundle B] [--package P]
        [--device cuda|cpu]

Prints one JSON line. ``--spawned-at`` is the parent's ``time.time()`` just before it started this
process, so the cold start includes interpreter start and ``import torch``. On ``--device cpu``
(``bench/run.py --smoke``) the systems that need CUDA refuse and no memory is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))

AOTPACK_SYSTEMS = ("aotpack", "aotpack-borrow", "aotpack-tuned", "aotpack-lf")  # -lf: the library-free bundle
CUDA_SYSTEMS = ("graph", "reduce-overhead")  # CUDA graphs by hand or by torch.compile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system")
    ap.add_argument("model")
    ap.add_argument("--spawned-at", type=float, required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bundle")
    ap.add_argument("--package")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if args.system in CUDA_SYSTEMS and not cuda:
        raise SystemExit(f"{args.system} needs a CUDA device, got --device {args.device}")

    import torch
    from common import (
        SHAPES,
        build_module,
        first_tensor,
        make_inputs,
        shape_label,
        synchronize,
        timed_calls,
        to_host,
    )

    result = {"system": args.system, "model": args.model}
    shapes = SHAPES[args.model]
    lowest_free: list[int] = []
    if cuda:
        torch.cuda.init()
        torch.cuda.synchronize()
        free_after_context = torch.cuda.mem_get_info()[0]
        lowest_free.append(free_after_context)

    def sample_free() -> None:
        if cuda:
            torch.cuda.synchronize()
            lowest_free.append(torch.cuda.mem_get_info()[0])

    first_inputs = make_inputs(args.model, shapes[0], args.device)
    synchronize(args.device)

    if args.system in AOTPACK_SYSTEMS:
        from aot.loader import load

        # aotpack-borrow: outputs lent from the graph until the next call (no copy per call)
        outputs = "borrow" if args.system == "aotpack-borrow" else "copy"
        fn = load(args.bundle, device=args.device, outputs=outputs)
    elif args.system == "aoti":
        import torch._inductor

        fn = torch._inductor.aoti_load_package(args.package)
    else:
        module = build_module(args.model, args.weights, args.device)
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
        synchronize(args.device)
        result["cold_start_s"] = time.time() - args.spawned_at
        sample_free()
        del out
        result["shapes"] = {}
        from safetensors.torch import save_file

        outputs = {}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for sizes in shapes:
            inputs = make_inputs(args.model, sizes, args.device)
            times = sorted(timed_calls(fn, inputs, device=args.device))
            sample_free()
            out = first_tensor(fn(*inputs))
            outputs[shape_label(sizes)] = to_host(out.detach()).float().contiguous()
            result["shapes"][shape_label(sizes)] = {
                "median_ms": times[len(times) // 2] * 1e3,
                "p90_ms": times[int(len(times) * 0.9)] * 1e3,
                "input_bytes": sum(x.numel() * x.element_size() for x in inputs),
                "output_bytes": out.numel() * out.element_size(),
            }
            del out
        save_file(outputs, f"{args.out}/{args.model}.{args.system}.safetensors")
        if cuda:
            result["peak_alloc_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if cuda:
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
