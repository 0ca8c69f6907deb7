"""A model that returns a slice of its own weight beside what it computes (a learned prompt
without its first row): a legitimate output that is a view of the runner's weights."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class PromptSlice(nn.Module):
    def __init__(self):
        super().__init__()
        self.prompt = nn.Parameter(torch.randn(4, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # x: [B, 8]
        return self.proj(x), self.prompt[1:]


batch = Dim("batch", 1, 8, example=2)
spec = ModelSpec(module=PromptSlice, inputs=[Input("x", (batch, 8))], dtype="float32")
