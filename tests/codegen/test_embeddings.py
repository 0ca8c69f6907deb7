"""Embedding lookups without ATen kernels (``aot.codegen.embeddings``): learned positions read as
a slice of their table, token lookups as a Triton gather checked in the interpreter (exact: a row
copy), an id outside the table a NaN row, and the CPU path unchanged against eager."""

from __future__ import annotations

from pathlib import Path

import torch

from aot.schema import StepKind
from tests.codegen.conftest import interpreted_json

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 24)
        self.pos = nn.Embedding(32, 24)
        self.norm = nn.LayerNorm(24)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.norm(self.tok(idx) + self.pos(pos))

batch = Dim("batch", 1, 4)
seq = Dim("seq", 1, {max_seq})
spec = ModelSpec(module=M, inputs=[Input("idx", (batch, seq), dtype="int64", low=0, high=50)])
"""


def _build(tmp_path: Path, max_seq: int):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / f"emb{max_seq}.py"
    path.write_text(MODEL.format(max_seq=max_seq))
    compiled = generate(trace(load_model_file(path)), ("sm_90",))
    pack(compiled, tmp_path / f"emb{max_seq}.tpk")
    return compiled, tmp_path / f"emb{max_seq}.tpk", path


def _targets(program):
    return [s.target for s in program.steps if s.kind == StepKind.ATEN]


def test_positions_become_a_slice_and_tokens_a_gather_kernel(tmp_path):
    from aot.loader import load

    compiled, bundle, path = _build(tmp_path, 32)
    program = compiled.program
    targets = _targets(program)
    assert "aten.embedding.default" not in targets and not any(t.startswith("aten.arange") for t in targets)
    kernels = {k.id: k for k in program.kernels}
    (gather,) = [
        s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "gather_rows"
    ]
    assert [r.target for r in gather.reference] == ["aten.embedding.default"]
    assert gather.args[0].name == "tok.weight"
    # the position table is read by the next kernel in place: no step makes a copy of its rows
    readers = [s for s in program.steps if any(getattr(a, "name", None) == "pos.weight" for a in s.args)]
    assert readers and all(s.kind == StepKind.KERNEL for s in readers)
    # the CPU path runs the lookups as ATen does, and agrees with eager
    runner = load(bundle)
    idx = torch.randint(0, 50, (3, 17))
    torch.testing.assert_close(runner(idx), spec_module(compiled, path)(idx), rtol=1e-5, atol=1e-5)


def spec_module(compiled, path):
    """The model file's module with the bundle's weights (the build's seeded ones)."""
    from aot.tracer import load_model_file

    module = load_model_file(path).module()
    state = {k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()}
    module.load_state_dict(state)
    return module.eval()


def test_positions_past_the_table_keep_their_lookup(tmp_path):
    """``seq`` may reach 64 with a 32-row table: a slice would come back short where the lookup
    raises, so the position lookup stays a lookup (a gather kernel on the arange's ids)."""
    compiled, _, _ = _build(tmp_path, 64)
    program = compiled.program
    assert any(t.startswith("aten.arange") for t in _targets(program))
    kernels = {k.id: k for k in program.kernels}
    gathers = [
        s for s in program.steps if s.kind == StepKind.KERNEL and kernels[s.target].name == "gather_rows"
    ]
    assert sorted(s.args[0].name for s in gathers) == ["pos.weight", "tok.weight"]


def test_gather_kernel_matches_the_lookup_and_marks_ids_outside_the_table(tmp_path):
    """In the interpreter: every kernel of the model against its reference at two sizes (the
    gather exactly), then the gather alone on ids -1 and 50 of a 50-row table: NaN rows, the
    rows of valid ids untouched."""
    from aot.verify.interpret import interpret_in_subprocess

    compiled, bundle, path = _build(tmp_path, 32)
    (results,) = interpret_in_subprocess(
        [(bundle, path, [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 29}], None)]
    )
    for size, checks in results.items():
        gathers = [c for c in checks if c.name == "gather_rows"]
        assert gathers and all(c.max_abs_error == 0.0 for c in gathers), size
        assert all(c.ok for c in checks), (size, [c for c in checks if not c.ok])
    kernel = next(k for k in compiled.program.kernels if k.name == "gather_rows")
    script = f"""
import json, torch
from aot.codegen.compile import load_function
fn = load_function({kernel.id!r}, {kernel.name!r}, {kernel.source!r})
w = torch.randn(50, 24)
ids = torch.tensor([3, -1, 50, 49])
out = torch.zeros(4, 24)
fn[(4, 1)](w, ids, out)
print(json.dumps([bool(torch.equal(out[0], w[3])), bool(out[1].isnan().all()), bool(out[2].isnan().all()), bool(torch.equal(out[3], w[49]))]))
"""
    assert interpreted_json(script) == [True, True, True, True]


HF_POSITIONS = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 24)
        self.pos = nn.Embedding(40, 24)

    def forward(self, idx):  # positions as transformers makes them: (arange + past).unsqueeze(0)
        pos = (torch.arange(idx.shape[1], device=idx.device) + {past}).unsqueeze(0)
        return self.tok(idx) + self.pos(pos)

batch = Dim("batch", 1, 4)
seq = Dim("seq", 1, 32)
spec = ModelSpec(module=M, inputs=[Input("idx", (batch, seq), dtype="int64", low=0, high=50)])
"""


def test_positions_made_as_transformers_makes_them_become_a_slice(tmp_path):
    """``(arange(T) + past).unsqueeze(0)`` with ``past`` 0 and 8: a slice of rows past..past+T
    viewed to [1, T, D], nothing left of the arange, the add or the unsqueeze; the CPU path as
    eager's."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    for past in (0, 8):
        path = tmp_path / f"hf{past}.py"
        path.write_text(HF_POSITIONS.format(past=past))
        compiled = generate(trace(load_model_file(path)), ("sm_90",))
        program = compiled.program
        targets = _targets(program)
        assert "aten.embedding.default" not in targets and "aten.add.Tensor" not in targets, targets
        assert not any(t.startswith("aten.arange") for t in targets), targets
        # the slice is a view: the kernel after it reads the table's rows in place
        (table_slice,) = [
            r for s in program.steps for r in (s.reference or (s,)) if r.target == "aten.slice.Tensor"
        ]
        assert table_slice.args[0].name == "pos.weight" and table_slice.args[2] == past
        pack(compiled, tmp_path / f"hf{past}.tpk")
        idx = torch.randint(0, 50, (2, 23))
        got = load(tmp_path / f"hf{past}.tpk")(idx)
        torch.testing.assert_close(got, spec_module(compiled, path)(idx), rtol=1e-5, atol=1e-5)
