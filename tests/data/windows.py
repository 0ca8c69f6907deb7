"""A windowed image model in the manner of Swin: a stride-2 patch embedding, then attention inside
4x4 windows, padding the feature map up to whole windows when its size is not a multiple of 4.
Its arithmetic depends on the image size modulo 8, so the image dims declare ``multiple_of=8``."""

import torch
from torch import nn
from torch.nn import functional as F

from aot import Dim, Input, ModelSpec

WINDOW = 4


class Windows(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, kernel_size=2, stride=2)
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, image):
        x = self.embed(image)
        b, c, h, w = x.shape
        if h % WINDOW != 0 or w % WINDOW != 0:
            x = F.pad(x, (0, (WINDOW - w % WINDOW) % WINDOW, 0, (WINDOW - h % WINDOW) % WINDOW))
        _, _, hp, wp = x.shape
        windows = x.view(b, c, hp // WINDOW, WINDOW, wp // WINDOW, WINDOW).permute(0, 2, 4, 3, 5, 1)
        tokens = windows.reshape(-1, WINDOW * WINDOW, c)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        attended = torch.softmax(q @ k.transpose(1, 2) / c**0.5, dim=-1) @ v
        y = self.out(attended).view(b, hp // WINDOW, wp // WINDOW, WINDOW, WINDOW, c)
        y = y.permute(0, 5, 1, 3, 2, 4).reshape(b, c, hp, wp)
        return y[:, :, :h, :w]


height = Dim("height", 8, 40, multiple_of=8)
width = Dim("width", 8, 40, multiple_of=8)
spec = ModelSpec(module=Windows, inputs=[Input("image", (Dim("batch", 1, 2), 3, height, width))])
