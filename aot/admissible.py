"""A symbol's admissible set (range, period, residues): membership, which the loader tests on every
call, and the text forms the tracer writes and the review tools print."""

from __future__ import annotations

from aot.schema import SymbolGuard

MAX_DIM = 1 << 31  # the largest size a model file may declare (``aot.spec.Dim``)


def residue_text(name: str, modulus: int, residues: tuple[int, ...]) -> str:
    if modulus <= 1:
        return ""
    if len(residues) == 1:
        return f"{name} % {modulus} == {residues[0]}"
    return "(" + " or ".join(f"{name} % {modulus} == {r}" for r in residues) + ")"


def first_admissible(lo: int, modulus: int, residues: tuple[int, ...]) -> int:
    """The smallest v >= lo with v % modulus in residues."""
    if modulus <= 1:
        return lo
    return min(lo + ((r - lo) % modulus) for r in residues)


def last_admissible(hi: int, modulus: int, residues: tuple[int, ...]) -> int:
    if modulus <= 1:
        return hi
    return max(hi - ((hi - r) % modulus) for r in residues)


def relative_text(
    name: str,
    lo: int,
    hi: int,
    modulus: int,
    residues: tuple[int, ...],
    excluded: tuple[int, ...],
    declared_lo: int,
    declared_hi: int,
) -> str:
    """What a set adds to the declared range, as a boolean expression (`and`-joined parts)."""
    parts = []
    if lo > first_admissible(declared_lo, modulus, residues):
        parts.append(f"{name} >= {lo}")
    if hi < last_admissible(declared_hi, modulus, residues):
        parts.append(f"{name} <= {hi}")
    if modulus > 1:
        parts.append(residue_text(name, modulus, residues))
    parts.extend(f"{name} != {v}" for v in excluded)
    return " and ".join(parts)


def admissible_text(g: SymbolGuard) -> str:
    """The whole admissible set of a symbol: ``10 <= seq <= 512, seq % 2 == 0``."""
    parts = [f"{g.min} <= {g.name} <= {g.max}"]
    if g.modulus > 1:
        parts.append(residue_text(g.name, g.modulus, g.residues))
    parts.extend(f"{g.name} != {v}" for v in g.excluded)
    return ", ".join(parts)


def admits(g: SymbolGuard, value: int) -> bool:
    return (
        g.min <= value <= g.max
        and (g.modulus <= 1 or value % g.modulus in g.residues)
        and value not in g.excluded
    )
