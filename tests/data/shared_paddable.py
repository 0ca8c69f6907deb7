"""Two inputs sharing paddable Dims (an encoder's input_ids and attention_mask), and two outputs."""

from torch import nn

from aot import Dim, Input, ModelSpec


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):  # x: [B, T, 4], mask: [B, T]
        h = self.proj(x) * mask.unsqueeze(-1)
        return h, h.sum(-1)


batch = Dim("batch", 1, 8, buckets=(1, 4, 8), paddable=True)
seq = Dim("seq", 1, 16, buckets=(4, 16), paddable=True)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, seq, 4)), Input("mask", (batch, seq))])
