"""AOTInductor build of a model, as its users do it: torch.export → aoti_compile_and_package.

python bench/aoti_build.py MODEL --weights W --package OUT.pt2 [--device cuda|cpu]
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
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    start = time.time()
    import torch
    import torch._inductor
    from common import SHAPES, build_module, load_spec, make_inputs

    from aot.spec import Dim

    spec = load_spec(args.model)
    module = build_module(args.model, args.weights, args.device)
    sizes = {d.name: max(2, d.example_size) for d in spec.dims()}
    example = make_inputs(args.model, {**SHAPES[args.model][0], **sizes}, args.device)
    dynamic = tuple(
        {
            d: torch.export.Dim.DYNAMIC(min=s.min, max=s.max)
            for d, s in enumerate(i.shape)
            if isinstance(s, Dim)
        }
        for i in spec.inputs
    )
    with torch.inference_mode():
        ep = torch.export.export(plain_outputs(module), tuple(example), dynamic_shapes={"inputs": dynamic})
        path = torch._inductor.aoti_compile_and_package(ep, package_path=args.package)
    print(json.dumps({"build_s": time.time() - start, "package": path}), flush=True)


def plain_outputs(module):
    """``module`` returning plain tuples where it returns a transformers ``ModelOutput``: the
    package records its outputs' pytree, and a ``ModelOutput`` there would need transformers
    imported wherever the package is loaded (as users export these models: as tuples)."""
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = module

        def forward(self, *inputs):
            out = self.module(*inputs)
            return out.to_tuple() if hasattr(out, "to_tuple") else out

    return Wrapper()


if __name__ == "__main__":
    main()
