"""A small model whose code adds guards: a branch on T and a reshape that needs T even."""

from torch import nn

from aot import Dim, Input, ModelSpec


class Branchy(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.proj = nn.Linear(c, c)

    def forward(self, x):  # x: [B, T, C]
        B, T, C = x.shape
        if T > 8:
            x = x * 2
        pairs = x.reshape(B, T // 2, 2 * C)
        return self.proj(pairs.reshape(B, T, C)).relu()


batch = Dim("batch", 1, 16)
seq = Dim("seq", 1, 256, example=16)
spec = ModelSpec(module=Branchy, inputs=[Input("x", (batch, seq, 16))], dtype="float32", allow_narrowing=True)
