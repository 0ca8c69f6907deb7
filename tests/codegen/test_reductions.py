"""Reductions over dims that are not the last ones (``aot.codegen.lower_reduction``): a mean over a
ViT's tokens (``[B, N, C] -> [B, C]``, BEiT's pooling), a sum over the batch and channels, an amax
kept as a dim and broadcast back, a variance, a logsumexp over the batch (amax and sum, as the export decomposes it) and a ``var_mean`` over
two leading dims, softmaxes over a middle dim and over the batch, and vector norms (L2 over the tokens as ConvNeXt-V2's global response norm takes
it; L1, L3.5, inf, -inf and 0 over the channels; L2 of everything; ``max``/``min`` over a dim whose
indices nothing reads, as amax/amin: Hiera's query pooling) are kernels (each reads its source with the reduced dims last), not ATen calls.
Checked: the program has no ATen reduction; the CPU path agrees with eager; every kernel matches
its ATen reference in Triton's interpreter at batch 1 and 3 (float32, the kernels' own tolerance:
the sums' order differs); the model builds ``--library-free``, which ATen's reductions refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aot.codegen.classify import REDUCTION_OPS
from aot.schema import StepKind

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x):  # x: [B, N, C]
        tokens = (x * 2).mean(1)                       # [B, C]
        both = x.sum(dim=(0, 2), keepdim=True)         # [1, N, 1]
        peak = x.amax(dim=1, keepdim=True) - x         # [B, 1, C] broadcast back
        spread = torch.var(x, dim=1, correction=0)     # [B, C]
        total = torch.logsumexp(x, dim=0)              # [N, C]
        var, mean = torch.var_mean(x, dim=(0, 1))      # [C], [C]
        radix = torch.softmax(x.view(x.shape[0], 7, 3, 4), dim=2)  # ResNeSt's split attention
        logs = torch.log_softmax(x, dim=0)             # over the batch
        l2 = torch.linalg.vector_norm(x, 2, dim=1, keepdim=True)  # ConvNeXt-V2's GRN
        norms = [torch.linalg.vector_norm(x, p, dim=2) for p in (1, 3.5, float("inf"), float("-inf"), 0)]
        whole = torch.linalg.vector_norm(x * (x > 0))  # every dim, zeros among the values
        pooled = x.view(x.shape[0], 7, 3, 4).max(dim=1).values  # Hiera's query pooling: no indices read
        low = torch.min(x, dim=-1, keepdim=True)[0]
        return tokens, both, peak, spread, total, var, mean, x / (l2 + 1e-6), *norms, whole, radix, logs, pooled, low

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 7, 12))])
"""


def _build(tmp_path: Path, **options):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / "reduce.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",), **options)
    pack(compiled, tmp_path / "reduce.tpk")
    return compiled, tmp_path / "reduce.tpk", path, spec


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("reduce"))


def test_no_reduction_is_left_to_aten(built):
    compiled, _, _, _ = built
    program = compiled.program
    aten = [s.target for s in program.steps if s.kind == StepKind.ATEN]
    assert not set(aten) & (REDUCTION_OPS | {"aten.max.dim", "aten.min.dim"}), aten
    kernels = {k.id: k for k in program.kernels}
    references = {r.target for s in program.steps if s.kind == StepKind.KERNEL for r in s.reference}
    # (the export decomposes logsumexp into amax, exp, sum and log)
    assert {
        "aten.mean.dim",
        "aten.sum.dim_IntList",
        "aten.amax.default",
        "aten.amin.default",
        "aten.var_mean.correction",
        "aten.linalg_vector_norm.default",
        "aten._softmax.default",
        "aten._log_softmax.default",
    } <= references
    assert all(r in kernels for r in (s.target for s in program.steps if s.kind == StepKind.KERNEL))


def test_cpu_path_agrees_with_eager(built):
    from aot.loader import load

    _, bundle, _, spec = built
    runner, module = load(bundle), spec.module().eval()
    for b in (1, 3, 4):
        x = torch.randn(b, 7, 12)
        for got, want in zip(runner(x), module(x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernels_match_aten_in_the_interpreter(built):
    from aot.verify.interpret import interpret_in_subprocess

    _, bundle, path, _ = built
    (results,) = interpret_in_subprocess([(bundle, path, [{"batch": 1}, {"batch": 3}], None)])
    kernels = {k.id for k in built[0].program.kernels}
    for size, checks in results.items():
        assert {c.kernel for c in checks} == kernels, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


def test_builds_library_free(tmp_path):
    compiled, _, _, _ = _build(tmp_path, gemm_candidates=True, library_free=True)
    assert all(
        s.kind != StepKind.ATEN or s.target in {"aten.view.default"} for s in compiled.program.steps
    ), [s.target for s in compiled.program.steps if s.kind == StepKind.ATEN]


GROUPS = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.one = nn.GroupNorm(1, 8)                  # PoolFormer's GroupNorm1: a norm over C, H, W
        self.four = nn.GroupNorm(4, 8)
        self.bare = nn.GroupNorm(2, 8, affine=False)
        for p in self.parameters():
            nn.init.normal_(p)

    def forward(self, x, seq):  # x: [B, 8, 5, 6], seq: [B, 8, 7]
        return self.one(x) * 2, self.four(x.relu()), self.bare(seq)

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 8, 5, 6)), Input("seq", (batch, 8, 7))])
"""


def test_group_norms_are_kernels(tmp_path):
    """``native_group_norm`` (one group, four, no affine; 4-D and 3-D): each a fused kernel (the
    tensor read as its groups' rows, normalized as a layer norm, scaled per channel), none left
    to ATen; the CPU path agrees with eager, every kernel with its reference in the interpreter at
    batch 1 and 3 (float32), and the model builds library-free."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess

    path = tmp_path / "groups.py"
    path.write_text(GROUPS)
    spec = load_model_file(path)
    traced = trace(spec)
    compiled = generate(traced, ("sm_90",))
    steps = compiled.program.steps
    assert not [s.target for s in steps if s.kind == StepKind.ATEN and "norm" in s.target]
    assert sum("native_group_norm" in str(s.reference) for s in steps if s.kind == StepKind.KERNEL) == 3
    pack(compiled, tmp_path / "groups.tpk")
    runner, module = load(tmp_path / "groups.tpk"), spec.module().eval()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    for b in (1, 3, 4):
        x, seq = torch.randn(b, 8, 5, 6), torch.randn(b, 8, 7)
        with torch.no_grad():
            want = module(x, seq)
        for got, w in zip(runner(x, seq), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    (results,) = interpret_in_subprocess(
        [(tmp_path / "groups.tpk", path, [{"batch": 1}, {"batch": 3}], None)]
    )
    for size, checks in results.items():
        assert {c.kernel for c in checks} == {k.id for k in compiled.program.kernels}, size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
    free = generate(traced, ("sm_90",), gemm_candidates=True, library_free=True)
    assert all(s.kind == StepKind.KERNEL or s.target == "aten.view.default" for s in free.program.steps)


def test_a_max_whose_indices_are_read_stays_atens(tmp_path):
    """``max(x, dim)`` as a reduction only where nothing reads its indices: returned, they are ATen's."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.tracer import load_model_file, trace

    path = tmp_path / "argmax.py"
    path.write_text(
        "import torch\nfrom torch import nn\nfrom aot import Dim, Input, ModelSpec\n\n"
        "class M(nn.Module):\n    def forward(self, x):\n        return tuple(x.max(dim=1))\n\n"
        "spec = ModelSpec(module=M, inputs=[Input('x', (Dim('batch', 1, 4), 7))])\n"
    )
    compiled = generate(trace(load_model_file(path)), ("sm_90",))
    assert "aten.max.dim" in {s.target for s in compiled.program.steps}
    from aot.packager import pack

    pack(compiled, tmp_path / "argmax.tpk")
    x = torch.randn(3, 7)
    values, indices = load(tmp_path / "argmax.tpk")(x)
    assert torch.equal(values, x.max(dim=1).values) and torch.equal(indices, x.max(dim=1).indices)
