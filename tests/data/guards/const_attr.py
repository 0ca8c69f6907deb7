"""Guard-diff fixture for the trace-only path: a plain tensor attribute (not a buffer) that the
shapes-only module leaves on the meta device, so export falls back to the full module."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.scale = torch.ones(16) * 2  # a plain tensor attribute, not a buffer

    def forward(self, x):  # x: [B, T, C]
        return self.proj(x) * self.scale


batch = Dim("batch", 1, 8)
seq = Dim("seq", 1, 64)
spec = ModelSpec(module=Net, inputs=[Input("x", (batch, seq, 16))], name="net")
