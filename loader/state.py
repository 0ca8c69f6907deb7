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
from aot.schema import Guards, Program
from aot.state import index_bounds, slots_error, state_specs


class State:
    """The state tensors of one runner, by name, and the symbol each one's rows follow."""

    def __init__(self, guards: Guards, dtypes: dict[str, torch.dtype], device: torch.device, where: str):
        self.tensors: dict[str, torch.Tensor] = {}
        specs = state_specs(guards, dtypes, where)
        self.batch: dict[str, str | None] = {n: sp.batch for n, sp in specs.items()}
        shapes = {n: (list(sp.shape), dtypes[sp.dtype]) for n, sp in specs.items()}
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
        return index_bounds(program, {n: tuple(shape) for n, (shape, _) in self.shapes.items()})

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
            raise GuardError(slots_error(name, state, slots, low if low < 0 else high))
