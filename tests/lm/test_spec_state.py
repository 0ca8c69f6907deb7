"""The model-file API for stateful bundles: ``Input(state=True)``, ``EntryPoint``, ``ModelSpec.entry_points``."""

import pytest

from aot import Dim, EntryPoint, Input, ModelSpec, SpecError

batch, seq = Dim("batch", 1, 4), Dim("seq", 1, 16)


def _spec(**kw):
    inputs = kw.pop(
        "inputs",
        [
            Input("input_ids", (batch, seq), dtype="int64", low=0, high=10),
            Input("cache", (batch, 2, 16, 8), state=True),
        ],
    )
    return ModelSpec(module=object, inputs=inputs, **kw)


def test_state_inputs_and_entry_points_are_kept():
    spec = _spec(entry_points=[EntryPoint("prefill"), EntryPoint("decode", {"seq": 1})])
    assert [i.name for i in spec.state_inputs()] == ["cache"]
    assert spec.entry_points == (EntryPoint("prefill", {}), EntryPoint("decode", {"seq": 1}))
    assert hash(spec.entry_points[1]) == hash(EntryPoint("decode", {"seq": 1}))


def test_state_may_be_dynamic_only_in_its_first_dim():
    with pytest.raises(SpecError, match=r"only its first dim \(the batch\) may be a Dim, got a Dim at dim 2"):
        Input("cache", (batch, 2, seq, 8), state=True)
    with pytest.raises(SpecError, match="scalar"):
        Input("cache", (), state=True)


def test_state_batch_must_be_a_callers_dim():
    other = Dim("rows", 1, 4)
    with pytest.raises(SpecError, match="no dim of a caller's input"):
        _spec(inputs=[Input("x", (batch, seq)), Input("cache", (other, 2), state=True)])
    with pytest.raises(SpecError, match="every Input is state"):
        _spec(inputs=[Input("cache", (batch, 2), state=True)])


@pytest.mark.parametrize(
    "entry_points, message",
    [
        ([EntryPoint("a"), EntryPoint("a")], "two entry points are named 'a'"),
        (
            [EntryPoint("d", {"tokens": 1})],
            r"fixes 'tokens', which is no Dim of the inputs \['batch', 'seq'\]",
        ),
        ([EntryPoint("d", {"seq": 17})], r"fixes seq = 17, outside Dim 'seq''s range 1..16"),
        ([EntryPoint("d", {"batch": 1})], "the batch dim of the state"),
        (["decode"], "must be EntryPoint objects"),
    ],
)
def test_bad_entry_points_are_spec_errors(entry_points, message):
    with pytest.raises(SpecError, match=message):
        _spec(entry_points=entry_points)


@pytest.mark.parametrize(
    "args, message",
    [
        (("de code",), "not an identifier"),
        (("decode", {"seq": "1"}), "must map Dim names to ints"),
        (("decode", {"seq": True}), "must map Dim names to ints"),
        (("decode", [("seq", 1)]), "must be a dict"),
    ],
)
def test_bad_entry_point_is_a_spec_error(args, message):
    with pytest.raises(SpecError, match=message):
        EntryPoint(*args)
