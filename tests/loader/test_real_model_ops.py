"""Ops that real models call and bundles used to refuse (``aten.linalg_vector_norm`` from every
``F.normalize`` and ConvNeXt-V2's GRN, ``aten.histc`` from transformers' MoE routing, ``erfinv``,
``cdist``, ``cumprod``): a small model calling each builds, loads and matches eager on the CPU.
Their hostile arguments are in the fuzz over every allowlisted op (``tests/aot/test_op_contracts.py``)."""

from __future__ import annotations

import textwrap

import pytest
import torch

MODEL = """
import torch
import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec

EXPERTS = 4


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, EXPERTS)
        self.gamma = nn.Parameter(torch.randn(1, 1, 16) * 0.1)
        self.beta = nn.Parameter(torch.randn(1, 1, 16) * 0.1)

    def forward(self, x):  # x: [B, T, 16]
        embedding = F.normalize(x.mean(1), dim=-1)  # sentence embeddings
        gx = torch.norm(x, p=2, dim=1, keepdim=True)  # ConvNeXt-V2 GRN, over positions
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        grn = self.gamma * (x * nx) + self.beta + x
        top = torch.topk(self.router(x).softmax(-1), 2, dim=-1).indices  # MoE routing
        load = torch.histc(top.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        gauss = torch.erfinv(torch.tanh(x) * 0.5)
        dist = torch.cdist(x, x)
        growth = torch.cumprod(1 + torch.sigmoid(x) * 0.01, dim=1)
        return embedding, grn, load, gauss, dist, growth


spec = ModelSpec(module=Model, inputs=[Input("x", (Dim("batch", 1, 4), Dim("seq", 2, 16), 16))], dtype="float32")
"""


@pytest.mark.slow
def test_models_calling_them_build_and_match_eager(tmp_path):
    from aot.allowed_ops import ALLOWED_OPS
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import call_model, example_inputs, instantiate, load_model_file, trace

    path = tmp_path / "real_ops.py"
    path.write_text(textwrap.dedent(MODEL))
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",))
    ops = {s.target for s in compiled.program.steps if s.kind == "aten"} | {
        r.target for s in compiled.program.steps for r in s.reference
    }
    wanted = {
        "aten.linalg_vector_norm.default",
        "aten.histc.default",
        "aten.erfinv.default",
        "aten.cumprod.default",
    }
    assert wanted <= ops <= ALLOWED_OPS
    pack(compiled, tmp_path / "real_ops.tpk")
    runner = load(tmp_path / "real_ops.tpk")
    module = instantiate(spec)
    for sizes in ({"batch": 1, "seq": 2}, {"batch": 3, "seq": 7}, {"batch": 4, "seq": 16}):
        inputs = example_inputs(spec, sizes, seed=sum(sizes.values()))
        with torch.no_grad():
            want = call_model(spec, module, inputs)
        got = runner(**inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
