"""Attention over more than one batch dim (Twins' locally grouped attention: ``[B, windows,
heads, L, D]`` operands, ``codegen/attention.merge_batch_dims``) runs as attention over one, its
operands' leading dims merged as views, so the attention kernels (4-D operands) take it: built
library-free, the CPU path agrees with eager and every kernel with its reference in Triton's
interpreter. Operands whose leading dims do not merge as a view keep the call as it was."""

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
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):  # x: [B, 4 windows, 9 tokens, 16]
        b, w, n, c = x.shape
        qkv = self.qkv(x).reshape(b, w, n, 3, 2, 8).permute(3, 0, 1, 4, 2, 5)
        q, k, v = qkv.unbind(0)  # [B, windows, heads, tokens, 8] each
        return F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, w, n, c)

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 3), 4, 9, 16))])
"""

APART = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, q, k, v):  # [B, H, W, T, D] read as [B, W, H, T, D]: no view merges B and W
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

shape = (Dim("batch", 1, 3), 2, 4, 5, 8)
spec = ModelSpec(module=M, inputs=[Input("q", shape), Input("k", shape), Input("v", shape)])
"""


def test_attention_over_windows_runs_over_merged_batch_dims(tmp_path):
    from aot.codegen.attention import SDPA
    from tests.codegen.conftest import library_free_checked

    sizes = [{"batch": 2}, {"batch": 1}, {"batch": 3}]
    compiled, _ = library_free_checked(
        tmp_path, MODEL, lambda s, g: (torch.randn(s["batch"], 4, 9, 16, generator=g),), sizes
    )
    assert any(SDPA in k.ops for k in compiled.program.kernels)


def test_operands_whose_batch_dims_do_not_merge_keep_the_call(tmp_path):
    from aot.codegen.attention import SDPA, merge_batch_dims
    from aot.tracer import load_model_file, trace

    (tmp_path / "apart.py").write_text(APART)
    program = trace(load_model_file(tmp_path / "apart.py")).program
    assert merge_batch_dims(program) == (program, 0)
    (tmp_path / "model.py").write_text(MODEL)
    windows = trace(load_model_file(tmp_path / "model.py")).program
    merged, n = merge_batch_dims(windows)
    (sdpa,) = [s for s in merged.steps if s.target == SDPA]
    assert n == 1 and merged.buffers[sdpa.outputs[0]].shape == ("4*batch", "2", "9", "8")
