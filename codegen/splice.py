"""What the rewrites that make lookups and indexes views share
(``embeddings.positions_as_slices``, ``index_views.indexes_as_views``): ``consecutive_positions``
follows the steps that make ids or indices back to an ``arange`` of consecutive positions, and
``spliced`` puts a rewrite's steps in place of the steps they replace and drops the chains that
made the positions or indices where nothing reads them any more."""

from __future__ import annotations

from dataclasses import replace

from aot.codegen import index as ix
from aot.program import step_reads
from aot.schema import Buf, DType, Program, Step, StepKind, Sym, TensorSpec

ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


def _size_text(arg) -> str | None:
    if isinstance(arg, Sym):
        return ix.size_text(ix.parse_size(arg.text))
    if type(arg) is int:
        return str(arg)
    return None


def _arange_span(step: Step) -> tuple[int, str] | None:
    """(start, end as size text) of an ``arange`` of consecutive int64 values; None otherwise."""
    if step.kind != StepKind.ATEN or step.target not in ARANGES or len(step.outputs) != 1:
        return None
    args = list(step.args)
    if step.target == "aten.arange.default":
        args = [0, *args]
    start, end = (args + [None, None])[:2]
    step_by = args[2] if len(args) > 2 else 1
    if type(start) is not int or start < 0 or step_by != 1 or _size_text(end) is None:
        return None
    if set(step.kwargs) - {"dtype", "layout", "device", "pin_memory"}:
        return None  # a step (or anything else) given by keyword: not consecutive positions for sure
    dtype = step.kwargs.get("dtype")
    if dtype is not None and dtype != DType("int64"):
        return None
    return start, _size_text(end)


SHAPE_VIEWS = (
    "aten.unsqueeze.default",
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
)


WHOLE_SLICE = "aten.slice.Tensor"


def whole_slice(step: Step, specs) -> bool:
    """``step`` is a slice of step 1 whose result has its input's shape (``x[:, 0:]``, or
    ``x[:, -1:]`` of a dim of one): it keeps every value where it was. ``specs``: name -> spec."""
    if (
        step.kind != StepKind.ATEN
        or step.target != WHOLE_SLICE
        or not step.args
        or not isinstance(step.args[0], Buf)
    ):
        return False
    here, there = specs.get(step.outputs[0]), specs.get(step.args[0].name)
    every = step.args[4] if len(step.args) > 4 else step.kwargs.get("step", 1)
    if here is None or there is None or every not in (None, 1) or len(here.shape) != len(there.shape):
        return False
    return all(ix.same(ix.parse_size(a), ix.parse_size(b)) for a, b in zip(here.shape, there.shape))


def consecutive_positions(
    name: str, program: Program, producer: dict[str, int], specs
) -> tuple[int, str, list[int]] | None:
    """(start, end as size text, the steps walked) where the ids ``name`` are consecutive
    positions: ``arange(s, e)``, plus an int (``arange + past`` with no past, as transformers
    writes it), in shape-only views that keep every value (``unsqueeze(0)``: position ids of one
    row; a slice of the whole dim). None otherwise."""
    walked: list[int] = []
    shift = 0
    while True:
        i = producer.get(name)
        if i is None:
            return None
        step = program.steps[i]
        walked.append(i)
        span = _arange_span(step)
        if span is not None:
            start, end = span
            if shift:
                end = ix.size_text(ix.parse_size(end) + shift)
            return start + shift, end, walked
        if step.kind != StepKind.ATEN or not step.args or not isinstance(step.args[0], Buf):
            return None
        if step.target == "aten.add.Tensor" and len(step.args) == 2 and type(step.args[1]) is int:
            if step.kwargs or step.args[1] < 0:
                return None
            shift += step.args[1]
        elif step.target in SHAPE_VIEWS:
            here, there = specs.get(step.outputs[0]), specs.get(step.args[0].name)
            if (
                here is None
                or there is None
                or ix.numel(tuple(map(ix.parse_size, here.shape)))
                != ix.numel(tuple(map(ix.parse_size, there.shape)))
            ):
                return None
        elif step.target == WHOLE_SLICE:
            if not whole_slice(step, specs):
                return None
        else:
            return None
        name = step.args[0].name


def spliced(
    program: Program, replaced: dict[int, list[Step]], chains: set[int], buffers: dict[str, TensorSpec]
) -> Program:
    """``program`` with step i replaced by ``replaced[i]`` (``buffers``: the program's buffers
    with the new steps' results), and the steps ``chains`` that made what the replaced steps read
    (positions, indices) dropped where nothing reads them any more, their buffers too."""
    steps = [replaced.get(i, [s]) for i, s in enumerate(program.steps)]
    dead: set[int] = set()
    changed = True
    while changed:
        changed = False
        read = {r for j, group in enumerate(steps) if j not in dead for st in group for r in step_reads(st)}
        for j in chains - dead:
            if not any(o in read or o in program.outputs for o in program.steps[j].outputs if o is not None):
                dead.add(j)
                changed = True
    gone = {o for j in dead for o in program.steps[j].outputs if o is not None}
    out_steps = tuple(st for j, group in enumerate(steps) if j not in dead for st in group)
    buffers = {k: v for k, v in buffers.items() if k not in gone}
    return replace(program, steps=out_steps, buffers=buffers)
