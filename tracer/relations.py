"""Which declared sizes a bundle's programs admit together, over a grid of every Dim's sizes.

A relation among symbols (DINOv2's ``(height//7)*(width//7) != 16``, from a branch on its native
patch grid) excludes some combinations of declared sizes that the per-symbol sets admit.
``aot.tracer.programs`` traces a program at such a combination, and this module says what is still
left: the grid's combinations that each symbol's sets admit but no program does, and how to name
them in a build message (``height 28..34, width 28..34``).
"""

from __future__ import annotations

import numpy as np

from aot.schema import SymbolGuard
from aot.spec import Dim, ModelSpec
from aot.sympy_text import evaluate_vectorized

# The largest grid of declared size combinations enumerated (booleans, one per combination); a
# larger one is not checked, and its relations are reported as such.
MAX_GRID = 1 << 21
# Boxes of left combinations named in a message; the rest are counted.
MAX_BOXES_SHOWN = 4


def excludes(spec: ModelSpec, ranges: dict[str, tuple[int, int]], expr: str) -> bool | None:
    """Whether ``expr`` fails at some combination of the declared sizes of the Dims it reads
    (the others left out), or None when those are too many to enumerate."""
    import re

    names = {d.name for d in spec.dims() if re.search(rf"\b{re.escape(d.name)}\b", expr)}
    own = [d for d in spec.dims() if d.name in names]
    if not own or not Grid.fits(own, ranges):
        return None
    grid = Grid(own, ranges)
    return not np.broadcast_to(evaluate_vectorized(expr, grid.env()), grid.shape).astype(bool).all()


class Grid:
    """Every declared size of each of ``dims`` (its multiples, within ``ranges``), as numpy axes."""

    def __init__(self, dims: list[Dim], ranges: dict[str, tuple[int, int]]):
        self.names = [d.name for d in dims]
        self.axes = []
        for d in dims:
            lo, hi = ranges[d.name]
            m = d.multiple_of
            self.axes.append(np.arange(-(-lo // m) * m, hi + 1, m, dtype=np.int64))
        self.shape = tuple(a.size for a in self.axes)

    @staticmethod
    def fits(dims: list[Dim], ranges: dict[str, tuple[int, int]]) -> bool:
        size = 1
        for d in dims:
            lo, hi = ranges[d.name]
            size *= max(hi // d.multiple_of - (-(-lo // d.multiple_of)) + 1, 1)
        return size <= MAX_GRID

    def env(self) -> dict[str, np.ndarray]:
        return dict(zip(self.names, np.meshgrid(*self.axes, indexing="ij", sparse=True)))

    def _along(self, k: int, mask: np.ndarray) -> np.ndarray:
        shape = [1] * len(self.axes)
        shape[k] = self.axes[k].size
        return mask.reshape(shape)

    def symbol_mask(self, k: int, g: SymbolGuard | None, lo: int, hi: int) -> np.ndarray:
        """Axis ``k``'s sizes that ``g`` admits within ``lo..hi`` (``g`` None: a static ``lo``)."""
        v = self.axes[k]
        mask = (v >= lo) & (v <= hi)
        if g is not None:
            mask &= (v >= g.min) & (v <= g.max) & ~np.isin(v, g.excluded)
            if g.modulus > 1:
                mask &= np.isin(v % g.modulus, g.residues)
        return mask

    def admitted(self, program) -> np.ndarray:
        """The combinations ``program`` (an ``Exported``) admits: its symbols' sets within its
        ranges, and its relations."""
        symbols = {g.name: g for g in program.guards.symbols}
        out = np.ones(self.shape, dtype=bool)
        for k, name in enumerate(self.names):
            lo, hi = program.ranges[name]
            out &= self._along(k, self.symbol_mask(k, symbols.get(name) if lo < hi else None, lo, hi))
        env = None
        for r in program.guards.relations:
            env = env or self.env()
            out &= np.broadcast_to(evaluate_vectorized(r.expr, env), self.shape).astype(bool)
        return out

    def each_symbol(self, programs) -> np.ndarray:
        """The combinations whose every size some program admits (the contract's per-symbol sets)."""
        out = np.ones(self.shape, dtype=bool)
        for k, name in enumerate(self.names):
            axis = np.zeros(self.axes[k].size, dtype=bool)
            for p in programs:
                lo, hi = p.ranges[name]
                g = {g.name: g for g in p.guards.symbols}.get(name) if lo < hi else None
                axis |= self.symbol_mask(k, g, lo, hi)
            out &= self._along(k, axis)
        return out

    def point(self, index: tuple[int, ...]) -> dict[str, int]:
        return {n: int(a[i]) for n, a, i in zip(self.names, self.axes, index)}

    def bounds(self, left: np.ndarray) -> dict[str, tuple[int, int]]:
        """Each Dim's smallest and largest size among the ``left`` combinations."""
        out = {}
        for k, name in enumerate(self.names):
            other = tuple(j for j in range(len(self.names)) if j != k)
            used = self.axes[k][left.any(axis=other)] if other else self.axes[k][left]
            out[name] = (int(used.min()), int(used.max()))
        return out

    def describe(self, left: np.ndarray) -> str:
        """The ``left`` combinations as boxes of consecutive sizes (``height 28..34, width
        28..34``); a Dim along which ``left`` does not change (every batch alike) is left out."""
        names, axes = [], []
        for k in reversed(range(left.ndim)):
            if (left.any(axis=k) == left.all(axis=k)).all():
                left = left.any(axis=k)
            else:
                names.insert(0, self.names[k])
                axes.insert(0, self.axes[k])
        if not names:
            return "of every size"
        left = left.copy()
        boxes = []
        total = int(left.sum())
        while left.any() and len(boxes) < MAX_BOXES_SHOWN:
            start = tuple(int(i[0]) for i in np.nonzero(left))
            hi = list(start)
            for k in range(len(axes)):  # grow along each axis while the box stays inside
                while hi[k] + 1 < axes[k].size:
                    trial = tuple(
                        slice(h + 1, h + 2) if j == k else slice(s, h + 1)
                        for j, (s, h) in enumerate(zip(start, hi))
                    )
                    if not left[trial].all():
                        break
                    hi[k] += 1
            left[tuple(slice(s, h + 1) for s, h in zip(start, hi))] = False
            parts = []
            for k, name in enumerate(names):
                a, b = int(axes[k][start[k]]), int(axes[k][hi[k]])
                parts.append(f"{name} {a}" if a == b else f"{name} {a}..{b}")
            boxes.append(", ".join(parts))
        rest = int(left.sum())
        more = f" and {rest} more of {total} combinations of {', '.join(names)}" if rest else ""
        return "; ".join(boxes) + more
