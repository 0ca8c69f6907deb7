"""Bilinear resizes as kernels in library-free builds (``aot.codegen.resize``:
``F.interpolate(mode="bilinear")``, SegFormer's and MobileViT's heads): to another tensor's
symbolic size, to a static size with the corners aligned, by scale factors, and into a
channels-last input, from a permuted view of an MLP's rows (read in place). The CPU path agrees with eager and every kernel with its ATen reference in
Triton's interpreter at three sizes: upsampling and downsampling, a one-pixel output, a
one-pixel-wide input's neighbours."""

from __future__ import annotations

import torch

# the two maps every model here takes (``maps`` makes them): x [B, 4, H, W], y [B, 4, H2, W2]
MAPS_SPEC = """
batch = Dim("batch", 1, 3)
spec = ModelSpec(
    module=M,
    inputs=[
        Input("x", (batch, 4, Dim("h", 1, 12), Dim("w", 3, 12))),
        Input("y", (batch, 4, Dim("h2", 1, 20), Dim("w2", 1, 20))),
    ],
)
"""

MODEL = (
    """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x, y):  # x: [B, 4, H, W], y: [B, 4, H2, W2]
        a = F.interpolate(x, size=y.shape[2:], mode="bilinear", align_corners=False)
        b = F.interpolate(x * 2, size=(7, 5), mode="bilinear", align_corners=True)
        c = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
        d = F.interpolate(x.contiguous(memory_format=torch.channels_last), size=(5, 9), mode="bilinear")
        e = F.interpolate(y, size=x.shape[2:], mode="bilinear", align_corners=True)
        # SegFormer's head: an MLP's rows [B, H*W, C] permuted and viewed as a map, read in place
        rows = x.flatten(2).transpose(1, 2) * 3
        f = F.interpolate(rows.permute(0, 2, 1).reshape(x.shape), size=(4, 6), mode="bilinear")
        return a + y, b, c, d, e, f

"""
    + MAPS_SPEC
)


SIZES = [
    {"batch": 2, "h": 5, "w": 11, "h2": 13, "w2": 3},
    {"batch": 1, "h": 1, "w": 3, "h2": 1, "w2": 20},
    {"batch": 3, "h": 12, "w": 12, "h2": 20, "w2": 7},
]


def maps(s: dict, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The two maps ``MODEL`` and ``NEAREST`` take, at sizes ``s``."""
    x = torch.randn(s["batch"], 4, s["h"], s["w"], generator=g)
    return x, torch.randn(s["batch"], 4, s["h2"], s["w2"], generator=g)


def test_bilinear_resizes_are_kernels(tmp_path):
    from aot.codegen.resize import BILINEAR
    from tests.codegen.conftest import library_free_checked

    compiled, _ = library_free_checked(tmp_path, MODEL, maps, SIZES, interpret_at=3)
    program = compiled.program
    assert BILINEAR not in {s.target for s in program.steps}
    assert sum(k.name == "bilinear2d" for k in program.kernels) == 6


NEAREST = (
    """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x, y):  # x: [B, 4, H, W], y: [B, 4, H2, W2]
        a = F.interpolate(x, size=y.shape[2:], mode="nearest")  # up or down by the sizes
        b = F.interpolate(x, scale_factor=2.0, mode="nearest")  # a U-Net's, a feature pyramid's
        c = F.interpolate(y * 2, scale_factor=(1.5, 0.5), mode="nearest")
        d = F.interpolate(x.contiguous(memory_format=torch.channels_last), size=(5, 9), mode="nearest")
        rows = x.flatten(2).transpose(1, 2) * 3  # a view of an MLP's rows, read in place
        e = F.interpolate(rows.permute(0, 2, 1).reshape(x.shape), size=(3, 7), mode="nearest")
        return a + y, b, c, d, e

"""
    + MAPS_SPEC
)


def test_nearest_resizes_are_read_inside_kernels(tmp_path):
    """Nearest resizes to sizes that are no whole multiple of the input's (symbolic, fewer rows, a
    fractional factor; ``lower_pointwise._nearest_rows``) are read inside the kernels that use
    them, as whole multiples are: no ATen resize and no kernel of their own."""
    from tests.codegen.conftest import library_free_checked

    target = "aten.upsample_nearest2d.vec"
    sizes = [*SIZES[:2], {"batch": 3, "h": 12, "w": 12, "h2": 7, "w2": 17}]  # fewer rows too
    compiled, _ = library_free_checked(tmp_path, NEAREST, maps, sizes, interpret_at=3)
    program = compiled.program
    assert target not in {s.target for s in program.steps}
    assert sum(k.ops.count(target) for k in program.kernels) == 5, [k.name for k in program.kernels]


ANTIALIASED = (
    """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 6, 4, 4))  # timm's position embeddings, resampled

    def forward(self, x, y):  # x: [B, 4, H, W], y: [B, 4, H2, W2]
        pos = F.interpolate(self.pos, size=x.shape[2:], mode="bicubic", antialias=True, align_corners=False)
        down = F.interpolate(y, size=(6, 8), mode="bicubic", antialias=True)  # shrinks: wider taps
        tri = F.interpolate(x * 2, size=y.shape[2:], mode="bilinear", antialias=True)
        return pos[:, :4] + x, down, tri

"""
    + MAPS_SPEC
)


def test_antialiased_resizes_are_kernels(tmp_path):
    """Antialiased bicubic and bilinear resizes (``aten._upsample_bicubic2d_aa``, timm's position
    embeddings at dynamic image sizes), growing and shrinking, as kernels: PIL's filters, the
    taps as wide as the scale where the map shrinks, the weights normalized, as ATen's."""
    from aot.codegen.resize import AA
    from tests.codegen.conftest import library_free_checked

    compiled, _ = library_free_checked(tmp_path, ANTIALIASED, maps, SIZES, interpret_at=3)
    program = compiled.program
    assert not set(AA) & {s.target for s in program.steps}
    names = sorted(k.name for k in program.kernels if k.name.endswith("_aa"))
    assert names == ["bicubic2d_aa", "bicubic2d_aa", "bilinear2d_aa"], names
