"""A vocabulary head of short K: LayerNorm, then Linear(64 -> 32003) without a bias, float16 (N past
``gemm_defaults.VOCAB_N``, odd as GPT-2's 50257)."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec

VOCAB = 32003


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        with torch.no_grad():  # a LayerNorm as trained: its scale and shift are not 1 and 0
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, x):  # x: [B, 64] -> logits [B, VOCAB]
        return self.head(self.norm(x))


batch = Dim("batch", 1, 8, buckets=(1, 8))
spec = ModelSpec(module=Head, inputs=[Input("x", (batch, 64))], dtype="float16")
