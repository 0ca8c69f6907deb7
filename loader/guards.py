"""Check a call's inputs against the bundle's guards, in microseconds.

Everything is prepared once at load: per input its dtype, rank and each dim as a static size or a
symbol; per symbol its admissible set; relations compiled by ``aot.symexpr`` (never ``eval``). A
call that fails gets a ``GuardError`` naming the input, dim, admissible set, value, and the model
line that introduced the guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aot.errors import BundleError, GuardError
from aot.guardtext import admissible_text, admits
from aot.schema import Guards, SymbolGuard
from aot.symexpr import compile_expr


class GuardChecker:
    def __init__(self, guards: Guards, dtypes: dict[str, Any]):
        self.guards = guards
        self.names = tuple(i.name for i in guards.inputs)
        self.symbols: dict[str, SymbolGuard] = {s.name: s for s in guards.symbols}
        self._inputs = []
        for inp in guards.inputs:
            if inp.dtype not in dtypes:
                raise BundleError(f"input {inp.name!r} has unknown dtype {inp.dtype!r}")
            dims = []
            for size in inp.shape:
                if size.isdigit():
                    dims.append(int(size))
                elif size in self.symbols:
                    dims.append(size)
                else:
                    raise BundleError(f"input {inp.name!r} has a size {size[:40]!r} that is neither an int nor a symbol")
            self._inputs.append((inp.name, dtypes[inp.dtype], inp.dtype, tuple(dims)))
        self._relations = [(compile_expr(r.expr), r) for r in guards.relations]
        self._sources = {
            s.name: [(compile_expr(src.text), src) for src in s.sources if src.text] for s in guards.symbols
        }

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Order positional and keyword arguments as the bundle's inputs."""
        if len(args) > len(self.names):
            raise GuardError(f"expected at most {len(self.names)} inputs {list(self.names)}, got {len(args)}")
        values = list(args)
        for name in self.names[len(args):]:
            if name not in kwargs:
                raise GuardError(f"missing input {name!r}; expected inputs {list(self.names)}")
            values.append(kwargs.pop(name))
        if kwargs:
            raise GuardError(f"unexpected input(s) {sorted(kwargs)}; expected inputs {list(self.names)}")
        return values

    def check(self, values: Sequence[Any], device: Any = None) -> dict[str, int]:
        """Validate inputs; returns the symbol values. Raises ``GuardError``."""
        import torch

        sizes: dict[str, int] = {}
        where: dict[str, str] = {}
        for (name, dtype, dtype_name, dims), value in zip(self._inputs, values):
            if not isinstance(value, torch.Tensor):
                raise GuardError(f"input {name!r}: expected a tensor, got {type(value).__name__}")
            if value.dtype != dtype:
                raise GuardError(
                    f"input {name!r}: expected dtype {dtype_name}, got {str(value.dtype).removeprefix('torch.')}"
                )
            if value.dim() != len(dims):
                raise GuardError(
                    f"input {name!r}: expected rank {len(dims)} [{', '.join(map(str, dims))}], "
                    f"got rank {value.dim()} {list(value.shape)}"
                )
            if device is not None and value.device.type != device.type:
                raise GuardError(f"input {name!r}: expected a tensor on {device.type}, got one on {value.device}")
            for d, (want, got) in enumerate(zip(dims, value.shape)):
                if type(want) is int:
                    if got != want:
                        raise GuardError(f"input {name!r} dim {d}: expected static size {want}, got {got}")
                elif want in sizes:
                    if sizes[want] != got:
                        raise GuardError(
                            f"input {name!r} dim {d} ({want}): expected {sizes[want]}, the size of {want} "
                            f"in {where[want]}, got {got}"
                        )
                else:
                    self._check_symbol(want, got, f"input {name!r} dim {d}")
                    sizes[want] = got
                    where[want] = f"input {name!r} dim {d}"
        for expr, rel in self._relations:
            if not expr(sizes):
                src = rel.source
                raise GuardError(
                    f"inputs violate {rel.expr} with {', '.join(f'{k}={v}' for k, v in sorted(sizes.items()))} "
                    f"(guard from {src.file}:{src.line}: {src.code})"
                )
        return sizes

    def _check_symbol(self, sym: str, value: int, what: str) -> None:
        g = self.symbols[sym]
        if admits(g, value):
            return
        cause = "declared in the model file"
        if g.declared_min <= value <= g.declared_max:
            for expr, src in self._sources[sym]:
                if not expr({sym: value}):
                    cause = f"guard {src.text} from {src.file}:{src.line}: {src.code}"
                    break
        raise GuardError(f"{what} ({sym}): expected {admissible_text(g)}, got {value} ({cause})")
