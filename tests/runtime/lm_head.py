"""A language model's last layers in small: a residual Linear(64→64), LayerNorm of the sum, then
the head Linear(64→1100) whose logits are the output (the steps after the runtime's CUDA graph
when they are large), its weight padded to 1152 rows so the logits are a slice of the GEMM's
result, rows apart, as gpt's are; float16; batch buckets 1 and 8. Built ``--library-free``: a tile form at every bucket, the
default table's one-row forms at batch 1 (``vec_1x2x512``, and ``vec_1x2x512_ln`` taking the
LayerNorm kernel into the head's prologue)."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        with torch.no_grad():  # a LayerNorm as trained: its scale and shift are not 1 and 0
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)
        self.head = nn.Linear(64, 1100, bias=False)

    def forward(self, x):  # x: [B, 64] -> logits [B, 1100]
        return self.head(self.norm(x + self.mix(x)))


batch = Dim("batch", 1, 8, buckets=(1, 8))
spec = ModelSpec(module=Head, inputs=[Input("x", (batch, 64))], dtype="float16")
