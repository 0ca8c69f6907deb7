"""``sign`` as a fused op (``aot.codegen.lower_pointwise``; DeBERTa-v2's and SEW-D's log-bucketed
relative positions): 1, -1 or 0 in the input's dtype, 0 for NaN as ATen gives, a boolean its own
sign. Checked against eager on the CPU path and every kernel against its ATen reference in Triton's
interpreter at two sizes, with zeros, NaNs (the log of negatives), integers and half floats among
the values; built library-free, no ATen step is left."""

from __future__ import annotations

import torch

from aot.schema import StepKind

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x, n):  # x: [B, S] float32, n: [B, S] int64
        rel = n[:, :, None] - n[:, None, :]  # relative positions, DeBERTa's log buckets
        mid = 4
        bucket = torch.where(rel.abs() <= mid, rel.float(), torch.log(rel.abs().float()) * torch.sign(rel))
        return (
            torch.sign(torch.log(x)),  # NaN below 0, negative in (0, 1), positive past 1
            torch.sign(torch.trunc(x)),  # zeros
            torch.sign(x.half() - 0.5),
            torch.sign(rel),
            torch.sign(x > 0),
            bucket,
        )

seq = Dim("seq", 2, 12)
spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 3), seq)), Input("n", (1, seq), dtype="int64")])
"""


def test_sign_is_a_kernel_with_atens_zeros(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "sign.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    traced = trace(spec)
    assert sum(s.target == "aten.sign.default" for s in traced.program.steps) >= 5
    compiled = generate(traced, ("sm_90",), gemm_candidates=True, library_free=True)
    assert all(s.kind == StepKind.KERNEL or s.target == "aten.view.default" for s in compiled.program.steps)
    pack(compiled, tmp_path / "sign.tpk")
    runner, module = load(tmp_path / "sign.tpk"), spec.module()
    gen = torch.Generator().manual_seed(0)
    for b, s in ((1, 2), (3, 7), (2, 12)):
        x = torch.randn(b, s, generator=gen) * 2
        x[0, 0] = 0.0
        n = torch.randint(-20, 20, (1, s), generator=gen)
        got_all, want_all = runner(x, n), module(x, n)
        assert torch.isnan(torch.log(x)).any() and (want_all[1] == 0).any()
        for got, want in zip(got_all, want_all, strict=True):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if want.is_floating_point() else 0)
    sizes = [{"batch": 1, "seq": 2}, {"batch": 3, "seq": 9}]
    (results,) = interpret_in_subprocess([(tmp_path / "sign.tpk", path, sizes, None)])
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in compiled.program.kernels}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
