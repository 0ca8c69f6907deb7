"""GEMM candidates, other epilogues: sigmoid(A Wa^T + a) * tanh(A Wb^T + b) (a dual GEMM with
biases), ReLU folded into ``_addmm_activation``, tanh-GELU, a subtraction and a cast to float32."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Acts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(32, 64)
        self.c = nn.Linear(64, 32)
        self.d = nn.Linear(32, 48)

    def forward(self, x):  # x: [B, 32]
        h = torch.sigmoid(self.a(x)) * torch.tanh(self.b(x))
        r = torch.relu(self.c(h)) - x
        return torch.nn.functional.gelu(self.d(r), approximate="tanh").float()


batch = Dim("batch", 1, 64, buckets=(1, 16, 37))
spec = ModelSpec(module=Acts, inputs=[Input("x", (batch, 32))], dtype="float16")
