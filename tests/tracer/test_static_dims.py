"""A Dim of one size (``Dim("seq", 12, 12)``: what the build's own hints propose for a size the
code fixes) is that size in the program's inputs as in the contract's guards: the bundle packs,
loads, runs as eager (float32, exactly: a linear layer and a sum), and refuses another size with
a GuardError naming the static size."""

from __future__ import annotations

import pytest
import torch

from aot import Dim, Input, ModelSpec
from aot.errors import GuardError


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):  # x: [B, 12, 8] -> [B, 4]
        return self.fc(x).sum(1)


def test_a_dim_of_one_size_is_that_size_in_the_program_and_the_guards(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from aot.tracer.model import instantiate

    spec = ModelSpec(module=_Model, inputs=[Input("x", (Dim("batch", 1, 4), Dim("seq", 12, 12), 8))])
    traced = trace(spec)
    assert traced.program.inputs[0].spec.shape == ("batch", "12", "8")
    pack(generate(traced, ("sm_90",)), tmp_path / "static.tpk")
    runner, module = load(tmp_path / "static.tpk"), instantiate(spec)
    for batch in (1, 3, 4):
        x = torch.randn(batch, 12, 8)
        with torch.no_grad():
            torch.testing.assert_close(runner(x), module(x), rtol=0, atol=0)
    with pytest.raises(GuardError, match=r"input 'x' dim 1: expected static size 12, got 11"):
        runner(torch.randn(2, 11, 8))
