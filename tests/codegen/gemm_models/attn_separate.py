"""Attention candidates, separate projections: q, k and v each a Linear of its own, 3 heads of 24
(not a power of two: the kernel masks the head dim), not causal, an explicit scale, and the
heads merged through ``contiguous()`` for the output projection; fp32."""

import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(72, 72)
        self.k = nn.Linear(72, 72)
        self.v = nn.Linear(72, 72)
        self.o = nn.Linear(72, 72)

    def forward(self, x):  # x: [B, T, 72]
        B, T, C = x.shape
        q = self.q(x).view(B, T, 3, 24).transpose(1, 2)
        k = self.k(x).view(B, T, 3, 24).transpose(1, 2)
        v = self.v(x).view(B, T, 3, 24).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, scale=0.3)
        return self.o(y.transpose(1, 2).contiguous().view(B, T, C))


batch = Dim("batch", 1, 8, buckets=(1, 2, 8))
seq = Dim("seq", 1, 96, buckets=(1, 16, 96))
spec = ModelSpec(module=Attention, inputs=[Input("x", (batch, seq, 72))], dtype="float32")
