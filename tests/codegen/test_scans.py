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


SEQUENCE_MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, ids, x):  # ids: [B, S] int64, x: [B, S, 3] float32
        mask = ids.ne(1).int()                          # RoBERTa's position ids from its padding
        positions = (mask.cumsum(1).type_as(mask) * mask).long() + 1
        return positions, x.cumsum(1)                   # a float run along S, 3 runs side by side

batch, seq = Dim("batch", 1, 2), Dim("seq", 1, 2100)
spec = ModelSpec(
    module=M,
    inputs=[Input("ids", (batch, seq), dtype="int64", low=0, high=3), Input("x", (batch, seq, 3))],
)
"""


def test_a_cumsum_along_a_symbolic_sequence_steps_through_it(tmp_path):
    """The scanned dim is the sequence (symbolic, up to 2100: two steps of ``MAX_RUN``), each
    step's sums carried into the next. Checked at 1, 7 and 2100 positions: the positions exactly,
    the float sums within 1e-4 of eager (relative), in the bundle's CPU path and the interpreter."""
    from aot.codegen import generate
    from aot.codegen.scans import MAX_RUN
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "positions.py"
    path.write_text(SEQUENCE_MODEL)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    kernels = {k.id: k for k in compiled.program.kernels}
    scans = [
        s for s in compiled.program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "cumsum"
    ]
    assert len(scans) == 2 and all(s.args[-1].text == "seq" for s in scans)
    assert 2100 > MAX_RUN and all(
        f"BLOCK_L = tl.constexpr({MAX_RUN})" in kernels[s.target].source for s in scans
    )
    pack(compiled, tmp_path / "positions.tpk")
    runner, module = load(tmp_path / "positions.tpk"), spec.module()
    gen = torch.Generator().manual_seed(0)
    sizes = [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 7}, {"batch": 1, "seq": 2100}]
    for s in sizes:
        ids = torch.randint(0, 3, (s["batch"], s["seq"]), generator=gen)
        x = torch.randn(s["batch"], s["seq"], 3, generator=gen)
        got, want = runner(ids, x), module(ids, x)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    (results,) = interpret_in_subprocess([(tmp_path / "positions.tpk", path, sizes, None)])
    scanned = {s.target for s in scans}
    for size, checks in results.items():
        assert scanned <= {c.kernel for c in checks}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
        exact = [
            c for c in checks if c.kernel in scanned and "int64" in kernels[c.kernel].source.split("\n")[0]
        ]
        assert exact and all(c.max_abs_error == 0.0 for c in exact), (size, exact)


DETR = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x, f):  # x: [B, 3, H, W] pixels, f: [B, 4, H2, W2] features
        mask = x[:, 0] > -1.0
        # DETR: the pixel mask resized (nearest) to the features' map, then its sine position
        # encoding's sums along rows and columns, every dim symbolic
        small = F.interpolate(mask[None].float(), size=f.shape[-2:]).to(torch.bool)[0]
        rows = small.cumsum(1, dtype=torch.float32)
        cols = small.cumsum(2, dtype=torch.float32)
        half = F.interpolate(f * 2, scale_factor=0.5, mode="nearest")  # a computed map, halved
        return rows / (rows[:, -1:, :] + 1e-6), cols, half

batch = Dim("batch", 1, 3)
spec = ModelSpec(
    module=M,
    inputs=[
        Input("x", (batch, 3, Dim("h", 4, 24), Dim("w", 4, 24))),
        Input("f", (batch, 4, Dim("h2", 2, 12), Dim("w2", 2, 12))),
    ],
)
"""


def test_sums_over_a_symbolic_map_and_nearest_resizes_read_in_kernels(tmp_path):
    """DETR's position encoding at declared image sizes: the dims after a scanned one symbolic
    (their sizes call-time arguments), and nearest resizes to sizes that are no whole multiple
    (the mask to the features' map, a computed map by 0.5) read inside the kernels that use them
    (``lower_pointwise._nearest_rows``)."""
    from aot.codegen.scans import CUMSUM
    from tests.codegen.conftest import library_free_checked

    sizes = [
        {"batch": 2, "h": 13, "w": 7, "h2": 5, "w2": 9},
        {"batch": 1, "h": 4, "w": 24, "h2": 12, "w2": 2},
        {"batch": 3, "h": 24, "w": 11, "h2": 3, "w2": 3},
    ]

    def inputs(s, g):
        x = torch.randn(s["batch"], 3, s["h"], s["w"], generator=g)
        return x, torch.randn(s["batch"], 4, s["h2"], s["w2"], generator=g)

    compiled, _ = library_free_checked(tmp_path, DETR, inputs, sizes, interpret_at=3)
    kernels = {k.id: k for k in compiled.program.kernels}
    steps = [s for s in compiled.program.steps if s.kind == StepKind.KERNEL]
    assert sum(kernels[s.target].name == "cumsum" for s in steps) == 2
    fused = [k for k in kernels.values() if "aten.upsample_nearest2d.vec" in k.ops]
    assert len(fused) == 2, [k.name for k in kernels.values()]  # each read in the kernel using it
    assert CUMSUM not in {s.target for s in compiled.program.steps if s.kind == StepKind.ATEN}
