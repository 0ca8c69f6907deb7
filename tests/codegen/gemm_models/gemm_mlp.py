"""GEMM candidates: Linear(64→1024) + bias + GELU, then Linear(1024→64) + bias + residual (split-K
applies: K = 1024), float16; ``gemm_mlp32.py`` is the same in float32."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 1024)
        self.down = nn.Linear(1024, 64)

    def forward(self, x):  # x: [B, 64]
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


batch = Dim("batch", 1, 64, buckets=(1, 16, 37, 64))
spec = ModelSpec(module=Block, inputs=[Input("x", (batch, 64))], dtype="float16")
