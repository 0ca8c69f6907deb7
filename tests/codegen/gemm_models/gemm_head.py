"""A small CNN whose only library GEMM is its classifier head: Conv2d(3→8) → ReLU → global
average pool → Linear(8→10). The default build runs the head as a Triton kernel (no cuBLAS)."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):  # x: [B, 3, 8, 8]
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


batch = Dim("batch", 1, 32, buckets=(1, 5, 32))
spec = ModelSpec(module=Head, inputs=[Input("x", (batch, 3, 8, 8))], dtype="float16")
