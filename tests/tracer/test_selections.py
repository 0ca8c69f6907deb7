"""Selections whose size depends on tensor values (``torch.nonzero``, ``masked_select``,
``x[mask]``): the build refuses each at its model line with the op, its bound in Dims and at the
declared maximum, the lines that use its result, and two ways to build the rest. The fixed-size
form it proposes (the first N selected rows and their count) builds and equals eager exactly on
the CPU (it is gathers and scatters of the inputs: no rounding)."""

from __future__ import annotations

import pytest
import torch

from aot.errors import TraceError
from aot.pytree import leaves
from aot.tracer import call_model, example_inputs, instantiate, trace
from tests.data import selections

HERE = "tests/data/selections.py"


def _refusal(module) -> str:
    with pytest.raises(TraceError) as e:
        trace(selections.spec(module))
    return str(e.value)


def _line(text: str) -> int:
    return next(k for k, ln in enumerate(open(selections.__file__).read().splitlines(), 1) if text in ln)


def test_nonzero_is_refused_with_its_bound_and_the_lines_that_use_it():
    msg = _refusal(selections.Nonzero)
    at, uses = _line("torch.nonzero(x > 0)"), _line("return idx * 2")
    assert (
        f"selections.py:{at}: idx = torch.nonzero(x > 0): torch.nonzero returns one row per nonzero element, "
        in msg
    )
    assert "so its size (u0, at most 8*batch, 32 at the declared maximum) depends on tensor values" in msg, (
        msg
    )
    assert (
        "move this line and what uses its result (" in msg
        and f"selections.py:{uses}) out of the bundle" in msg
    )
    assert "or keep the size fixed: torch.where(mask, x, fill) over the whole tensor" in msg, msg


def test_masked_select_is_refused_as_a_selection_not_as_an_unlisted_op():
    msg = _refusal(selections.MaskedSelect)
    assert "masked_select returns one element per True value of its mask" in msg, msg
    assert "(u0, at most 8*batch, 32 at the declared maximum)" in msg, msg
    assert "aot/allowed_ops.py" not in msg, msg


def test_a_boolean_mask_index_is_refused_with_the_mask_length_as_its_bound():
    msg = _refusal(selections.BooleanMask)
    at, uses = _line("rows = x[keep]"), _line("return rows * 3 + 1")
    assert (
        f"selections.py:{at}: rows = x[keep]: indexing with a boolean mask returns one row per True " in msg
    )
    assert "(u0, at most n, 16 at the declared maximum)" in msg, msg
    assert f"selections.py:{uses})" in msg, msg


def test_the_proposed_fixed_size_form_builds_and_equals_eager(tmp_path):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack

    spec = selections.spec(selections.FirstRows)
    module = instantiate(spec)
    pack(generate(trace(spec), ("sm_90",)), tmp_path / "first_rows.tpk")
    runner = load(tmp_path / "first_rows.tpk", device="cpu")
    for n in (1, 5, 16):  # no row kept to more than N kept at the largest
        inputs = example_inputs(spec, {"n": n}, seed=n)
        with torch.no_grad():
            want = leaves(call_model(spec, module, inputs))
        got = leaves(runner(**inputs))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), n
        kept = inputs["x"][inputs["scores"] > 0.5][: selections.N] * 3 + 1
        assert torch.equal(got[0][: len(kept)], kept)
