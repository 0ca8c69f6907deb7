"""A set model: each item is normalized against the mean and spread of all items of the call, so
every row of the output depends on every row of the input."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class SetNorm(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, C]
        centred = x - x.mean(dim=0, keepdim=True)
        return self.proj(centred / (centred.std(dim=0, keepdim=True) + 1e-5))


items = Dim("items", 2, 32, example=4)
spec = ModelSpec(module=SetNorm, inputs=[Input("x", (items, 16))], dtype="float32")
