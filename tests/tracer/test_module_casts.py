"""A forward that casts a submodule to the dtype it already has (``self.classifier =
self.classifier.to(self.dtype)``: Switch Transformers' router) exports (``tracer.export.
unchanged_module_to``): the bundle equals eager at the smallest, an odd and the largest size
(float32: 1e-5 absolute and relative). While exporting, such a cast returns the module itself,
and one that changes a dtype still converts; afterwards ``Module.to`` is torch's again."""

from __future__ import annotations

import torch

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.dtype = torch.float32
        self.classifier = nn.Linear(8, 4)

    def forward(self, x):  # x: [B, 8]
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype)).softmax(-1)

spec = ModelSpec(module=Router, inputs=[Input("x", (Dim("batch", 1, 5), 8))])
"""


def test_a_cast_to_the_dtype_a_submodule_has_exports(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import instantiate, load_model_file, trace

    path = tmp_path / "router.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    pack(generate(trace(spec), ("sm_90",)), tmp_path / "router.tpk")
    runner, module = load(tmp_path / "router.tpk"), instantiate(spec)
    for batch in (1, 3, 5):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(runner(x), module(x), rtol=1e-5, atol=1e-5)


def test_only_a_cast_that_changes_nothing_is_skipped():
    from aot.tracer.export import unchanged_module_to

    torch_to = torch.nn.Module.to
    linear = torch.nn.Linear(4, 2)
    with unchanged_module_to():
        assert torch.nn.Module.to is not torch_to
        weight = linear.weight
        assert linear.to(torch.float32) is linear and linear.weight is weight
        assert linear.to("cpu") is linear and linear.to(torch.device("cpu"), torch.float32) is linear
        assert linear.to(torch.float64) is linear and linear.weight.dtype == torch.float64  # converted
    assert torch.nn.Module.to is torch_to
