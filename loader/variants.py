"""Every program of a bundle, checked as the first is.

A bundle may hold several programs (``Program.variants``, one ``ProgramEntry`` each). Opening it
checks the first program against the manifest (``aot.bundle``); ``check_programs`` holds
every one of them to the same rules, so a variant cannot admit more than the bundle's contract
(``batch <= 1000`` under a contract of ``batch <= 6``), call an op the manifest does not list (the
environment preflight reads ``manifest.ops``), take inputs other than its guards declare, read
sizes its guards do not bind, launch a kernel no program defines, or declare a weight the others
declare in another shape (the one tensor in the weights file is checked against every
declaration).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from aot.admissible import admissible_text, admits, first_admissible
from aot.errors import BundleError
from aot.manifest_text import static_size
from aot.memory import largest_sizes
from aot.program import all_steps
from aot.schema import Guards, Manifest, Program, Step, StepKind, Sym, SymbolGuard, SymBool, SymFloat
from aot.symexpr import FloatText, compile_expr


def check_programs(
    manifest: Manifest, programs: Sequence[Program], guards: Sequence[Guards], path: Path
) -> None:
    """``BundleError`` naming the program and what it does beyond the bundle's manifest."""
    contract = manifest.guards
    listed = set(manifest.ops)
    kernels = {k.id for p in programs for k in p.kernels}
    weights: dict[str, tuple] = {}
    for index, (program, own) in enumerate(zip(programs, guards)):
        where = f"{path}: program {index}"
        _within_contract(own, contract, where)
        want = [(i.name, i.dtype, tuple(i.shape)) for i in own.inputs]
        got = [(i.name, i.spec.dtype, tuple(i.spec.shape)) for i in program.inputs]
        if want != got:
            raise BundleError(
                f"{where} takes inputs {got[:4]}, its guards declare {want[:4]}; rebuild the bundle"
            )
        steps = list(_steps(program))
        unlisted = sorted({s.target for s in steps if s.kind == StepKind.ATEN} - listed)
        if unlisted:
            raise BundleError(
                f"{where} calls {unlisted[0][:80]!r}, which the manifest's ops do not list; rebuild the bundle"
            )
        unknown = sorted({s.target for s in steps if s.kind == StepKind.KERNEL} - kernels)
        if unknown:
            raise BundleError(f"{where} launches kernel {unknown[0][:40]!r}, which no program defines")
        symbols = {s.name for s in own.symbols}
        ranks = {i.name: len(i.shape) for i in own.inputs}
        for src in program.symbols:
            if src.symbol not in symbols or not 0 <= src.dim < ranks.get(src.input, 0):
                raise BundleError(
                    f"{where} reads symbol {src.symbol[:40]!r} from {src.input[:40]!r} dim {src.dim}, "
                    f"which its guards do not declare"
                )
        for text in _expressions(program, steps):
            extra = compile_expr(text, floats=isinstance(text, FloatText)).symbols - symbols
            if extra:
                raise BundleError(
                    f"{where}: expression {text[:60]!r} uses {sorted(extra)[0][:40]!r}, which is not a "
                    f"symbol of its guards"
                )
        for w in program.weights:
            spec = (w.spec.dtype, tuple(w.spec.shape))
            if weights.setdefault(w.name, spec) != spec:
                raise BundleError(
                    f"{where} declares weight {w.name[:60]!r} as {spec[0]} {list(spec[1])}, another "
                    f"program as {weights[w.name][0]} {list(weights[w.name][1])}; rebuild the bundle"
                )


def _within_contract(own: Guards, contract: Guards, where: str) -> None:
    """Every call ``own`` admits, the bundle's contract admits: the same inputs (names, dtypes,
    ranks), each dim static where the contract's is, and each symbol's admissible set within the
    contract's (a static size there: a size the contract's symbol admits)."""
    declared = {i.name: i for i in contract.inputs}
    symbols = {s.name: s for s in contract.symbols}
    mine = {s.name: s for s in own.symbols}
    if [(i.name, i.dtype, len(i.shape), i.state) for i in own.inputs] != [
        (i.name, i.dtype, len(i.shape), i.state) for i in contract.inputs
    ]:
        raise BundleError(
            f"{where}'s guards take other inputs than the bundle's contract; rebuild the bundle"
        )
    for inp in own.inputs:
        for d, (size, bound) in enumerate(zip(inp.shape, declared[inp.name].shape)):
            what = f"{where} admits input {inp.name!r} dim {d}"
            fixed, allowed = static_size(size), static_size(bound)
            if allowed is not None:
                if fixed != allowed:
                    raise BundleError(f"{what} of size {size[:40]}, the bundle's contract only {allowed}")
                continue
            outer = symbols.get(bound)
            if outer is None:
                raise BundleError(f"{where}: the contract's input {inp.name!r} dim {d} is no symbol of it")
            if fixed is not None:
                if not admits(outer, fixed):
                    raise BundleError(f"{what} of size {fixed}; the contract admits {admissible_text(outer)}")
                continue
            inner = mine.get(size)
            if inner is None or size != bound:
                raise BundleError(f"{what} as {size[:40]!r}, the contract's dim is {bound!r}")
            if not _subset(inner, outer):
                raise BundleError(
                    f"{what} ({size}) over {admissible_text(inner)}, beyond the bundle's contract "
                    f"{admissible_text(outer)}; rebuild the bundle"
                )


def _subset(inner: SymbolGuard, outer: SymbolGuard) -> bool:
    """Whether every value ``inner`` admits, ``outer`` admits (sufficient conditions, exact for
    the sets builds write)."""
    low = first_admissible(inner.min, inner.modulus, inner.residues)
    high = largest_sizes(Guards((), (inner,), ()))[inner.name]
    if low < outer.min or high > outer.max:
        return False
    if low == high:  # one size (a size its trace fixed): exact
        return admits(outer, low)
    if outer.modulus > 1 and (
        inner.modulus % outer.modulus or any(r % outer.modulus not in outer.residues for r in inner.residues)
    ):
        return False
    return not any(admits(inner, v) for v in outer.excluded)


def _steps(program: Program) -> Iterator[Step]:
    """Every step of ``program``: its own, its GEMM candidates', and their reference steps."""
    pending = all_steps(program)
    while pending:
        step = pending.pop()
        yield step
        pending.extend(step.reference)


def _expressions(program: Program, steps: list[Step]) -> Iterator[str]:
    for spec in [
        *(i.spec for i in program.inputs),
        *(w.spec for w in program.weights),
        *program.buffers.values(),
    ]:
        yield from spec.shape
    for step in steps:
        yield from step.grid
        values = [*step.args, *step.kwargs.values()]
        while values:
            v = values.pop()
            if isinstance(v, list):
                values.extend(v)
            elif isinstance(v, (Sym, SymBool)):
                yield v.text
            elif isinstance(v, SymFloat):
                yield FloatText(v.text)
