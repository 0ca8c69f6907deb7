"""Padding an unaligned matmul weight (GPT-2's 50257-row vocabulary) leaves results unchanged."""

import pytest
import torch

from aot.codegen.weight_padding import PAD_TO, pad_matmul_weights
from aot.loader.program import AtenProgram
from aot.tracer import example_inputs, load_model_file
from tests.codegen.conftest import interpreted_json
from tests.conftest import model_path


@pytest.mark.slow
def test_gpt_vocabulary_is_padded_and_logits_unchanged(built):
    spec = load_model_file(model_path("gpt"))
    traced = built.traced("gpt")  # shared with the other tests of this session
    program, weights, n = pad_matmul_weights(traced.program, dict(traced.weights))
    assert n == 1
    assert weights["wte.weight"].shape == (50304, 768) and 50304 % PAD_TO == 0
    assert weights["wte.weight"][50257:].abs().max() == 0  # zero rows: never gathered, sliced away
    sizes = {"batch": 2, "seq": 9}
    inputs = example_inputs(spec, sizes, seed=3)
    want = AtenProgram(traced.program, dict(traced.weights), torch.device("cpu"))(inputs, sizes)[0]
    got = AtenProgram(program, weights, torch.device("cpu"))(inputs, sizes)[0]
    assert got.shape == want.shape == (2, 9, 50257)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_aligned_or_otherwise_used_weights_are_left_alone(built):
    traced = built.traced("mlp")  # 1024 and 4096 wide: already aligned
    assert pad_matmul_weights(traced.program, dict(traced.weights))[2] == 0


TIED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):  # a tied vocabulary of 1030 rows: padded to 1088 for the logits GEMM
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(1030, 16)

    def forward(self, idx):
        return self.wte(idx) @ self.wte.weight.t()

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("idx", (batch, 5), dtype="int64", low=0, high=1030)])
"""


def test_a_lookup_past_the_vocabulary_is_refused_not_read_from_the_padding(tmp_path):
    """The padded rows are the GEMM's alone: the lookup reads a slice of the real 1030 rows, so an
    id in [1030, 1088) is refused on the CPU as before padding, and the gather kernel (checked in the
    interpreter) gives that id a row of NaN, not the padding's zeros."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.schema import StepKind
    from aot.tracer import trace

    path = tmp_path / "tied.py"
    path.write_text(TIED)
    compiled = generate(trace(load_model_file(path)), ("sm_90",))
    program = compiled.program
    assert compiled.traced.weights["wte.weight"].shape == (1088, 16)
    kernels = {k.id: k for k in program.kernels}
    (gather,) = [
        s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "gather_rows"
    ]
    kernel = kernels[gather.target]
    assert "ROWS = tl.constexpr(1030)" in kernel.source
    pack(compiled, tmp_path / "tied.tpk")
    runner = load(tmp_path / "tied.tpk")
    ok = torch.tensor([[0, 5, 1029, 7, 3]])
    w = compiled.traced.weights["wte.weight"][:1030]
    torch.testing.assert_close(runner(ok), w[ok] @ w.t())
    from aot.errors import BundleError

    with pytest.raises(BundleError, match="IndexError: index out of range"):  # as before padding
        runner(torch.tensor([[0, 5, 1031, 7, 3]]))
    script = f"""
import json, torch
from aot.codegen.compile import load_function
fn = load_function({kernel.id!r}, {kernel.name!r}, {kernel.source!r})
w = torch.randn(1088, 16)
w[1030:] = 0
ids = torch.tensor([1029, 1030, 1087])
out = torch.zeros(3, 16)
fn[(3, 1)](w, ids, out)
print(json.dumps([bool(torch.equal(out[0], w[1029])), bool(out[1].isnan().all()), bool(out[2].isnan().all())]))
"""
    assert interpreted_json(script) == [True, True, True]


BIASED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):  # heads of 1030 outputs with biases: padded to 1088 where the bias is theirs alone
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 1030)
        self.other = nn.Linear(16, 1030)

    def forward(self, x):
        return self.head(x), self.other(x) + self.other.bias  # other's bias read twice

batch = Dim("batch", 1, 4)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 16))])
"""


def test_a_head_with_a_bias_it_alone_reads_is_padded_with_its_bias(tmp_path):
    """``addmm(bias, x, W^T)`` (a LayerNorm's shift folded into a head makes one): W and its bias
    padded with zero rows to 1088, the product sliced back, the outputs as before (float32: the
    CPU's GEMM may block a wider product otherwise, 1e-6); a head whose bias another step reads
    too is left alone."""
    from aot.tracer import trace

    path = tmp_path / "biased.py"
    path.write_text(BIASED)
    spec = load_model_file(path)
    traced = trace(spec)
    program, weights, n = pad_matmul_weights(traced.program, dict(traced.weights))
    assert n == 1
    assert weights["head.weight"].shape == (1088, 16) and weights["head.bias"].shape == (1088,)
    assert weights["head.weight"][1030:].abs().max() == 0 and weights["head.bias"][1030:].abs().max() == 0
    assert weights["other.weight"].shape == (1030, 16) and weights["other.bias"].shape == (1030,)
    sizes = {"batch": 3}
    inputs = example_inputs(spec, sizes, seed=1)
    want = AtenProgram(traced.program, dict(traced.weights), torch.device("cpu"))(inputs, sizes)
    got = AtenProgram(program, weights, torch.device("cpu"))(inputs, sizes)
    assert [g.shape for g in got] == [w.shape for w in want] == [(3, 1030), (3, 1030)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
