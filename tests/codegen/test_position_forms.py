"""Positions and biases that transformers computes in the forward, as kernels of a library-free
build: OPT's positions are a cumsum of a mask of ones it makes itself (``torch.ones(B, S)``: a
generator that only the scan kernel reads, which a kernel now writes; it was left an ATen step),
BLOOM's ALiBi slopes are ``pow(tensor, arange)`` (``pow.Tensor_Tensor``) repeated over a symbolic
batch. ``pow`` of two tensors is checked on negative bases with integer and fractional powers and
on zero. Checked: every live step a kernel or a view, the torch-free runtime takes the bundle, the
CPU path agrees with eager, every kernel with its reference in the interpreter."""

from __future__ import annotations

import torch

from aot.schema import StepKind
from tests.codegen.conftest import library_free_checked

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 8)

    def forward(self, ids, x):  # ids: [B, S] int64, x: [B, S]
        b, s = ids.shape
        ones = torch.ones(b, s)  # OPT: positions from a mask of ones
        positions = (torch.cumsum(ones, dim=1) * ones - 1).long()
        slopes = torch.pow(torch.full((), 0.25), torch.arange(1, 5, dtype=torch.int32))  # BLOOM's ALiBi
        alibi = (slopes[:, None, None] * torch.arange(s)[None, None, :]).repeat(b, 1, 1)  # [4B, 1, S]
        signs = torch.where(x > 0, -x, x)  # bases of zero and below
        ints = torch.floor(x * 4)  # integer powers, zero among them
        return (
            self.embed(ids) + self.embed(positions),
            alibi,
            torch.pow(signs, ints),
            torch.pow(signs, x),  # a negative base to a fractional power: NaN
            torch.pow(torch.relu(x), ints),  # zero to negative powers: inf
        )

batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 32)
spec = ModelSpec(
    module=M,
    inputs=[Input("ids", (batch, seq), dtype="int64", low=0, high=40), Input("x", (batch, seq))],
)
"""


def test_generated_positions_and_alibi_build_library_free(tmp_path):
    def inputs(size, gen):
        ids = torch.randint(0, 40, (size["batch"], size["seq"]), generator=gen)
        return ids, torch.randn(size["batch"], size["seq"], generator=gen)

    sizes = [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 13}, {"batch": 4, "seq": 32}]
    compiled, _ = library_free_checked(tmp_path, MODEL, inputs, sizes)
    program = compiled.program
    references = {r.target for s in program.steps if s.kind == StepKind.KERNEL for r in s.reference}
    assert {"aten.full.default", "aten.pow.Tensor_Tensor", "aten.repeat.default"} <= references
