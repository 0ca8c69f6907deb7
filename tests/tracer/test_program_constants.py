"""Programs of one model with tensors of their own: a model that makes a tensor in forward
(``torch.tensor(...)``) with other values in another branch of its sizes, here ``t > 4``, builds
two programs; each keeps the tensor it traced (the second under a name of its own) and the bundle
matches eager on the CPU at the minimum, the largest size of the general program, an odd size and
the maximum. Once every program of a model had to share all its weights, and such a model failed
with "uses other weights than the general one". Tolerance: exact (one multiply by a constant)."""

from __future__ import annotations

import pytest
import torch

MODEL = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, x):  # x: [B, T]
        if x.shape[1] > 4:
            return x * torch.tensor([3.0])
        return x * torch.tensor([2.0])

spec = ModelSpec(module=M, inputs=[Input("x", (Dim("batch", 1, 4), Dim("t", 1, 8)))])
"""


@pytest.mark.slow  # a trace of two programs and a build: about half a minute on two cores
def test_each_program_keeps_the_tensors_it_made_in_forward(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / "two.py"
    path.write_text(MODEL)
    spec = load_model_file(path)
    traced = trace(spec)
    assert [p.name for p in traced.programs][1:] == ["5 <= t <= 8"]
    # each program's tensor, its copy folded at build time (``aot.tracer.folding``): named by its bytes
    names = [sorted(w.name for w in p.program.weights) for p in traced.programs]
    assert [len(n) for n in names] == [1, 1] and names[0] != names[1], names
    assert [traced.weights[n].tolist() for (n,) in names] == [[2.0], [3.0]]
    pack(generate(traced, ("sm_90",)), tmp_path / "two.tpk")
    runner, module = load(tmp_path / "two.tpk"), spec.module()
    for b, t in [(1, 1), (2, 4), (3, 5), (4, 8)]:
        x = torch.randn(b, t)
        torch.testing.assert_close(runner(x), module(x), rtol=0, atol=0)


def test_weights_that_still_differ_are_named():
    """What the build error lists when programs disagree on a parameter or buffer."""
    from aot.tracer.trace import _weight_differences

    general = {"w": torch.ones(2), "b": torch.zeros(2), "c": torch.zeros(1)}
    assert _weight_differences(general, dict(general)) == ""
    assert _weight_differences(general, {"w": torch.ones(2)}, partial=True) == ""
    other = {"w": torch.ones(3), "b": torch.ones(2), "d": torch.zeros(1)}
    assert _weight_differences(general, other) == (
        "c only in the general program, d only in this one, b with other values and 1 more"
    )
    assert _weight_differences(general, other, frozenset({"b", "c", "d"})) == "w of shape [3], not [2]"
