"""Rows come back in reverse order: row b of the output is row B-1-b of the input."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Flipped(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C]
        return self.proj(x).relu().flip(0)


batch = Dim("batch", 1, 16, example=3)
spec = ModelSpec(module=Flipped, inputs=[Input("x", (batch, 16))], dtype="float32")
