"""Library-free builds of views that are views of views (``aot.codegen.library_free
.copy_strided_operands``): MaxViT restores its windows' rows from the attention's result through a
transpose and two views, ``o.transpose(1, 2).reshape(...)``; the views after the transpose are at
the transpose's address, but the transpose is itself a view no step writes, so the output
projection's A had no layout a kernel reads in place and the build refused it. Now a kernel copies
A out row-major first. Checked: the build succeeds, the torch-free runtime takes the bundle, the
CPU path agrees with eager (1e-5) and every kernel with its reference in the interpreter at batch
1 and 3."""

from __future__ import annotations

import torch

from aot.schema import StepKind

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


def test_a_gemm_reading_views_of_a_transpose_builds_library_free(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.program import is_view, live_steps
    from aot.runtime import check
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "windows.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    program = compiled.program
    live = live_steps(program)
    assert all(s.kind == StepKind.KERNEL or is_view(s) for s in live), [s.target for s in live]
    copies = [
        s for s in program.steps if s.kind == StepKind.KERNEL and "aten.clone.default" in str(s.reference)
    ]
    assert copies, [s.reference for s in program.steps]
    pack(compiled, tmp_path / "windows.tpk")
    assert check(tmp_path / "windows.tpk").entries  # the torch-free runtime takes it
    module = spec.module().eval()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    runner = load(tmp_path / "windows.tpk")
    for b in (1, 3, 4):
        x = torch.randn(b, 4, 64)
        with torch.no_grad():
            torch.testing.assert_close(runner(x), module(x), rtol=1e-5, atol=1e-5)
    (results,) = interpret_in_subprocess(
        [(tmp_path / "windows.tpk", path, [{"batch": 1}, {"batch": 3}], None)]
    )
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in program.kernels}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
