"""The runtime's activation arena (``aot.runtime.plan.ArenaLayout``) and the views it places
(``aot.program.aliases``), on hand-made programs: buffers alive at once never share bytes, dead
ones do, views sit at their base's address, and a slice of the last dim is rows apart."""

from __future__ import annotations

from aot.codegen.library_free import library_free
from aot.program import aliases, lifetimes, live_steps
from aot.runtime.plan import ALIGN, ArenaLayout
from aot.schema import Bucket, Buf, Program, Step, StepKind, Sym, TensorSpec
from tests.verify.test_library_free import _program


def test_buffers_alive_together_never_share_bytes_and_dead_ones_do():
    program = library_free(_program(), (Bucket("batch", (1, 8, 16)),))
    steps = live_steps(program)
    layout = ArenaLayout(program, steps, {"batch": 8}, {"w1", "w2"})
    spans = {
        name: (born, last)
        for name, born, last in lifetimes(program.__class__(**{**program.__dict__, "steps": steps}))
    }
    spans["x"] = (-1, len(steps))
    placed = {n: (layout.offsets[n], layout.offsets[n] + layout.nbytes[n]) for n in layout.offsets}
    assert set(placed) == {"x", "h", "a", "y"} and all(o % ALIGN == 0 for o, _ in placed.values())
    for a in placed:
        for b in placed:
            alive_together = a != b and not (spans[a][1] < spans[b][0] or spans[b][1] < spans[a][0])
            if alive_together:
                assert placed[a][1] <= placed[b][0] or placed[b][1] <= placed[a][0], (a, b)
    assert layout.nbytes == {"x": 8 * 8 * 2, "h": 8 * 16 * 2, "a": 8 * 16 * 2, "y": 8 * 4 * 2}
    # h (dead after a is made) and y share: the arena is smaller than every buffer side by side
    assert layout.offsets["y"] == layout.offsets["h"] and layout.size == 3 * ALIGN


def _viewing(*steps: Step, out: tuple[str, ...] = ("2", "n/2", "50")) -> Program:
    f16 = lambda *shape: TensorSpec("float16", shape)  # noqa: E731
    return Program(
        inputs=(),
        weights=(),
        steps=steps,
        outputs=("out",),
        symbols=(),
        buffers={
            "padded": f16("n", "64"),
            "rows": f16("n", "50"),
            "out": f16(*out),
            "flat": f16("n*64"),
        },
    )


def test_views_alias_their_base_and_a_last_dim_slice_is_rows_apart():
    view = lambda src, out, shape: Step(StepKind.ATEN, "aten.view.default", (Buf(src), shape), {}, (out,))  # noqa: E731
    cut = Step(StepKind.ATEN, "aten.slice.Tensor", (Buf("padded"), 1, 2, 52), {}, ("rows",))
    program = _viewing(cut, view("rows", "out", [2, Sym("n/2"), 50]), view("padded", "flat", [Sym("n*64")]))
    got = aliases(program, program.steps)
    assert got["rows"].__dict__ == {"base": "padded", "offset": 2, "width": 50, "pitch": 64}
    assert got["out"] == got["rows"]  # rows stay rows: only the leading dims changed
    assert got["flat"].__dict__ == {"base": "padded", "offset": 0, "width": 0, "pitch": 0}
    bad = _viewing(cut, view("rows", "out", [Sym("n*50")]), out=("n*50",))  # would merge rows that are apart
    assert "out" not in aliases(bad, bad.steps)


def test_a_whole_slice_and_a_select_of_one_element_sit_at_their_base():
    """``logits[:, -1]`` of ``[B, 1, V]`` after ``x[0:]`` (transformers' causal-LM output): both
    views keep every element in place; a slice of the first dim that starts later is one run of
    elements further on; a select of a longer dim is no such view."""
    f16 = lambda *shape: TensorSpec("float16", shape)  # noqa: E731
    big = 9223372036854775807
    steps = (
        Step(StepKind.ATEN, "aten.slice.Tensor", (Buf("logits"), 0, 0, big), {}, ("whole",)),
        Step(StepKind.ATEN, "aten.select.int", (Buf("whole"), 1, -1), {}, ("last",)),
        Step(StepKind.ATEN, "aten.slice.Tensor", (Buf("logits"), 0, 1, big), {}, ("later",)),
        Step(StepKind.ATEN, "aten.select.int", (Buf("wide"), 1, -1), {}, ("picked",)),
    )
    program = Program(
        inputs=(),
        weights=(),
        steps=steps,
        outputs=("last",),
        symbols=(),
        buffers={
            "logits": f16("b", "1", "96"),
            "whole": f16("b", "1", "96"),
            "last": f16("b", "96"),
            "later": f16("b - 1", "1", "96"),
            "wide": f16("b", "3", "96"),
            "picked": f16("b", "96"),
        },
    )
    got = aliases(program, program.steps)
    assert got["whole"].__dict__ == {"base": "logits", "offset": 0, "width": 0, "pitch": 0}
    assert got["last"] == got["whole"]
    assert got["later"].__dict__ == {"base": "logits", "offset": 96, "width": 0, "pitch": 0}
    assert "picked" not in got


def test_a_slice_after_dims_of_one_element_is_one_run_at_its_start():
    """``position_ids[:, :seq]`` of ``[1, P]`` (BERT's positions, a slice to a size) reads the
    first ``seq`` elements in place; ``[:, 3:seq]`` from element 3; the same slice of ``[2, P]``
    takes rows apart, and with a symbolic end no 2-D copy reads it: no view."""
    i64 = lambda *shape: TensorSpec("int64", shape)  # noqa: E731

    def cut(src: str, out: str, start: int) -> Step:
        return Step(StepKind.ATEN, "aten.slice.Tensor", (Buf(src), 1, start, Sym("seq")), {}, (out,))

    program = Program(
        inputs=(),
        weights=(),
        steps=(cut("one", "first", 0), cut("one", "later", 3), cut("two", "apart", 0)),
        outputs=("first",),
        symbols=(),
        buffers={
            "one": i64("1", "64"),
            "two": i64("2", "64"),
            "first": i64("1", "seq"),
            "later": i64("1", "seq - 3"),
            "apart": i64("2", "seq"),
        },
    )
    got = aliases(program, program.steps)
    assert got["first"].__dict__ == {"base": "one", "offset": 0, "width": 0, "pitch": 0}
    assert got["later"].__dict__ == {"base": "one", "offset": 3, "width": 0, "pitch": 0}
    assert "apart" not in got
