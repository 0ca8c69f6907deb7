"""Several programs for one model, so a bundle covers every size its model file declares.

When one trace's guards exclude part of a declared range, the model is exported again over that
part (``batch == 1`` beside ``2 <= batch <= 64``); the loader runs each call in the first program
whose guards admit it. ``contract`` is what the bundle admits as a whole.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from aot.admissible import admissible_text
from aot.errors import SpecError, TraceError
from aot.schema import Bucket, Guards, InputGuard, SymbolGuard
from aot.spec import Dim, ModelSpec, plan_buckets
from aot.sympy_text import evaluate_vectorized
from aot.tracer.export import Exported, example_size, export_model, region_name
from aot.tracer.model import binding_note, call_model, call_plan, example_inputs, instantiate, split_constants
from aot.tracer.relations import MAX_GRID, Grid, excludes

# How many programs one build may trace to cover the declared ranges, and how many separate
# intervals of one symbol's uncovered sizes it traces (an odd/even split is never covered this way).
MAX_PROGRAMS = 8
MAX_REGIONS = 2
# A half-precision model's own error is measured against a float32 copy of it only up to this size.
FLOAT32_COPY_MAX_BYTES = 4 << 30


def float32_copy_fits(module) -> bool:
    return sum(t.numel() for t in module.state_dict().values()) * 4 <= FLOAT32_COPY_MAX_BYTES


def _uncovered(g, lo: int, hi: int, step: int = 1) -> list[tuple[int, int]]:
    """The sizes in ``lo..hi`` (multiples of ``step``: a Dim's ``multiple_of``) that ``g`` does not
    admit, as maximal runs of consecutive such sizes."""
    import numpy as np

    if hi - lo >= (1 << 22):
        whole = (
            (g.min, g.max) == (lo, hi) and g.modulus in (1, step) and g.residues == (0,) and not g.excluded
        )
        return [] if whole else [(lo, hi)] * 99
    v = np.arange(-(-lo // step) * step, hi + 1, step, dtype=np.int64)
    ok = (v >= g.min) & (v <= g.max) & np.isin(v % max(g.modulus, 1), g.residues if g.modulus > 1 else (0,))
    ok &= ~np.isin(v, g.excluded)
    bad = v[~ok]
    if bad.size == 0:
        return []
    breaks = np.nonzero(np.diff(bad) != step)[0]
    starts = np.concatenate([[bad[0]], bad[breaks + 1]])
    ends = np.concatenate([bad[breaks], [bad[-1]]])
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def export_programs(
    spec: ModelSpec,
    weights: str | None = None,
    fast: bool = False,
    allow_narrowing: bool | None = None,
    progress=None,
    ranges: dict[str, tuple[int, int]] | None = None,
    entry: str = "",
    module=None,
) -> list[Exported]:
    """Export the model over its declared ranges, and again over every part of them that the
    first trace's guards do not admit (``batch == 1`` beside ``2 <= batch <= 64``), until the
    programs together cover the declared ranges: the ahead-of-time counterpart of Dynamo's cache
    of guarded graphs. A part that cannot be covered (an odd size a reshape forbids, a model that
    fails to trace there) fails the build with the guard's site, unless ``allow_narrowing``.
    ``ranges``: where to start instead of the declared ranges (an entry point's fixed sizes);
    ``entry``: the entry point the programs serve.
    """
    say = progress or (lambda msg: None)
    allow = spec.allow_narrowing if allow_narrowing is None else allow_narrowing
    programs: list[Exported] = []
    failures: list[str] = []
    exhausted: list[str] = []  # regions left when MAX_PROGRAMS were traced
    real = None

    def trace_region(ranges: dict[str, tuple[int, int]], at: dict[str, int] | None = None):
        """One program over ``ranges`` (traced at ``at`` when given), sizes its trace fixes traced
        as static, size 1 of relaxed symbols checked against eager: (program, coverage), where
        coverage is the guards that say what it covers when a static trace replaced it."""
        nonlocal module, real
        ex = export_model(spec, weights, fast, ranges, module=module, at=at)
        module = ex.module
        coverage = None
        pinned = {
            g.name: g.min
            for g in ex.guards.symbols
            if g.min == g.max and ranges[g.name][0] < ranges[g.name][1]
        }
        if pinned:  # the trace fixed these sizes (int(h / 2), a quotient of 1): trace them as static
            coverage = ex.guards
            ex = export_model(
                spec, weights, fast, {**ranges, **{n: (v, v) for n, v in pinned.items()}}, module, at=at
            )
            if not programs and not entry:  # the bundle's first program takes the contract's inputs:
                # its guards are the dynamic trace's, which admit the fixed sizes alone
                ex = replace(
                    ex, guards=coverage, buckets=plan_buckets(spec, coverage), relaxed=(), strict=None
                )
        ex = replace(ex, entry=entry)
        if ex.relaxed:
            if fast and real is None:  # the check runs the model: it needs real weights
                real = instantiate(spec, weights)
            why = _check_relaxed(spec, ex, real if fast else ex.module)
            if why is None:
                say(f"  {', '.join(ex.relaxed)} = 1 runs the general trace: checked against eager")
            else:
                say(f"  {', '.join(ex.relaxed)} = 1 needs a program of its own: {why}")
                ex = replace(
                    ex, guards=ex.strict, buckets=plan_buckets(spec, ex.strict), relaxed=(), strict=None
                )
        return ex, coverage

    def cover(ranges: dict[str, tuple[int, int]]) -> None:
        if len(programs) >= MAX_PROGRAMS:
            exhausted.append(region_name(spec, ranges))
            return
        try:
            ex, coverage = trace_region(ranges)
        except (TraceError, SpecError) as e:
            if not programs:
                raise
            failures.append(f"{region_name(spec, ranges)}: {e}")
            return
        if programs:
            say(f"  traced a program for {ex.name} (the general trace's guards exclude it)")
        elif entry:
            say(f"  traced entry point {entry} ({ex.name})")
        elif note := binding_note(spec, ex.module):
            say(f"  {note}")
        programs.append(ex)
        symbols = {g.name: g for g in (ex.guards if coverage is None else coverage).symbols}
        fixed = dict(ranges)
        for d in spec.dims():
            lo, hi = ranges[d.name]
            if lo == hi:
                continue
            g = symbols[d.name]
            parts = _uncovered(g, lo, hi, d.multiple_of)
            if len(parts) > MAX_REGIONS:
                why = "; ".join(f"{s.text} at {s.file}:{s.line}: {s.code}" for s in g.sources) or "tracing"
                failures.append(
                    f"{d.name} {lo}..{hi} admits only {admissible_text(g)} ({why}){_propose(d, g)}"
                )
            else:
                for a, b in parts:
                    cover({**fixed, d.name: (a, b)})
            fixed[d.name] = (g.min, g.max)

    start = dict(ranges) if ranges else {d.name: (d.min, d.max) for d in spec.dims()}
    cover(start)

    def cover_relations() -> None:
        """Trace a program at each combination of sizes that a relation of the programs so far
        excludes and no program admits (DINOv2's native grid, ``(height//7)*(width//7) == 16``), over
        the smallest box holding what is left, until every combination the symbols' sets admit is
        admitted; what cannot be covered is a build warning that names the relation and the sizes."""
        relations = list(dict.fromkeys(r for p in programs for r in p.guards.relations))
        if not relations:
            return
        sites = "; ".join(f"{r.expr} at {r.source.file}:{r.source.line}: {r.source.code}" for r in relations)
        if not Grid.fits(spec.dims(), start):
            unsure = [r for r in relations if excludes(spec, start, r.expr) is not False]
            if unsure:
                sites = "; ".join(
                    f"{r.expr} at {r.source.file}:{r.source.line}: {r.source.code}" for r in unsure
                )
                say(
                    f"  warning: relation(s) {sites} may exclude declared sizes; the build does not check "
                    f"which (more than {MAX_GRID} combinations of sizes): a call they exclude is refused "
                    "with a GuardError"
                )
            return
        grid = Grid(spec.dims(), start)
        wanted = grid.each_symbol(programs)
        admitted = np.zeros(grid.shape, dtype=bool)
        for p in programs:
            admitted |= grid.admitted(p)
        why = ""
        while (left := wanted & ~admitted).any():
            if len(programs) >= MAX_PROGRAMS:
                why = f"more than {MAX_PROGRAMS} programs would be needed"
                break
            at = grid.point(tuple(int(i[0]) for i in np.nonzero(left)))
            try:
                ex, _ = trace_region(grid.bounds(left), at)
            except (TraceError, SpecError) as e:
                first = str(e).splitlines()[0]
                why = f"the model does not trace there: {first if len(first) <= 400 else first[:400] + '...'}"
                break
            mine = grid.admitted(ex) & left
            if not mine.any():  # the trace at ``at`` admits none of them: tracing again would not either
                why = f"the trace at {_sizes_text(at)} admits none of them"
                break
            own = [r.expr for r in ex.guards.relations]
            named = [ex.name] if ex.name != "general" else []
            ex = replace(ex, name="; ".join(named + own) or ex.name)
            say(f"  traced a program for {ex.name} (a relation of the other programs excludes it)")
            programs.append(ex)
            admitted |= mine
        else:
            return
        say(
            f"  warning: the bundle refuses declared sizes {grid.describe(left)} ({sites}): {why}; "
            "a call at those sizes gets a GuardError (aotpack guards lists the relation)"
        )

    if not exhausted:
        cover_relations()
    if exhausted:
        failures.append(_too_many(spec, programs[0], exhausted))
    if failures and not allow:
        raise TraceError(
            "the build cannot cover every declared size: "
            + " | ".join(dict.fromkeys(failures))  # once, though several regions of another dim miss it
            + "; change the model at those lines, declare narrower Dims, or accept the narrower contract with "
            "--allow-narrowing (ModelSpec(allow_narrowing=True))"
        )
    return programs


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def _too_many(spec: ModelSpec, general: Exported, regions: list[str]) -> str:
    """Why the programs ran out: the regions left, and what the general trace admits of each Dim
    it narrowed, with the model lines (a size made a Python int, ``int(math.ceil(h / 2) * 2)``, is
    fixed per trace; a window layout chosen by the size modulo a stride splits by residue)."""
    symbols = {g.name: g for g in general.guards.symbols}
    narrowed = []
    for d in spec.dims():
        g = symbols.get(d.name)
        lo, hi = general.ranges[d.name]
        if g is None or not _uncovered(g, lo, hi, d.multiple_of):
            continue
        why = "; ".join(f"{s.text} at {s.file}:{s.line}: {s.code}" for s in g.sources) or "tracing"
        narrowed.append(f"{d.name} {lo}..{hi} admits only {admissible_text(g)} ({why}){_propose(d, g)}")
    shown = ", ".join(regions[:4]) + (f" and {len(regions) - 4} more" if len(regions) > 4 else "")
    return (
        f"more than {MAX_PROGRAMS} programs would be needed ({shown} left); in the general trace, "
        + (" | ".join(narrowed) if narrowed else "guards split the declared ranges")
        + "; a size the model turns into a Python number (int(...), math.ceil of a size) is fixed per trace, "
        "so each size needs a program: declare fewer sizes (Dim(..., multiple_of=m) or narrower ranges)"
    )


def _propose(d: Dim, g) -> str:
    """What to declare when the sizes a trace admits are the multiples of some ``m`` (and maybe
    more): ``Dim(name, lo, hi, multiple_of=m)``, one program over the multiples (windows, strided
    patches), the other sizes refused at load with a ``GuardError`` that names the multiple."""
    import math

    if g.modulus <= 1 or 0 not in g.residues:
        return ""
    m = math.lcm(g.modulus, d.multiple_of)
    lo, hi = -(-max(d.min, g.min) // m) * m, min(d.max, g.max) // m * m
    if lo > hi:
        return ""
    from aot.spec import _dim_text

    want = replace(d, min=lo, max=hi, multiple_of=m, example=None, buckets=None)
    return (
        f"; the model needs {d.name} to be a multiple of {m}: declare {_dim_text(want)} and pad or resize "
        f"inputs to a multiple of {m} (the loader refuses other sizes with a GuardError that names it)"
    )


def _check_relaxed(spec: ModelSpec, ex: Exported, module) -> str | None:
    """Run the exported program at size 1 of each relaxed symbol against the eager ``module``
    (whose weights it takes); the reason it may not be relaxed, or None when every output matches."""
    import copy

    import torch

    from aot.dtypes import tolerance
    from aot.pytree import nest
    from aot.tracer.lower import tensor_leaves as leaves

    by_keyword, constants = call_plan(spec, module)
    constants, _ = split_constants(module, constants)  # the rest are bound inside the trace
    base = {d.name: example_size(d, ex.ranges[d.name]) for d in spec.dims()}
    try:  # the size-1 call must reach the graph, not the guard check export wraps around it
        graph = ex.ep.module(check_guards=False)
    except TypeError:  # torch without the option checks input ranges only, which admit 1
        graph = ex.ep.module()
    if module is not ex.module:  # traced with uninitialized weights (the guards-only path)
        # every parameter and buffer, non-persistent ones included (BERT's position_ids, RoPE's
        # inv_freq), which a state dict leaves out, and tied ones under each of their names
        real = {
            **dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False)),
        }
        with torch.no_grad():
            for name, t in [
                *graph.named_parameters(remove_duplicate=False),
                *graph.named_buffers(remove_duplicate=False),
            ]:
                if name in real and real[name].shape == t.shape:
                    t.copy_(real[name])
    # half precision's own error, measured against a float32 copy when that copy is affordable
    half = spec.dtype in ("float16", "bfloat16") and float32_copy_fits(module)
    wide = copy.deepcopy(module).float() if half else None
    smallest = {d.name: ex.ranges[d.name][0] for d in spec.dims()}
    for sym, others in ((s, o) for s in ex.relaxed for o in (base, smallest)):
        inputs = example_inputs(spec, {**others, sym: 1}, seed=spec.seed + 3)
        state = {i.name for i in spec.state_inputs()}
        fresh = {k: v.clone() for k, v in inputs.items() if k in state}  # each run writes its own
        try:
            with torch.no_grad():
                want = leaves(
                    call_model(spec, module, {**inputs, **{k: v.clone() for k, v in fresh.items()}})
                )
                inputs = {**inputs, **{k: v.clone() for k, v in fresh.items()}}
                if by_keyword:
                    got = leaves(graph(**nest({i.name: inputs[i.name] for i in spec.inputs}), **constants))
                else:
                    got = leaves(graph(*(inputs[i.name] for i in spec.inputs), **constants))
                exact = (
                    leaves(
                        call_model(
                            spec,
                            wide,
                            {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()},
                        )
                    )
                    if half
                    else want
                )
        except Exception as e:
            return f"the trace fails at {sym} = 1: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        for w, g, x in zip(want, got, exact):
            if w.shape != g.shape:
                return f"at {sym} = 1 the trace gives shape {list(g.shape)}, eager {list(w.shape)}"
            if w.dtype.is_floating_point:
                err = (w.float() - g.float()).abs().max().item() if w.numel() else 0.0
                scale = max(1.0, w.float().abs().max().item() if w.numel() else 1.0)
                # two half-precision evaluations differ by up to about twice their own error
                noise = (w.float() - x.float()).abs().max().item() if w.numel() else 0.0
                if not err <= max(tolerance(spec.dtype).rtol * scale, 4 * noise):
                    return f"at {sym} = 1 the trace differs from eager by {err:.3g}"
            elif not torch.equal(w, g):
                return f"at {sym} = 1 the trace differs from eager"
    return None


def contract(spec: ModelSpec, programs: list[Exported]) -> Guards:
    """The bundle's guards as a whole: per symbol, every size some program admits (a program
    tracing a symbol as static admits that one size); relations of the general program; the
    guard sources of every program (they explain where the programs split)."""
    import numpy as np

    from aot.tracer.guards import MAX_RANGE, describe_mask

    if len(programs) == 1:
        return programs[0].guards
    first = programs[0].guards
    symbols = []
    # a Dim every program traced as one static size (a range of one size, ``Dim("batch", 1, 1)``:
    # export specializes it) is that size in the contract, as in a bundle of one program: the
    # programs' inputs then agree with the contract's
    static: dict[str, int] = {}
    for d in spec.dims():
        per = [{g.name: g for g in p.guards.symbols}.get(d.name) for p in programs]
        fixed = {p.ranges[d.name] for p in programs}
        if all(g is None for g in per) and len(fixed) == 1 and len({*next(iter(fixed))}) == 1:
            static[d.name] = next(iter(fixed))[0]
            continue
        general = per[0]
        if d.max - d.min >= MAX_RANGE:
            symbols.append(general)
            continue
        values = np.arange(d.min, d.max + 1, dtype=np.int64)
        mask = np.zeros(values.shape, dtype=bool)
        declared = values % d.multiple_of == 0
        for p, g in zip(programs, per):
            if g is None:  # static in that program
                mask |= values == p.ranges[d.name][0]
            else:
                m = (values >= g.min) & (values <= g.max) & ~np.isin(values, g.excluded)
                if g.modulus > 1:
                    m &= np.isin(values % g.modulus, g.residues)
                mask |= m
        shape = describe_mask(values, mask & declared)
        if shape is None:
            raise TraceError(f"no program admits any size of {d.name}")
        # Every program's guards stay listed: they say why the programs split where they do.
        sources = list(dict.fromkeys(src for g in per if g is not None for src in g.sources))
        symbols.append(
            SymbolGuard(
                name=d.name,
                declared_min=d.min,
                declared_max=d.max,
                min=shape.lo,
                max=shape.hi,
                modulus=shape.modulus,
                residues=shape.residues,
                excluded=shape.excluded,
                sources=tuple(sorted(sources, key=lambda s: (s.file, s.line, s.text))),
                declared_multiple=d.multiple_of if d.multiple_of > 1 else 0,
            )
        )
    declared_inputs = tuple(
        InputGuard(
            name=i.name,
            dtype=i.dtype or spec.dtype,
            shape=tuple(
                (str(static[s.name]) if s.name in static else s.name) if isinstance(s, Dim) else str(s)
                for s in i.shape
            ),
            state=i.state,
        )
        for i in spec.inputs
    )
    return Guards(
        inputs=declared_inputs,
        symbols=tuple(symbols),
        relations=_contract_relations(spec, programs),
        specializations=first.specializations,
    )


def _contract_relations(spec: ModelSpec, programs: list[Exported]):
    """The general program's relations that every program keeps: one that another program
    crosses (the branch DINOv2 takes at its native grid) is not the bundle's, each program's own
    guards hold it where it applies. Without a grid to check on, all of them."""
    relations = programs[0].guards.relations
    if not relations or len(programs) == 1:
        return relations
    ranges = {d.name: (d.min, d.max) for d in spec.dims()}
    if not Grid.fits(spec.dims(), ranges):
        return relations
    grid = Grid(spec.dims(), ranges)
    admitted = np.zeros(grid.shape, dtype=bool)
    for p in programs:
        admitted |= grid.admitted(p)
    env = grid.env()
    return tuple(
        r
        for r in relations
        if np.broadcast_to(evaluate_vectorized(r.expr, env), grid.shape).astype(bool)[admitted].all()
    )


def program_entries(
    spec: ModelSpec, programs: list[Exported], buckets: list[tuple[Bucket, ...]] | None = None
):
    """``ProgramEntry`` per program (for the manifest); empty when there is only one."""
    from aot.schema import ProgramEntry

    if len(programs) == 1 and not programs[0].entry:
        return ()
    buckets = buckets or [p.buckets for p in programs]
    return tuple(
        ProgramEntry(name=p.name, guards=p.guards, buckets=b, entry=p.entry)
        for p, b in zip(programs, buckets)
    )


def export_entry_points(
    spec: ModelSpec,
    weights: str | None = None,
    fast: bool = False,
    allow_narrowing: bool | None = None,
    progress=None,
) -> list[Exported]:
    """``export_programs`` for each entry point of ``spec`` (its Dims fixed as the entry point
    says), in declaration order; for a spec without entry points, ``export_programs`` itself."""
    if not spec.entry_points:
        return export_programs(spec, weights, fast, allow_narrowing, progress)
    out: list[Exported] = []
    for ep in spec.entry_points:
        ranges = {
            d.name: (ep.sizes[d.name],) * 2 if d.name in ep.sizes else (d.min, d.max) for d in spec.dims()
        }
        module = out[0].module if out else None
        out += export_programs(
            spec.for_entry(ep),
            weights,
            fast,
            allow_narrowing,
            progress,
            ranges=ranges,
            entry=ep.name,
            module=module,
        )
    return out
