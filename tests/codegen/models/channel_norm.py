"""A LayerNorm over the channels of an NCHW tensor, as ConvNeXt writes it (permute, normalize,
permute back), and a mean over the spatial positions: reductions whose reduced elements sit a stride
apart in memory while consecutive rows are adjacent, which take wide row tiles."""

import torch
import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec

C = 24


class ChannelNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, C))
        self.bias = nn.Parameter(torch.linspace(-0.3, 0.3, C))

    def forward(self, x):  # x: [B, C, H, W]
        y = F.layer_norm(x.permute(0, 2, 3, 1), (C,), self.weight, self.bias, 1e-6).permute(0, 3, 1, 2)
        return y + x, y.mean((2, 3))


batch = Dim("batch", 1, 4)
spec = ModelSpec(module=ChannelNorm, inputs=[Input("x", (batch, C, 12, 10))], dtype="float16")
