"""Attention candidates, heads shaped as transformers shapes them: one QKV projection split into
q, k and v, each viewed with ``-1`` for the heads, SDPA's result viewed to the shape it already
has before its heads are merged back, causal; fp32."""

import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.o = nn.Linear(64, 64)

    def forward(self, x):  # x: [B, T, 64]
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(64, dim=2)
        q, k, v = (t.view(B, T, -1, 16).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.view(B, 4, T, 16)  # to the shape it has
        return self.o(y.transpose(1, 2).reshape(B, T, C))


batch = Dim("batch", 1, 4, buckets=(1, 4))
seq = Dim("seq", 1, 64, buckets=(1, 16, 64))
spec = ModelSpec(module=Attention, inputs=[Input("x", (batch, seq, 64))], dtype="float32")
