"""Attention candidates, GPT-style: one QKV projection split into 4 causal heads of 16, the heads
merged back for the output projection; fp16."""

import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):  # x: [B, T, 64]
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(64, dim=2)
        q = q.view(B, T, 4, 16).transpose(1, 2)
        k = k.view(B, T, 4, 16).transpose(1, 2)
        v = v.view(B, T, 4, 16).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


batch = Dim("batch", 1, 8, buckets=(1, 2, 8))
seq = Dim("seq", 1, 96, buckets=(1, 16, 96))
spec = ModelSpec(module=Attention, inputs=[Input("x", (batch, seq, 64))], dtype="float16")
