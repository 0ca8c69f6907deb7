"""Reductions over more elements than one block holds (looped kernels): log-softmax, mean, var."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec

V = 10007  # > SINGLE_BLOCK_MAX, and not a multiple of the loop block


class Looped(nn.Module):
    def forward(self, x):  # x: [B, V]
        h = x * 1.5 - 0.25
        lsm = torch.log_softmax(h, dim=-1)
        var, mean = torch.var_mean(h, dim=-1)
        ln = torch.nn.functional.layer_norm(h, (V,))
        return lsm, mean + var, ln


batch = Dim("batch", 1, 6)
spec = ModelSpec(module=Looped, inputs=[Input("x", (batch, V), low=-3.0, high=3.0)], dtype="float32")
