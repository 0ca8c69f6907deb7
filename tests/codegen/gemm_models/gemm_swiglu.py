"""GEMM candidates, Llama MLP: down(silu(gate(x)) * up(x)) + x over [B, T, 64], no biases; the
gate and up GEMMs share their input, so one dual-GEMM kernel computes both and the product."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 128, bias=False)
        self.up = nn.Linear(64, 128, bias=False)
        self.down = nn.Linear(128, 64, bias=False)

    def forward(self, x):  # x: [B, T, 64]
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


batch = Dim("batch", 1, 64, buckets=(1, 2, 37))
seq = Dim("seq", 1, 8, buckets=(1, 8))
spec = ModelSpec(module=SwiGLU, inputs=[Input("x", (batch, seq, 64))], dtype="float16")
