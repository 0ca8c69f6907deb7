"""Library-free builds of views that are views of views (``aot.codegen.library_free
.copy_strided_operands``): MaxViT restores its windows' rows from the attention's result through a
transpose and two views, ``o.transpose(1, 2).reshape(...)``; the views after the transpose are at
the transpose's address, but the transpose is itself a view no step writes, so the output
projection's A had no layout a kernel reads in place and the build refused it. Now a kernel copies
A out row-major first. So are a ``bmm``'s operands that are no strided view of a buffer (MobileViT's
heads of one token merged across a slice of the stacked projections). Checked: the build
succeeds, the torch-free runtime takes the bundle, the CPU path agrees with eager (1e-5) and every
kernel with its reference in the interpreter at two sizes."""

from __future__ import annotations

import torch

from aot.schema import StepKind
from tests.codegen.conftest import library_free_checked

MODEL = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):  # x: [B, 4, 64]: windows of 4 tokens, 2 heads of 32
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, 4, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v)   # [B, 2, 4, 32]
        o = o.transpose(1, 2).reshape(b, 2, 2, -1)    # MaxViT's restore_shape: views of the transpose
        return self.proj(o.reshape(b * 4, 64))

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 4, 64))])
"""


HEADS_OF_ONE_TOKEN = """
import math
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):  # x: [B * 4, 1, 64]: MobileViT's patches of one token, 4 heads of 16
        shape = (*x.shape[:-1], -1, 16)
        q = self.q(x).view(shape).transpose(1, 2)
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(16)
        return torch.matmul(scores.softmax(-1), v)

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("rows", 1, 16), 1, 64))])
"""


def _copies(program) -> list:
    """The kernels that copy a view out row-major (``clone``)."""
    return [
        s for s in program.steps if s.kind == StepKind.KERNEL and "aten.clone.default" in str(s.reference)
    ]


def test_a_gemm_reading_views_of_a_transpose_builds_library_free(tmp_path):
    sizes = [{"batch": 1}, {"batch": 3}, {"batch": 4}]
    compiled, _ = library_free_checked(
        tmp_path, MODEL, lambda s, g: (torch.randn(s["batch"], 4, 64, generator=g),), sizes
    )
    assert _copies(compiled.program)


def test_a_bmm_of_heads_merged_across_a_slice_builds_library_free(tmp_path):
    """MobileViT's attention over patches of one token: the stacked q/k/v projection's rows are
    sliced, so ``[4R, 4, 1, 16]`` heads viewed as ``[16R, 1, 16]`` are no strided view of them
    (``cache_writes.strided_view``); each such ``bmm`` operand is copied row-major first."""
    sizes = [{"rows": 1}, {"rows": 5}, {"rows": 16}]
    compiled, _ = library_free_checked(
        tmp_path, HEADS_OF_ONE_TOKEN, lambda s, g: (torch.randn(s["rows"], 1, 64, generator=g),), sizes
    )
    program = compiled.program
    names = {k.id: k.name for k in program.kernels}
    assert _copies(program) and "bmm" in [names[s.target] for s in program.steps if s.kind == StepKind.KERNEL]
