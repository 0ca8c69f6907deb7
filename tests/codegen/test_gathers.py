"""``aten.gather`` as a kernel of library-free builds (``aot.codegen.gathers``): RoBERTa's token
types gathered from its buffered zeros by the positions it computes from the padding, and a float
gather along the last dim of a transposed tensor by indices expanded over it (both read in place
through their views). Checked: no ATen gather left, the torch-free runtime takes the bundle, the
CPU path agrees with eager and every kernel matches its reference in the interpreter (the gathers
exactly); an index outside the dim gives NaN."""

from __future__ import annotations

import pytest
import torch

from aot.schema import StepKind
from tests.codegen.conftest import interpreted_json, library_free_checked

MODEL = """
import pytest
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("token_type_ids", torch.zeros(1, 40, dtype=torch.long))  # RoBERTa's
        self.types = nn.Embedding(2, 8)

    def forward(self, ids, x):  # ids: [B, S] int64, x: [B, 6, S]
        mask = ids.ne(1).int()
        positions = (mask.cumsum(1).type_as(mask) * mask).long() + 1
        types = torch.gather(self.token_type_ids.expand(ids.shape[0], -1), 1, positions)
        picks = ((ids * 2) % 6)[..., None].expand(-1, -1, 3)  # [B, S, 3] of 0, 2, 4
        return self.types(types), torch.gather(x.transpose(1, 2), 2, picks)

batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 32)
spec = ModelSpec(
    module=M,
    inputs=[Input("ids", (batch, seq), dtype="int64", low=0, high=3), Input("x", (batch, 6, seq))],
)
"""


def test_gathers_are_kernels_in_a_library_free_build(tmp_path):
    def inputs(size, gen):
        ids = torch.randint(0, 3, (size["batch"], size["seq"]), generator=gen)
        return ids, torch.randn(size["batch"], 6, size["seq"], generator=gen)

    sizes = [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 13}, {"batch": 4, "seq": 32}]
    compiled, results = library_free_checked(tmp_path, MODEL, inputs, sizes)
    program = compiled.program
    kernels = {k.id: k for k in program.kernels}
    gathers = [s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "gather"]
    assert len(gathers) == 2 and all(s.reference[0].target == "aten.gather.default" for s in gathers)
    for size, checks in results.items():
        exact = [c for c in checks if c.name == "gather"]
        assert len(exact) == 2 and all(c.max_abs_error == 0.0 for c in exact), (size, exact)
    float_gather = next(s for s in gathers if program.buffers[s.outputs[0]].dtype == "float32")
    kernel = kernels[float_gather.target]
    script = f"""
import json, torch
from aot.codegen.compile import load_function
fn = load_function({kernel.id!r}, {kernel.name!r}, {kernel.source!r})
x = torch.randn(2, 6, 5)
picks = torch.tensor([[0, 5, 6, -1, 2]]).repeat(2, 1)  # 6 and -1 are outside the dim
out = torch.zeros(2, 5, 3)
sizes = {{"batch": 2, "seq": 5}}
args = [eval(a, {{}}, sizes) for a in {[a.text for a in float_gather.args[3:]]!r}]
fn[tuple(eval(g, {{}}, sizes) for g in {list(float_gather.grid)!r})](x, picks, out, *args)
inside = torch.tensor([True, True, False, False, True])
want = torch.gather(x.transpose(1, 2), 2, picks.clamp(0, 5)[..., None].expand(-1, -1, 3))
print(json.dumps([bool(torch.equal(out[:, inside], want[:, inside])), bool(out[:, ~inside].isnan().all())]))
"""
    assert interpreted_json(script) == [True, True]


@pytest.mark.slow  # a transformers model built library-free, its kernels interpreted
def test_the_zoo_roberta_builds_library_free_and_its_kernels_match(tmp_path):
    """The zoo's RoBERTa: its positions a scan kernel, its token types a gather kernel, every
    kernel against its reference in the interpreter at one token and at a padded batch."""
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.packager import pack
    from aot.runtime import check
    from aot.tracer import trace
    from aot.verify.interpret import interpret_in_subprocess
    from tests.realmodels.zoo import ZOO

    compiled = generate(trace(ZOO["roberta"]()), ("sm_90",), gemm_candidates=True, library_free=True)
    kernels = {k.id: k.name for k in compiled.program.kernels}
    names = [kernels[s.target] for s in compiled.program.steps if s.kind == StepKind.KERNEL]
    assert "gather" in names and "cumsum" in names
    pack(compiled, tmp_path / "roberta.tpk")
    assert check(tmp_path / "roberta.tpk").entries  # the torch-free runtime takes it
    model = tmp_path / "roberta_model.py"
    model.write_text("from tests.realmodels.zoo import ZOO\nspec = ZOO['roberta']()\n")
    sizes = [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 13}]
    (results,) = interpret_in_subprocess([(tmp_path / "roberta.tpk", model, sizes, None)])
    for size, checks in results.items():
        assert {c.kernel for c in checks} == set(kernels), size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
