"""Two inputs with different Dims that the model forces equal (x + y)."""

from torch import nn

from aot import Dim, Input, ModelSpec


class M(nn.Module):
    def forward(self, x, y):  # x: [A, 4], y: [B, 4]
        return x + y


spec = ModelSpec(module=M, inputs=[Input("x", (Dim("a", 1, 8), 4)), Input("y", (Dim("b", 1, 8), 4))])
