"""A caller's integer inputs that index a weight's rows, found in a program, torch-free: shared by
the torch loader (``aot.loader.values``) and the runtime without torch (``aot.runtime``), which
hold each call's values to the rows there are with the same ``GuardError`` text.

Guards bound sizes, not values: a token id at or past the vocabulary is a row of NaN (a kernel's
masked load) or a device assert on a GPU. ``value_bounds`` finds, in a program, every caller's
integer input whose values a step uses as indices into a weight (``embedding``, ``index_select``,
``index.Tensor``, ``gather``), directly or through views and integer casts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aot.errors import GuardError
from aot.program import VIEW_OPS, reference_steps
from aot.schema import Buf, Program, StepKind

# Ops that hand on their first argument's values unchanged (an index cast to int64, a view)
_SAME_VALUES = VIEW_OPS | {"aten._to_copy.default", "aten.clone.default", "aten.lift_fresh_copy.default"}


def value_bounds(
    program: Program, shapes: Mapping[str, Sequence[int]]
) -> tuple[tuple[str, int, int, str, str], ...]:
    """(input, lowest, highest, weight, op) for each caller's integer input whose values index
    rows ``lowest..highest`` of a weight (``shapes``: each weight's shape), the narrowest range
    where several steps use it."""
    callers = {i.name for i in program.inputs if i.spec.dtype.startswith(("int", "uint"))} - set(
        program.state
    )
    origin = {name: name for name in callers}  # buffer → the input whose values it holds
    found: dict[str, tuple[int, int, str, str]] = {}
    steps = [s for s in reference_steps(program) if s.kind == StepKind.ATEN]
    for step in steps:
        args = step.args
        first = args[0] if args else None
        if step.target in _SAME_VALUES and isinstance(first, Buf) and first.name in origin:
            dtype = step.kwargs.get("dtype")
            if step.target != "aten._to_copy.default" or (
                dtype is not None and "int" in getattr(dtype, "name", "")
            ):
                for out in step.outputs:
                    if out is not None:
                        origin[out] = origin[first.name]
            continue
        for table, dim, index, low_ok in _lookups(step.target, args):
            if not (isinstance(table, Buf) and table.name in shapes and isinstance(index, Buf)):
                continue
            source = origin.get(index.name)
            shape = shapes[table.name]
            if source is None or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
                continue
            rows = shape[dim]
            low, high = (-rows if low_ok else 0), rows - 1
            kept = found.get(source)
            if kept is None or high - low < kept[1] - kept[0]:
                found[source] = (low, high, table.name, step.target)
    return tuple((name, *found[name]) for name in sorted(found))


def _lookups(target: str, args: tuple) -> list[tuple]:
    """(table, dim, index, negative indices count from the end) of a lookup step."""
    if target == "aten.embedding.default" and len(args) >= 2:
        return [(args[0], 0, args[1], False)]
    if target == "aten.index_select.default" and len(args) >= 3:
        return [(args[0], args[1], args[2], False)]
    if target == "aten.gather.default" and len(args) >= 3:
        return [(args[0], args[1], args[2], False)]
    if target == "aten.index.Tensor" and len(args) >= 2 and isinstance(args[1], list):
        return [(args[0], d, index, True) for d, index in enumerate(args[1]) if index is not None]
    return []


def value_error(name: str, bad: int, low: int, high: int, table: str, op: str) -> GuardError:
    """The refusal of input ``name`` holding ``bad`` outside ``low..high``, the rows of ``table``."""
    return GuardError(
        f"input {name!r} holds {bad}, outside {low}..{high}: it indexes the {high + 1} rows of "
        f"{table!r} ({op}); pass values in {low}..{high}"
    )
