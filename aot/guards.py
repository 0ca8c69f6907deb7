"""The bundle's guards as plain Python: validated once at load, then checked on every call.

Shared by both executors (``aot.loader.guards`` for torch tensors, ``aot.runtime`` for DLPack and
NumPy arrays): what an input's dims bind, the admissible set of each symbol, the relations among
them, and the ``GuardError`` texts, which name the input, dim, admissible set, value, and the model
line that introduced the guard. Guards that could not have come from a build (sizes beyond
``MAX_SIZE``, empty admissible sets, unknown symbols) are refused at load with ``BundleError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aot.admissible import MAX_DIM, admissible_text, admits, first_admissible
from aot.errors import BundleError, GuardError, printable
from aot.schema import Guards, SymbolGuard
from aot.symexpr import compile_expr, static_size

MAX_SIZE = MAX_DIM  # the largest size a model file may declare; larger guards are not from a build
MAX_EXCLUDED = 1024  # excluded values per symbol (checked on every call)
# Relations among symbols, all evaluated on every call: real models have none or a few (``a == b``
# where the model adds two inputs of independent dims). At these bounds a check costs at most about
# 0.1 ms more (measured on a busy 2-core box: 64 relations or 1,000 nodes added 0.2 ms to 16 µs).
MAX_RELATIONS = 32
MAX_RELATION_NODES = 512  # syntax nodes of all relations together


def _validate(guards: Guards) -> None:
    """Refuse guards that no build writes; each failure names the field and the bound."""
    names = [i.name for i in guards.inputs]
    if not names or len(set(names)) != len(names):
        raise BundleError(f"guards name inputs {names[:8]}; expected one or more distinct names")
    symbols = [s.name for s in guards.symbols]
    if len(set(symbols)) != len(symbols):
        raise BundleError(f"guards declare symbols {symbols[:8]} more than once")
    used = {size for i in guards.inputs if not i.state for size in i.shape}
    for g in guards.symbols:
        what = f"symbol {g.name[:40]!r}"
        if g.name not in used:
            raise BundleError(f"{what} is not the size of any input dim, so no call could bind it")
        if not (0 <= g.declared_min <= g.declared_max <= MAX_SIZE and 0 <= g.min <= g.max <= MAX_SIZE):
            raise BundleError(
                f"{what}: expected 0 <= min <= max <= {MAX_SIZE} (declared and admissible), got "
                f"declared {g.declared_min}..{g.declared_max}, admissible {g.min}..{g.max}"
            )
        if (
            not 1 <= g.modulus <= MAX_SIZE
            or not all(0 <= r < g.modulus for r in g.residues)
            or (g.modulus > 1 and not g.residues)
        ):
            raise BundleError(
                f"{what}: expected residues in 0..modulus-1 of a modulus in 1..{MAX_SIZE}, "
                f"got modulus {g.modulus} residues {list(g.residues)[:8]}"
            )
        if not 0 <= g.declared_multiple <= MAX_SIZE:
            raise BundleError(
                f"{what}: expected a declared multiple in 0..{MAX_SIZE}, got {g.declared_multiple}"
            )
        if len(g.excluded) > MAX_EXCLUDED:
            raise BundleError(f"{what} excludes {len(g.excluded)} values (limit {MAX_EXCLUDED})")
        if first_admissible(g.min, g.modulus, g.residues) > g.max:
            raise BundleError(f"{what} admits no size at all ({admissible_text(g)})")
    known = set(symbols)
    if len(guards.relations) > MAX_RELATIONS:
        raise BundleError(f"guards hold {len(guards.relations)} relations (limit {MAX_RELATIONS})")
    nodes = 0
    for r in guards.relations:
        expr = compile_expr(r.expr)
        nodes += expr.nodes
        if nodes > MAX_RELATION_NODES:
            raise BundleError(
                f"guards' relations have more than {MAX_RELATION_NODES} syntax nodes in all (the limit)"
            )
        unknown = expr.symbols - known
        if unknown:
            raise BundleError(
                f"relation {r.expr[:60]!r} uses symbols {sorted(unknown)[:3]} that no input binds"
            )


class GuardCore:
    """What every call is checked against, without the tensors: bind, dims, relations."""

    def __init__(self, guards: Guards, dtypes: dict[str, Any]):
        _validate(guards)
        self.guards = guards
        self.names = tuple(i.name for i in guards.inputs if not i.state)
        self._name_set = frozenset(self.names)
        self.state_names = frozenset(i.name for i in guards.inputs if i.state)
        if not self.names:
            raise BundleError("every input of the guards is state; a call needs at least one input")
        self.symbols: dict[str, SymbolGuard] = {s.name: s for s in guards.symbols}
        self.inputs = []
        for inp in guards.inputs:
            if inp.state:
                continue
            if inp.dtype not in dtypes:
                raise BundleError(f"input {inp.name!r} has unknown dtype {inp.dtype!r}")
            dims = []
            for size in inp.shape:
                static = static_size(size)
                if static is not None:
                    if static > MAX_SIZE:
                        raise BundleError(f"input {inp.name!r} has static size {size[:24]} beyond {MAX_SIZE}")
                    dims.append(static)
                elif size in self.symbols:
                    dims.append(size)
                else:
                    raise BundleError(
                        f"input {inp.name!r} has a size {size[:40]!r} that is neither an int nor a symbol"
                    )
            self.inputs.append((inp.name, dtypes[inp.dtype], inp.dtype, tuple(dims)))
        self._relations = [(compile_expr(r.expr), r) for r in guards.relations]
        self._sources = {
            s.name: [(compile_expr(src.text), src) for src in s.sources if src.text] for s in guards.symbols
        }
        for s in guards.symbols:
            for expr, src in self._sources[s.name]:
                if not expr.symbols <= {s.name}:
                    raise BundleError(f"guard {src.text[:60]!r} of symbol {s.name[:40]!r} uses other symbols")

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Order positional and keyword arguments as the bundle's inputs."""
        if not kwargs and len(args) == len(self.names):  # every input by position: nothing to order
            return list(args)
        if not args and kwargs.keys() == self._name_set:  # every input by name, nothing else
            return [kwargs[n] for n in self.names]
        if len(args) > len(self.names):
            raise GuardError(f"expected at most {len(self.names)} inputs {list(self.names)}, got {len(args)}")
        twice = [n for n in self.names[: len(args)] if n in kwargs]
        if twice:
            raise GuardError(
                f"input(s) {twice} given both by position and by name; expected inputs {list(self.names)}"
            )
        state = sorted(self.state_names & kwargs.keys())
        if state:
            raise GuardError(
                f"input {state[0]!r} is state: the runner owns it (allocated once, updated in place by "
                f"every call); pass only {list(self.names)}, and clear the state with runner.reset()"
            )
        values = list(args)
        for name in self.names[len(args) :]:
            if name not in kwargs:
                raise GuardError(f"missing input {name!r}; expected inputs {list(self.names)}")
            values.append(kwargs.pop(name))
        if kwargs:
            raise GuardError(f"unexpected input(s) {sorted(kwargs)}; expected inputs {list(self.names)}")
        return values

    def bind_dims(
        self,
        name: str,
        dims: tuple[int | str, ...],
        shape: Sequence[int],
        sizes: dict[str, int],
        where: dict[str, tuple[str, int]],
    ) -> None:
        """Check input ``name``'s ``shape`` (its rank already checked) against ``dims``, binding
        the symbols it is the first to size into ``sizes`` (``where``: symbol -> input and dim)."""
        for d, (want, got) in enumerate(zip(dims, shape)):
            if type(want) is int:
                if got != want:
                    raise GuardError(f"input {name!r} dim {d}: expected static size {want}, got {got}")
            elif want in sizes:
                if sizes[want] != got:
                    first, first_dim = where[want]
                    raise GuardError(
                        f"input {name!r} dim {d} ({want}): expected {sizes[want]}, the size of {want} "
                        f"in input {first!r} dim {first_dim}, got {got}"
                    )
            else:
                if not admits(self.symbols[want], got):
                    self.check_symbol(want, got, f"input {name!r} dim {d}")
                sizes[want] = got
                where[want] = (name, d)

    def check_relations(self, sizes: dict[str, int]) -> None:
        """The relations among symbols (``a == b``), once every input bound its dims."""
        for expr, rel in self._relations:
            if not expr(sizes):
                src = rel.source
                raise GuardError(
                    printable(
                        f"inputs violate {rel.expr} with {', '.join(f'{k}={v}' for k, v in sorted(sizes.items()))} "
                        f"(guard from {src.file}:{src.line}: {src.code})"
                    )
                )

    def check_symbol(self, sym: str, value: int, what: str) -> None:
        g = self.symbols[sym]
        if admits(g, value):
            return
        cause = "declared in the model file"
        m = g.declared_multiple
        if m > 1 and value % m and g.min <= value <= g.max:
            near = " or ".join(
                str(v) for v in sorted({value // m * m, value // m * m + m}) if g.min <= v <= g.max
            )
            raise GuardError(
                printable(
                    f"{what} ({sym}): expected a multiple of {m}, got {value}: the model file declares "
                    f"Dim({sym!r}, ..., multiple_of={m}) (the model's windows or strides need it); pad or resize "
                    f"the input to {near}"
                )
            )
        if g.declared_min <= value <= g.declared_max:
            for expr, src in self._sources[sym]:
                if not expr({sym: value}):
                    cause = f"guard {src.text} from {src.file}:{src.line}: {src.code}"
                    break
        raise GuardError(printable(f"{what} ({sym}): expected {admissible_text(g)}, got {value} ({cause})"))
