"""A model torch.export cannot trace: it branches on a tensor's values."""

from torch import nn

from aot import Dim, Input, ModelSpec


class ValueBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


spec = ModelSpec(module=ValueBranch, inputs=[Input("x", (Dim("batch", 1, 8), 4))])
