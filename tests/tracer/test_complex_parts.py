"""Complex tensors as real pairs (``aot.tracer.complex_parts``): a rotary embedding in complex
numbers (``polar``, ``view_as_complex``, a complex product, ``view_as_real``: Llama 4's and
DeepSeek-V2's form) builds a program with no complex tensor, and the bundle equals eager on the
CPU at the smallest, an odd and the largest size within float32's tolerance (1e-5 absolute and
relative: the complex product's rounding is the library's choice); a complex tensor that reaches
an op the pass does not take (``abs``) leaves the graph as it was, and the build refuses the op
that made the complex tensor, naming the model's line."""

from __future__ import annotations

import pytest
import torch

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    def forward(self, x, pos):  # x: [B, H, T, 8], pos: [T]
        angles = pos.float()[:, None] * self.inv_freq[None, :]  # [T, 4]
        freqs = torch.polar(torch.ones_like(angles), angles)  # complex [T, 4]
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], 4, 2))  # [B, H, T, 4]
        out = torch.view_as_real(z * freqs[None, None]).flatten(3)  # [B, H, T, 8]
        return BODY

batch, t = Dim("batch", 1, 4), Dim("t", 1, 6)
spec = ModelSpec(module=Rotary, inputs=[Input("x", (batch, 2, t, 8)), Input("pos", (t,), dtype="int64", low=0, high=64)])
"""


def _build(tmp_path, body: str):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / "rotary.py"
    path.write_text(MODEL.replace("BODY", body))
    spec = load_model_file(path)
    traced = trace(spec)
    pack(generate(traced, ("sm_90",)), tmp_path / "rotary.tpk")
    return spec, traced, tmp_path / "rotary.tpk"


def test_a_complex_rotary_embedding_runs_as_real_pairs(tmp_path):
    from aot.loader import load

    spec, traced, path = _build(tmp_path, "out * 2 + x")
    dtypes = {b.dtype for b in traced.program.buffers.values()}
    assert not any("complex" in d for d in dtypes), dtypes
    targets = {s.target for s in traced.program.steps}
    assert {"aten.cos.default", "aten.sin.default"} <= targets and "aten.polar.default" not in targets
    runner, module = load(path), spec.module()
    for batch, t in ((1, 1), (3, 5), (4, 6)):
        x, pos = torch.randn(batch, 2, t, 8), torch.randint(0, 64, (t,))
        torch.testing.assert_close(runner(x, pos), module(x, pos), rtol=1e-5, atol=1e-5)


def test_a_complex_tensor_the_pass_cannot_take_is_refused_as_before(tmp_path):
    from aot.errors import TraceError

    # at the line of the polar call, which export records as the complex of its two products
    line = MODEL.splitlines().index(next(ln for ln in MODEL.splitlines() if "torch.polar" in ln)) + 1
    with pytest.raises(
        TraceError, match=rf"rotary\.py:{line}: the model calls aten\.complex\.default, which a bundle"
    ):
        _build(tmp_path, "out + (z * freqs[None, None]).abs().sum(-1, keepdim=True)")


def test_a_graph_without_complex_tensors_is_left_alone():
    from aot.tracer.complex_parts import split_complex

    ep = torch.export.export(torch.nn.Linear(4, 3), (torch.randn(2, 4),)).run_decompositions()
    before = [str(n.target) for n in ep.graph.nodes]
    assert split_complex(ep.graph) == 0
    assert [str(n.target) for n in ep.graph.nodes] == before


BATCHED = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class Rotary(nn.Module):
    def forward(self, x, pos):  # x: [B, T, 8], pos: [B, T]: each row's positions, as Llama 4's
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, device=x.device).float() / 8))
        angles = pos.float()[..., None] * inv_freq  # [B, T, 4]
        freqs = torch.polar(torch.ones_like(angles), angles)
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], 4, 2))
        return torch.view_as_real(z * freqs).flatten(2)

batch, t = Dim("batch", 1, 2), Dim("t", 1, 6)
spec = ModelSpec(module=Rotary, inputs=[Input("x", (batch, t, 8)), Input("pos", (batch, t), dtype="int64", low=0, high=64)])
"""


def test_polar_over_a_batch_of_at_most_two_rows_exports(tmp_path):
    """``torch.polar`` over angles with the batch dim, the batch at most 2 (Llama 4's rotary at
    ``max_batch=2``): the library's polar guards every dim at 2 or more, which made that batch a
    static 2 and failed the export; under export it is ``torch.complex`` of its two products
    (``complex_parts.polar_from_parts``), and the bundle equals eager at batch 1 and 2."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / "rotary.py"
    path.write_text(BATCHED)
    spec = load_model_file(path)
    pack(generate(trace(spec), ("sm_90",)), tmp_path / "rotary.tpk")
    runner, module = load(tmp_path / "rotary.tpk"), spec.module()
    for batch, t in ((1, 1), (2, 5), (2, 6)):
        x, pos = torch.randn(batch, t, 8), torch.randint(0, 64, (batch, t))
        torch.testing.assert_close(runner(x, pos), module(x, pos), rtol=1e-5, atol=1e-5)
    assert torch.polar is not None and torch.polar.__module__ != "aot.tracer.complex_parts"
