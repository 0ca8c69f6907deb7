"""Self-attention under a padding mask (BERT's) in a library-free build (``aot.codegen.
cache_attention``, keys and values read from their projection's rows): the SDPA call is one
kernel step reading the ``[B, 1, 1, S]`` additive mask through its ``expand`` in place; the
kernel matches SDPA in Triton's interpreter (float32, the verifier's tolerance), with padding in
the inputs; the torch loader's CPU path agrees with eager; the runtime without torch accepts the
bundle."""

from __future__ import annotations

import pytest
import torch

from aot.schema import StepKind

MODEL = """
import torch
from torch import nn
from torch.nn import functional as F
from aot import Dim, Input, ModelSpec

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.qkv = nn.Linear(32, 96)
        self.o = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, input_ids, attention_mask):  # [B, S] each; attention_mask 1 = a token
        b, s = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, dim=-1))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(b, 1, s, s))
        return self.norm(x + self.o(y.transpose(1, 2).reshape(b, s, 32)))

batch = Dim("batch", 1, 4)
seq = Dim("seq", 2, 40)
spec = ModelSpec(
    module=Encoder,
    inputs=[
        Input("input_ids", (batch, seq), dtype="int64", low=0, high=50),
        Input("attention_mask", (batch, seq), dtype="int64", low=1, high=2),
    ],
)
"""

pytestmark = pytest.mark.slow  # a library-free build: GEMM candidates compiled


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    tmp = tmp_path_factory.mktemp("masked")
    path = tmp / "encoder.py"
    path.write_text(MODEL)
    compiled = generate(trace(load_model_file(path)), ("sm_90",), gemm_candidates=True, library_free=True)
    pack(compiled, tmp / "encoder.tpk")
    return compiled, tmp / "encoder.tpk", path


def test_the_masked_attention_is_one_kernel_reading_the_mask_in_place(built):
    compiled, bundle, _ = built
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    steps = [
        s
        for s in program.steps
        if s.kind == StepKind.KERNEL and kernels[s.target].name == "masked_attention_d8"
    ]
    assert len(steps) == 1 and steps[0].reference[0].target == "aten.scaled_dot_product_attention.default"
    mask = steps[0].args[3].name
    assert program.buffers[mask].shape == ("batch", "1", "1", "seq")  # the padding mask, not its expand
    from aot.runtime import check

    assert [e.name for e in check(bundle).entries] == ["general"]


def test_the_kernel_matches_sdpa_in_the_interpreter_with_padding(built):
    """Every kernel against its reference at two sizes, a row of each with padding at its end."""
    from tests.codegen.conftest import interpreted_json

    compiled, _, _ = built
    program = compiled.program
    (kernel,) = [k for k in program.kernels if k.name == "masked_attention_d8"]
    step = next(s for s in program.steps if s.kind == StepKind.KERNEL and s.target == kernel.id)
    script = f"""
import json, torch
from aot.codegen.compile import load_function
F = torch.nn.functional
fn = load_function({kernel.id!r}, {kernel.name!r}, {kernel.source!r})
errors = []
for b, s in ((2, 7), (3, 33)):
    g = torch.Generator().manual_seed(s)
    rows = torch.randn(b * s, 96, generator=g)  # the fused projection's rows: q, k, v
    q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in rows.split(32, dim=-1))
    valid = torch.ones(b, s)
    valid[1, s // 2:] = 0  # padding
    mask = ((1.0 - valid[:, None, None, :]) * torch.finfo(torch.float32).min).contiguous()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(b, 1, s, s)).transpose(1, 2).reshape(b, s, 32)
    out = torch.full((b, s, 32), float("nan"))
    sizes = {{"batch": b, "seq": s}}
    args = [rows, rows, rows, mask, out] + [eval(a, {{}}, sizes) for a in {[a.text for a in step.args[5:]]!r}]
    fn[tuple(eval(g_, {{}}, sizes) for g_ in {list(step.grid)!r})](*args)
    errors.append(float((out - want).abs().max()))
print(json.dumps(errors))
"""
    errors = interpreted_json(script)
    assert all(e <= 1e-5 for e in errors), errors


def test_the_cpu_path_agrees_with_eager(built):
    from aot.loader import load
    from aot.tracer import load_model_file

    compiled, bundle, path = built
    module = load_model_file(path).module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    module.eval()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, 9, dtype=torch.int64)
    valid[1, 5:] = 0
    torch.testing.assert_close(load(bundle)(ids, valid), module(ids, valid), rtol=1e-5, atol=1e-5)
