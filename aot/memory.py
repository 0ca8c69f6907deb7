"""The memory a call may take, known at load and held to on every call.

At load, each program's peak activation bytes is bounded over every size its guards admit: each
buffer's declared shape is evaluated over the symbols' admitted ranges in interval arithmetic
(``Bounds``, an ``aot.symexpr.Algebra``), so a shape that shrinks as a symbol grows is bounded
too, and the buffers' liveness gives the peak (``aot.program.peak_of``), on the path this device
runs (kernel steps on CUDA, their reference steps on the CPU). For a real model, whose sizes grow
with its symbols, that is the peak at the largest admitted sizes. The memory plan in the manifest
must agree with the packager's own computation (``aot.program.peak_bytes``), and a caller's
``max_memory`` refuses a bundle whose bound exceeds it. On every call each step's results are held
to their declared shapes' bytes (``OutputBytes``), so the declared shapes, and the bound computed
from them, bind the program.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from aot.admissible import first_admissible, last_admissible
from aot.dtypes import ITEMSIZE
from aot.errors import BundleError, EnvError
from aot.program import peak_bytes, peak_of, reference_steps, spec_bytes
from aot.schema import Guards, Manifest, Program, TensorSpec
from aot.symexpr import MAX_VALUE, fold, parse

Interval = tuple[int, int]

# How far the manifest's memory plan may be from the loader's own computation: the same function
# gives the same number; the margin admits planners of other aotpack versions that count a view or
# an alignment differently, not a plan off by a factor.
PLAN_TOLERANCE = 0.10
PLAN_SLACK_BYTES = 64 << 10
OUTPUT_BYTES_CACHE = 64  # distinct call sizes whose buffer bytes are kept (one dict each)


def largest_sizes(guards: Guards) -> dict[str, int]:
    """Each symbol at the largest value its admissible set holds (relations aside: a bound)."""
    out = {}
    for g in guards.symbols:
        v = last_admissible(g.max, g.modulus, g.residues)
        excluded = set(g.excluded)
        while v in excluded and v >= g.min:
            v = last_admissible(v - 1, g.modulus, g.residues)
        out[g.name] = v
    return out


def admitted_box(guards: Guards) -> dict[str, Interval]:
    """Each symbol's smallest and largest admitted value."""
    largest = largest_sizes(guards)
    return {g.name: (first_admissible(g.min, g.modulus, g.residues), largest[g.name]) for g in guards.symbols}


class Bounds:
    """Size expressions over intervals: each construct maps (lo, hi) bounds of its operands to
    bounds of its value (exact for sums and products of sizes, conservative elsewhere)."""

    def __init__(self, box: dict[str, Interval]):
        self.box = box

    def const(self, value: int) -> Interval:
        return (value, value)

    def name(self, name: str) -> Interval:
        if name not in self.box:
            raise BundleError(f"symbolic expression uses unknown symbol {name!r}")
        return self.box[name]

    def binary(self, op: str, a: Interval, b: Interval) -> Interval:
        if op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if op == "-":
            return (a[0] - b[1], a[1] - b[0])
        if op == "%":
            return (0, b[1] - 1) if b[0] > 0 else (-MAX_VALUE, MAX_VALUE)
        if op == "//" and b[0] <= 0:
            return (-MAX_VALUE, MAX_VALUE)
        corners = [x * y if op == "*" else x // y for x in a for y in b]
        return (min(corners), max(corners))

    def compare(self, op: str, a: Interval, b: Interval) -> Interval:
        return (0, 1)

    def neg(self, a: Interval) -> Interval:
        return (-a[1], -a[0])

    def not_(self, a: Interval) -> Interval:
        return (0, 1)

    def boolean(self, op: str, parts: list[Interval]) -> Interval:
        return (0, 1)

    def call(self, fn: str, args: list[Interval]) -> Interval:
        pick = max if fn == "max" else min
        return (pick(a[0] for a in args), pick(a[1] for a in args))


def bytes_bound(spec: TensorSpec, bounds: Bounds) -> int:
    """The most bytes a tensor of ``spec`` takes at any size in the box."""
    n = ITEMSIZE.get(spec.dtype, 8)
    for size in spec.shape:
        n *= max(0, fold(parse(size), bounds)[1])
    return n


def planned_peak(program: Program, guards: Guards, cpu: bool) -> tuple[int, dict[str, int]]:
    """(the most activation bytes a call may hold at any admitted size, the largest admitted sizes),
    on the CPU path or the GPU's."""
    bounds = Bounds(admitted_box(guards))
    if cpu:
        program = replace(program, steps=tuple(reference_steps(program)))
    return peak_of(program, lambda spec: bytes_bound(spec, bounds)), largest_sizes(guards)


def check_plan(manifest: Manifest, program: Program, path: Path) -> None:
    """The manifest's memory plan is what the program's buffers take at its largest bucket's sizes
    (what the one shared CUDA-graph pool must hold) and its smallest; the entries between are
    only shown by ``aotpack inspect``, and each costs milliseconds to recompute."""
    plan = manifest.stats.memory_plan
    for entry in plan[:1] + plan[1:][-1:]:
        if set(entry.sizes) != {s.symbol for s in program.symbols}:
            raise BundleError(
                f"{path}: memory plan entry at {entry.sizes} does not name the program's symbols"
            )
        got = peak_bytes(program, dict(entry.sizes))
        if abs(got - entry.peak_bytes) > PLAN_TOLERANCE * got + PLAN_SLACK_BYTES:
            raise BundleError(
                f"{path}: the memory plan says {entry.peak_bytes} bytes at {_sizes_text(entry.sizes)}, "
                f"the program's buffers take {got}; the plan is wrong, rebuild the bundle"
            )


def check_max_memory(peak: int, sizes: dict[str, int], max_memory: int, name: str) -> None:
    if peak > max_memory:
        raise EnvError(
            f"program {name!r} needs up to {_bytes_text(peak)} of activations per call (at the "
            f"sizes its guards admit, up to {_sizes_text(sizes)}), more than max_memory "
            f"{_bytes_text(max_memory)}; raise max_memory, or rebuild with smaller declared ranges"
        )


class OutputBytes:
    """Each buffer's declared bytes at a call's sizes, for holding step results to them."""

    def __init__(self, program: Program):
        self.specs = dict(program.buffers)
        self._cache: dict[tuple, dict[str, int]] = {}

    def at(self, sizes: dict[str, int]) -> dict[str, int]:
        key = tuple(sorted(sizes.items()))
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) >= OUTPUT_BYTES_CACHE:
                self._cache.clear()
            found = self._cache[key] = {n: spec_bytes(s, sizes) for n, s in self.specs.items()}
        return found


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())) or "static sizes"


def _bytes_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
