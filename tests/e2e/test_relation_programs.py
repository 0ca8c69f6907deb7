"""Relations among sizes that exclude declared sizes: a program of its own where the model traces
there, a build warning and a listed relation where it does not.

``tests/data/native_grid.py`` uses its position embedding as it is at its native 4x4 patch grid
and resizes it elsewhere, as DINOv2 does: the general trace keeps ``(width//4)*(height//4) != 16``;
the build traces ``height == width`` and ``height != width`` over 16..19 (the sizes of that grid)
beside it, and every declared size matches eager. ``tests/data/refused_area.py`` raises
on more than 256 pixels: the build warns naming the line and the sizes it refuses, the guard text
lists the relation with a note, and a call there is a GuardError.

Tolerance (float32): the CPU path runs eager's ATen ops, so outputs agree to 1e-5 absolute."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aot import Dim
from aot.errors import GuardError
from aot.loader import load
from aot.manifest_text import canonical, parse_guards_text, render_manifest
from aot.pytree import leaves
from aot.tracer import call_model, example_inputs, export_programs, instantiate, load_model_file
from aot.tracer.trace import guard_manifest
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


def test_the_native_grid_gets_programs_of_its_own_and_every_declared_size_matches_eager(built):
    spec = load_model_file(model_path("native_grid"))
    runner = load(built("native_grid", ("sm_90",)), device="cpu")
    assert runner.programs == (
        "general",
        "16 <= height <= 19, 16 <= width <= 19; height == width",
        "16 <= height <= 19, 16 <= width <= 19; height != width",
    )
    module = instantiate(spec)
    for sizes in (
        {"batch": 1, "height": 16, "width": 16},  # the native grid: the embedding as it is
        {"batch": 2, "height": 19, "width": 19},
        {"batch": 2, "height": 16, "width": 19},  # a 4x4 grid, not square: resized
        {"batch": 1, "height": 8, "width": 8},
        {"batch": 2, "height": 23, "width": 9},
        {"batch": 2, "height": 24, "width": 24},
    ):
        _compare(spec, module, runner, sizes)
    text = runner.guards_text()
    assert "\nrelation " not in text, text  # the programs together admit every declared size
    assert "program general  admits  1 <= batch <= 2; 8 <= height <= 24; 8 <= width <= 24; " in text, text
    assert parse_guards_text(render_manifest(parse_guards_text(text))) == canonical(parse_guards_text(text))


def test_the_general_trace_alone_refuses_the_native_grid():
    spec = load_model_file(model_path("native_grid"))
    general = export_programs(spec)[0]
    (relation,) = general.guards.relations
    assert relation.expr == "(width//4)*(height//4) != 16"
    assert (relation.source.file, relation.source.line) == ("tests/data/native_grid.py", 21)


def test_a_relation_no_trace_covers_is_a_build_warning_listed_in_the_guards(built):
    spec = load_model_file(model_path("refused_area"))
    said: list[str] = []
    export_programs(spec, progress=said.append)
    (warning,) = [s for s in said if "warning" in s]
    assert warning.startswith(
        "  warning: the bundle refuses declared sizes height 9..32, width 29..32; height 10..32, width 26..28; "
    ), warning
    assert (
        "and 183 more of 434 combinations of height, width (height*width <= 256 at tests/data/refused_area.py:11: "
        "if image.shape[1] * image.shape[2] > 256:): the model does not trace there: " in warning
    ), warning
    text = render_manifest(guard_manifest(spec, ("sm_90",)))
    assert (
        "relation height*width <= 256  at tests/data/refused_area.py:11  if image.shape[1] * image.shape[2] > 256:\n"
        "# relation height*width <= 256 refuses 434 of 841 combinations of height, width that the symbols admit, "
        "e.g. height=9, width=29; height=9, width=30; height=9, width=31; ...\n"
    ) in text, text
    runner = load(built("refused_area", ("sm_90",)), device="cpu")
    assert render_manifest(parse_guards_text(runner.guards_text()), notes=False) == render_manifest(
        parse_guards_text(text), notes=False
    )
    assert "refuses 434 of 841 combinations" in runner.guards_text()
    runner(image=torch.zeros(2, 16, 16))
    with pytest.raises(GuardError) as e:
        runner(image=torch.zeros(1, 16, 17))
    assert str(e.value) == (
        "inputs violate height*width <= 256 with batch=1, height=16, width=17 (guard from "
        "tests/data/refused_area.py:11: if image.shape[1] * image.shape[2] > 256:)"
    )


def test_aotpack_guards_traces_the_same_programs_as_the_build(built):
    spec = load_model_file(model_path("native_grid"))
    runner = load(built("native_grid", ("sm_90",)), device="cpu")
    text = render_manifest(guard_manifest(spec, ("sm_90",)), notes=False)
    assert text == render_manifest(parse_guards_text(runner.guards_text()), notes=False)


def test_a_relation_over_too_many_combinations_to_check_is_a_warning():
    spec = load_model_file(model_path("refused_area"))
    image = spec.inputs[0]
    wide = Dim("batch", 1, 4096)  # 4096 * 29 * 29 combinations: more than the build enumerates
    spec = dataclasses.replace(spec, inputs=[dataclasses.replace(image, shape=(wide, *image.shape[1:]))])
    said: list[str] = []
    (general,) = export_programs(spec, progress=said.append)
    assert [s for s in said if "warning" in s] == [
        "  warning: relation(s) height*width <= 256 at tests/data/refused_area.py:11: if image.shape[1] * "
        "image.shape[2] > 256: may exclude declared sizes; the build does not check which (more than 2097152 "
        "combinations of sizes): a call they exclude is refused with a GuardError"
    ]
