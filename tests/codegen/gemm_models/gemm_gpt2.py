"""A GPT-2 MLP half as transformers writes it: ``h = r + dropout(x)`` (inference mode: a copy),
LayerNorm(600) → Conv1D(600→128) (W [K, N], ``addmm``) → ``gelu_new`` (the tanh form, written
with pointwise ops and ``x ** 3``) → Conv1D(128→600) → ``h + dropout(·)``. K = 600: a one-row
form of 512-wide K steps takes a partial second step (the built-in table's, ``vec_1x2x1024``,
one masked step). float16."""

import math

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Conv1D(nn.Module):
    def __init__(self, nx: int, nf: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.05)  # [K, N]
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size = x.size()[:-1] + (self.weight.size(-1),)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size)


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(600)
        with torch.no_grad():  # a LayerNorm as trained: its scale and shift are not 1 and 0
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.2, 0.2)
        self.fc = Conv1D(600, 128)
        self.proj = Conv1D(128, 600)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, r):  # x, r: [B, 600]
        h = r + self.drop(x)
        return h + self.drop(self.proj(gelu_new(self.fc(self.ln(h)))))


batch = Dim("batch", 1, 4, buckets=(1, 3, 4))
spec = ModelSpec(module=Block, inputs=[Input("x", (batch, 600)), Input("r", (batch, 600))], dtype="float16")
