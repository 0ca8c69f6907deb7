"""A dim range so large that buffers can exceed 2**31 elements: kernels must index with int64."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Big(nn.Module):
    def forward(self, x):  # x: [B, 4096]
        return torch.softmax(x, dim=-1), torch.relu(x) * 2.0


batch = Dim("batch", 1, 1 << 20)
spec = ModelSpec(module=Big, inputs=[Input("x", (batch, 4096))], dtype="float16")
