"""A position embedding learned for a 4x4 patch grid, used as it is at that grid and resized to
any other, as DINOv2 does (``if num_patches == num_positions and height == width``): the trace at
one size keeps the relation ``(height//4)*(width//4) != 16``, which excludes the native size."""

import torch
from torch import nn
from torch.nn import functional as F

from aot import Dim, Input, ModelSpec


class NativeGrid(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, kernel_size=4, stride=4)
        self.pos = nn.Parameter(torch.randn(1, 8, 4, 4))

    def forward(self, image):  # image: [B, 3, H, W]
        height, width = image.shape[2], image.shape[3]
        x = self.embed(image)  # x: [B, 8, H//4, W//4]
        if x.shape[2] * x.shape[3] == 16 and height == width:
            pos = self.pos
        else:
            pos = F.interpolate(self.pos, size=(x.shape[2], x.shape[3]), mode="bilinear", align_corners=False)
        return (x + pos).flatten(2).transpose(1, 2)  # [B, (H//4)*(W//4), 8]


spec = ModelSpec(
    module=NativeGrid,
    inputs=[Input("image", (Dim("batch", 1, 2), 3, Dim("height", 8, 24), Dim("width", 8, 24)))],
)
