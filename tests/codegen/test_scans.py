"""Cumulative sums as Triton kernels in library-free builds (``aot.codegen.scans``): EdgeNeXt's
position encoding (a bool mask summed along the image's rows and columns into float32), a
float16 sum over the last dim, an int64 sum, and a bool sum to int64 (positions from a mask) over
a run of 1 element, the batch before each scanned dim symbolic. Checked: no ATen cumsum left;
the library-free bundle agrees with eager on the CPU; every kernel matches its reference in
Triton's interpreter at batch 1 and 3 (integers and the mask's counts exactly, floats within the
kernels' own tolerance)."""

from __future__ import annotations

import torch

from aot.schema import StepKind

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x, ids):  # x: [B, 6, 5] float16, ids: [B, 7] int64
        mask = x > 0
        rows = mask.cumsum(1, dtype=torch.float32)      # EdgeNeXt's y_embed
        cols = mask.cumsum(2, dtype=torch.float32)      # and x_embed
        last = (x * 2).cumsum(-1)                       # float16, summed in float32
        positions = ids.cumsum(1)                       # int64
        one = (ids[:, :1] > 3).cumsum(1)                # bool -> int64, runs of one
        return rows, cols, last, positions, one

batch = Dim("batch", 1, 4)
spec = ModelSpec(
    module=M,
    inputs=[Input("x", (batch, 6, 5), dtype="float16"), Input("ids", (batch, 7), dtype="int64")],
)
"""


def test_cumsums_are_kernels_in_a_library_free_build(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.runtime import check
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "scan.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    assert "aten.cumsum.default" not in {s.target for s in program.steps if s.kind == StepKind.ATEN}
    scans = [s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "cumsum"]
    assert len(scans) == 5, [kernels[s.target].name for s in program.steps if s.kind == StepKind.KERNEL]
    pack(compiled, tmp_path / "scan.tpk")
    assert check(tmp_path / "scan.tpk").entries  # the torch-free runtime takes it
    runner, module = load(tmp_path / "scan.tpk"), spec.module()
    gen = torch.Generator().manual_seed(0)
    for b in (1, 3, 4):
        x = torch.randn(b, 6, 5, generator=gen).half()
        ids = torch.randint(0, 9, (b, 7), generator=gen)
        for got, want in zip(runner(x, ids), module(x, ids), strict=True):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    (results,) = interpret_in_subprocess([(tmp_path / "scan.tpk", path, [{"batch": 1}, {"batch": 3}], None)])
    scanned = {s.target for s in scans}
    for size, checks in results.items():
        assert {c.kernel for c in checks} == set(kernels), size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
        exact = [c for c in checks if c.kernel in scanned and "float16" not in kernels[c.kernel].source]
        assert len(exact) >= 3 and all(c.max_abs_error == 0.0 for c in exact), (size, exact)
