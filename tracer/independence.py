"""Prove, at build time, which dynamic dims keep their rows independent, and confirm it.

A server joins requests along a dim only when row ``b`` of every output depends on row ``b`` of
the inputs alone. For each symbol, ``aot.rows.row_mixing`` reads that off every program's steps;
where it holds, the eager model is run twice on the same inputs but for one row, and every other
row of every output must come back bitwise equal. The answer goes into the contract's
``SymbolGuard.rows_independent`` and ``rows_check`` (what was checked, or why not).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.admissible import admits
from aot.rows import row_mixing
from aot.schema import Guards, Program, SymbolGuard
from aot.spec import Dim, ModelSpec

ROWS_CHECKED = 3  # rows in the numerical check: the changed one sits between two others


def check_rows(
    spec: ModelSpec, module: Any, programs: list[Program], guards: Guards, progress=None
) -> Guards:
    """``guards`` with ``rows_independent`` and ``rows_check`` set for every symbol."""
    symbols = {g.name: g for g in guards.symbols}
    base = {}
    for d in spec.dims():
        g = symbols.get(d.name)
        base[d.name] = d.example_size if g is None or admits(g, d.example_size) else g.min
    out = []
    for g in guards.symbols:
        reason = next(
            (r for p in programs if (r := row_mixing(p, g.name, base)) is not None),
            None,
        )
        if reason is None:
            reason = _confirm(spec, module, programs[0], g, base)
        if reason is None:
            n, j = _rows_to_check(g)
            note = f"no step mixes rows; changing row {j} of {n} left the other rows of every output bitwise equal"
            out.append(replace(g, rows_independent=True, rows_check=note))
        else:
            if progress:
                progress(f"  rows along {g.name} are not independent: {reason}")
            out.append(replace(g, rows_independent=False, rows_check=reason))
    return replace(guards, symbols=tuple(out))


def _rows_to_check(g: SymbolGuard) -> tuple[int, int]:
    """(rows, the row to change): the smallest admitted size of at least ``ROWS_CHECKED`` rows (or
    2), and its middle row."""
    for least in (ROWS_CHECKED, 2):
        n = next((v for v in range(max(g.min, least), min(g.max, 4096) + 1) if admits(g, v)), None)
        if n is not None:
            return n, n // 2
    return 0, 0


def _changed_row(value: Any, other: Any, inp, dim: int, row: int) -> Any:
    """``value`` with row ``row`` along ``dim`` taken from ``other``, or (where that is the same)
    moved to another value the input admits."""
    import torch

    out = value.clone()
    target, source = out.select(dim, row), other.select(dim, row)
    if torch.equal(target, source):
        if value.dtype == torch.bool:
            source = ~target
        elif value.dtype.is_floating_point:
            source = target * 0.5 + 0.25
        else:
            low, high = int(inp.low), int(inp.high)
            source = (target - low + 1) % max(1, high - low) + low
    target.copy_(source)
    return out


def _confirm(
    spec: ModelSpec, module: Any, program: Program, g: SymbolGuard, base: dict[str, int]
) -> str | None:
    import torch

    from aot.tracer.lower import tensor_leaves as leaves
    from aot.tracer.model import call_model, example_inputs

    n, j = _rows_to_check(g)
    if n < 2:
        return f"{g.name} admits no size of two rows or more: nothing to join"
    sizes = {**base, g.name: n}
    inputs = example_inputs(spec, sizes, seed=spec.seed + 3)
    others = example_inputs(spec, sizes, seed=spec.seed + 4)
    changed = dict(inputs)
    for inp in spec.inputs:
        dims = [d for d, s in enumerate(inp.shape) if isinstance(s, Dim) and s.name == g.name]
        if dims:
            changed[inp.name] = _changed_row(inputs[inp.name], others[inp.name], inp, dims[0], j)
    try:
        with torch.no_grad():
            want = leaves(call_model(spec, module, inputs))
            got = leaves(call_model(spec, module, changed))
    except Exception as e:  # sizes the model refuses (a relation between dims): not confirmed
        sizes_text = ", ".join(f"{k}={v}" for k, v in sizes.items())
        return f"not confirmed: the eager model failed at {sizes_text} ({type(e).__name__}: {str(e)[:120]})"
    shapes = [program.buffers[o].shape if o in program.buffers else () for o in program.outputs]
    for k, (w, c) in enumerate(zip(want, got)):
        dims = [d for d, s in enumerate(shapes[k] if k < len(shapes) else ()) if s == g.name]
        if not dims:
            continue
        keep = [i for i in range(n) if i != j]
        a = w.index_select(dims[0], torch.tensor(keep)).contiguous()
        b = c.index_select(dims[0], torch.tensor(keep)).contiguous()
        if a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return (
                f"the program's steps keep rows apart, but changing row {j} of {n} changed other rows "
                f"of output {k} on the eager model"
            )
    return None
