"""Fusion at dynamic image sizes: a MobileNetV3-style squeeze-excite block (strided convolution,
batch norm, hardswish, a mean over H×W, 1×1 convolutions, hardsigmoid, the gate multiplied in and
read by a channels-last convolution) built with dynamic height and width fuses exactly what the
same model fuses at a fixed size, with no "cannot render" line; the bundle matches eager on the CPU
at the minimum, odd and maximum sizes, and its kernels match their references in Triton's
interpreter.

The gate's multiply once stayed an ATen call: the spatial size of the strided convolution's output,
``(h' + 1)*(w' + 1)``, was taken for a multiple of its 16 channels (``aot.codegen.index.divides``),
and the index of the channels-last product came out as ``r // ((h' + 1)*(w' + 1)/16)``.

Tolerance (float32): 1e-5 absolute and relative; the CPU path runs the kernels' reference
decompositions, eager's ops, so only rounding may differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aot.schema import StepKind

pytestmark = pytest.mark.slow  # two builds of a small CNN: about half a minute on two cores

MODEL = """
from torch import nn
from aot import Dim, Input, ModelSpec

class SqueezeExcite(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.reduce = nn.Conv2d(16, 8, 1)
        self.expand = nn.Conv2d(8, 16, 1)
        self.project = nn.Conv2d(16, 8, 1, bias=False)
        nn.init.uniform_(self.bn.running_mean, -0.1, 0.1)
        nn.init.uniform_(self.bn.running_var, 0.5, 1.5)

    def forward(self, x):  # x: [B, 3, H, W]
        y = nn.functional.hardswish(self.bn(self.conv(x)))  # y: [B, 16, (H+1)//2, (W+1)//2]
        gate = nn.functional.hardsigmoid(self.expand(self.reduce(y.mean((2, 3), keepdim=True)).relu()))
        return self.project(y * gate).mean((2, 3))  # [B, 8]

batch = Dim("batch", 1, 4)
SIZES
spec = ModelSpec(module=SqueezeExcite, inputs=[Input("x", (batch, 3, h, w))])
"""
DYNAMIC = 'h = Dim("h", 4, 32, example=9)\nw = Dim("w", 4, 32, example=11)'
STATIC = "h = 9\nw = 11"
SIZES = [(1, 4, 4), (3, 9, 11), (2, 17, 6), (4, 32, 32)]  # (batch, h, w): min, odd, mixed, max


def _build(tmp_path: Path, sizes: str, name: str):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / f"{name}.py"
    path.write_text(MODEL.replace("SIZES", sizes))
    messages: list[str] = []
    compiled = generate(trace(load_model_file(path)), ("sm_90",), progress=messages.append)
    pack(compiled, tmp_path / f"{name}.tpk")
    return compiled, tmp_path / f"{name}.tpk", path, messages


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("se")
    return _build(tmp, DYNAMIC, "dynamic"), _build(tmp, STATIC, "static")


def _aten(program) -> list[str]:
    return sorted(s.target for s in program.steps if s.kind == StepKind.ATEN)


def test_dynamic_sizes_fuse_what_a_fixed_size_fuses(builds):
    (dynamic, _, _, messages), (static, _, _, _) = builds
    assert not [m for m in messages if "cannot render" in m]
    assert _aten(dynamic.program) == _aten(static.program) == ["aten.convolution.default"] * 4
    assert sorted(k.name for k in dynamic.program.kernels) == sorted(k.name for k in static.program.kernels)


def test_cpu_path_agrees_with_eager_at_min_odd_and_max_sizes(builds):
    from aot.loader import load
    from aot.tracer import load_model_file

    compiled, bundle, path, _ = builds[0]
    module = load_model_file(path).module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    module.eval()
    runner = load(bundle)
    gen = torch.Generator().manual_seed(0)
    for b, h, w in SIZES:
        x = torch.randn(b, 3, h, w, generator=gen)
        with torch.no_grad():
            want = module(x)
        torch.testing.assert_close(runner(x), want, rtol=1e-5, atol=1e-5)


def test_kernels_match_their_references_in_the_interpreter(builds):
    from aot.verify.interpret import interpret_in_subprocess

    _, bundle, path, _ = builds[0]
    sizes = [{"batch": 1, "h": 4, "w": 4}, {"batch": 2, "h": 17, "w": 6}]
    (results,) = interpret_in_subprocess([(bundle, path, sizes, 1)])
    for size, checks in results.items():
        assert any(c.name.startswith("fused_add_clamp_div_mul") for c in checks), (size, checks)
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
