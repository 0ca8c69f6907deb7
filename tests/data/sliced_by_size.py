"""Attention over the first ``ctx`` rows of a buffer, ``ctx`` read off an input's size (a KV
cache read up to a mask's length). Traced at ``ctx == 8`` it builds; traced at 16, the buffer's
own length, decomposing the export fixes ``ctx`` at 16 (the slice is then the whole buffer), and
the build must say so rather than write guards that admit 1..16 (tests/e2e)."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class SlicedBySize(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(1, 4, 16, 8))

    def forward(self, q, mask):  # q: [1, 4, S, 8], mask: [1, C]
        k = self.table[:, :, : mask.shape[1]]  # [1, 4, C, 8]
        bias = (mask[:, None, None, :] - 1.0) * 1e4  # [1, 1, 1, C]
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=bias)


seq = Dim("seq", 1, 16, example=4)
ctx = Dim("ctx", 1, 16, example=8)
spec = ModelSpec(module=SlicedBySize, inputs=[Input("q", (1, 4, seq, 8)), Input("mask", (1, ctx))])
