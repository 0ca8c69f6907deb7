"""Attention with an explicit causal mask built from sizes (as HF's masking utilities do under
export), and a padding mask that comes from the caller."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class MaskedAttention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, padding):  # x: [B, T, D], padding: [B, T] bool (True = attend)
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T, device=x.device)
        causal = (pos[None, :] <= pos[:, None])[None, None].expand(B, 1, T, T)  # built from sizes only
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        b = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=padding[:, None, None, :] | ~causal.any(-1, keepdim=True)
        )
        return (a + b).transpose(1, 2).reshape(B, T, D)


spec = ModelSpec(
    module=MaskedAttention,
    inputs=[
        Input("x", (Dim("batch", 1, 4), Dim("seq", 1, 32), 16)),
        Input("padding", (Dim("batch", 1, 4), Dim("seq", 1, 32)), dtype="bool"),
    ],
)
