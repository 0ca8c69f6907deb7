"""A model file's own Mixture-of-Experts layer (no transformers: a router with top-k and an experts
module of stacked weights whose forward loops over the tokens, which export cannot hold) builds as
grouped GEMMs (``aot.experts`` finds it by its structure), loads and matches eager on the CPU
at batch 1, odd sizes and the maximum (fp32: 1e-4 absolute + 1e-4 relative, ``aot.dtypes.TOLERANCE``)."""

from __future__ import annotations

import textwrap

import pytest
import torch

MODEL = """
import torch
from torch import nn

from aot import Dim, Input, ModelSpec

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 6, 2, 16, 24


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.3)
        self.act_fn = nn.GELU()

    def forward(self, hidden_states, top_k_index, top_k_weights):  # [T, H], [T, k], [T, k]
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                gate, up = (hidden_states[t] @ self.gate_up_proj[e].T).chunk(2)
                out[t] += top_k_weights[t, j] * (self.act_fn(gate) * up) @ self.down_proj[e].T
        return out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x):  # x: [B, T, H]
        rows = x.reshape(-1, HIDDEN)
        weights, index = self.router(rows).softmax(-1).topk(TOP_K, dim=-1)
        mixed = self.experts(rows, index, weights / weights.sum(-1, keepdim=True))
        return self.norm(x + mixed.view_as(x))


spec = ModelSpec(
    module=Model,
    inputs=[Input("x", (Dim("batch", 1, 4), Dim("seq", 1, 12), HIDDEN))],
    dtype="float32",
)
"""


@pytest.mark.slow  # a bundle of its own; Mixtral's (tests/lm/test_moe.py) holds the default run's
def test_a_model_files_experts_layer_builds_as_grouped_gemms_and_matches_eager(tmp_path):
    from aot.codegen import generate
    from aot.dtypes import TOLERANCE
    from aot.loader import load
    from aot.packager import pack
    from aot.schema import StepKind
    from aot.tracer import call_model, example_inputs, instantiate, load_model_file, trace

    path = tmp_path / "moe.py"
    path.write_text(textwrap.dedent(MODEL))
    spec = load_model_file(path)
    compiled = generate(trace(spec), ("sm_90",))
    kernels = {k.id: k for k in compiled.program.kernels}
    grouped = [
        s
        for s in compiled.program.steps
        if s.kind == StepKind.KERNEL and kernels[s.target].config.get("kind") == "grouped_gemm"
    ]
    assert len(grouped) == 2  # gate/up and down
    pack(compiled, tmp_path / "moe.tpk")
    runner = load(tmp_path / "moe.tpk")
    module = instantiate(spec)
    tol = TOLERANCE["float32"]
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 3, "seq": 7}, {"batch": 4, "seq": 12}):
        inputs = example_inputs(spec, sizes, seed=sum(sizes.values()))
        with torch.no_grad():
            want = call_model(spec, module, inputs)
        torch.testing.assert_close(runner(**inputs), want, rtol=tol.rtol, atol=tol.atol)
