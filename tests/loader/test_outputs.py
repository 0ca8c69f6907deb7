"""Where results go: outputs the caller owns (default), borrowed outputs (``outputs="borrow"``),
and caller-provided buffers (``runner(..., out=...)``), on the CPU path. The CUDA-graph side of
the same contract is in tests/gpu/test_memory_gpu.py."""

from __future__ import annotations

import pytest
import torch

from aot.errors import GuardError
from aot.loader import load
from aot.pytree import leaves


def _structured_inputs(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.randn(batch, 4, generator=g), "mask": torch.randn(batch, generator=g)}


def _empty_like_tree(obj):
    """Fresh buffers shaped like a runner's output tree."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _empty_like_tree(v) for k, v in obj.items()}
    return type(obj)(_empty_like_tree(v) for v in obj)


@pytest.fixture(scope="module")
def structured(built):
    return load(built("structured"))


def test_out_buffers_receive_the_results_and_are_returned(structured):
    for batch in (1, 3, 8):
        inputs = _structured_inputs(batch, seed=batch)
        expected = structured(**inputs)
        out = _empty_like_tree({k: v for k, v in expected.items()})
        for t in leaves(out):
            t.fill_(float("nan"))
        got = structured(**inputs, out=out)
        assert got is out
        for e, o in zip(leaves(expected), leaves(out), strict=True):
            torch.testing.assert_close(o, e, rtol=0, atol=0)


def test_out_buffers_of_the_wrong_shape_dtype_or_structure_are_refused_before_running(structured):
    inputs = _structured_inputs(3)
    expected = structured(**inputs)
    good = _empty_like_tree(dict(expected))

    wrong_shape = _empty_like_tree(dict(expected))
    wrong_shape["hidden"] = torch.empty(4, 4)
    with pytest.raises(
        GuardError,
        match=r"out buffer 0 \(output .*\) is torch.float32 \[4, 4\] on cpu; "
        r"expected torch.float32 \[3, 4\]",
    ):
        structured(**inputs, out=wrong_shape)

    wrong_dtype = _empty_like_tree(dict(expected))
    wrong_dtype["hidden"] = torch.empty(3, 4, dtype=torch.float64)
    with pytest.raises(GuardError, match="expected torch.float32"):
        structured(**inputs, out=wrong_dtype)

    missing_key = dict(good)
    del missing_key["extra"]
    with pytest.raises(
        GuardError, match="not shaped like the model's output: .*expected a mapping with keys"
    ):
        structured(**inputs, out=missing_key)

    with pytest.raises(GuardError, match="not shaped like the model's output"):
        structured(**inputs, out=torch.empty(3, 4))

    strided = _empty_like_tree(dict(expected))
    strided["hidden"] = torch.empty(4, 3).t()
    with pytest.raises(GuardError, match="not contiguous"):
        structured(**inputs, out=strided)

    # nothing was written into the good buffers by the refused calls above
    marker = _empty_like_tree(dict(expected))
    for t in leaves(marker):
        t.fill_(7.0)
    wrong_shape = dict(marker)
    wrong_shape["extra"] = [torch.empty(2)]
    with pytest.raises(GuardError):
        structured(**inputs, out=wrong_shape)
    assert all(bool((t == 7.0).all()) for t in leaves(marker) if t.shape != (2,))


def test_out_buffers_may_not_share_memory_with_inputs_weights_or_each_other(structured):
    inputs = _structured_inputs(4)
    expected = structured(**inputs)

    shared = _empty_like_tree(dict(expected))
    block = torch.empty(8)
    shared["pair"] = {"low": block[:4], "high": block[2:6]}  # they overlap each other
    with pytest.raises(GuardError, match="shares memory with .* another out buffer"):
        structured(**inputs, out=shared)

    into_input = _empty_like_tree(dict(expected))
    into_input["hidden"] = inputs["features"]  # [4, 4] like the output: the caller's own input
    with pytest.raises(GuardError, match="shares memory with an input"):
        structured(**inputs, out=into_input)

    weight = next(w for w in structured.weights.values() if w.shape == (4, 4))
    into_weight = _empty_like_tree(dict(expected))
    into_weight["hidden"] = weight
    with pytest.raises(GuardError, match="shares memory with an input, a weight"):
        structured(**inputs, out=into_weight)
    # and the weight is unchanged: the call was refused before anything ran
    again = structured(**inputs)
    torch.testing.assert_close(again["hidden"], expected["hidden"], rtol=0, atol=0)


def test_out_works_for_a_bare_tensor_output(built):
    runner = load(built("small_mlp"))
    x = runner.inputs_at({}, seed=1)
    expected = runner(**x)
    assert isinstance(expected, torch.Tensor)
    buf = torch.empty_like(expected)
    assert runner(**x, out=buf) is buf
    torch.testing.assert_close(buf, expected, rtol=0, atol=0)
    with pytest.raises(GuardError, match="expected a tensor, got tuple"):
        runner(**x, out=(buf,))


def test_borrowed_outputs_on_the_cpu_path_equal_owned_ones_and_stay_valid(built):
    owned = load(built("structured"))
    borrowed = load(built("structured"), outputs="borrow")
    first_inputs, second_inputs = _structured_inputs(2, seed=1), _structured_inputs(2, seed=2)
    first = borrowed(**first_inputs)
    kept = [t.clone() for t in leaves(first)]
    borrowed(**second_inputs)
    # the CPU path has no graph memory to lend: each call's outputs are the caller's
    for a, b in zip(leaves(first), kept, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(leaves(owned(**first_inputs)), kept, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unknown_output_mode_is_refused(built):
    with pytest.raises(ValueError, match="outputs must be one of"):
        load(built("small_mlp"), outputs="lend")


def test_a_named_tuple_output_takes_its_buffers_by_key_or_by_position(structured):
    inputs = _structured_inputs(2)
    expected = structured(**inputs)
    out = _empty_like_tree(dict(expected))
    out["pair"] = (torch.empty(2), torch.empty(2))  # as the model's NamedTuple would hold them
    structured(**inputs, out=out)
    torch.testing.assert_close(out["pair"][0], expected["pair"].low, rtol=0, atol=0)
    torch.testing.assert_close(out["pair"][1], expected["pair"].high, rtol=0, atol=0)


def _aten(target: str, reads: list[str], out: str, *rest):
    from aot.schema import Buf, Step, StepKind

    return Step(
        kind=StepKind.ATEN,
        target=target,
        args=[Buf(r) for r in reads] + list(rest),
        kwargs={},
        outputs=(out,),
    )


def test_output_tail_is_the_outputs_last_computation_and_the_views_of_it():
    """The steps a graph leaves to run after each replay (``aot.loader.gpu.output_tail``): gpt's
    logits GEMM and the slice and view behind it, with the weight's permute before them kept in
    the graph; nothing when another computation comes after the output's, the output is an
    input's view, or what computes it is not a GEMM or a kernel."""
    from aot.loader.gpu import output_tail

    steps = (
        _aten("aten.native_layer_norm.default", ["x", "w", "b"], "ln"),
        _aten("aten.permute.default", ["wte"], "wt", [1, 0]),
        _aten("aten.view.default", ["ln"], "rows", [4, 8]),
        _aten("aten.mm.default", ["rows", "wt"], "mm_padded"),
        _aten("aten.slice.Tensor", ["mm_padded"], "mm", 1, 0, 50),
        _aten("aten.view.default", ["mm"], "logits", [1, 4, 50]),
    )
    assert output_tail(steps, ("logits",)) == 3
    assert output_tail(steps[:4], ("mm_padded",)) == 3
    # two outputs computed last: the tail starts at the first one's producer
    two = steps[:4] + (_aten("aten.mm.default", ["rows", "wt"], "again"),)
    assert output_tail(two, ("mm_padded", "again")) == 3
    # computed by an op that may return a view of its input (or anything but a GEMM or a kernel):
    # its result could be graph memory, so it stays in the graph and is copied out
    assert output_tail(steps[:4] + (_aten("aten.diagonal.default", ["mm_padded"], "d"),), ("d",)) is None
    assert output_tail(steps[:4] + (_aten("aten.relu.default", ["mm_padded"], "act"),), ("act",)) is None
    # an output computed by the first step: the tail would be the whole program
    assert output_tail(steps, ("logits", "ln")) is None
    # an unrelated computation after the producer: no tail
    late = steps + (_aten("aten.relu.default", ["ln"], "other"),)
    assert output_tail(late, ("logits",)) is None
    # an output that is a view of an input: nothing to compute after the graph
    assert output_tail(steps, ("logits", "xv")) is None
    assert output_tail((_aten("aten.view.default", ["x"], "xv", [8]),), ("xv",)) is None


RETURN_TYPES = """
import torch
from torch import nn
from aot import Dim, Input, ModelSpec


class Extremes(nn.Module):
    def forward(self, x):  # x: [B, 8]
        return x.max(dim=1), torch.topk(x, 3)


spec = ModelSpec(module=Extremes, inputs=[Input("x", (Dim("batch", 1, 4), 8))])
"""


def test_torch_return_types_come_back_as_tuples(tmp_path):
    """``x.max(dim)`` and ``topk`` return ``torch.return_types`` (struct sequences): the bundle
    gives each back as a tuple, so ``values, indices = out`` unpacks as eager's does, with eager's
    values and indices."""
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    (tmp_path / "extremes.py").write_text(RETURN_TYPES)
    spec = load_model_file(tmp_path / "extremes.py")
    pack(generate(trace(spec), ("sm_90",)), tmp_path / "extremes.tpk")
    runner = load(tmp_path / "extremes.tpk", device="cpu")
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    (values, indices), (top, where) = runner(x)
    want_max, want_top = x.max(dim=1), torch.topk(x, 3)
    assert type(runner(x)[0]) is tuple
    assert torch.equal(values, want_max.values) and torch.equal(indices, want_max.indices)
    assert torch.equal(top, want_top.values) and torch.equal(where, want_top.indices)
