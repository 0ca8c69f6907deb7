"""``fmod`` as a fused op (``aot.codegen.lower_pointwise``; Swin's shifted-window mask): the
remainder with the dividend's sign, C's, not Python's. Floats as ``a - trunc(a / b) * b``; integers
as Triton's ``%``, which truncates as C's does (on the GPU and in the interpreter). Checked against eager on the CPU path and every kernel against its ATen
reference in Triton's interpreter at batch 1 and 3, negative dividends and divisors among the
values: integers exactly, floats within 1e-6. Integer ``remainder`` (Python's ``%``, the divisor's
sign: RoBERTa-style index arithmetic) is C's ``%`` moved by the divisor where the signs differ."""

from __future__ import annotations

import torch

from aot.schema import StepKind

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x, n):  # x: [B, 9] float32, n: [B, 9] int64
        fmods = torch.fmod(x, 0.75), torch.fmod(x * 3, x + 4), torch.fmod(n - 10, 4), torch.fmod(n - 10, 3 - n.flip(1) * 2)
        # and Python's remainder of integers, with the divisor's sign
        return *fmods, torch.remainder(n - 10, 4), torch.remainder(n - 10, -3), (n - 10) % (3 - n.flip(1) * 2)

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 9)), Input("n", (batch, 9), dtype="int64")])
"""


def test_fmod_keeps_the_dividends_sign(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "fmod.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",))
    steps = compiled.program.steps
    assert not [
        s.target for s in steps if s.kind == StepKind.ATEN and ("fmod" in s.target or "remainder" in s.target)
    ]
    pack(compiled, tmp_path / "fmod.tpk")
    runner, module = load(tmp_path / "fmod.tpk"), spec.module()
    gen = torch.Generator().manual_seed(0)
    for b in (1, 3, 4):
        x = torch.randn(b, 9, generator=gen) * 3
        n = torch.randint(-20, 20, (b, 9), generator=gen)
        for got, want in zip(runner(x, n), module(x, n), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if want.is_floating_point() else 0)
    (results,) = interpret_in_subprocess([(tmp_path / "fmod.tpk", path, [{"batch": 1}, {"batch": 3}], None)])
    for size, checks in results.items():
        assert checks and all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
