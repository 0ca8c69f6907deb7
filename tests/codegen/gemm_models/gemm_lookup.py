"""A decode step's first norm read from its lookups, as a decoder's first layer has it: GPT-2's
``h = wte[ids] + wpe[positions]``, LayerNorm(600) → Linear(600→128) → Linear(128→600) → ``h + ·``
(the sum read by the residual after the second GEMM); and Llama's ``e = embed[ids]``, RMSNorm(600)
as transformers writes it → Linear(600→128, no bias) → Linear(128→600) → ``e + ·`` (the lookup's
rows read by the residual too). ids and positions: [B] int64. K = 600: a one-row form of
512-wide K steps takes a partial second step. float16."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d).uniform_(0.5, 1.5))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Lookups(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(50, 600)
        self.wpe = nn.Embedding(32, 600)
        self.ln = nn.LayerNorm(600)
        with torch.no_grad():  # a LayerNorm as trained: its scale and shift are not 1 and 0
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.2, 0.2)
        self.fc = nn.Linear(600, 128)
        self.fc_out = nn.Linear(128, 600)
        self.embed = nn.Embedding(50, 600)
        self.norm = RMSNorm(600)
        self.proj = nn.Linear(600, 128, bias=False)
        self.proj_out = nn.Linear(128, 600)

    def forward(self, ids, positions):  # [B], [B]
        h = self.wte(ids) + self.wpe(positions)
        e = self.embed(ids)
        return h + self.fc_out(self.fc(self.ln(h))), e + self.proj_out(self.proj(self.norm(e)))


batch = Dim("batch", 1, 4, buckets=(1, 3, 4))
spec = ModelSpec(
    module=Lookups,
    inputs=[
        Input("ids", (batch,), dtype="int64", low=0, high=50),
        Input("positions", (batch,), dtype="int64", low=0, high=32),
    ],
    dtype="float16",
)
