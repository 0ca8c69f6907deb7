"""Constant padding (``aten.constant_pad_nd``: ``F.pad``, timm's "same" padding before a
convolution, the NF-Nets' and EfficientNets') as fused kernels (``aot.codegen.lower_pointwise``):
each padded dim a ``cat`` of the value, the tensor and the value, a negative pad a crop. Checked:
no ATen pad left; the CPU path agrees with eager; every kernel matches its ATen reference in
Triton's interpreter at batch 1 and 3 (exactly: a pad rounds nothing, the convolution's kernels
within their own tolerance); the model builds ``--library-free``, which ATen's pad refused."""

from __future__ import annotations

import pytest
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
        self.conv = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, x):  # x: [B, 3, 9, 10]
        same = self.conv(F.pad(x, [0, 1, 1, 1]))         # timm's pad_same for a 3x3, stride 2
        framed = F.pad(x * 2, [1, 2, 0, 3], value=0.5)  # [B, 3, 12, 13]
        cropped = F.pad(x, [-1, 2, 2, -3])               # crop and pad in one call: [B, 3, 8, 11]
        channels = F.pad(x.relu(), [0, 0, 0, 0, 2, 0], value=-1.0)  # [B, 5, 9, 10]
        return same, framed, cropped, channels

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 3, 9, 10))])
"""


def _build(tmp_path, **options):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / "pad.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), **options)
    pack(compiled, tmp_path / "pad.tpk")
    return compiled, tmp_path / "pad.tpk", path, spec


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("pad"))


def test_pads_are_kernels_and_agree_with_eager(built):
    from aot.loader import load

    compiled, bundle, _, spec = built
    program = compiled.program
    assert "aten.constant_pad_nd.default" not in {s.target for s in program.steps if s.kind == StepKind.ATEN}
    pads = [s for s in program.steps if s.kind == StepKind.KERNEL and "constant_pad_nd" in str(s.reference)]
    assert len(pads) >= 1, [s.target for s in program.steps]
    module = spec.module().eval()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    runner = load(bundle)
    for b in (1, 3, 4):
        x = torch.randn(b, 3, 9, 10)
        with torch.no_grad():
            want = module(x)
        for got, w in zip(runner(x), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)


def test_pad_kernels_match_aten_in_the_interpreter(built):
    from aot.verify.interpret import interpret_in_subprocess

    compiled, bundle, path, _ = built
    (results,) = interpret_in_subprocess([(bundle, path, [{"batch": 1}, {"batch": 3}], None)])
    pads = {s.target for s in compiled.program.steps if "constant_pad_nd" in str(s.reference)}
    for size, checks in results.items():
        assert {c.kernel for c in checks} >= pads, size
        assert all(c.max_abs_error == 0.0 for c in checks if c.kernel in pads and "conv" not in c.name), size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


def test_builds_library_free(tmp_path):
    compiled, _, _, _ = _build(tmp_path, gemm_candidates=True, library_free=True)
    aten = [s.target for s in compiled.program.steps if s.kind == StepKind.ATEN]
    assert "aten.constant_pad_nd.default" not in aten and "aten.convolution.default" not in aten, aten


OVER_TIME = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, stride=2)

    def forward(self, x):  # x: [B, 4, samples]
        y = self.conv(x)  # (samples - 3)//2 + 1 frames
        # SEW's frames padded back to its input's length: a pad of 0 or 1 by the samples' parity
        even = F.pad(y, [0, x.shape[-1] - 2 * y.shape[-1] - 1])
        # a low pad that crops below 12 samples and pads from 14
        either = F.pad(x * 2, [y.shape[-1] // 2 - 3, 2], value=0.5)
        return even, either

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 3), 4, Dim("samples", 5, 40)))])
"""


def test_pads_of_a_symbolic_amount_are_kernels(tmp_path):
    """A pad whose amount is a size expression, 0 at some declared sizes and 1 at others, or a
    crop at some and a pad at others, is a kernel (its runs pieces of a cat whose ends are
    expressions): built library-free, the bundle equals eager on the CPU at sizes of both parities
    and both signs, and every kernel its reference in the interpreter."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.schema import Sym
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "over_time.py"
    path.write_text(OVER_TIME)
    spec = load_model_file(path)
    traced = trace(spec)
    pads = [s for s in traced.program.steps if s.target == "aten.constant_pad_nd.default"]
    assert len(pads) == 2 and all(any(isinstance(p, Sym) for p in s.args[1]) for s in pads), pads
    compiled = generate(traced, ("sm_90",), gemm_candidates=True, library_free=True)
    assert all(s.kind == StepKind.KERNEL or s.target == "aten.view.default" for s in compiled.program.steps)
    pack(compiled, tmp_path / "over_time.tpk")
    module = spec.module().eval()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    runner = load(tmp_path / "over_time.tpk")
    lows, evens = set(), set()
    for samples in (5, 6, 7, 12, 13, 14, 40):  # crops at 5-13, pads of 0 and 1 at odd and even
        x = torch.randn(2, 4, samples)
        with torch.no_grad():
            want = module(x)
        lows.add(want[1].shape[-1] - samples - 2)
        evens.add(samples - 1 - 2 * ((samples - 3) // 2 + 1))
        for got, w in zip(runner(x), want, strict=True):
            assert got.shape == w.shape
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    assert evens == {0, 1} and {-2, 0, 6} <= lows  # the low pad cropped, zero, and padded
    sizes = [{"batch": 1, "samples": 5}, {"batch": 2, "samples": 14}, {"batch": 3, "samples": 40}]
    (results,) = interpret_in_subprocess([(tmp_path / "over_time.tpk", path, sizes, None)])
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in compiled.program.kernels}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


SCATTERED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x):  # x: [B, 6, 5]
        out = (x * 3)[:, :4]       # GhostNet's ghost module keeps its first channels
        out += x[:, 2:]            # then adds the shortcut in place: a slice_scatter of the slice
        y = x.relu()
        y[:, 1:3] = x[:, :2] * 2   # an assignment into a slice
        z = x.clone()
        z[:, :, -2:] += 1.0        # negative bounds, the last dim
        return out, y, z

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 6, 5))])
"""


def _fused_exactly(tmp_path, text: str, name: str, gone: str, shape: tuple, traced_has: str | None = None):
    """Build ``text`` (``traced_has``: a target its trace holds) and check: no ATen step whose
    target holds ``gone`` is left; the CPU path equals eager at batch 1, 3 and 4 (inputs
    ``[B, *shape]``); every kernel equals its reference in the interpreter at batch 1 and 3; a
    library-free build has only kernels and views. (spec, traced, the eager module.)"""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import instantiate, load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = load_model_file(path)
    traced = trace(spec)
    assert traced_has is None or traced_has in {s.target for s in traced.program.steps}
    compiled = generate(traced, ("sm_90",))
    assert not [s for s in compiled.program.steps if s.kind == StepKind.ATEN and gone in s.target]
    pack(compiled, tmp_path / f"{name}.tpk")
    runner, module = load(tmp_path / f"{name}.tpk"), instantiate(spec)
    for b in (1, 3, 4):
        x = torch.randn(b, *shape)
        with torch.no_grad():
            want = module(x)
        for got, w in zip(runner(x), want, strict=True):
            torch.testing.assert_close(got, w, rtol=0, atol=0)
    (results,) = interpret_in_subprocess(
        [(tmp_path / f"{name}.tpk", path, [{"batch": 1}, {"batch": 3}], None)]
    )
    for size, checks in results.items():
        assert checks and all(c.ok and c.max_abs_error == 0.0 for c in checks), (size, checks)
    free = generate(traced, ("sm_90",), gemm_candidates=True, library_free=True)
    assert all(s.kind == StepKind.KERNEL or s.target == "aten.view.default" for s in free.program.steps), [
        s.target for s in free.program.steps if s.kind != StepKind.KERNEL
    ]
    return spec, free, module


def test_slice_scatters_are_kernels(tmp_path):
    """An in-place op on a slice, functionalized as ``slice_scatter`` (GhostNet's ``x += shortcut``
    on a channel slice): a cat of the tensor around the slice and the new values, fused; the CPU
    path and every kernel in the interpreter (exactly) agree with ATen, and it builds library-free
    (a view returned, which the runtime cannot return, copied out by a kernel)."""
    from aot.loader import load
    from aot.packager import pack
    from aot.runtime import check

    _, free, module = _fused_exactly(
        tmp_path, SCATTERED, "scatter", "scatter", (6, 5), "aten.slice_scatter.default"
    )
    # library-free: the first output, a view of the sum's channels, is copied out by a kernel
    pack(free, tmp_path / "scatter-free.tpk")
    assert check(tmp_path / "scatter-free.tpk").entries  # the torch-free runtime takes it
    runner = load(tmp_path / "scatter-free.tpk")
    x = torch.randn(3, 6, 5)
    for got, want in zip(runner(x), module(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


UPSAMPLED = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x, low):  # x: [B, 3, 12, 10], low: [B, 3, 6, 5]
        top = x + F.interpolate(self.conv(low), scale_factor=2, mode="nearest")  # HRNet's fuse layer
        wide = F.interpolate(low * 2, size=(18, 20), mode="nearest")             # 3x rows, 4x columns
        kept = F.interpolate(low, size=(12, 7), mode="nearest")                  # 7 of 5: rows read
        return top, wide, kept

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 3, 12, 10)), Input("low", (batch, 3, 6, 5))])
"""


def test_nearest_upsampling_by_whole_factors_is_index_arithmetic(tmp_path):
    """``upsample_nearest2d`` by a whole factor per dim (2, 3, 4) reads ``in[y // k, x // k]`` in the
    kernel after it, as ATen's float32 ``floor(y * (1 / k))`` does for those factors; a size that is
    no whole multiple is read there too, at the rows and columns the kernel computes as ATen does
    (``lower_pointwise._nearest_rows``). The CPU path and every kernel in the interpreter agree with
    ATen exactly (a copy of values, then an add)."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "up.py"
    path.write_text(UPSAMPLED)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",))
    aten = [s.target for s in compiled.program.steps if s.kind == StepKind.ATEN and "upsample" in s.target]
    assert aten == [], aten
    fused = [
        s for s in compiled.program.steps if s.kind == StepKind.KERNEL and "upsample" in str(s.reference)
    ]
    assert len(fused) == 3, fused
    pack(compiled, tmp_path / "up.tpk")
    runner, module = load(tmp_path / "up.tpk"), spec.module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    for b in (1, 3):
        x, low = torch.randn(b, 3, 12, 10), torch.randn(b, 3, 6, 5)
        with torch.no_grad():
            want = module(x, low)
        for got, w in zip(runner(x, low), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    (results,) = interpret_in_subprocess([(tmp_path / "up.tpk", path, [{"batch": 1}, {"batch": 3}], None)])
    for size, checks in results.items():
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
        copies = [c for c in checks if c.kernel in {s.target for s in fused} and "conv" not in c.name]
        assert copies and all(c.max_abs_error == 0.0 for c in copies), (size, copies)


REPEATED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 4, 3, 2))

    def forward(self, x):  # x: [B, 4, 3, 2]
        b = x.shape[0]
        tiled = x.repeat(1, 2, 1, 3) * 2           # [B, 8, 3, 6]
        framed = x.relu().repeat(2, 1, 1, 1, 1)    # a new leading dim: [2, B, 4, 3, 2]
        return x + self.pos.repeat(b, 1, 1, 1), tiled, framed  # XCiT's position encoding

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 4, 3, 2))])
"""


def test_repeats_are_index_arithmetic(tmp_path):
    """``repeat`` (XCiT's position encoding over the batch; static dims tiled; a new leading dim):
    ``x[i % n]`` read by the kernel after it, no ATen repeat left; the CPU path and every kernel in
    the interpreter agree with ATen exactly, and it builds library-free."""
    _fused_exactly(tmp_path, REPEATED, "repeat", "repeat", (4, 3, 2))


ROLLED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x):  # x: [B, 6, 7, 4]
        shifted = torch.roll(x, shifts=(-3, 2), dims=(1, 2))  # Swin's cyclic shift and its reverse
        return torch.roll(shifted * 2, shifts=(3, -2), dims=(1, 2)), torch.roll(x, 6, 1) + 1

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 6, 7, 4))])
"""


def test_rolls_are_slices(tmp_path):
    """``torch.roll`` along static dims (export: ``index_select`` by ``fmod(arange + c, n)``) is two
    slices and a cat, fused: no index_select left; the CPU path and every kernel in the interpreter
    agree with ATen exactly (a shift of the whole dim, 6 of 6, too), and it builds library-free."""
    _fused_exactly(tmp_path, ROLLED, "roll", "index", (6, 7, 4), "aten.index_select.default")
