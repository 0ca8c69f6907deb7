"""Convolutions in the layouts the codegen gives them (``aot.codegen.layouts``): a stem with
BatchNorm + ReLU and a max pool, a residual block, a ConvNeXt-style block (depthwise convolution,
LayerNorm over the channels of the permuted tensor, layer scale and residual), a convolution whose
output is read through a view, and one whose output is the model's output (kept row-major). The
biases of the depthwise and the head convolution join the kernels after them."""

import torch
import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec

C = 16


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.copy_(torch.linspace(-0.2, 0.2, c))
        bn.running_var.copy_(torch.linspace(0.5, 1.5, c))
    return bn


class ConvLayouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1, bias=False)
        self.bn0 = _bn(C)
        self.conv1 = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn1 = _bn(C)
        self.dw = nn.Conv2d(C, C, 7, padding=3, groups=C)
        self.norm = nn.LayerNorm(C, eps=1e-6)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.0, C))
        self.head = nn.Conv2d(C, 8, 1)
        self.out = nn.Conv2d(C, 4, 1, bias=False)

    def forward(self, x):  # x: [B, 3, H, W]
        x = F.max_pool2d(F.relu(self.bn0(self.stem(x))), 2)
        x = F.relu(self.bn1(self.conv1(x)) + x)
        y = self.norm(self.dw(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = x + y * self.gamma.reshape(1, -1, 1, 1)
        pooled = self.head(x).flatten(1).softmax(-1)  # read through a view
        return self.out(x), pooled


batch = Dim("batch", 1, 4)
spec = ModelSpec(module=ConvLayouts, inputs=[Input("x", (batch, 3, 12, 10))], dtype="float16")
