"""Keyword inputs, a constant keyword argument, and an output tree of a dict, a tuple and a named tuple."""

from typing import NamedTuple

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Pair(NamedTuple):
    low: torch.Tensor
    high: torch.Tensor


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, features, mask=None, scale: float = 1.0, return_extra: bool = False):
        # features: [B, 4], mask: [B]
        h = self.proj(features) * scale
        out = {"hidden": h, "pair": Pair(h.amin(-1), h.amax(-1))}
        if mask is not None:
            out["masked"] = (h * mask[:, None], None)
        if return_extra:
            out["extra"] = [h.sum()]
        return out


batch = Dim("batch", 1, 8)
spec = ModelSpec(
    module=Structured,
    inputs=[Input("features", (batch, 4)), Input("mask", (batch,))],
    kwargs={"scale": 2.0, "return_extra": True},
)
