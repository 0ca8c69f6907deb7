"""Row gathers in library-free builds (``aot.codegen.index_rows``): ``aten.index`` with one index
tensor on one dim becomes a kernel step, its positions computed in the kernel where they are a
slice of an ``arange`` (``h[:, arange(seq)[-1:]]``, transformers' last-position pick) and read from
their buffer otherwise (a caller's int64 input, negative indices counting from the end; an index
of two dims read as its elements in row-major order); each
kernel matches ``aten.index`` in Triton's interpreter at two sizes; the torch loader's CPU path
agrees with eager; the runtime without torch accepts the bundle. Tiny GPT-2 and Llama through
``aot.hf.causal_lm`` build ``--library-free`` (they were refused at the last-position index)."""

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
        self.proj = nn.Linear(24, 24)

    def forward(self, x, pick):  # x: [B, S, 24], pick: [K] int64 in -4..3
        h = torch.tanh(self.proj(x))  # [B, S, 24], a kernel's result
        last = torch.arange(x.shape[1], device=x.device)[-1:]
        pairs = torch.stack((pick, -1 - pick))  # [2, K]: an index of two dims (CodeGen's [1, S] positions)
        return h[:, last] * 2, h[:, pick] + 1, h[:, pairs] - 1  # [B, 1, 24], [B, K, 24], [B, 2, K, 24]

batch = Dim("batch", 1, 4)
seq = Dim("seq", 4, 20)
picks = Dim("picks", 1, 6)
spec = ModelSpec(
    module=M,
    inputs=[Input("x", (batch, seq, 24)), Input("pick", (picks,), dtype="int64", low=-4, high=3)],
)
"""

pytestmark = pytest.mark.slow  # library-free builds: GEMM candidates compiled


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    tmp = tmp_path_factory.mktemp("index_rows")
    path = tmp / "rows.py"
    path.write_text(MODEL)
    compiled = generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    pack(compiled, tmp / "rows.tpk")
    return compiled, tmp / "rows.tpk", path


def _gathers(program):
    kernels = {k.id: k for k in program.kernels}
    return [s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "index_rows"]


def test_both_indexes_are_kernels_and_the_runtime_accepts_the_bundle(built):
    from aot.runtime import check

    compiled, bundle, _ = built
    program = compiled.program
    steps = _gathers(program)
    assert len(steps) == 3 and all(s.reference[-1].target == "aten.index.Tensor" for s in steps)
    # the last position is computed in the kernel: its arange and slice joined the reference
    computed = [s for s in steps if len(s.reference) > 1]
    assert len(computed) == 1
    assert [r.target for r in computed[0].reference] == [
        "aten.arange.start_step",
        "aten.slice.Tensor",
        "aten.index.Tensor",
    ]
    assert not any(
        s.kind == StepKind.ATEN and s.target.startswith(("aten.index", "aten.arange")) for s in program.steps
    )
    assert [e.name for e in check(bundle).entries] == ["general"]


def test_every_kernel_matches_its_reference_in_the_interpreter(built):
    from aot.verify.interpret import interpret_in_subprocess

    _, bundle, path = built
    sizes = [{"batch": 2, "seq": 7, "picks": 5}, {"batch": 3, "seq": 20, "picks": 1}]
    (results,) = interpret_in_subprocess([(bundle, path, sizes, None)])
    for size, checks in results.items():
        assert [c.name for c in checks].count("index_rows") == 3, (size, [c.name for c in checks])
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])


def test_the_cpu_path_agrees_with_eager(built):
    from aot.loader import load
    from aot.tracer import load_model_file

    compiled, bundle, path = built
    module = load_model_file(path).module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    module.eval()
    x = torch.randn(3, 9, 24, generator=torch.Generator().manual_seed(0))
    pick = torch.tensor([-1, 0, 3, -4])
    got, want = load(bundle)(x, pick), module(x, pick)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_causal_lms_build_library_free(kind, tmp_path):
    """The last-position pick of ``aot.hf``'s wrapper runs as a row gather in prefill (decode
    keeps its one position by a slice: no gather); the bundle has no library call left, the
    runtime accepts it, and the torch loader's CPU path (the reference steps) generates the eager
    model's greedy tokens."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.runtime import check
    from aot.tracer import trace
    from tests.hf.test_causal_lm import built as eager_model
    from tests.hf.test_causal_lm import factory, hf_greedy, prompts

    spec = causal_lm(factory(kind), max_batch=4, max_context=16, name=kind)
    compiled = generate(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    for program in (compiled.program, *compiled.program.variants):  # prefill and decode
        decode = program.inputs[0].spec.shape[1] == "1"
        assert len(_gathers(program)) == (0 if decode else 1)
    out = tmp_path / f"{kind}.tpk"
    pack(compiled, out)
    check(out)
    ids, mask = prompts(2)
    want, _ = hf_greedy(eager_model(kind), ids, mask, 4)
    assert load(out).generate(ids, 4, attention_mask=mask) == want.tolist()
