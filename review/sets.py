"""Exact comparison of two admissible sets.

Sets are bounded, and within a range a set only depends on ``v % modulus`` apart from a few
excluded values, so the difference of two sets is counted segment by segment, one period at a
time (``aot.admissible.admits`` decides membership), whatever the size of the ranges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aot.admissible import admissible_text, admits
from aot.errors import BundleError
from aot.review.verdict import Change, change
from aot.schema import SymbolGuard

RUNS_SHOWN = 6  # runs of sizes listed when a set gains or loses values
MAX_PERIOD_WORK = 1 << 24  # bound on the exact set comparison: period × segments


@dataclass(frozen=True)
class Sizes:
    """A set of sizes: how many, and its first runs ``(first, last)`` in increasing order."""

    count: int
    runs: tuple[tuple[int, int], ...]
    more: bool  # more runs exist than ``runs`` shows
    last: int = 0  # the largest size in the set

    def text(self) -> str:
        """``33..64``, ``1, 3, 5`` or, for a longer progression, ``130..256 step 2``."""
        starts = [a for a, b in self.runs]
        if self.more and all(a == b for a, b in self.runs) and len(starts) > 2:
            step = starts[1] - starts[0]
            if (
                all(y - x == step for x, y in zip(starts, starts[1:]))
                and self.count == (self.last - starts[0]) // step + 1
            ):
                return f"{starts[0]}..{self.last} step {step}"
        shown = [str(a) if a == b else (f"{a}, {b}" if b == a + 1 else f"{a}..{b}") for a, b in self.runs]
        return ", ".join(shown + ([f"…, {self.last}"] if self.more else []))


def static_set(size: int) -> SymbolGuard:
    return SymbolGuard(name=str(size), declared_min=size, declared_max=size, min=size, max=size)


def difference(a: SymbolGuard, b: SymbolGuard, limit: int = RUNS_SHOWN) -> Sizes:
    """The sizes ``a`` admits and ``b`` does not, counted exactly.

    Cut ``a``'s range where ``b``'s range starts or ends and around every excluded value; inside a
    segment, membership in both sets depends only on ``v % lcm(a.modulus, b.modulus)``, so one
    period of it gives the count for the whole segment and the pattern of its runs.
    """
    lo, hi = a.min, a.max
    if lo > hi:
        return Sizes(0, (), False)
    period = math.lcm(max(a.modulus, 1), max(b.modulus, 1))
    cuts = {lo, hi + 1}
    for v in (b.min, b.max + 1, *a.excluded, *b.excluded, *(e + 1 for e in (*a.excluded, *b.excluded))):
        if lo < v <= hi:
            cuts.add(v)
    cuts = sorted(cuts)
    if period * len(cuts) > MAX_PERIOD_WORK:
        raise BundleError(
            f"cannot compare the sets of {a.name} and {b.name}: moduli {a.modulus} and {b.modulus} with "
            f"{len(cuts)} cut points exceed the comparison bound; simplify the guards"
        )
    count, runs, more, last = 0, [], False, 0

    def add(first: int, last: int) -> None:
        nonlocal more
        if runs and runs[-1][1] + 1 == first:
            runs[-1] = (runs[-1][0], last)
        elif len(runs) < limit:
            runs.append((first, last))
        else:
            more = True

    for start, end in zip(cuts, cuts[1:]):  # segment [start, end)
        n = end - start
        hits = [k for k in range(min(n, period)) if admits(a, start + k) and not admits(b, start + k)]
        if not hits:
            continue
        if n > period:  # whole periods, then the partial one at the end
            count += (n // period) * len(hits) + sum(k < n % period for k in hits)
        else:
            count += len(hits)
        last = max(start + k + (end - 1 - start - k) // period * period for k in hits)
        if more:
            continue
        if len(hits) == period:
            add(start, end - 1)
            continue
        q = 0
        while not more and start + q * period < end:
            for k in hits:
                v = start + q * period + k
                if v >= end or more:
                    break
                add(v, v)
            q += 1
    return Sizes(count, tuple(runs), more, last)


def set_text(g: SymbolGuard) -> str:
    return g.name if g.name.isdigit() else admissible_text(g)


def sizes_text(sizes: Sizes) -> str:
    return f"{sizes.text()} ({sizes.count} size{'s' * (sizes.count != 1)})"


def declared_text(g: SymbolGuard) -> str:
    """What the model file declared for a symbol: ``16..64``, ``16..64 multiple_of 8``."""
    multiple = f" multiple_of {g.declared_multiple}" if g.declared_multiple > 1 else ""
    return f"{g.declared_min}..{g.declared_max}{multiple}"


def compare_sets(subject: str, a: SymbolGuard, b: SymbolGuard, name: str) -> list[Change]:
    """widened / narrowed (or nothing) for the same dim or symbol with set ``a`` before, ``b`` after."""
    lost, gained = difference(a, b), difference(b, a)
    if not lost.count and not gained.count:
        return []
    details = []
    symbolic = not a.name.isdigit() and not b.name.isdigit()
    if symbolic and declared_text(a) != declared_text(b):
        details.append(f"declared {declared_text(a)} -> {declared_text(b)}")
    if lost.count:
        details.append(f"no longer accepted: {name} in {sizes_text(lost)}")
    if gained.count:
        details.append(f"newly accepted: {name} in {sizes_text(gained)}")
    kind = "narrowed" if lost.count else "widened"
    return [change(kind, subject, set_text(a), set_text(b), tuple(details))]
