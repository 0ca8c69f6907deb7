"""A batch norm over its own statistics with no running ones (``F.batch_norm(w, None, None,
training=True)``), as timm's weight-standardized convolutions of NF-Nets and BiT call it in eval
mode: a pure function of its input, decomposed by the tracer (``tracer.trace.DECOMPOSE_OPS``)
into means, variances and pointwise ops rather than refused as a training-mode batch norm. The
bundle equals eager on the CPU at the smallest, an odd and the largest batch (float32: 1e-5
relative to the output's scale, the order of the variance's sums may differ)."""

from __future__ import annotations

import torch

MODEL = """
import torch
import torch.nn.functional as F
from torch import nn
from aot import Dim, Input, ModelSpec

class StdConv(nn.Conv2d):
    def forward(self, x):  # x: [B, 3, 8, 8]
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                         momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w * 1.5, self.bias, self.stride, self.padding)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = StdConv(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        # a batch norm over the activations' own statistics too: the op is pure wherever it runs
        y = F.batch_norm(self.conv(x), None, None, training=True, momentum=0.0, eps=1e-5)
        return self.head(y.mean((2, 3)))

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 3, 8, 8))])
"""


def test_a_batch_norm_over_its_own_statistics_is_decomposed_and_runs_as_eager(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.tracer.model import instantiate

    path = tmp_path / "std_conv.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    traced = trace(spec)
    targets = {s.target for s in traced.program.steps}
    assert not any("batch_norm" in t for t in targets), sorted(targets)
    assert "aten.convolution.default" in targets
    pack(generate(traced, ("sm_90",)), tmp_path / "std_conv.tpk")
    runner = load(tmp_path / "std_conv.tpk")
    module = instantiate(spec)  # the weights the build made: seeded as ModelSpec seeds them
    for batch in (1, 3, 4):
        x = torch.randn(batch, 3, 8, 8)
        with torch.no_grad():
            expected = module(x)
        got = runner(x)
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
