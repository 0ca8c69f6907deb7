"""Sibling projections that read one activation: q/k/v without bias (Llama), with bias (BERT),
a gated MLP's gate and up, and a projection whose weight is also read elsewhere (left alone)."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Siblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32, bias=False)
        self.k = nn.Linear(32, 16, bias=False)
        self.v = nn.Linear(32, 16, bias=False)
        self.bq = nn.Linear(32, 24)
        self.bk = nn.Linear(32, 24)
        self.gate = nn.Linear(32, 48, bias=False)
        self.up = nn.Linear(32, 48, bias=False)
        self.down = nn.Linear(48, 32, bias=False)
        self.shared = nn.Linear(32, 8, bias=False)
        self.other = nn.Linear(32, 8, bias=False)

    def forward(self, x):  # x: [B, T, 32]
        q, k, v = self.q(x), self.k(x), self.v(x)  # [B, T, 32], [B, T, 16] x2
        attn = q[..., :16] * k + v  # [B, T, 16]
        scores = self.bq(x) * self.bk(x)  # [B, T, 24]
        h = self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))  # [B, T, 32]
        tied = self.shared(x) + x[..., :8] @ self.shared.weight[:, :8]  # shared's weight read twice
        return attn, scores, h, tied + self.other(x)


batch = Dim("batch", 1, 4)
seq = Dim("seq", 1, 40, example=5)
spec = ModelSpec(module=Siblings, inputs=[Input("x", (batch, seq, 32))], dtype="float16")
