"""Max and average pooling and convolution inputs without ATen kernels (``aot.codegen.pooling``,
``aot.codegen.layouts.relayout_conv_inputs``): a max pool whose indices nothing reads is a Triton
kernel, checked in the interpreter against ATen's pool (exactly: a maximum rounds nothing), NCHW
and NHWC, with padding, stride, dilation and ceil mode; NaN propagates; a program input that a
channels-last convolution reads is copied NHWC by a kernel; the CPU path agrees with eager. An
average pool is a kernel too, with each of ATen's divisors (the window clipped to the padded
image, to the image, ``divisor_override``), in float32 within 1e-6 of ATen's (the sum's order);
so are pools whose window passes the whole map (EfficientNet's pooler), clipped to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aot.schema import StepKind
from tests.codegen.conftest import interpreted_json

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1)                       # NHWC: a kernel writes its input
        self.pool2 = nn.MaxPool2d(2, ceil_mode=True)             # NHWC, the last window cut short
        self.pool3 = nn.MaxPool2d(3, stride=1, dilation=2)       # on the image itself: NCHW
        self.conv2 = nn.Conv2d(8, 4, 1)

    def forward(self, x):  # x: [B, 3, 15, 17]
        y = self.pool(self.bn(self.conv(x)).relu())
        y = self.conv2(self.pool2(y))
        return y.mean(dim=(2, 3)), self.pool3(x)

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 3, 15, 17))])
"""

INDICES = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x):  # the indices are an output: ATen's pool makes them
        return nn.functional.max_pool2d(x * 2, 2, return_indices=True)

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 3, 8, 8))])
"""


AVERAGE = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        # the NF-Nets' and ResNet-D's shortcut: the last window cut short, counted without padding
        self.down = nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False)
        # padding counted, the last window past the padded image (so cut short) by the ceil mode
        self.branch = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.odd = nn.AvgPool2d((3, 2), stride=(2, 3), padding=(1, 1), divisor_override=5)
        # EfficientNet's pooler: a window far past the map (1280 wide over 4 x 5), ends at its edge
        self.pooler = nn.AvgPool2d(1280, ceil_mode=True)

    def forward(self, x):  # x: [B, 3, 15, 17]
        y = self.conv(x).relu()  # NHWC
        z = self.branch(self.down(y))
        return z, self.odd(x), self.down(x) * 2, self.pooler(z), nn.functional.max_pool2d(z, 40, ceil_mode=True)

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 3, 15, 17))])
"""


def _build(tmp_path: Path, text: str = MODEL, name: str = "pool"):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / f"{name}.py"
    path.write_text(text)
    compiled = generate(trace(load_model_file(path)), ("sm_90",))
    pack(compiled, tmp_path / f"{name}.tpk")
    return compiled, tmp_path / f"{name}.tpk", path


def _kernel_steps(program, name):
    kernels = {k.id: k for k in program.kernels}
    return [s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == name]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("pool"))


def test_pools_and_the_image_copy_are_kernels(built):
    compiled, _, _ = built
    program = compiled.program
    aten = [s.target for s in program.steps if s.kind == StepKind.ATEN]
    # convolutions are cuDNN's; everything else a kernel, or a view
    assert set(aten) <= {"aten.convolution.default", "aten.view.default", "aten.permute.default"}, aten
    pools = _kernel_steps(program, "max_pool2d")
    assert len(pools) == 3
    assert all([r.target for r in s.reference] == ["aten.max_pool2d_with_indices.default"] for s in pools)
    # a pool keeps its input's layout: NHWC after the kernel that writes it, NCHW on the image
    orders = {s.args[0].name: program.buffers[s.outputs[0]].order for s in pools}
    assert orders.pop("x") == () and list(orders.values()) == [(0, 2, 3, 1)] * 2
    # the image reaches the first convolution through a kernel that writes it NHWC
    conv = next(s for s in program.steps if s.target == "aten.convolution.default")
    copy = next(s for s in program.steps if conv.args[0].name in s.outputs)
    assert copy.kind == StepKind.KERNEL and copy.reference[0].target == "aten.clone.default"
    assert copy.reference[0].args[0].name == "x"
    assert program.buffers[conv.args[0].name].order == (0, 2, 3, 1)


def test_cpu_path_agrees_with_eager(built):
    from aot.loader import load
    from aot.tracer import load_model_file

    compiled, bundle, path = built
    module = load_model_file(path).module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    module.eval()
    x = torch.randn(3, 3, 15, 17)
    got = load(bundle)(x)
    want = module(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_pool_kernels_match_aten_in_the_interpreter(built):
    """Every kernel of the model against its reference, at batch 1 and 3: the pools exactly."""
    from aot.verify.interpret import interpret_in_subprocess

    _, bundle, path = built
    (results,) = interpret_in_subprocess([(bundle, path, [{"batch": 1}, {"batch": 3}], None)])
    for size, checks in results.items():
        pools = [c for c in checks if c.name == "max_pool2d"]
        assert len(pools) == 3 and all(c.max_abs_error == 0.0 for c in pools), (size, pools)
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


def test_nan_propagates_and_padding_never_wins(built):
    """The first pool's kernel alone, in the interpreter, on NHWC input with a NaN and with every
    value negative: the NaN's windows give NaN, padding (-inf) never shows, other windows as ATen."""
    compiled, _, _ = built
    step = next(s for s in _kernel_steps(compiled.program, "max_pool2d") if s.reference[0].args[1] == [3, 3])
    kernel = next(k for k in compiled.program.kernels if k.id == step.target)
    grid = [g.replace("batch", "2") for g in step.grid]
    script = f"""
import json, torch
from aot.codegen.compile import load_function
fn = load_function({kernel.id!r}, {kernel.name!r}, {kernel.source!r})
torch.manual_seed(0)
x = (-1 - torch.rand(2, 8, 15, 17)).contiguous(memory_format=torch.channels_last)
x[1, 5, 7, 9] = float("nan")
want = torch.nn.functional.max_pool2d(x, 3, 2, 1)
out = torch.empty_like(want).contiguous(memory_format=torch.channels_last)
fn[tuple(eval(g) for g in {grid!r})](x, out)
nan = out.isnan()
print(json.dumps([
    bool(torch.equal(nan, want.isnan())), int(nan.sum()), bool(nan[1, 5].any()),
    bool(torch.equal(out[~nan], want[~nan])), bool((out[~nan] < 0).all()),
]))
"""
    same_nans, n_nan, in_channel, same_values, all_negative = interpreted_json(script)
    assert same_nans and n_nan > 0 and in_channel and same_values and all_negative


def test_read_indices_keep_atens_pool(tmp_path):
    compiled, _, _ = _build(tmp_path, INDICES, "indices")
    program = compiled.program
    assert "aten.max_pool2d_with_indices.default" in [s.target for s in program.steps]
    assert not _kernel_steps(program, "max_pool2d")


def test_inspect_names_the_libraries_the_calls_launch(built, tmp_path):
    """The pool model launches cuDNN's convolutions and nothing of ATen's; a model that keeps
    ATen's pool (its indices read) says so, with what ATen's kernels cost a process."""
    from aot.cli.reports import bundle_summary, summary_text

    _, bundle, _ = built
    m, info = bundle_summary(str(bundle))
    assert info["libraries"] == {"cudnn": {"aten.convolution.default": 2}}
    text = summary_text(m, info)
    assert "library calls launch: cuDNN (convolution ×2)" in text and "costs a process" not in text
    _, indices, _ = _build(tmp_path, INDICES, "indices")
    m, info = bundle_summary(str(indices))
    assert info["libraries"] == {"aten": {"aten.max_pool2d_with_indices.default": 1}}
    assert "ATen kernels (max_pool2d_with_indices ×1); loading them costs a process ATen kernels ~92 MiB" in (
        summary_text(m, info)
    )


@pytest.fixture(scope="module")
def averaged(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("avg"), AVERAGE, "avg")


def test_average_pools_are_kernels_and_agree_with_eager(averaged):
    from aot.loader import load
    from aot.tracer import load_model_file

    compiled, bundle, path = averaged
    program = compiled.program
    assert "aten.avg_pool2d.default" not in [s.target for s in program.steps]
    pools = _kernel_steps(program, "avg_pool2d")
    assert len(pools) == 5 and all(s.reference[0].target == "aten.avg_pool2d.default" for s in pools)
    assert len(_kernel_steps(program, "max_pool2d")) == 1  # the window of 40 clipped to the map too
    module = load_model_file(path).module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    module.eval()
    x = torch.randn(3, 3, 15, 17)
    with torch.no_grad():
        want = module(x)
    for g, w in zip(load(bundle)(x), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_average_pool_kernels_match_aten_in_the_interpreter(averaged):
    """Each divisor's kernel against ATen's pool at batch 1 and 3, NCHW and NHWC (float32)."""
    from aot.verify.interpret import interpret_in_subprocess

    _, bundle, path = averaged
    (results,) = interpret_in_subprocess([(bundle, path, [{"batch": 1}, {"batch": 3}], None)])
    for size, checks in results.items():
        pools = [c for c in checks if c.name == "avg_pool2d"]
        assert len(pools) == 5 and all(c.max_abs_error <= 1e-6 for c in pools), (size, pools)
        (biggest,) = [c for c in checks if c.name == "max_pool2d"]
        assert biggest.max_abs_error == 0.0, (size, biggest)
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


def test_a_model_with_average_pools_builds_library_free(averaged):
    """``avg_pool2d`` had no Triton form: a library-free build refused it (timm's NF-Nets)."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    _, _, path = averaged
    compiled = generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    assert "aten.avg_pool2d.default" not in {s.target for s in compiled.program.steps}
    assert len(_kernel_steps(compiled.program, "avg_pool2d")) == 5


PERMUTED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv2d(8, 4, 1)

    def forward(self, x):  # x: [B, H, W, C], as CoAtNet's LayerNorm2d normalizes it
        y = self.norm(x).permute(0, 3, 1, 2)  # [B, C, H, W] over [B, H, W, C] rows
        return self.conv(nn.functional.avg_pool2d(y, 2)), nn.functional.max_pool2d(y, 3, 2, 1)

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 6, 7, 8))])
"""


def test_a_pool_of_a_permuted_view_builds_library_free(tmp_path):
    """CoAtNet's shortcut pools the permute of its LayerNorm2d's rows: a view the pool kernel cannot
    read in place, which the library-free build refused. Now a kernel copies it row-major first (one
    copy for both pools); the bundle agrees with eager on the CPU and each kernel with its
    reference in the interpreter at batch 1 and 3."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.runtime import check
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "permuted.py"
    path.write_text(PERMUTED)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    program = compiled.program
    pools = _kernel_steps(program, "avg_pool2d") + _kernel_steps(program, "max_pool2d")
    assert len(pools) == 2 and len({s.args[0].name for s in pools}) == 1
    (copy,) = [s for s in program.steps if pools[0].args[0].name in s.outputs]
    assert copy.kind == StepKind.KERNEL and "aten.clone.default" in {r.target for r in copy.reference}
    pack(compiled, tmp_path / "permuted.tpk")
    assert check(tmp_path / "permuted.tpk").entries  # the torch-free runtime takes it
    module = spec.module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    x = torch.randn(3, 6, 7, 8)
    with torch.no_grad():
        want = module.eval()(x)
    for got, w in zip(load(tmp_path / "permuted.tpk")(x), want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    (results,) = interpret_in_subprocess(
        [(tmp_path / "permuted.tpk", path, [{"batch": 1}, {"batch": 3}], None)]
    )
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in program.kernels}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


OVER_TIME = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 5, stride=2)  # frames: a floor division of the samples
        self.squeeze = nn.AvgPool1d(2, 2)  # SEW's squeeze of its frames: the last odd one dropped
        self.padded = nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False)
        self.smooth = nn.AvgPool1d(3, stride=1, padding=1)  # the padding counted

    def forward(self, x):  # x: [B, 4, samples]
        y = self.conv(x).relu()
        return self.squeeze(y), self.padded(y) * 2, self.smooth(y)

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 3), 4, Dim("samples", 9, 40)))])
"""


def test_pools_over_a_symbolic_length_are_kernels(tmp_path):
    """A 1-D average pool over time (a 2-D one of height 1 over a symbolic width: the frames a
    strided convolution makes of a symbolic sample count) is a kernel whose width, output width and
    strides are arguments: built library-free, the bundle agrees with eager on the CPU, and every
    kernel its reference in the interpreter at the narrowest width, an odd one (the squeeze drops
    the last frame) and the widest. A window that may pass the narrowest padded width is not taken.
    (torch.export keeps a 1-D max pool's length symbolic at no size: it guards each one.)"""
    from aot.codegen import generate
    from aot.codegen.pooling import pool_sites
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "over_time.py"
    path.write_text(OVER_TIME)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    program = compiled.program
    pools = _kernel_steps(program, "avg_pool2d")
    assert len(pools) == 3
    kernels = {k.id: k for k in program.kernels}
    assert all(any(p.name == "W" for p in kernels[s.target].params) for s in pools)  # an argument
    pack(compiled, tmp_path / "over_time.tpk")
    module = spec.module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    runner = load(tmp_path / "over_time.tpk")
    for samples in (9, 20, 40):
        x = torch.randn(2, 4, samples)
        with torch.no_grad():
            want = module.eval()(x)
        for got, w in zip(runner(x), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    sizes = [{"batch": 1, "samples": 9}, {"batch": 2, "samples": 20}, {"batch": 3, "samples": 40}]
    (results,) = interpret_in_subprocess([(tmp_path / "over_time.tpk", path, sizes, None)])
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in program.kernels}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
    # from 5 samples the conv makes 1 frame: the squeeze's window of 2 passes it, the padded ones fit
    narrow = pool_sites(compiled.traced.program, {"batch": (1, 3), "samples": (5, 40)})
    assert len(narrow) == 2
    assert len(pool_sites(compiled.traced.program, {"batch": (1, 3), "samples": (9, 40)})) == 3


IMAGES = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)  # a ResNet's stem pool
        self.down = nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False)  # ResNet-D's shortcut
        self.wide = nn.AvgPool2d((1, 3), stride=1, padding=(0, 1))

    def forward(self, x):  # x: [B, 3, H, W]
        y = self.pool(self.stem(x).relu())
        return self.down(y), self.wide(y).sum(dim=(2, 3))

spec = ModelSpec(
    module=M, inputs=[Input("x", (Dim("batch", 1, 3), 3, Dim("height", 8, 40), Dim("width", 8, 40)))]
)
"""


def test_pools_over_a_symbolic_map_are_kernels(tmp_path):
    """2-D pools over a symbolic height and width (images of a declared range of sizes: a ResNet's
    stem max pool, ResNet-D's average shortcut with ceil_mode, a window along the width only) are
    kernels whose sizes and strides are arguments: library-free, the CPU path equals eager and every
    kernel its reference in the interpreter at an odd, unequal size and the smallest. A window that
    may pass the narrowest padded map is not taken."""
    from aot.codegen.pooling import pool_sites
    from tests.codegen.conftest import library_free_checked

    sizes = [
        {"batch": 2, "height": 13, "width": 27},
        {"batch": 1, "height": 8, "width": 8},
        {"batch": 3, "height": 40, "width": 40},
    ]
    inputs = lambda s, g: (torch.randn(s["batch"], 3, s["height"], s["width"], generator=g),)  # noqa: E731
    compiled, _ = library_free_checked(tmp_path, IMAGES, inputs, sizes)
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    pools = [s for s in program.steps if s.kind.value == "kernel" and "pool2d" in kernels[s.target].name]
    assert len(pools) == 3
    assert all(any(p.name == "H" for p in kernels[s.target].params) for s in pools[:2])  # arguments
    traced = compiled.traced.program
    # from a 1-pixel image the stem makes a 1x1 map: the 3x3 window with padding 1 still fits it
    # (3 <= 1 + 2), the 2x2 one with no padding passes it; along the width the 1x3 fits
    assert len(pool_sites(traced, {"batch": (1, 3), "height": (1, 40), "width": (8, 40)})) == 2
    assert len(pool_sites(traced, {"batch": (1, 3), "height": (8, 40), "width": (8, 40)})) == 3
