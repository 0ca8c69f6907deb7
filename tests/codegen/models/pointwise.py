"""Pointwise chains with broadcasting: casts, where, comparisons, scalar ops, activations."""

import torch
import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec


class Pointwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 24))
        self.b = nn.Parameter(torch.linspace(0.5, 1.5, 24))

    def forward(self, x):  # x: [B, T, 24]
        y = x[0, :, :1]  # [T, 1]
        a = x * 2.0 + self.w  # broadcast over a weight
        b = torch.where(a > 0.25, torch.sigmoid(a), F.gelu(a))  # comparison, where
        c = b - y  # broadcast of a [T, 1] input
        d = torch.clamp(c, -0.75, 2.0).pow(2) + torch.exp(-c.abs()) + F.silu(c) + torch.tanh(c)
        e = (d.float() / self.b.float()).to(torch.float16)  # casts
        f = torch.maximum(e, torch.zeros_like(e)) + F.gelu(c, approximate="tanh") * 0.5
        g = torch.rsqrt(f.abs() + 1.0) + torch.log1p(f.abs()) - (f < 0.5).to(torch.float16)
        return g, F.relu(x).sum(dim=-1), a > 0.5, (x * 10.0).to(torch.int64)  # bool and int64 stores


batch = Dim("batch", 1, 8)
seq = Dim("seq", 2, 64, example=5)
spec = ModelSpec(
    module=Pointwise,
    inputs=[Input("x", (batch, seq, 24))],
    dtype="float16",
)
