"""Selections whose size depends on tensor values (a bundle refuses them, naming the op, its
bound and the lines to move out), and the fixed-size form the refusal proposes."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec

N = 8  # the most rows the fixed-size selection keeps


class Nonzero(nn.Module):
    def forward(self, x):  # x: [B, 8]
        idx = torch.nonzero(x > 0)
        return idx * 2


class MaskedSelect(nn.Module):
    def forward(self, x):  # x: [B, 8]
        return torch.masked_select(x, x > 0).exp()


class BooleanMask(nn.Module):
    def forward(self, x, scores):  # x: [n, 4], scores: [n]
        keep = scores > 0.5
        rows = x[keep]
        return rows * 3 + 1


class FirstRows(nn.Module):
    """BooleanMask at a fixed size: the first N kept rows of x in N + 1 rows, and their count."""

    def forward(self, x, scores):  # x: [n, 4], scores: [n]
        keep = scores > 0.5
        pos = keep.cumsum(0) - 1  # each kept row's place among the kept
        pos = torch.where(keep & (pos < N), pos, N)  # the others go to the spare row N
        rows = x.new_zeros(N + 1, x.shape[1]).scatter(0, pos[:, None].expand_as(x), x)[:N]
        return rows * 3 + 1, keep.sum()


def spec(module) -> ModelSpec:
    if module in (Nonzero, MaskedSelect):
        return ModelSpec(module=module, inputs=[Input("x", (Dim("batch", 1, 4), 8))])
    n = Dim("n", 1, 16)
    return ModelSpec(module=module, inputs=[Input("x", (n, 4)), Input("scores", (n,))])
