"""A model with no library call: one fused kernel (scale, shift by a weight, relu), so its default
build is library-free and the torch-free runtime accepts it."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Pointwise(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.shift = nn.Parameter(torch.linspace(-1, 1, c))

    def forward(self, x):  # x: [B, C]
        return (x * 2 + self.shift).relu()


batch = Dim("batch", 1, 16, buckets=(1, 8, 16))
spec = ModelSpec(module=Pointwise, inputs=[Input("x", (batch, 16))], dtype="float32")
