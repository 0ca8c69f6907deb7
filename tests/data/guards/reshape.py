"""Guard-diff fixture, the base: x [batch, seq, 16] with seq in 1..64. Each sibling file makes
one change to it; tests/test_guards_review.py diffs the pairs.
This one: a reshape that needs T % 2 == 0."""

from torch import nn

from aot import Dim, Input, ModelSpec


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):  # x: [B, T, C]
        B, T, C = x.shape
        x = x.reshape(B, T // 2, 2 * C).reshape(B, T, C)
        return self.proj(x).relu()


batch = Dim("batch", 1, 8)
seq = Dim("seq", 1, 64)
spec = ModelSpec(module=Net, inputs=[Input("x", (batch, seq, 16))], name="net")
