"""Sibling matmuls stacked into one GEMM (``codegen/sibling_matmuls.py``): which sites qualify, what
the rewritten program computes, and that the bundle matches eager at several sizes."""

from __future__ import annotations

import torch

from aot.loader import load
from aot.schema import StepKind
from aot.tracer import instantiate, load_model_file
from tests.codegen.conftest import PATTERNS


def _library_calls(program, target):
    return [s for s in program.steps if s.kind == StepKind.ATEN and s.target == target]


def test_siblings_become_one_matmul_and_their_weights_one_stacked_weight(pattern):
    traced, compiled, _, _, messages = pattern("siblings")
    before = traced.program
    after = compiled.program
    # every bias-free projection of x (q, k, v, gate, up, other) -> 1 mm, bq/bk -> 1 addmm; down (reads
    # another activation), shared (its weight is read twice) and the slice @ matmul stay
    assert len(_library_calls(before, "aten.mm.default")) == 9
    assert len(_library_calls(after, "aten.mm.default")) == 4
    assert len(_library_calls(before, "aten.addmm.default")) == 2
    assert len(_library_calls(after, "aten.addmm.default")) == 1
    names = {w.name for w in after.weights}
    assert {"q.weight.stacked6", "bq.weight.stacked2", "bq.weight.stacked2.bias"} <= names
    assert not {"q.weight", "k.weight", "v.weight", "gate.weight", "up.weight", "other.weight"} & names
    assert not {"bq.weight", "bk.weight", "bq.bias", "bk.bias"} & names
    assert "shared.weight" in names  # read by its matmul and by the slice of the second product
    stacked = next(w for w in after.weights if w.name == "q.weight.stacked6")
    assert stacked.spec.shape == (str(32 + 16 + 16 + 48 + 48 + 8), "32")
    assert any("stacked the weights of 2 groups" in m for m in messages)
    weights = compiled.traced.weights
    assert set(weights) == names  # the stacked weights replace their siblings, nothing is kept twice


def test_the_stacked_bundle_matches_eager(pattern):
    _, _, bundle, model, _ = pattern("siblings")
    spec = load_model_file(PATTERNS / "siblings.py")
    module = instantiate(spec).float()
    runner = load(bundle)
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 3, "seq": 37}, {"batch": 4, "seq": 40}):
        x = runner.inputs_at(sizes, seed=sizes["seq"])["x"]
        with torch.no_grad():
            expected = module(x.float())
        got = runner(x)
        for g, e in zip(got, expected, strict=True):
            # fp16 bundle vs fp32 eager: half rounding of inputs, weights and results
            torch.testing.assert_close(g.float(), e, atol=2e-2, rtol=2e-2)
