"""Dynamic image sizes: a windowed model declared ``Dim(..., multiple_of=8)`` builds one program
over the multiples and matches eager; other sizes are refused with a GuardError that names the
multiple; a build without the declaration fails with the multiple to declare and the model lines;
the manifest, its parser and ``aotpack diff`` carry the declared multiple. A float computed from
sizes (a position embedding's interpolation scale) is stored and evaluated per call.

Tolerance (float32): the CPU path runs eager's ATen ops, so outputs agree to 1e-5 absolute."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aot import Dim
from aot.errors import GuardError, TraceError
from aot.loader import load
from aot.manifest_text import canonical, parse_guards_text, render_manifest
from aot.pytree import leaves
from aot.review.manifest_changes import diff_manifests
from aot.tracer import call_model, example_inputs, instantiate, load_model_file, trace
from tests.conftest import model_path

ATOL = 1e-5


def _compare(spec, module, runner, sizes: dict[str, int]) -> None:
    inputs = example_inputs(spec, sizes, seed=sum(sizes.values()))
    with torch.no_grad():
        want = leaves(call_model(spec, module, inputs))
    got = leaves(runner(**inputs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, sizes
        assert (g - w).abs().max().item() <= ATOL, f"at {sizes}"


def test_a_declared_multiple_gives_one_program_that_matches_eager_and_refuses_other_sizes(built):
    spec = load_model_file(model_path("windows"))
    runner = load(built("windows", ("sm_90",)), device="cpu")
    assert runner.programs == ("general",)
    module = instantiate(spec)
    for sizes in (
        {"batch": 1, "height": 8, "width": 8},  # the minimum
        {"batch": 2, "height": 24, "width": 16},
        {"batch": 1, "height": 40, "width": 40},  # the maximum
    ):
        _compare(spec, module, runner, sizes)
    image = torch.zeros(1, 3, 20, 16)
    with pytest.raises(GuardError) as e:
        runner(image=image)
    assert str(e.value) == (
        "input 'image' dim 2 (height): expected a multiple of 8, got 20: the model file declares "
        "Dim('height', ..., multiple_of=8) (the model's windows or strides need it); pad or resize the input "
        "to 16 or 24"
    )
    text = runner.guards_text()
    assert "symbol height: 8 <= height <= 40, height % 8 == 0  (declared 8..40 multiple_of 8)" in text, text
    assert "  guard height % 8 == 0  at tests/data/windows.py:36  height = Dim(" in text, text
    # the model's own `h % 4` guards hold at every multiple of 8: none is listed
    assert "windows.py:24" not in text, text
    parsed = parse_guards_text(text)
    assert {g.name: g.declared_multiple for g in parsed.guards.symbols} == {
        "batch": 0,
        "height": 8,
        "width": 8,
    }
    assert parse_guards_text(render_manifest(parsed)) == canonical(parsed)


def test_a_size_the_model_needs_a_multiple_of_fails_the_build_with_the_multiple_and_lines():
    spec = load_model_file(model_path("windows"))
    plain = [
        dataclasses.replace(
            i, shape=tuple(Dim(s.name, s.min, s.max) if isinstance(s, Dim) else s for s in i.shape)
        )
        for i in spec.inputs
    ]
    with pytest.raises(TraceError) as e:
        trace(dataclasses.replace(spec, inputs=plain))
    msg = str(e.value)
    assert "cannot cover every declared size" in msg, msg
    assert (
        "the model needs height to be a multiple of 8: declare Dim('height', 8, 40, multiple_of=8) and pad or "
        "resize inputs to a multiple of 8 (the loader refuses other sizes with a GuardError that names it)"
    ) in msg, msg
    assert "tests/data/windows.py:24: if h % WINDOW != 0 or w % WINDOW != 0:" in msg, msg


def test_diff_names_a_declared_multiple_as_a_narrowing(built):
    new = parse_guards_text(load(built("windows", ("sm_90",)), device="cpu").guards_text())
    old = dataclasses.replace(
        new,
        guards=dataclasses.replace(
            new.guards,
            symbols=tuple(
                dataclasses.replace(g, modulus=1, residues=(0,), declared_multiple=0, sources=())
                for g in new.guards.symbols
            ),
        ),
    )
    changes = diff_manifests(old, new)
    (height,) = [c for c in changes if c.subject == "symbol height" and c.kind == "narrowed"]
    assert height.breaking and "declared 8..40 -> 8..40 multiple_of 8" in height.details, height
    (line,) = [c for c in changes if c.subject == "symbol height" and c.kind == "new guard"]
    assert "multiple_of=8" in line.new, line


def test_a_float_computed_from_sizes_is_stored_and_evaluated_per_call(built):
    from aot.schema import SymFloat

    spec = load_model_file(model_path("pos_interp"))
    runner = load(built("pos_interp", ("sm_90",)), device="cpu")
    floats = [
        a
        for step in built.traced("pos_interp").program.steps
        for a in [*step.args, *step.kwargs.values()]
        if isinstance(a, SymFloat)
    ]
    assert floats and all("/" in f.text for f in floats), floats
    module = instantiate(spec)
    for sizes in (
        {"batch": 1, "height": 4, "width": 4},
        {"batch": 2, "height": 13, "width": 27},
        {"batch": 2, "height": 40, "width": 40},
    ):
        _compare(spec, module, runner, sizes)


def test_a_multiple_of_must_fit_the_declared_range():
    from aot.errors import SpecError

    with pytest.raises(SpecError) as e:
        Dim("height", 12, 60, multiple_of=8)
    assert str(e.value) == (
        "Dim 'height': multiple_of=8, but min=12, max=60 are no multiples of 8; declare min=16, max=56"
    )
    with pytest.raises(SpecError, match=r"buckets \[12\] are no multiples of 8"):
        Dim("height", 8, 64, multiple_of=8, buckets=(8, 12))
    with pytest.raises(SpecError, match="multiple_of must be an int in 1..64"):
        Dim("height", 8, 64, multiple_of=0)
    d = Dim("height", 8, 64, multiple_of=8)
    assert d.example_size == 16 and d.default_buckets() == (8, 16, 32, 64)
