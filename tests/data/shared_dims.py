"""Two inputs share the Dims batch and seq."""

from torch import nn

from aot import Dim, Input, ModelSpec


class M(nn.Module):
    def forward(self, x, mask):  # x: [B, T, C], mask: [B, T]
        return x * mask.unsqueeze(-1)


batch = Dim("batch", 1, 8)
seq = Dim("seq", 1, 64)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, seq, 4)), Input("mask", (batch, seq))])
