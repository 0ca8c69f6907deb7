"""An op the fuser does not know (cumsum) between fusible ones: it must stay a library call."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec


class Unknown(nn.Module):
    def forward(self, x):  # x: [B, 32]
        h = torch.relu(x * 3.0 - 1.0)
        c = torch.cumsum(h, dim=-1)
        return torch.sigmoid(c) + h


batch = Dim("batch", 1, 8)
spec = ModelSpec(module=Unknown, inputs=[Input("x", (batch, 32))], dtype="float32")
