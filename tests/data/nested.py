"""Nested inputs: a dict argument and a tuple argument, and an optional argument left out."""

from torch import nn

from aot import Dim, Input, ModelSpec


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(
        self, inputs, past, bias=None
    ):  # inputs: {"image": [B, 4], "scale": [B, 1]}; past: ([B, 4], [B, 4])
        h = self.proj(inputs["image"]) * inputs["scale"]
        if bias is not None:
            h = h + bias
        return h + past[0] - past[1]


batch = Dim("batch", 1, 8)
spec = ModelSpec(
    module=Nested,
    inputs=[
        Input("inputs.image", (batch, 4)),
        Input("inputs.scale", (batch, 1)),
        Input("past.0", (batch, 4)),
        Input("past.1", (batch, 4)),
    ],
)
