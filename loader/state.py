"""The runner's state: tensors a stateful bundle's programs update in place (a static KV cache).

A model file declares them ``Input(..., state=True)``; the manifest lists them as inputs with
``InputGuard.state``. The loader allocates each once, zero-initialised, at its largest size (its
first dim, the batch, at the largest batch any program admits; its other dims are static), on the
runner's device, and never hands it to the caller. A call on ``b`` rows binds the row view
``state[:b]`` (contiguous: the batch is the outermost dim), which the program's state writes
(``aot.allowed_ops.STATE_WRITE_OPS``) update in place; CUDA graphs capture those views where they
live, so replays neither copy the state in nor out. ``reset`` zeroes all rows or some.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aot.errors import BundleError, EnvError, GuardError
from aot.manifest_text import static_size
from aot.memory import largest_sizes
from aot.program import reference_steps
from aot.schema import Buf, Guards, Program


class State:
    """The state tensors of one runner, by name, and the symbol each one's rows follow."""

    def __init__(self, guards: Guards, dtypes: dict[str, torch.dtype], device: torch.device, where: str):
        largest = largest_sizes(guards)
        self.tensors: dict[str, torch.Tensor] = {}
        self.batch: dict[str, str | None] = {}  # state name -> the symbol of its first dim, or None
        shapes: dict[str, tuple[list[int], torch.dtype]] = {}
        for inp in guards.inputs:
            if not inp.state:
                continue
            if inp.dtype not in dtypes:
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
            self.batch[inp.name] = None if static_size(inp.shape[0]) is not None else inp.shape[0]
            shapes[inp.name] = (shape, dtypes[inp.dtype])
        self.shapes = shapes
        self.nbytes = sum(_numel(shape) * dtype.itemsize for shape, dtype in shapes.values())
        self.device = device
        self.rows = max((shape[0] for shape, _ in shapes.values()), default=0)

    def allocate(self) -> None:
        """Allocate every state tensor, zeroed (``EnvError`` when the device cannot hold them)."""
        try:
            for name, (shape, dtype) in self.shapes.items():
                self.tensors[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            self.tensors.clear()
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:200]
            raise EnvError(
                f"the bundle's state ({self.nbytes / 2**20:.1f} MiB at its largest batch) does not fit on "
                f"{self.device}: {first}; rebuild with a smaller maximum batch or context"
            ) from None

    def check_program(self, program: Program, where: str) -> None:
        """The program's state is the bundle's, with the same dtypes and shapes."""
        inputs = {i.name: i.spec for i in program.inputs}
        if set(program.state) != set(self.shapes):
            raise BundleError(
                f"{where}: a program declares state {sorted(program.state)[:8]}, the bundle's guards "
                f"{sorted(self.shapes)[:8]}"
            )
        for name in program.state:
            spec = inputs.get(name)
            if spec is None:
                raise BundleError(f"{where}: state {name[:40]!r} is not an input of its program")

    def index_bounds(self, program: Program) -> tuple[tuple[str, str, int], ...]:
        """(input, state, slots) for each caller's input that a state write of ``program`` uses as
        an index (``cache_position`` in ``index_put_(key_cache, [None, None, cache_position], k)``):
        a slot outside ``0 <= slot < slots`` would write out of the state on a GPU (a device-side
        assert that ends the process) or, negative, wrap around to another slot on any device."""
        callers = {i.name for i in program.inputs} - set(program.state)
        bounds: dict[tuple[str, str], int] = {}
        for step in reference_steps(program):  # a write a kernel folded in is in its reference
            if step.target == "aten.index_put_.default" and len(step.args) >= 2:
                target, indices = step.args[0], list(enumerate(step.args[1] or ()))
            elif step.target == "aten.index_copy_.default" and len(step.args) >= 3:
                target, indices = step.args[0], [(step.args[1], step.args[2])]
            else:
                continue
            if not isinstance(target, Buf) or target.name not in self.shapes:
                continue
            shape = self.shapes[target.name][0]
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

    def views(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Each state tensor's rows ``0..b-1`` for a call on ``b`` rows (the whole tensor when its
        first dim is static)."""
        return {
            name: t if self.batch[name] is None else t[: sizes[self.batch[name]]]
            for name, t in self.tensors.items()
        }

    def reset(self, rows: int | Iterable[int] | None = None) -> None:
        """Zero the state: every row, or the given rows of the batch (``GuardError`` for a row
        outside ``0..rows-1``)."""
        if rows is None:
            for t in self.tensors.values():
                t.zero_()
            return
        picked = [rows] if isinstance(rows, int) else list(rows)
        bad = [r for r in picked if type(r) is not int or not 0 <= r < self.rows]
        if bad:
            raise GuardError(
                f"reset rows must be ints in 0..{self.rows - 1} (the state's batch rows), got {bad[:4]}"
            )
        if not picked:
            return
        index = torch.tensor(picked, dtype=torch.int64, device=self.device)
        for name, t in self.tensors.items():
            if self.batch[name] is None:
                t.zero_()  # a state without a batch dim is shared by every row
            else:
                t.index_fill_(0, index, 0)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_index_bounds(bounds: tuple[tuple[str, str, int], ...], inputs: dict[str, torch.Tensor]) -> None:
    """``GuardError`` unless every index input addresses slots of the state it writes (one small
    reduction and one host sync per index input on a GPU)."""
    for name, state, slots in bounds:
        index = inputs.get(name)
        if (
            not isinstance(index, torch.Tensor)
            or not index.numel()
            or index.dtype in (torch.bool, torch.uint8)
        ):
            continue
        low, high = torch.stack(torch.aminmax(index.reshape(-1))).tolist()
        if low < 0 or high >= slots:
            raise GuardError(
                f"{name} holds slot {low if low < 0 else high}, the state {state[:60]!r} has {slots} slots: "
                f"each must be 0 <= slot < {slots}; start a new sequence (reset) or use a bundle built "
                f"with a longer context"
            )
