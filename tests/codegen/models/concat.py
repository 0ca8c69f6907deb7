"""``cat`` fused into the kernels that read it: RoPE's ``rotate_half`` (a cat of a negated half
and the other half), a cat along a dynamic dim, a three-piece cat read by a softmax row (the
reduction reads every piece), a cat of two views of one buffer, and a cat that is the row of a
looped reduction (rows longer than one block)."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


def rotate_half(x):  # x: [B, H, T, D]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(1, 3, 16))
        self.long_rows = nn.Parameter(torch.randn(2, 5000))  # a cat of them is a looped reduction's row

    def forward(self, q, pos):  # q: [B, H, T, 16], pos: [T]
        inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # [8]
        freqs = pos.float()[:, None] * inv[None, :]  # [T, 8]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, 16]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        roped = q * cos + rotate_half(q) * sin  # [B, H, T, 16]
        rows = q[:, 0]  # [B, T, 16]
        longer = torch.cat(
            (self.prefix.expand(rows.shape[0], -1, -1).to(q.dtype), rows), dim=1
        )  # [B, 3+T, 16]
        wide = torch.cat((rows, rows * 2.0, rows[..., :4]), dim=-1)  # [B, T, 36]
        m = q.float().mean()  # each piece reads the input (a cat of weights alone is folded at build time)
        long_row = torch.cat((self.long_rows.float() * m, -self.long_rows.float() * m), dim=-1)  # [2, 10000]
        return roped, longer * 1.5, torch.softmax(wide.float(), dim=-1), torch.log_softmax(long_row, dim=-1)


batch = Dim("batch", 1, 4)
seq = Dim("seq", 1, 64, example=5)
spec = ModelSpec(
    module=Concat,
    inputs=[Input("q", (batch, 2, seq, 16)), Input("pos", (seq,), dtype="int64", low=0, high=512)],
    dtype="float16",
)
