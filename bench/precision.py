"""Where fp16 error comes from in a deep network: the bundle against an fp32 eager reference.

    python bench/precision.py [--model resnet50] [--size 224] [--batch 1,8]

Builds a float16 bundle of a timm model (trained-looking BatchNorm statistics, see
tests/realmodels/zoo.py's ``lively``), then on one CUDA GPU compares, against eager float32 with
TF32 off, the relative error (max |x - ref| / max |ref|) of: eager float16, the bundle on the GPU
(CUDA graphs), and the bundle's CPU path (what ``aotpack verify`` takes as reference). If the
bundle on the GPU is as close to float32 as eager float16 is, its kernels lose nothing and any
verify failure is a tolerance too tight for the network's depth.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from aot import Dim, Input, ModelSpec
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import instantiate, trace
    from tests.realmodels.zoo import import_torchvision, lively

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--out", default="/tmp/precision")
    args = ap.parse_args()
    import_torchvision()
    import timm

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = ModelSpec(
        module=lambda: lively(timm.create_model(args.model, pretrained=False), size=args.size),
        inputs=[Input("x", (Dim("batch", 1, 8), 3, args.size, args.size))],
        dtype="float16",
        name=args.model,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.model}-fp16.tpk"
    pack(generate(trace(spec), ("sm_80", "sm_90")), path)
    gpu, cpu = load(path, device="cuda"), load(path, device="cpu")
    ref32 = instantiate(replace(spec, dtype="float32")).cuda()
    eager16 = instantiate(spec).cuda()
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        x = torch.randn(b, 3, args.size, args.size, generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            ref = ref32(x.cuda()).float()
            got = {
                "eager_fp16": eager16(x.half().cuda()).float(),
                "aotpack_gpu_fp16": gpu(x.half().cuda()).float(),
                "aotpack_cpu_fp16": cpu(x.half()).float().cuda(),
            }
        scale = ref.abs().max().item()
        row = {"model": args.model, "size": args.size, "batch": b, "ref_scale": scale}
        row.update({k: (v - ref).abs().max().item() / scale for k, v in got.items()})
        row["gpu_vs_cpu_path"] = (
            got["aotpack_gpu_fp16"] - got["aotpack_cpu_fp16"]
        ).abs().max().item() / scale
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
