"""Attention-style scores (a library bmm) → causal mask from arange/where → softmax; log-softmax."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Softmax(nn.Module):
    def forward(self, q):  # q: [B, T, 16]
        s = q @ q.transpose(1, 2)  # [B, T, T]
        T = q.shape[1]
        i = torch.arange(T, device=q.device)
        causal = i[:, None] >= i[None, :]
        masked = torch.where(causal, s * 0.25, torch.full_like(s, float("-inf")))
        p = torch.softmax(masked, dim=-1)
        return p, torch.log_softmax(s, dim=-1), s.amax(dim=-1)


batch = Dim("batch", 1, 3)
seq = Dim("seq", 1, 96, example=9)
spec = ModelSpec(module=Softmax, inputs=[Input("q", (batch, seq, 16), low=-1.0, high=1.0)], dtype="float32")
