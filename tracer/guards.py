"""Simplify the guards torch.export discovered into per-symbol admissible sets and relations.

Every symbol has a bounded declared range, so a guard can be checked exhaustively over it: a
single-symbol guard becomes a mask over the range; a multi-symbol guard that is a product of
per-symbol masks (``16*T*B == 32*B*(T//2)`` is just ``T % 2 == 0``) is split into them; one that
always holds inside the other guards is dropped; what is left is a residual relation. Each mask is
described as ``lo <= v <= hi, v % m == r, v != x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aot.admissible import relative_text
from aot.errors import TraceError
from aot.schema import GuardSource, Relation, SymbolGuard
from aot.sympy_text import evaluate_vectorized

MAX_RANGE = 1 << 22  # largest declared range enumerated per symbol
MAX_GRID = 1 << 22  # largest grid enumerated for a multi-symbol guard
MAX_MODULUS = 64
MAX_EXCLUDED = 16


@dataclass(frozen=True)
class RawGuard:
    text: str  # expression text over declared symbol names
    symbols: tuple[str, ...]
    file: str
    line: int
    code: str


@dataclass(frozen=True)
class SetShape:
    lo: int
    hi: int
    modulus: int
    residues: tuple[int, ...]
    excluded: tuple[int, ...]


def describe_mask(values: np.ndarray, mask: np.ndarray) -> SetShape | None:
    """Describe the admitted ``values[mask]`` as range + residues + a few exclusions; None if empty
    or not describable that way."""
    admitted = values[mask]
    if admitted.size == 0:
        return None
    lo, hi = int(admitted.min()), int(admitted.max())
    inside = values[(values >= lo) & (values <= hi)]
    inside_mask = mask[(values >= lo) & (values <= hi)]
    best: SetShape | None = None
    for m in range(1, MAX_MODULUS + 1):
        residues = np.unique(admitted % m)
        if residues.size == m and m > 1:
            continue
        candidates = np.isin(inside % m, residues)
        excluded = inside[candidates & ~inside_mask]
        if excluded.size <= MAX_EXCLUDED and (best is None or excluded.size < len(best.excluded)):
            best = SetShape(lo, hi, m, tuple(int(r) for r in residues), tuple(int(v) for v in excluded))
            if excluded.size == 0:
                break
    return best


class GuardSimplifier:
    """``declared``: each symbol's range; ``multiples``: the guard ``v % m == 0`` of each symbol
    declared ``Dim(..., multiple_of=m)``, which the others are simplified under (a guard that
    every multiple satisfies, such as Swin's ``height % 2 == 0``, is not listed)."""

    def __init__(
        self, declared: dict[str, tuple[int, int]], multiples: dict[str, tuple[int, RawGuard]] | None = None
    ):
        self.declared = declared
        self.values = {
            s: np.arange(lo, hi + 1, dtype=np.int64)
            for s, (lo, hi) in declared.items()
            if hi - lo < MAX_RANGE
        }
        self.masks = {s: np.ones(v.shape, dtype=bool) for s, v in self.values.items()}
        self.sources: dict[str, list[GuardSource]] = {s: [] for s in declared}
        self.relations: list[Relation] = []
        self.allowed = {s: np.ones(v.shape, dtype=bool) for s, v in self.values.items()}
        for sym, (m, g) in (multiples or {}).items():
            if sym in self.values:
                self._narrow(sym, self.values[sym] % m == 0, g)
                self.allowed[sym] = self.masks[sym].copy()

    def _source(self, g: RawGuard, text: str) -> GuardSource:
        return GuardSource(text=text, file=g.file, line=g.line, code=g.code)

    def _narrow(self, sym: str, mask: np.ndarray, g: RawGuard) -> None:
        if (mask | ~self.allowed[sym]).all():
            return
        lo, hi = self.declared[sym]
        shape = describe_mask(self.values[sym], mask)
        if shape is None:
            raise TraceError(
                f"{g.file}:{g.line}: the guard {g.text} admits no value of {sym} in {lo}..{hi}; "
                f"widen the Dim or change this line: {g.code}"
            )
        text = relative_text(sym, shape.lo, shape.hi, shape.modulus, shape.residues, shape.excluded, lo, hi)
        src = self._source(g, text)
        if src not in self.sources[sym]:
            self.sources[sym].append(src)
        self.masks[sym] &= mask

    def add(self, guards: list[RawGuard]) -> None:
        # single-symbol guards first: they bound the grids of the multi-symbol ones.
        for g in sorted(guards, key=lambda g: len(g.symbols)):
            if not g.symbols:
                continue
            if any(s not in self.values for s in g.symbols):
                self.relations.append(Relation(expr=g.text, source=self._source(g, g.text)))
                continue
            if len(g.symbols) == 1:
                (sym,) = g.symbols
                mask = np.broadcast_to(
                    evaluate_vectorized(g.text, {sym: self.values[sym]}), self.values[sym].shape
                )
                self._narrow(sym, mask.astype(bool), g)
                continue
            self._add_multi(g)

    def _add_multi(self, g: RawGuard) -> None:
        syms = g.symbols
        axes = [self.values[s][self.masks[s]] for s in syms]
        if int(np.prod([a.size for a in axes])) > MAX_GRID:
            self.relations.append(Relation(expr=g.text, source=self._source(g, g.text)))
            return
        grids = np.meshgrid(*axes, indexing="ij", sparse=True)
        full = np.broadcast_to(
            evaluate_vectorized(g.text, dict(zip(syms, grids))), [a.size for a in axes]
        ).astype(bool)
        if full.all():
            return
        projections = []
        for i in range(len(syms)):
            other = tuple(j for j in range(len(syms)) if j != i)
            projections.append(full.any(axis=other))
        product = projections[0]
        for p in projections[1:]:
            product = np.multiply.outer(product, p)
        if not np.array_equal(product, full):
            self.relations.append(Relation(expr=g.text, source=self._source(g, g.text)))
            return
        for i, (sym, proj) in enumerate(zip(syms, projections)):
            if proj.all():
                continue
            # Evaluate this symbol over its whole declared range (the others over what they admit),
            # so the guard's own effect reads as simply as it is: "seq % 2 == 0".
            env = {
                s: a
                for s, a in zip(
                    syms,
                    np.meshgrid(
                        *[self.values[sym] if j == i else axes[j] for j in range(len(syms))],
                        indexing="ij",
                        sparse=True,
                    ),
                )
            }
            shape = [self.values[sym].size if j == i else axes[j].size for j in range(len(syms))]
            over = np.broadcast_to(evaluate_vectorized(g.text, env), shape).astype(bool)
            other = tuple(j for j in range(len(syms)) if j != i)
            self._narrow(sym, over.any(axis=other), g)

    def symbol_guards(self) -> tuple[SymbolGuard, ...]:
        out = []
        for sym, (lo, hi) in self.declared.items():
            if sym not in self.values:
                out.append(
                    SymbolGuard(
                        name=sym,
                        declared_min=lo,
                        declared_max=hi,
                        min=lo,
                        max=hi,
                        sources=tuple(self.sources[sym]),
                    )
                )
                continue
            shape = describe_mask(self.values[sym], self.masks[sym])
            if shape is None:
                raise TraceError(f"the guards on {sym} together admit no value in {lo}..{hi}")
            out.append(
                SymbolGuard(
                    name=sym,
                    declared_min=lo,
                    declared_max=hi,
                    min=shape.lo,
                    max=shape.hi,
                    modulus=shape.modulus,
                    residues=shape.residues,
                    excluded=shape.excluded,
                    sources=tuple(sorted(self.sources[sym], key=lambda s: (s.file, s.line, s.text))),
                )
            )
        return tuple(out)

    def relation_guards(self) -> tuple[Relation, ...]:
        seen, out = set(), []
        for r in sorted(self.relations, key=lambda r: (r.expr, r.source.file, r.source.line)):
            if r.expr not in seen:
                seen.add(r.expr)
                out.append(r)
        return tuple(out)
