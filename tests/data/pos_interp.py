"""A position embedding learned at 4x4 and resized to the image's patch grid, as DINOv2 does:
bicubic interpolation to a size computed from the input, whose scale (4 / (height // 2)) is a
float of the sizes the bundle stores and evaluates per call."""

import torch
from torch import nn
from torch.nn import functional as F

from aot import Dim, Input, ModelSpec


class PosInterp(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, kernel_size=2, stride=2)
        self.pos = nn.Parameter(torch.randn(1, 8, 4, 4))

    def forward(self, image):
        x = self.embed(image)
        pos = F.interpolate(self.pos, size=(x.shape[2], x.shape[3]), mode="bicubic", align_corners=False)
        return (x + pos).flatten(2).transpose(1, 2) * (image.shape[3] / 16)


spec = ModelSpec(
    module=PosInterp,
    inputs=[Input("image", (Dim("batch", 1, 2), 3, Dim("height", 4, 40), Dim("width", 4, 40)))],
)
