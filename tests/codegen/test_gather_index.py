"""Advanced indexing with two or more index tensors inside kernels (``codegen/lower_gather.py``)
and floats computed from sizes as kernel values (``aot.schema.SymFloat``): the bicubic resizes that
``torch.export`` decomposes into index arithmetic and sixteen reads (DINOv2's, ViT's and CLIP's
position embeddings resized to the patch grid), and ``x[:, :, i, j]`` by a caller's indices,
negative ones counted from the end. Built library-free: the CPU path agrees with eager and every
kernel with its ATen reference in Triton's interpreter (1e-5)."""

from __future__ import annotations

import torch

MODEL = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 6, 5, 5))

    def forward(self, x, i, j):  # x: [B, 3, H, W]; i: [K, 1], j: [L] (int64)
        h, w = x.shape[2], x.shape[3]
        # a weight resized to the input's map: the scale a float of the sizes (5 / h)
        pos = F.interpolate(self.table, size=(h, w), mode="bicubic", align_corners=False)
        # an input resized to a static size, the corners aligned: (h - 1) / 2
        small = F.interpolate(x, size=(3, 4), mode="bicubic", align_corners=True)
        picked = x[:, :, i, j]  # [B, 3, K, L]: i broadcast along L, j along K
        row = x[:, :, i[:1, 0], j]  # [B, 3, L]: one index for every lane (ConvBERT's span pads)
        scaled = x * (4 / (h // 2 + 1)) - 1.5 / w  # floats of the sizes in pointwise arithmetic
        return pos[:, :3] + x, small, picked, row, scaled

spec = ModelSpec(
    module=M,
    inputs=[
        Input("x", (Dim("batch", 1, 3), 3, Dim("h", 2, 12), Dim("w", 2, 12))),
        Input("i", (Dim("k", 1, 4), 1), dtype="int64"),
        Input("j", (Dim("l", 1, 5),), dtype="int64"),
    ],
)
"""


def index_inputs(s: dict, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``MODEL``'s arguments at sizes ``s``: indices anywhere inside their dims, negative ones
    (counted from the end) among them."""
    x = torch.randn(s["batch"], 3, s["h"], s["w"], generator=g)
    i = torch.randint(-s["h"], s["h"], (s["k"], 1), generator=g)
    return x, i, torch.randint(-s["w"], s["w"], (s["l"],), generator=g)


def test_indexes_and_bicubic_resizes_are_kernels(tmp_path):
    from aot.codegen.lower_gather import INDEX
    from aot.program import live_steps
    from tests.codegen.conftest import library_free_checked

    sizes = [
        {"batch": 2, "h": 5, "w": 11, "k": 3, "l": 5},
        {"batch": 1, "h": 2, "w": 2, "k": 1, "l": 1},
        {"batch": 3, "h": 12, "w": 7, "k": 4, "l": 2},
    ]

    compiled, _ = library_free_checked(tmp_path, MODEL, index_inputs, sizes, interpret_at=3)
    program = compiled.program
    assert INDEX not in {s.target for s in live_steps(program)}
    gathers = [k for k in program.kernels if INDEX in k.ops]
    # each bicubic resize one kernel with its 16 reads, the caller's indexes one each
    assert len(gathers) == 4, [(k.name, k.ops.count(INDEX)) for k in gathers]
    assert sorted(k.ops.count(INDEX) for k in gathers) == [1, 1, 16, 16]


def test_a_float_of_the_sizes_is_computed_in_float64_in_the_kernel():
    from aot.codegen.index import triton_float
    from aot.codegen.step_args import literal
    from aot.schema import SymFloat

    assert triton_float("(4)/(width//7)") == "(4.0 / ((s_width // 7)).to(tl.float64))"
    assert (
        literal(SymFloat("(4)/(width//7)"), "fp32")
        == "((4.0 / ((s_width // 7)).to(tl.float64))).to(tl.float32)"
    )
    assert literal(SymFloat("(3)/(2)"), "fp32") == "1.5"  # a constant folds at build time
    assert triton_float("(h + 0.0)*(0.5)") == "(((s_h).to(tl.float64) + 0.0) * 0.5)"
