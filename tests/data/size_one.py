"""A model that behaves differently at batch 1 and has a branch on the sequence length: one trace
cannot cover its declared ranges, so a build traces a program per case."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class SizeOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # x: [B, T, 8]
        B, T, _ = x.shape
        if B == 1:  # a single row is scaled: eager code paths like this exist in real models
            x = x * 3
        y = self.proj(x)
        if T > 4:
            y = torch.tanh(y)
        return y


spec = ModelSpec(module=SizeOne, inputs=[Input("x", (Dim("batch", 1, 6), Dim("seq", 1, 16), 8))])
