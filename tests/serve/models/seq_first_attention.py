"""Self-attention in PyTorch's default layout, (seq, batch, embed): dim 0 is the sequence, which
attention mixes. A server that joined requests along dim 0 would hand client A answers computed
from client B's tokens."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class SeqFirstAttention(nn.Module):
    def __init__(self, embed: int = 16, heads: int = 2):
        super().__init__()
        self.attention = nn.MultiheadAttention(embed, heads)  # batch_first=False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, B, E]
        return self.attention(x, x, x, need_weights=False)[0]


seq = Dim("seq", 1, 16, example=4)
batch = Dim("batch", 1, 8, example=2)
spec = ModelSpec(module=SeqFirstAttention, inputs=[Input("x", (seq, batch, 16))], dtype="float32")
