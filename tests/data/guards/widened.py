"""Guard-diff fixture, the base: x [batch, seq, 16] with seq in 1..64. Each sibling file makes
one change to it; tests/test_guards_review.py diffs the pairs.
This one: the range of seq widened from 1..64 to 1..128."""

from torch import nn

from aot import Dim, Input, ModelSpec


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):  # x: [B, T, C]
        B, T, C = x.shape
        return self.proj(x).relu()


batch = Dim("batch", 1, 8)
seq = Dim("seq", 1, 128)
spec = ModelSpec(module=Net, inputs=[Input("x", (batch, seq, 16))], name="net")
