"""``aotpack build --library-free`` (``aot.codegen.library_free``): on a hand-made program, which
candidate each site takes, the program it makes (no library call left, the kernels no step
launches dropped), and the refusals naming the site or the step; the example mlp built
library-free runs on the torch loader's CPU path exactly as its default build (slow)."""

from __future__ import annotations

import re

import pytest

from aot.codegen.library_free import choose, library_free
from aot.errors import CodegenError
from aot.program import live_steps
from aot.schema import Bucket, GemmCandidate, StepKind
from tests.verify.test_library_free import _program

BUCKET = (Bucket("batch", (1, 8, 16)),)


def test_each_site_takes_the_preferred_candidate_compiled_for_every_bucket():
    program = _program()
    gemm_0, attn_0 = program.alternatives[0], program.alternatives[1]
    assert choose(gemm_0, BUCKET) == "tile_a"  # tile forms first, in the site's order
    assert choose(attn_0, BUCKET) == "flash_a"
    narrow = GemmCandidate("tile_0", gemm_0.candidates[0].steps, ({"batch": 1},))
    site = type(gemm_0)(**{**gemm_0.__dict__, "candidates": (narrow, *gemm_0.candidates[1:])})
    assert choose(site, BUCKET) == "tile_b"  # tile_0 was compiled for batch 1 only


def test_the_program_has_no_library_call_left():
    out = library_free(_program(), BUCKET)
    assert out.alternatives == ()
    kinds = [(s.kind, s.target) for s in live_steps(out)]
    assert kinds == [
        (StepKind.KERNEL, "k_h_tile_a"),
        (StepKind.KERNEL, "k_a_flash_a"),
        (StepKind.KERNEL, "k_y_tile_a"),
    ]


def test_a_site_without_a_candidate_for_every_bucket_is_refused_by_name():
    program = _program()
    gemm_0 = program.alternatives[0]
    only_one = tuple(GemmCandidate(c.name, c.steps, ({"batch": 1},)) for c in gemm_0.candidates)
    site = type(gemm_0)(**{**gemm_0.__dict__, "candidates": only_one})
    with pytest.raises(
        CodegenError, match=r"--library-free: gemm_0 \(a batchx16x8 library call, result h\) has no"
    ):
        library_free(
            type(program)(**{**program.__dict__, "alternatives": (site, *program.alternatives[1:])}), BUCKET
        )


def test_a_library_step_no_form_covers_is_refused_naming_it():
    program = _program(gemm_1_site=False)  # gemm_1's mm has no candidates: it stays a library call
    with pytest.raises(CodegenError) as e:
        library_free(program, BUCKET)
    assert str(e.value) == (
        "--library-free: step 3 (aten.mm.default -> y) is a library call; aotpack-rt runs library-free "
        "bundles only (every step a compiled kernel or a driver copy): no Triton form exists for it yet: "
        "build without --library-free and run it with the torch loader"
    )


@pytest.mark.slow
def test_the_mlp_built_library_free_matches_its_default_build_on_the_cpu(tmp_path):
    """Same reference ops on the CPU: outputs equal bit for bit; and the runtime accepts it."""
    import torch

    from aot.cli import main
    from aot.loader import load
    from aot.runtime import check

    free, default = tmp_path / "free.tpk", tmp_path / "default.tpk"
    for out, extra in ((free, ["--library-free"]), (default, [])):
        with pytest.raises(SystemExit) as done:
            main(["build", "models/mlp.py", "-o", str(out), "--arch", "sm_90", "-q", *extra])
        assert done.value.code == 0
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0)).half()
    assert torch.equal(load(free)(x), load(default)(x))
    assert [e.name for e in check(free).entries] == ["general"]


@pytest.mark.slow
def test_the_cnn_builds_library_free_and_its_cpu_path_matches_the_default_build(tmp_path):
    """models/cnn.py (ResNet-18): every convolution a Triton kernel (``aot.codegen.convolution``),
    row-major throughout; the runtime accepts it; on the CPU (reference steps) its logits agree
    with the default build's (channels-last there) within float16 rounding."""
    import torch

    from aot.bundle import open_bundle
    from aot.cli import main
    from aot.loader import load
    from aot.runtime import check

    free, default = tmp_path / "free.tpk", tmp_path / "default.tpk"
    for out, extra in ((free, ["--library-free"]), (default, [])):
        with pytest.raises(SystemExit) as done:
            main(["build", "models/cnn.py", "-o", str(out), "--arch", "sm_90", "-q", *extra])
        assert done.value.code == 0
    b = open_bundle(free)
    program = b.program()
    kinds = {k.id: k.config.get("kind") for k in program.kernels}
    convs = [s for s in live_steps(program) if s.kind == StepKind.KERNEL and kinds[s.target] == "conv_igemm"]
    assert len(convs) == 20  # the stem, 16 in the blocks, 3 downsamples
    assert not any(s.kind == StepKind.ATEN and s.target == "aten.convolution.default" for s in program.steps)
    assert [e.name for e in check(free).entries] == ["general"]
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)).half()
    torch.testing.assert_close(load(free)(x).float(), load(default)(x).float(), rtol=2e-2, atol=2e-2)


TRANSPOSED_MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)

    def forward(self, x):  # x: [B, 4, 8, 8]
        return self.up(x).relu()

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 4, 8, 8))])
"""


def test_a_step_without_a_form_is_refused_with_its_model_line(tmp_path):
    """A transposed convolution has no Triton form: the build names the step and the model line."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    path = tmp_path / "upsample.py"
    path.write_text(TRANSPOSED_MODEL)
    line = next(i for i, text in enumerate(TRANSPOSED_MODEL.splitlines(), 1) if "self.up(x)" in text)
    with pytest.raises(CodegenError) as e:
        generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    message = str(e.value)
    pattern = (
        rf"step \d+ \(aten\.convolution\.default -> \w+, made at \S*upsample\.py:{line}\) is a library call"
    )
    assert re.search(pattern, message), message
    assert message.endswith(
        "no Triton form exists for it yet: build without --library-free and run it with the torch loader"
    )
