"""Batched matrix products in library-free builds (``aot.codegen.batched_matmul``): attention
written out as matmuls (``q @ k.transpose(-1, -2)``, ``weights @ v``, heads as batches) becomes
kernel steps reading both operands through their views in place; each matches ``bmm`` in Triton's
interpreter (float32, the verifier's tolerance) at two sizes; the torch loader's CPU path agrees
with eager; the runtime without torch accepts the bundle."""

from __future__ import annotations

import pytest
import torch

from aot.schema import StepKind

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.o = nn.Linear(32, 32)

    def forward(self, x):  # x: [B, S, 32]
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, dim=-1))
        weights = ((q @ k.transpose(-1, -2)) * 8**-0.5).softmax(-1)  # [B, 4, S, S]
        return self.o((weights @ v).transpose(1, 2).reshape(b, s, 32))

batch = Dim("batch", 1, 4)
seq = Dim("seq", 1, 24)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, seq, 32))])
"""

pytestmark = pytest.mark.slow  # a library-free build: GEMM candidates compiled


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    tmp = tmp_path_factory.mktemp("bmm")
    path = tmp / "matmuls.py"
    path.write_text(MODEL)
    compiled = generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    pack(compiled, tmp / "matmuls.tpk")
    return compiled, tmp / "matmuls.tpk", path


def test_both_products_are_kernels_and_the_runtime_accepts_the_bundle(built):
    from aot.runtime import check

    compiled, bundle, _ = built
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    steps = [s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "bmm"]
    assert len(steps) == 2 and all(s.reference[0].target == "aten.bmm.default" for s in steps)
    assert not any(s.kind == StepKind.ATEN and s.target == "aten.bmm.default" for s in program.steps)
    assert [e.name for e in check(bundle).entries] == ["general"]


def test_every_kernel_matches_its_reference_in_the_interpreter(built):
    from aot.verify.interpret import interpret_in_subprocess

    _, bundle, path = built
    (results,) = interpret_in_subprocess(
        [(bundle, path, [{"batch": 2, "seq": 7}, {"batch": 3, "seq": 24}], None)]
    )
    for size, checks in results.items():
        assert [c.name for c in checks].count("bmm") == 2, (size, [c.name for c in checks])
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


def test_the_cpu_path_agrees_with_eager(built):
    from aot.loader import load
    from aot.tracer import load_model_file

    compiled, bundle, path = built
    module = load_model_file(path).module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    module.eval()
    x = torch.randn(3, 11, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load(bundle)(x), module(x), rtol=1e-5, atol=1e-5)
