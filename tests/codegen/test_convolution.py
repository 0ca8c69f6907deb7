"""Convolutions as Triton kernels (``aot.codegen.convolution``), for library-free builds.

Each form runs in Triton's interpreter against ``torch.nn.functional.conv1d/conv2d`` on the same
inputs: the implicit GEMM (strides, padding, dilation, groups, bias, 1-D) and the depthwise form
(channel multiplier, a 7x7 window as convnext's), float32 within 1e-4 (IEEE products, float32
accumulation in another order) and float16 within 1e-2 of the float32 result (one rounding of the
float32 sum). A model with those convolutions built ``--library-free`` keeps no convolution step,
every kernel agrees with its reference in the interpreter, and the torch loader's CPU path agrees
with eager; steps no form covers (transposed) stay ATen steps.
"""

from __future__ import annotations

import pytest
import torch

from aot.codegen.convolution import conv_sites, render_convolution
from aot.schema import Buf, NamedTensor, Program, Step, StepKind, SymbolSource, TensorSpec
from tests.codegen.conftest import interpreted_json

CONV = "aten.convolution.default"


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _program(c_in, c_out, size, k, stride, padding, dilation, groups, bias, dtype, one_d=False):
    """A one-step program: ``convolution(x, w, b?)`` over a dynamic batch."""
    spatial = [size] if one_d else [size, size - 1]
    kernel = [k] if one_d else [k, k - (k > 1)]
    n = len(spatial)
    stride, padding, dilation = [stride] * n, [padding] * n, [dilation] * n
    out = [_out_size(s, kk, st, p, d) for s, kk, st, p, d in zip(spatial, kernel, stride, padding, dilation)]
    shape = lambda dims: tuple(str(d) for d in dims)  # noqa: E731
    weights = [NamedTensor("w", TensorSpec(dtype, shape([c_out, c_in // groups, *kernel])))]
    if bias:
        weights.append(NamedTensor("b", TensorSpec(dtype, (str(c_out),))))
    step = Step(
        StepKind.ATEN,
        CONV,
        (Buf("x"), Buf("w"), Buf("b") if bias else None, stride, padding, dilation, False, [0] * n, groups),
        {},
        ("y",),
    )
    program = Program(
        inputs=(NamedTensor("x", TensorSpec(dtype, ("batch", *shape([c_in, *spatial])))),),
        weights=tuple(weights),
        buffers={"y": TensorSpec(dtype, ("batch", *shape([c_out, *out])))},
        steps=(step,),
        outputs=("y",),
        symbols=(SymbolSource("batch", "x", 0),),
    )
    return program, step, (kernel, stride, padding, dilation)


CASES = [
    # (name, c_in, c_out, size, k, stride, padding, dilation, groups, bias, one_d)
    ("stem_7x7_s2", 3, 16, 19, 7, 2, 3, 1, 1, False, False),
    ("3x3_bias", 8, 24, 9, 3, 1, 1, 1, 1, True, False),
    ("grouped_dilated", 8, 12, 11, 3, 2, 2, 2, 2, True, False),
    ("1x1_s2", 32, 8, 8, 1, 2, 0, 1, 1, False, False),
    ("depthwise_7x7", 16, 16, 10, 7, 1, 3, 1, 16, True, False),
    ("depthwise_x2_s2", 8, 16, 9, 3, 2, 1, 1, 8, False, False),
    ("conv1d_grouped", 6, 9, 21, 5, 2, 2, 1, 3, True, True),
]


# float32 by default (every form, every case); float16, the same forms, in the slow run
@pytest.mark.parametrize(
    "dtype,tol", [("float32", 1e-4), pytest.param("float16", 1e-2, marks=pytest.mark.slow)]
)
def test_each_form_matches_eager_in_the_interpreter(dtype, tol):
    """Every case, at batch 2, against torch's convolution in float32 on the same values."""
    scripts = []
    expected_kinds = {}
    for name, c_in, c_out, size, k, stride, padding, dilation, groups, bias, one_d in CASES:
        program, step, geometry = _program(
            c_in, c_out, size, k, stride, padding, dilation, groups, bias, dtype, one_d
        )
        assert conv_sites(program) == [step]
        r = render_convolution(step, program, {"batch": (1, 4)})
        assert r is not None
        expected_kinds[name] = "conv_depthwise" if c_in == groups else "conv_igemm"
        assert r.name == expected_kinds[name] and r.config["kind"] == r.name
        assert [a.name for a in r.args] == ["x", "w", *(["b"] if bias else []), "y"]
        scripts.append((name, r.name, r.source, r.grid, geometry, c_in, c_out, size, groups, bias, one_d))
    script = f"""
import json, torch
from aot.codegen.compile import load_function
F = torch.nn.functional
dtype = getattr(torch, {dtype!r})
errors = {{}}
for i, (name, fn_name, source, grid, geometry, c_in, c_out, size, groups, bias, one_d) in enumerate({scripts!r}):
    kernel, stride, padding, dilation = geometry
    g = torch.Generator().manual_seed(i)
    spatial = [size] if one_d else [size, size - 1]
    x = torch.randn(2, c_in, *spatial, generator=g).to(dtype)
    w = (torch.randn(c_out, c_in // groups, *kernel, generator=g) / 3).to(dtype)
    b = torch.randn(c_out, generator=g).to(dtype) if bias else None
    conv = F.conv1d if one_d else F.conv2d
    want = conv(x.float(), w.float(), None if b is None else b.float(), stride, padding, dilation, groups)
    out = torch.full(want.shape, float("nan"), dtype=dtype)
    fn = load_function("k_" + name, fn_name, source)
    args = [x, w, *([b] if bias else []), out]
    fn[tuple(eval(s.replace("batch", "2")) for s in grid)](*args)
    errors[name] = float((out.float() - want).abs().max())
print(json.dumps(errors))
"""
    errors = interpreted_json(script)
    assert set(errors) == {c[0] for c in CASES}
    bad = {name: e for name, e in errors.items() if not e <= tol}  # NaN (a position never written) fails
    assert not bad, (dtype, tol, bad)


def test_transposed_and_unlisted_convolutions_are_not_sites():
    program, step, _ = _program(4, 4, 6, 3, 1, 1, 1, 1, False, "float32")
    transposed = Step(step.kind, step.target, (*step.args[:6], True, *step.args[7:]), {}, step.outputs)
    assert conv_sites(Program(**{**program.__dict__, "steps": (transposed,)})) == []
    channels = TensorSpec("float32", ("batch", "c", "6", "6"))  # symbolic channels
    odd = Program(**{**program.__dict__, "inputs": (NamedTensor("x", channels),)})
    assert conv_sites(odd) == []


def test_one_element_strides_and_padding_read_as_every_dims():
    """SigLIP's ``padding="valid"`` traces as ``padding=[0]``: ATen reads a one-element stride,
    padding or dilation for every spatial dim, and so does the kernel, whose source is then the
    one of the spelled-out step (checked against eager in the interpreter above)."""
    program, step, _ = _program(3, 8, 16, 4, 4, 0, 1, 1, True, "float32")
    short = Step(step.kind, step.target, (*step.args[:3], [4], [0], [1], *step.args[6:]), {}, step.outputs)
    short_program = Program(**{**program.__dict__, "steps": (short,)})
    assert conv_sites(short_program) == [short]
    ranges = {"batch": (1, 4)}
    assert (
        render_convolution(short, short_program, ranges).source
        == render_convolution(step, program, ranges).source
    )


MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 5, 2, 2, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)         # convnext's depthwise
        self.norm = nn.LayerNorm(16)
        self.pw = nn.Linear(16, 32)
        self.grouped = nn.Conv2d(32, 32, 3, stride=2, padding=2, dilation=2, groups=4)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):  # x: [B, 3, 20, 18]
        y = self.pool(self.bn(self.stem(x)).relu())
        y = self.dw(y).permute(0, 2, 3, 1)
        y = self.pw(self.norm(y)).relu().permute(0, 3, 1, 2)
        y = self.grouped(y) + 1.0
        return self.fc(y.mean(dim=(2, 3)))

batch = Dim("batch", 1, 4, buckets=(1, 4))
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 3, 20, 18))])
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    tmp = tmp_path_factory.mktemp("conv")
    path = tmp / "convs.py"
    path.write_text(MODEL)
    compiled = generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    pack(compiled, tmp / "convs.tpk")
    return compiled, tmp / "convs.tpk", path


@pytest.mark.slow  # a library-free build: GEMM candidates compiled
def test_the_library_free_build_has_no_convolution_step(built):
    compiled, _, _ = built
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    assert all(s.target != CONV for s in program.steps if s.kind == StepKind.ATEN)
    convs = [
        s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name.startswith("conv_")
    ]
    assert sorted(kernels[s.target].name for s in convs) == ["conv_depthwise", "conv_igemm", "conv_igemm"]
    assert all([r.target for r in s.reference] == [CONV] for s in convs)
    # row-major throughout: the runtime without torch refuses other layouts
    assert all(not spec.order for spec in program.buffers.values())


@pytest.mark.slow  # a library-free build: GEMM candidates compiled
def test_every_kernel_matches_its_reference_in_the_interpreter(built):
    from aot.verify.interpret import interpret_in_subprocess

    _, bundle, path = built
    (results,) = interpret_in_subprocess([(bundle, path, [{"batch": 3}], None)])
    for size, checks in results.items():
        assert sum(c.name.startswith("conv_") for c in checks) == 3, (size, [c.name for c in checks])
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


@pytest.mark.slow  # a library-free build: GEMM candidates compiled
def test_the_torch_loader_runs_the_library_free_bundle_on_the_cpu_as_eager(built):
    from aot.loader import load
    from aot.runtime import check
    from aot.tracer import load_model_file
    from aot.tracer.model import instantiate

    compiled, bundle, path = built
    module = instantiate(load_model_file(path))  # the build's weights (its LayerNorm folded into pw's)
    x = torch.randn(3, 3, 20, 18, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load(bundle)(x), module(x), rtol=1e-5, atol=1e-5)
    assert [e.name for e in check(bundle).entries] == ["general"]  # aotpack-rt accepts it


SEQUENCE = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Conv1d(1, 8, 10, stride=5, bias=False)  # wav2vec 2's first feature layer
        self.positions = nn.Conv1d(8, 8, 5, padding=2, groups=2)   # its grouped positional convolution
        self.depthwise = nn.Conv1d(8, 8, 3, padding=1, groups=8)   # SqueezeBERT/ConvBERT-style

    def forward(self, x):  # x: [B, L] samples
        h = self.features(x[:, None]).relu()
        return self.depthwise(self.positions(h) + h)

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 3), Dim("samples", 20, 400)))])
"""


def test_one_d_convolutions_over_a_symbolic_length_are_kernels(tmp_path):
    """A 1-D convolution's length may be symbolic (audio samples, a sequence): the sizes and
    strides it enters are call-time arguments, the kernel otherwise the same. Library-free build;
    the CPU path agrees with eager and every kernel with its reference in the interpreter at two
    lengths, one whose strided windows do not fill the last position."""
    from tests.codegen.conftest import library_free_checked

    sizes = [{"batch": 2, "samples": 123}, {"batch": 1, "samples": 20}, {"batch": 3, "samples": 400}]
    inputs = lambda s, g: (torch.randn(s["batch"], s["samples"], generator=g),)  # noqa: E731
    compiled, _ = library_free_checked(tmp_path, SEQUENCE, inputs, sizes)
    program = compiled.program
    assert CONV not in {s.target for s in program.steps}
    kernels = {k.id: k for k in program.kernels}
    convs = [
        s for s in program.steps if s.kind.value == "kernel" and kernels[s.target].name.startswith("conv_")
    ]
    assert len(convs) == 3 and all("samples" in " ".join(s.grid) for s in convs)


IMAGES = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)  # a ViT's patch embedding
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 5, padding=2, groups=8)
        self.pointwise = nn.Conv2d(8, 6, 1)
        self.tall = nn.Conv2d(8, 8, (3, 1), padding=(1, 0), groups=8, bias=False)  # Nystromformer's

    def forward(self, x):  # x: [B, 3, H, W]
        p = self.patch(x)
        y = self.pointwise(self.depthwise(self.stem(x).relu()))
        return p.flatten(2).transpose(1, 2), y, self.tall(p)

spec = ModelSpec(
    module=M, inputs=[Input("x", (Dim("batch", 1, 3), 3, Dim("height", 8, 40), Dim("width", 8, 40)))]
)
"""


def test_two_d_convolutions_over_a_symbolic_map_are_kernels(tmp_path):
    """A 2-D convolution's height and width may be symbolic (images of a declared range of sizes):
    the sizes and strides they enter are call-time arguments and the grid's position blocks are
    counted per call. Library-free build of a patch embedding, a strided stem, a depthwise and a
    pointwise convolution and a tall depthwise window; the CPU path agrees with eager and every
    kernel with its reference in the interpreter at an odd, unequal size (the patches and the
    stride leave rows and columns over) and the smallest."""
    from tests.codegen.conftest import library_free_checked

    sizes = [
        {"batch": 2, "height": 13, "width": 27},
        {"batch": 1, "height": 8, "width": 8},
        {"batch": 3, "height": 40, "width": 40},
    ]
    inputs = lambda s, g: (torch.randn(s["batch"], 3, s["height"], s["width"], generator=g),)  # noqa: E731
    compiled, _ = library_free_checked(tmp_path, IMAGES, inputs, sizes)
    program = compiled.program
    assert CONV not in {s.target for s in program.steps}
    kernels = {k.id: k for k in program.kernels}
    convs = [
        s for s in program.steps if s.kind.value == "kernel" and kernels[s.target].name.startswith("conv_")
    ]
    assert len(convs) == 5, [kernels[s.target].name for s in program.steps if s.kind.value == "kernel"]
    assert all("height" in " ".join(s.grid) and "width" in " ".join(s.grid) for s in convs)
