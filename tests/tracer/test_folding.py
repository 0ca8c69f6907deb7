"""Steps of weights alone are computed at build time (``aot.tracer.folding``): a weight-standardized
convolution's statistics, a relative-position bias gathered from its table, a weight norm. The
program keeps no such step, stores each result a step reads as a ``folded.`` weight (named by its
bytes) and leaves out the weights only folded steps read; views of weights feeding the GEMMs stay
views of the stored weight, and tensors made from nothing (``arange``) or larger than their
weights stay steps. The bundle equals eager on the CPU at the smallest, an odd and the largest
batch (float32: 1e-5 relative to the output's scale, the order of the statistics' sums may
differ), and a weight-standardized convolution now builds ``--library-free``."""

from __future__ import annotations

import torch

MODEL = """
import torch
import torch.nn.functional as F
from torch import nn
from aot import Dim, Input, ModelSpec

class StdConv(nn.Conv2d):
    def forward(self, x):  # x: [B, 3, 8, 8]
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                         momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w * 1.5, self.bias, self.stride, self.padding)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = StdConv(3, 4, 3, padding=1)
        self.table = nn.Parameter(torch.randn(9, 4))  # a relative-position bias table
        self.register_buffer("index", torch.tensor([0, 4, 8, 2]))
        self.v = nn.Parameter(torch.randn(5, 4))  # weight norm: w = g * v / |v|
        self.g = nn.Parameter(torch.rand(5, 1) + 0.5)
        self.head = nn.Linear(4, 5)
        self.a = nn.Parameter(torch.randn(1024))  # their outer product: 4 MiB from 8 KiB
        self.b = nn.Parameter(torch.randn(1024))

    def forward(self, x):
        y = self.conv(x).mean((2, 3)) + self.table[self.index].sum(0)  # [B, 4]
        w = self.g * self.v / self.v.norm(dim=1, keepdim=True)
        z = self.head(y) + y @ w.t()  # the head's weight read through its transposed view
        big = torch.outer(self.a, self.b)  # [1024, 1024]: larger than its weights, not folded
        return z + big[:5, :5].sum(0) + torch.arange(5, dtype=x.dtype)

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 3, 8, 8))])
"""


def _traced(tmp_path):
    from aot.tracer import load_model_file, trace

    path = tmp_path / "folded.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    return spec, trace(spec)


def test_steps_of_weights_alone_are_computed_at_build_time_and_run_as_eager(tmp_path):
    from aot import schema
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer.folding import FOLDED_PREFIX
    from aot.tracer.model import instantiate

    spec, traced = _traced(tmp_path)
    program = traced.program
    targets = [s.target for s in program.steps]
    # the statistics of the weight, the table's gather and the weight norm: no step left
    assert not any(
        t.split(".")[1] in ("var_mean", "var", "index", "norm", "linalg_vector_norm") for t in targets
    )
    names = {w.name for w in program.weights}
    folded = {n for n in names if n.startswith(FOLDED_PREFIX)}
    # the standardized conv weight (times 1.5), the gathered bias's sum, the normed weight
    assert len(folded) == 3, sorted(names)
    assert not names & {"conv.weight", "table", "index", "v", "g"}, sorted(names)
    # kept as steps: the head's weight read through its view, arange, the outer product
    assert {"head.weight", "a", "b"} <= names
    reads = {(s.target, *(a.name for a in s.args if isinstance(a, schema.Buf))) for s in program.steps}
    assert ("aten.permute.default", "head.weight") in reads
    assert "aten.arange.start_step" in targets
    (outer,) = [s for s in program.steps if s.target == "aten.mul.Tensor" and schema.Buf("b") in s.args]
    assert program.buffers[outer.outputs[0]].shape == ("1024", "1024")
    assert set(traced.weights) == names  # the bundle's weights: those the program reads
    for n in folded:
        assert traced.weights[n].is_contiguous()
    pack(generate(traced, ("sm_90",)), tmp_path / "folded.tpk")
    runner = load(tmp_path / "folded.tpk")
    module = instantiate(spec)  # the weights the build made: seeded as ModelSpec seeds them
    for batch in (1, 3, 4):
        x = torch.randn(batch, 3, 8, 8)
        with torch.no_grad():
            expected = module(x)
        got = runner(x)
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)


def test_a_folded_weight_is_named_by_its_bytes():
    from aot.tracer.folding import folded_name

    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert folded_name(a) == folded_name(a.clone()) == folded_name(a.t().contiguous().t())
    assert folded_name(a) != folded_name(a.reshape(3, 2))  # the shape is part of the name
    assert folded_name(a) != folded_name(a.to(torch.float64))
    assert folded_name(a) != folded_name(a + 1)
    assert folded_name(torch.tensor(1.5, dtype=torch.bfloat16)).startswith("folded.")


def test_a_weight_standardized_convolution_builds_library_free(tmp_path):
    """``var_mean`` has no Triton form: before folding, a library-free build refused it."""
    from aot.codegen import generate
    from aot.tracer import load_model_file, trace

    path = tmp_path / "std_conv.py"
    path.write_text(
        MODEL.split("class M(")[0]
        + """
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = StdConv(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 3, 8, 8))])
"""
    )
    compiled = generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    assert not any("var_mean" in s.target for s in compiled.program.steps)


PIECES = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, 16))  # SigLIP's pooling head: a query of weights
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # splits its in_proj [E, 2E]
        self.freqs = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):  # x: [B, 8, 16]
        q = self.probe.repeat(x.shape[0], 1, 1)
        emb = torch.cat((self.freqs.sin(), self.freqs.cos()), -1)  # folded, then chunked (EVA-02's rope)
        sin, cos = emb.chunk(2, -1)
        return self.attn(q, x, x)[0], x[:, :, :4] * cos + x[:, :, 4:8] * sin

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), 8, 16))])
"""


def test_the_pieces_of_split_weights_stay_steps_and_run_as_eager(tmp_path):
    """A split or chunk of weights (``nn.MultiheadAttention``'s in_proj split into q and kv, a
    folded table chunked in two) gives pieces that stay the split's steps: each declared, none
    stored as a copy sharing the weight's memory (which safetensors refuses)."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.tracer.model import instantiate

    path = tmp_path / "pieces.py"
    path.write_text(PIECES)
    spec = load_model_file(path)
    traced = trace(spec)
    assert "aten.split_with_sizes.default" in {s.target for s in traced.program.steps}
    pack(generate(traced, ("sm_90",)), tmp_path / "pieces.tpk")
    runner = load(tmp_path / "pieces.tpk")
    module = instantiate(spec)
    for batch in (1, 3, 4):
        x = torch.randn(batch, 8, 16)
        with torch.no_grad():
            expected = module(x)
        for g, w in zip(runner(x), expected):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * max(1.0, w.abs().max().item()))
