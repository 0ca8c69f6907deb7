"""GEMM candidates with a LayerNorm prologue: LayerNorm(96) → Linear(96→256) + GELU →
Linear(256→96) + residual, then LayerNorm of that sum → Linear(96→48); the sum is an output too
(the prologue's add result, written by the GEMM that absorbs its LayerNorm). K = 96 is not a
multiple of any BLOCK_K, float16."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(96)
        self.up = nn.Linear(96, 256)
        self.down = nn.Linear(256, 96)
        self.ln2 = nn.LayerNorm(96)
        self.proj = nn.Linear(96, 48)

    def forward(self, x):  # x: [B, 96]
        h = x + self.down(torch.nn.functional.gelu(self.up(self.ln1(x))))
        return self.proj(self.ln2(h)), h


batch = Dim("batch", 1, 64, buckets=(1, 16, 37, 64))
spec = ModelSpec(module=Block, inputs=[Input("x", (batch, 96))], dtype="float16")
