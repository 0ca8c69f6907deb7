"""A parallel block (Phi, Falcon, GPT-J): an attention and an MLP branch beside each other, and
the next LayerNorm's input the sum of three rows, both branches (each through its dropout's copy)
and the residual; the next projection reads it, and the sum is an output too. The LayerNorm
kernel before that projection adds three rows, which the one-row forms' LayerNorm prologue (a sum
of at most two) cannot: it must stay a kernel of its own. float16."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Parallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_a = nn.LayerNorm(64)
        self.ln_m = nn.LayerNorm(64)
        self.attn = nn.Linear(64, 64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.ln2 = nn.LayerNorm(64)
        self.proj = nn.Linear(64, 96)
        self.drop = nn.Dropout(0.1)  # in eval a copy of each branch, as Phi's resid_dropout

    def forward(self, x):  # x: [B, 64]
        mlp = self.down(torch.nn.functional.gelu(self.up(self.ln_m(x))))
        h = self.drop(self.attn(self.ln_a(x))) + self.drop(mlp) + x
        return self.proj(self.ln2(h)), h


batch = Dim("batch", 1, 8, buckets=(1, 8))
spec = ModelSpec(module=Parallel, inputs=[Input("x", (batch, 64))], dtype="float16")
