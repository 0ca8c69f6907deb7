"""A tensor made with ``empty`` and filled slice by slice (``aot.tracer.filled``): where the slices
of one dim cover it from 0 to its size, each element once, the program holds their
concatenation and no ``empty`` (DeepSeek-V3's attention builds its keys so), in whatever order
the slices are written, and the bundle
equals eager on the CPU exactly at the smallest, an odd and the largest batch; where a slice is
left unwritten, two overlap, or the empty tensor is read, the build refuses ``empty`` with the
model's line, as before. Tolerance: exact (copies and concatenations only)."""

from __future__ import annotations

import pytest
import torch

HEAD = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec

class M(nn.Module):
    def forward(self, a, b):  # a: [B, 3, 4], b: [B, 3, 2] -> [B, 3, 6]
        out = a.new_empty(a.shape[0], 3, 6)
"""
TAIL = """
spec = ModelSpec(module=M, inputs=[Input("a", (Dim("batch", 1, 5), 3, 4)), Input("b", (Dim("batch", 1, 5), 3, 2))])
"""
FILLS = {
    # in order, the second piece to the end (``out[..., 4:]``), the first a computed value
    "covered": "        out[..., :4] = a * 2\n        out[..., 4:] = b\n        return out + 1\n",
    # the pieces written last first: still each element once
    "backwards": "        out[..., 4:] = b\n        out[..., :4] = a\n        return out\n",
    "gap": "        out[..., :3] = a[..., :3]\n        out[..., 4:] = b\n        return out\n",
    "overlap": "        out[..., :4] = a\n        out[..., 3:5] = b\n        out[..., 5:] = b[..., :1]\n        return out\n",
    "read": "        kept = out.sum()\n        out[..., :4] = a\n        out[..., 4:] = b\n        return out + kept\n",
}


def _build(tmp_path, name: str):
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + FILLS[name] + TAIL)
    spec = load_model_file(path)
    traced = trace(spec)
    pack(generate(traced, ("sm_90",)), tmp_path / f"{name}.tpk")
    return spec, traced, tmp_path / f"{name}.tpk"


@pytest.mark.parametrize("name", ["covered", "backwards"])
def test_an_empty_tensor_filled_slice_by_slice_is_the_concatenation_of_its_pieces(tmp_path, name):
    from aot.loader import load

    spec, traced, path = _build(tmp_path, name)
    targets = [s.target for s in traced.program.steps]
    assert "aten.empty.memory_format" not in targets and "aten.cat.default" in targets
    runner, module = load(path), spec.module()
    for batch in (1, 3, 5):
        a, b = torch.randn(batch, 3, 4), torch.randn(batch, 3, 2)
        torch.testing.assert_close(runner(a, b), module(a, b), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gap", "overlap", "read"])
def test_other_fills_keep_empty_and_are_refused(tmp_path, name):
    from aot.errors import TraceError

    with pytest.raises(
        TraceError, match=r"the model calls aten\.empty\.memory_format, which a bundle may not run"
    ):
        _build(tmp_path, name)


def test_the_pass_leaves_a_graph_without_the_pattern_alone():
    from aot.tracer.filled import cat_filled_empties

    class M(torch.nn.Module):
        def forward(self, x):
            y = x.new_empty(2, 3)
            y.copy_(x)  # a whole copy, not slices: not this pass's pattern
            return y

    ep = torch.export.export(M(), (torch.randn(2, 3),)).run_decompositions()
    before = [str(n.target) for n in ep.graph.nodes]
    assert cat_filled_empties(ep.graph) == 0
    assert [str(n.target) for n in ep.graph.nodes] == before
