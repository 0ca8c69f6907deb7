"""AOTInductor build of a model, as its users do it: torch.export → aoti_compile_and_package.

python bench/aoti_build.py MODEL --weights W --package OUT.pt2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--package", required=True)
    args = ap.parse_args()
    start = time.time()
    import torch
    import torch._inductor
    from common import SHAPES, build_module, load_spec, make_inputs

    from aot.spec import Dim

    spec = load_spec(args.model)
    module = build_module(args.model, args.weights)
    sizes = {d.name: max(2, d.example_size) for d in spec.dims()}
    example = make_inputs(args.model, {**SHAPES[args.model][0], **sizes})
    dynamic = tuple(
        {
            d: torch.export.Dim.DYNAMIC(min=s.min, max=s.max)
            for d, s in enumerate(i.shape)
            if isinstance(s, Dim)
        }
        for i in spec.inputs
    )
    with torch.inference_mode():
        ep = torch.export.export(module, tuple(example), dynamic_shapes=dynamic)
        path = torch._inductor.aoti_compile_and_package(ep, package_path=args.package)
    print(json.dumps({"build_s": time.time() - start, "package": path}), flush=True)


if __name__ == "__main__":
    main()
