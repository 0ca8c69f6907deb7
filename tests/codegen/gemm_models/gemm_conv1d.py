"""GEMM candidates on weights stored [K, N] (transformers' Conv1D: ``x @ W + b``, GPT-2's
projections): a fused QKV-style projection with a bias, then an output projection with a bias and
a residual add; fp16. The build stores the first weight transposed, [N, K]
(``aot.codegen.weight_layout``); the second is also read as a tensor (its first row, added to the
result: its column sums would be computed at build time, ``aot.tracer.folding``), so it keeps
its layout and its site reads W [K, N] as stored."""

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


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = Conv1D(64, 192)
        self.down = Conv1D(192, 64)

    def forward(self, x):  # x: [B, 64]
        return x + self.down(torch.relu(self.up(x))) + self.down.weight[0]


batch = Dim("batch", 1, 64, buckets=(1, 16, 64))
spec = ModelSpec(module=Block, inputs=[Input("x", (batch, 64))], dtype="float16")
