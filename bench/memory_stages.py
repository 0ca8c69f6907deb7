"""Where a system's device memory goes, stage by stage, on a GPU: one fresh process per
configuration, printing after each stage the device memory taken since the CUDA context was made
(cudaMemGetInfo), the caching allocator's reserved and allocated bytes, MiB.

    python bench/memory_stages.py --model mlp --bundle .bundles/mlp.tpk [--out stages.json]

Configurations: ``aotpack`` (lazy capture, as the benchmark loads it), ``aotpack-nograph``
(capture="none": what the CUDA graphs add is the difference), ``aotpack-borrow``, and ``probe``
(``probe-own-stream``): a side stream from torch's pool (from ``cuStreamCreate``), an add and a
CUDA graph of it, a first fp16 ``torch.mm`` and a graph of it, all on that stream, then an mm on
the default stream: what a stream, cuBLAS and a graph cost any system in a process; and
``probe-default-first``: the same kernels eager on the default stream first, the side stream used
only to capture (whether a first launch costs its memory, or a second stream does); and
``probe-fill``: a driver memset, a device-to-device copy, then ATen's fill kernel and an add (which
first launch costs the memory: any kernel, or ATen's kernels); ``probe-conv``: after an ATen add, a
first fp16 convolution (cuDNN), one channels-last, one captured in a CUDA graph, then a first cuBLAS
mm (what cuDNN costs a process beyond ATen's kernels).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = (
    "probe",
    "probe-own-stream",
    "probe-default-first",
    "probe-fill",
    "probe-conv",
    "aotpack",
    "aotpack-nograph",
    "aotpack-borrow",
)


def child(model: str, bundle: str, config: str) -> list[dict]:
    import torch

    sys.path.insert(0, str(HERE))
    from common import SHAPES, make_inputs, shape_label

    torch.cuda.init()
    torch.cuda.synchronize()
    base = torch.cuda.mem_get_info()[0]
    stages: list[dict] = []

    def stage(name: str) -> None:
        torch.cuda.synchronize()
        stages.append(
            {
                "stage": name,
                "device_mib": round((base - torch.cuda.mem_get_info()[0]) / 2**20, 1),
                "reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
                "allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
            }
        )

    stage("context")
    if config in ("probe", "probe-own-stream"):
        if config == "probe":
            side = torch.cuda.Stream()
            stage("torch.cuda.Stream() (its pool)")
        else:
            from aot.loader.cuda import capture_stream

            side, _ = capture_stream(torch.device("cuda"))
            stage("cuStreamCreate stream")
        a = torch.randn(64, 1024, dtype=torch.float16, device="cuda")
        b = torch.randn(1024, 1024, dtype=torch.float16, device="cuda")
        stage("two small tensors")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            c = a + 1
            stage("an add on the side stream")
            add = torch.cuda.CUDAGraph()
            with torch.cuda.graph(add, stream=side):
                c = a + 1
            add.replay()
            stage("a CUDA graph of the add")
            torch.mm(a, b)
            stage("first cuBLAS mm, side stream")
            mm = torch.cuda.CUDAGraph()
            with torch.cuda.graph(mm, stream=side):
                c = torch.mm(a, b)
            mm.replay()
            stage("a CUDA graph of the mm")
        torch.cuda.current_stream().wait_stream(side)
        torch.mm(a, b)
        stage("mm on the default stream")
        del c
        return stages

    if config == "probe-default-first":
        # Is the ~92 MiB of a first launch on a second stream paid by any first kernel (module
        # loading), or by a second stream? Everything eager runs on the default stream here, and
        # the side stream only ever captures.
        from aot.loader.cuda import capture_stream

        side, _ = capture_stream(torch.device("cuda"))
        a = torch.randn(64, 1024, dtype=torch.float16, device="cuda")
        b = torch.randn(1024, 1024, dtype=torch.float16, device="cuda")
        stage("two small tensors")
        c = a + 1
        stage("an add on the default stream")
        torch.mm(a, b)
        stage("first cuBLAS mm, default stream")
        side.wait_stream(torch.cuda.current_stream())
        add = torch.cuda.CUDAGraph()
        with torch.cuda.graph(add, stream=side):
            c = a + 1
        add.replay()
        stage("a graph of the add captured on the side stream")
        mm = torch.cuda.CUDAGraph()
        with torch.cuda.graph(mm, stream=side):
            c = torch.mm(a, b)
        mm.replay()
        torch.cuda.synchronize()
        stage("a graph of the mm captured on the side stream")
        del c
        return stages

    if config == "probe-fill":
        from aot.loader.cuda import zeros

        a = zeros([64, 1024], torch.float16, "cuda")
        stage("a driver memset (cuMemsetD8Async)")
        b = a.clone()
        stage("a device-to-device copy (clone)")
        b.zero_()
        stage("ATen fill kernel (zero_)")
        c = a + b
        stage("ATen add kernel")
        torch.mm(a, b.t())
        stage("first cuBLAS mm")
        del c
        return stages

    if config == "probe-conv":
        x = torch.randn(8, 64, 56, 56, dtype=torch.float16, device="cuda")
        w = torch.randn(64, 64, 3, 3, dtype=torch.float16, device="cuda")
        y = x + 1
        stage("input, weight, an ATen add")
        y = torch.nn.functional.conv2d(x, w, padding=1)
        stage("first cuDNN convolution (NCHW)")
        xl, wl = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
        y = torch.nn.functional.conv2d(xl, wl, padding=1)
        stage("a channels-last convolution")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            y = torch.nn.functional.conv2d(xl, wl, padding=1)
        g.replay()
        stage("a CUDA graph of the convolution")
        torch.mm(x[0, 0], x[0, 1])
        stage("first cuBLAS mm")
        del y
        return stages

    from aot.loader import load

    capture = "none" if config == "aotpack-nograph" else "lazy"
    outputs = "borrow" if config == "aotpack-borrow" else "copy"
    runner = load(bundle, device="cuda", capture=capture, outputs=outputs)
    stage("load")
    with torch.inference_mode():
        for sizes in SHAPES[model]:
            inputs = make_inputs(model, sizes, "cuda")
            for calls in (1, 20):
                for _ in range(calls):
                    out = runner(*inputs)
                del out
                stage(f"{shape_label(sizes)} after {'1 call' if calls == 1 else '21 calls'}")
            del inputs
    return stages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.bundle, args.child)))
        return
    report = {}
    for config in args.configs.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--bundle", args.bundle, "--child", config],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            why = f"exit status {proc.returncode}\n{proc.stderr[-2000:]}"
            print(f"{args.model} {config}: failed, {why}", flush=True)
            report[config] = {"error": why}
            continue
        report[config] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{args.model} {config}", flush=True)
        for s in report[config]:
            print(
                f"  {s['stage']:28} device {s['device_mib']:8.1f}  reserved {s['reserved_mib']:8.1f}  "
                f"allocated {s['allocated_mib']:8.1f} MiB",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
