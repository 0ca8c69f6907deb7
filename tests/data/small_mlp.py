"""A small copy of ``models/mlp.py`` (same structure and dtype, tiny sizes) for fast bundle tests."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec

D_MODEL = 32
D_HIDDEN = 64
N_BLOCKS = 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.up = nn.Linear(D_MODEL, D_HIDDEN)
        self.down = nn.Linear(D_HIDDEN, D_MODEL)

    def forward(self, x):  # x: [B, D]
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(N_BLOCKS)])
        self.norm = nn.LayerNorm(D_MODEL)

    def forward(self, x):  # x: [B, D]
        return self.norm(self.blocks(x))


batch = Dim("batch", 1, 64, paddable=True)
spec = ModelSpec(module=MLP, inputs=[Input("x", (batch, D_MODEL))], dtype="float16")
