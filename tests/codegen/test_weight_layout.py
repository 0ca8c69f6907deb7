"""Matmul weights stored [K, N] are stored [N, K] under a new name (``aot.codegen.weight_layout``)
where GEMMs alone read them, and the program computes what it did (fp32 on the CPU: 1e-5)."""

import pytest
import torch

from aot.codegen.weight_layout import transpose_matmul_weights
from aot.loader.program import AtenProgram
from aot.program import readers_of
from aot.schema import Buf
from aot.tracer import example_inputs, load_model_file, trace

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.qkv = nn.Parameter(torch.randn(16, 48, generator=g) * 0.2)  # [K, N]: addmm(b, x, W)
        self.qkv_bias = nn.Parameter(torch.randn(48, generator=g) * 0.1)
        self.proj = nn.Parameter(torch.randn(48, 48, generator=g) * 0.2)  # square, two GEMMs
        self.head = nn.Parameter(torch.randn(48, 16, generator=g) * 0.2)  # a GEMM's, and added
        self.lin = nn.Linear(16, 16)  # [N, K] already: read through its transpose

    def forward(self, x):  # x: [B, 16]
        h = torch.addmm(self.qkv_bias, x, self.qkv)
        h = torch.relu(torch.relu(h @ self.proj) @ self.proj)
        return self.lin(h @ self.head + self.head[0])  # (its sum would be folded at build time)

batch = Dim("batch", 1, 8)
spec = ModelSpec(module=M, inputs=[Input("x", (batch, 16))])
"""


def _eager(spec, weights):
    """The model with ``weights`` (its parameters by name)."""
    module = spec.module()
    module.load_state_dict({k: v for k, v in weights.items() if not k.endswith(".nk")})
    return module.eval()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("weight_layout") / "conv1d_like.py"
    path.write_text(MODEL)
    return path


def test_weights_read_by_gemms_alone_are_transposed_and_results_unchanged(model):
    spec = load_model_file(model)
    traced = trace(spec)
    program, weights, n = transpose_matmul_weights(traced.program, dict(traced.weights))
    assert n == 2  # qkv and proj; head's first row is also added, lin's weight is read through its transpose
    names = [w.name for w in program.weights]
    assert "qkv.nk" in names and "proj.nk" in names and "qkv" not in names and "proj" not in names
    assert "head" in names and "lin.weight" in names
    new = {"qkv": "qkv.nk", "proj": "proj.nk"}
    assert list(weights) == [new.get(k, k) for k in traced.weights]  # each in its original's place
    assert names == [new.get(w.name, w.name) for w in traced.program.weights]
    assert torch.equal(weights["qkv.nk"], traced.weights["qkv"].t()) and weights["qkv.nk"].is_contiguous()
    assert torch.equal(weights["proj.nk"], traced.weights["proj"].t())
    assert torch.equal(weights["head"], traced.weights["head"])
    specs = {w.name: w.spec for w in program.weights}
    assert specs["qkv.nk"].shape == ("48", "16")
    # one permute per GEMM that reads the transposed weight, which a GEMM site takes with it
    readers = readers_of(program.steps)
    perms = [program.steps[i] for i in readers["proj.nk"]]
    assert [p.target for p in perms] == ["aten.permute.default"] * 2
    for p in perms:
        (gemm,) = [program.steps[i] for i in readers[p.outputs[0]]]
        assert gemm.target == "aten.mm.default" and gemm.args[1] == Buf(p.outputs[0])
        assert program.buffers[p.outputs[0]].shape == ("48", "48")
    sizes = {"batch": 5}
    inputs = example_inputs(spec, sizes, seed=1)
    want = _eager(spec, traced.weights)(inputs["x"])
    before = AtenProgram(traced.program, dict(traced.weights), torch.device("cpu"))(inputs, sizes)[0]
    got = AtenProgram(program, weights, torch.device("cpu"))(inputs, sizes)[0]
    torch.testing.assert_close(before, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_build_packs_the_transposed_weights_and_runs_as_the_model(model, tmp_path):
    from safetensors.torch import load

    from aot.codegen import generate
    from aot.loader import load as load_bundle
    from aot.loader.bundle import open_bundle
    from aot.packager import pack
    from aot.schema import WEIGHTS_PATH

    spec = load_model_file(model)
    said: list[str] = []
    compiled = generate(trace(spec), ("sm_90",), progress=said.append)
    assert any("stored 2 matmul weights [K, N] as [N, K]" in line for line in said)
    pack(compiled, tmp_path / "m.tpk")
    bundle = open_bundle(tmp_path / "m.tpk")
    try:
        stored = load(bundle.read(WEIGHTS_PATH))
    finally:
        bundle.close()
    assert sorted(stored) == sorted(["qkv.nk", "qkv_bias", "proj.nk", "head", "lin.weight", "lin.bias"])
    module = _eager(
        spec, compiled.traced.weights | {"qkv": stored["qkv.nk"].t(), "proj": stored["proj.nk"].t()}
    )
    assert torch.equal(stored["proj.nk"], trace(spec).weights["proj"].t())
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(load_bundle(tmp_path / "m.tpk")(x), module(x), rtol=1e-5, atol=1e-5)


def test_a_program_without_such_weights_is_left_as_it_is(model):
    traced = trace(load_model_file(model))
    program, weights, n = transpose_matmul_weights(traced.program, dict(traced.weights))
    again, weights_again, m = transpose_matmul_weights(program, weights)
    assert m == 0 and again is program and weights_again is weights


HEAD = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, 16))  # SigLIP's pooling head: a query of weights
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # splits its in_proj into q and kv
        self.mlp = nn.Linear(16, 16)

    def forward(self, x):  # x: [B, 8, 16]
        h = self.attn(self.probe.repeat(x.shape[0], 1, 1), x, x)[0]
        return h + self.mlp(h)

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 8, 16))])
"""


def test_weights_only_a_split_reads_are_stored_as_their_pieces(tmp_path):
    """``nn.MultiheadAttention``'s cross-attention splits its ``in_proj_weight`` and bias into
    the query's rows and the keys' and values': each piece is a weight of its own (the original
    gone, no split left), so its projections are GEMM sites and the head builds library-free.
    Checked: the bundle's CPU path agrees with eager, every kernel with its reference in the
    interpreter at batch 1 and 3."""
    from aot.codegen.weight_layout import SPLITS
    from tests.codegen.conftest import library_free_checked

    path = tmp_path / "head.py"
    path.write_text(HEAD)
    assert {s.target for s in trace(load_model_file(path)).program.steps} & set(SPLITS)
    sizes = [{"batch": 1}, {"batch": 3}, {"batch": 4}]
    compiled, _ = library_free_checked(
        tmp_path, HEAD, lambda s, g: (torch.randn(s["batch"], 8, 16, generator=g),), sizes
    )
    program = compiled.program
    names = {w.name for w in program.weights}
    assert {"attn.in_proj_weight.0", "attn.in_proj_weight.1", "attn.in_proj_bias.0"} <= names
    assert "attn.in_proj_weight" not in names and not {s.target for s in program.steps} & set(SPLITS)
    in_proj = compiled.traced.weights["attn.in_proj_weight.0"]
    assert in_proj.shape == (16, 16) and in_proj.is_contiguous()
