"""The state of a stateful bundle (a static KV cache), in plain Python: shared by the torch loader
(``aot.loader.state``) and the runtime without torch (``aot.runtime.plan.StateLayout``).

A model file declares state ``Input(..., state=True)``; the manifest lists it among the guards'
inputs with ``InputGuard.state``. The runner allocates each state tensor once, zeroed, at its
largest size: its first dim (the batch) at the largest batch any program admits, its other dims
static. A call on ``b`` rows uses rows ``0..b-1`` (contiguous: the batch is the outermost dim).
"""

from __future__ import annotations

from dataclasses import dataclass

from aot.errors import BundleError
from aot.memory import largest_sizes
from aot.program import reference_steps
from aot.schema import Buf, Guards, Program
from aot.symexpr import static_size


@dataclass(frozen=True)
class StateSpec:
    """One state tensor: dtype, shape at its largest, and the symbol its rows follow (None: static)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    batch: str | None


def state_specs(guards: Guards, known_dtypes, where: str) -> dict[str, StateSpec]:
    """Every state input of ``guards`` at its largest size (module docstring); ``BundleError`` for a
    dtype not in ``known_dtypes``, a scalar, or a symbolic dim other than the first."""
    largest = largest_sizes(guards)
    out: dict[str, StateSpec] = {}
    for inp in guards.inputs:
        if not inp.state:
            continue
        if inp.dtype not in known_dtypes:
            raise BundleError(f"{where}: state {inp.name[:40]!r} has unknown dtype {inp.dtype[:20]!r}")
        if not inp.shape:
            raise BundleError(f"{where}: state {inp.name[:40]!r} is a scalar; state has at least one dim")
        shape = []
        for d, size in enumerate(inp.shape):
            static = static_size(size)
            if static is not None:
                shape.append(static)
            elif d == 0 and size in largest:
                shape.append(largest[size])
            else:
                raise BundleError(
                    f"{where}: state {inp.name[:40]!r} dim {d} is {size[:40]!r}; only a state's first "
                    f"dim may be a symbol (the batch), the others are static sizes"
                )
        batch = None if static_size(inp.shape[0]) is not None else inp.shape[0]
        out[inp.name] = StateSpec(inp.name, inp.dtype, tuple(shape), batch)
    return out


def index_bounds(program: Program, shapes: dict[str, tuple[int, ...]]) -> tuple[tuple[str, str, int], ...]:
    """(input, state, slots) for each caller's input that a state write of ``program`` uses as
    an index (``cache_position`` in ``index_put_(key_cache, [None, None, cache_position], k)``):
    a slot outside ``0 <= slot < slots`` would write out of the state on a GPU or, negative, wrap
    around to another slot on any device. ``shapes``: each state's shape at its largest."""
    callers = {i.name for i in program.inputs} - set(program.state)
    bounds: dict[tuple[str, str], int] = {}
    for step in reference_steps(program):  # a write a kernel stands for is in its reference
        if step.target == "aten.index_put_.default" and len(step.args) >= 2:
            target, indices = step.args[0], list(enumerate(step.args[1] or ()))
        elif step.target == "aten.index_copy_.default" and len(step.args) >= 3:
            target, indices = step.args[0], [(step.args[1], step.args[2])]
        else:
            continue
        if not isinstance(target, Buf) or target.name not in shapes:
            continue
        shape = shapes[target.name]
        for dim, index in indices:
            if (
                isinstance(index, Buf)
                and index.name in callers
                and isinstance(dim, int)
                and -len(shape) <= dim < len(shape)
            ):
                key = (index.name, target.name)
                bounds[key] = min(bounds.get(key, shape[dim]), shape[dim])
    return tuple((name, state, n) for (name, state), n in sorted(bounds.items()))


def slots_error(name: str, state: str, slots: int, bad: int) -> str:
    """The ``GuardError`` text for an index input holding slot ``bad`` of a state of ``slots``."""
    return (
        f"{name} holds slot {bad}, the state {state[:60]!r} has {slots} slots: "
        f"each must be 0 <= slot < {slots}; start a new sequence (reset) or use a bundle built "
        f"with a longer context"
    )
