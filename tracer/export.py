"""One ``torch.export`` of the model over given ranges of its symbols, and the guards it needed.

Every guard the shape environment records is renamed to the model file's Dim names, placed at its
source line (``aot.tracer.sites``) and simplified over the bounded ranges (``aot.tracer.guards``).
Guards that exclude only size 1 are set apart: ``aot.tracer.programs`` checks them against eager.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aot.errors import TraceError
from aot.experts import grouped_experts
from aot.schema import Bucket, Guards, InputGuard
from aot.spec import Dim, ModelSpec, plan_buckets
from aot.tracer.complex_parts import polar_from_parts
from aot.tracer.model import (
    bound_forward,
    call_plan,
    example_inputs,
    instantiate,
    instantiate_shapes_only,
    positional_names,
    run_eager,
    split_constants,
    user_input_nodes,
)
from aot.tracer.sites import (
    VALUE_SHAPES,
    display_path,
    error_site,
    first_line,
    float_from_sizes,
    record_guard_sites,
    value_dependent_size,
)


@contextlib.contextmanager
def quiet_torch():
    """Keep torch's own output out of a build's log: a failed export prints its partial graph to
    stderr and logs warnings and errors before raising, and aotpack reports the failure in one line
    with the model's file:line. ``aotpack --verbose`` (``AOTPACK_VERBOSE=1``) or ``AOTPACK_DEBUG=1``
    lets it all through."""
    if os.environ.get("AOTPACK_VERBOSE") or os.environ.get("AOTPACK_DEBUG"):
        yield
        return
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def unchanged_module_to():
    """While a model is exported, ``Module.to`` that changes nothing (every parameter and buffer
    already of that dtype and on that device) returns the module as it is. A forward that casts a
    submodule to the dtype it has (Switch Transformers' router: ``self.classifier =
    self.classifier.to(self.dtype)``) would otherwise swap each parameter for itself, which the
    export's parameters refuse; a cast that changes something still does what it did."""
    import torch

    original = torch.nn.Module.to

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        unchanged = memory_format is None and all(
            (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
            and (device is None or t.device == device)
            for t in tensors
        )
        return self if unchanged else original(self, *args, **kwargs)

    torch.nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]


# torch.export's item for a dynamic dim the code turned into a constant
SPECIALIZED = re.compile(
    r"L\['(\w+)'\]\.size\(\)\[(\d+)\] as dynamic but your code specialized it to be a constant \((\d+)\)"
)


# torch.export's item for a dynamic dim whose range leaves one size once 0 and 1 are ruled out
TWO_SIZES = re.compile(r"Dim\.DYNAMIC\(min=(\d+), max=(\d+)\), but tracing inferred a static shape of (\d+)")


def specialized(name: str, dim: int | str, dim_name: str, size: Any, also: str = "") -> str:
    """That input ``name``'s dim ``dim`` (the Dim ``dim_name``) was traced as the constant
    ``size``, and what to do; ``also``: the other inputs' dims it fixed, said after it."""
    return (
        f"input {name!r} dim {dim} ({dim_name}) was specialized to {size} while tracing{also}; make it a "
        f"static size or remove the code that fixes it (or, where {size} is also the length of a tensor "
        f"that {dim_name} slices, trace at another example: Dim(..., example=N))"
    )


def _specialized(text: str, spec: ModelSpec) -> str | None:
    """What to say where torch.export reports declared dims the code turned into constants (its
    ``specialized it to be a constant`` items), in the words of ``symbol_names``' own check; None
    where the message has no such item."""
    items = SPECIALIZED.findall(text)
    if not items:
        return None
    inputs = {i.name: i for i in spec.inputs}
    found = []
    for name, dim, value in items:
        shape = inputs[name].shape if name in inputs else ()
        declared = shape[int(dim)] if int(dim) < len(shape) else None
        found.append((name, dim, value, declared.name if isinstance(declared, Dim) else "a Dim"))
    name, dim, value, label = found[0]
    also = f" (so were {', '.join(f'{n} dim {d}' for n, d, *_ in found[1:])})" if found[1:] else ""
    return specialized(name, dim, label, value, also) + '; TORCH_LOGS="+dynamic" shows the line'


def export_error(e: Exception, spec: ModelSpec) -> TraceError:
    where, frame = error_site(e, Path(spec.extra.get("path", "model.py")))
    specialized = _specialized(str(e), spec)
    if specialized:
        return TraceError(f"{where}cannot export the model: {specialized}")
    code = f" ({frame.line.strip()})" if frame and frame.line else ""
    name = type(e).__name__
    text = str(e)
    first = first_line(e)[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if first.endswith(":") and len(lines) > 1:  # a heading (torch's list of conflicts): its first item too
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        first = f"{first} {lines[1].lstrip('- ')[:300]}{more}"
    if "Could not extract specialized" in text or "Could not extract" in text and "data-dependent" in text:
        hint = (
            "the model turns a tensor value into a Python number (.item(), int(t), t.tolist()); "
            + VALUE_SHAPES
            + ", and keep values as tensors"
        )
    elif "DataDependent" in name or "data-dependent" in text.lower():
        hint = (
            "the model branches on tensor values (an `if` on a tensor); use torch.where or torch.cond, "
            "or torch._check to state the assumption"
        )
    elif (two := TWO_SIZES.search(text)) and max(int(two[1]), 2) == int(two[2]) == int(two[3]):
        hint = (
            f"torch.export traces a dynamic dim as at least 2, so a range of {two[1]} to {two[2]} leaves it "
            f"only {two[2]}; widen the range (a max of 3 or more) or make that dim static"
        )
    elif "Constraint" in name or "specializ" in text.lower() or "inferred a static shape" in text:
        hint = "a Dim was specialized or its range conflicts with the code; make that dim static or change the code"
    else:
        hint = "change the model so torch.export can trace it (https://pytorch.org/docs/stable/export.html)"
    return TraceError(f"{where}cannot export the model{code}: {name}: {first}; {hint}")


def _guard_text(expr, names, frame: traceback.FrameSummary | None, model_path: Path) -> str:
    """A guard in the grammar of ``aot.symexpr``; one on a float computed from sizes (``h0 / 4 ==
    1.0`` from an interpolation's scale) fails at the model line that computes it."""
    import sympy
    from torch.utils._sympy import functions as tfn

    from aot.sympy_text import to_text

    try:
        return to_text(expr, names)
    except TraceError:
        floats = (tfn.IntTrueDiv, tfn.FloatTrueDiv, tfn.ToFloat, sympy.Float)
        if not any(isinstance(a, floats) for a in sympy.preorder_traversal(expr)):
            raise
    where = f"{display_path(frame.filename, model_path)}:{frame.lineno}: " if frame else ""
    shown = str(expr)
    for sym, name in names.items():
        shown = shown.replace(str(sym), name)
    code = (frame.line or "").strip() if frame else ""
    raise TraceError(float_from_sizes(where, "a guard", shown, code)) from None


@dataclass(frozen=True)
class Exported:
    """The result of ``export_model``: enough for guards; ``trace`` goes on to lower it.

    ``ranges``: each symbol's range in this trace (a sub-range of the declared one when the
    trace covers part of it; ``lo == hi`` traced as a static size)."""

    ep: Any
    module: Any
    examples: dict[str, Any]
    guards: Guards
    buckets: tuple[Bucket, ...]
    start: float
    ranges: dict[str, tuple[int, int]]
    name: str = "general"
    # Symbols whose only exclusion was size 1 (HF's ``if batch_size != position_ids.shape[0]``,
    # ``is_causal = q_len > 1``): admitted here, checked against eager at size 1 by
    # ``aot.tracer.programs``; ``strict`` holds the guards with those exclusions kept.
    relaxed: tuple[str, ...] = ()
    strict: Guards | None = None
    entry: str = ""  # the entry point (``aot.spec.EntryPoint``) this export serves


def export_model(
    spec: ModelSpec,
    weights: str | None = None,
    fast: bool = False,
    ranges: dict[str, tuple[int, int]] | None = None,
    module: Any = None,
    at: dict[str, int] | None = None,
) -> Exported:
    """``torch.export`` the model with its declared dims and collect the simplified guards.

    ``ranges`` restricts symbols to sub-ranges of their declared ones (``lo == hi``: static).
    ``fast``: export a module with uninitialized weights (``instantiate_shapes_only``): the same
    guards, for callers that need only them (``aotpack guards``/``check``); if that module does
    not export, the full module is exported instead. ``module``: reuse one already built.
    ``at``: sizes to trace at instead of the Dims' examples (a point a relation excludes).
    """
    import torch
    import torch.fx.experimental._config as fx_config
    from torch.export import Dim as TorchDim
    from torch.export import export

    from aot.tracer.guards import RawGuard

    start = time.perf_counter()
    model_path = Path(spec.extra.get("path", "model.py"))
    ranges = ranges or {d.name: (d.min, d.max) for d in spec.dims()}
    if module is None:
        module = instantiate_shapes_only(spec) if fast else None
        if module is None:
            fast, module = False, instantiate(spec, weights)
    sizes = {d.name: example_size(d, ranges[d.name]) for d in spec.dims()} | (at or {})
    examples = example_inputs(spec, sizes)
    by_keyword, constants = call_plan(spec, module)
    constants, bound = split_constants(module, constants)
    quotients: dict[str, Any] = {}

    def torch_dim(d: Dim):
        lo, hi = ranges[d.name]
        m = d.multiple_of
        if m == 1:
            return TorchDim.DYNAMIC(min=lo, max=hi)
        # ``Dim(..., multiple_of=m)``: traced as m * q, so arithmetic modulo m (or a divisor) is exact
        if d.name not in quotients:
            quotients[d.name] = TorchDim(f"{d.name}_over_{m}", min=-(-lo // m), max=hi // m)
        return quotients[d.name] * m

    def dims_of(inp):
        return {
            d: torch_dim(s)
            for d, s in enumerate(inp.shape)
            if isinstance(s, Dim) and ranges[s.name][0] < ranges[s.name][1]
        } or None

    if by_keyword:
        from aot.pytree import nest

        args, kwargs = (), {**nest({i.name: examples[i.name] for i in spec.inputs}), **constants}
        dynamic: Any = {**nest({i.name: dims_of(i) for i in spec.inputs}), **{k: None for k in constants}}
    else:
        args, kwargs = tuple(examples[i.name] for i in spec.inputs), dict(constants)
        dynamic = tuple(dims_of(i) for i in spec.inputs)
        if constants:
            dynamic = {
                **dict(zip(positional_names(module, len(args)), dynamic)),
                **{k: None for k in constants},
            }
    sites: dict[int, traceback.FrameSummary | None] = {}
    try:
        with (
            record_guard_sites(sites),
            fx_config.patch(backed_size_oblivious=True),
            torch.no_grad(),
            bound_forward(module, bound),
            grouped_experts(module),
            unchanged_module_to(),
            polar_from_parts(),
            quiet_torch(),
        ):
            ep = export(module, args, kwargs, dynamic_shapes=dynamic)
    except Exception as e:
        if fast:
            return export_model(spec, weights, ranges=ranges, at=at)
        run_eager(spec, module, examples)  # a spec mistake is reported as one
        raise export_error(e, spec) from None

    static = {name: lo for name, (lo, hi) in ranges.items() if lo == hi}
    names = symbol_names(ep, spec, check=True, static=static)
    user_vals = [n.meta["val"] for n in user_input_nodes(ep, spec).values()]
    fake_mode = next((v.fake_mode for v in user_vals if hasattr(v, "fake_mode")), None)
    if fake_mode is not None:
        # Inputs that share a size get one symbol after export (the others are replaced), but guards
        # recorded before that still name the originals: name every symbol by where it was read.
        names = {**names, **_source_names(fake_mode.shape_env, spec, module, by_keyword)}
    raw = []
    for g in fake_mode.shape_env.guards if fake_mode is not None else ():
        if not g.expr.free_symbols:
            continue
        frame = sites.get(id(g.sloc))
        unnamed = sorted(str(s) for s in g.expr.free_symbols if s not in names)
        if unnamed:
            where = f"{display_path(frame.filename, model_path)}:{frame.lineno}: " if frame else ""
            raise value_dependent_size(unnamed[0], where, (frame.line or "").strip() if frame else "")
        raw.append(
            RawGuard(
                text=_guard_text(g.expr, names, frame, model_path),
                symbols=tuple(sorted({dim_of_name(names[s]) for s in g.expr.free_symbols})),
                file=display_path(frame.filename, model_path) if frame else "<torch>",
                line=frame.lineno if frame else 0,
                code=(frame.line or "").strip() if frame else "",
            )
        )
    dynamic_ranges = {d.name: ranges[d.name] for d in spec.dims() if d.name not in static}
    relaxable = _size_one_guards(ep, names, raw, dynamic_ranges)
    binding = [g for g in raw if g not in relaxable]
    multiples = {
        d.name: (d.multiple_of, declared_multiple(d, model_path))
        for d in spec.dims()
        if d.multiple_of > 1 and d.name in dynamic_ranges
    }
    guards = _guards(spec, static, dynamic_ranges, binding, multiples)
    strict = _guards(spec, static, dynamic_ranges, raw, multiples) if relaxable else None
    relaxed = tuple(sorted({g.symbols[0] for g in relaxable}))
    return Exported(
        ep=ep,
        module=module,
        examples=examples,
        guards=guards,
        buckets=plan_buckets(spec, guards),
        start=start,
        ranges=dict(ranges),
        name=region_name(spec, ranges),
        relaxed=relaxed,
        strict=strict,
    )


def _size_one_guards(ep, names: dict, raw: list, ranges: dict[str, tuple[int, int]]) -> list:
    """Guards that exclude only size 1 of one symbol declared from 1: the ``>= 2`` side of a
    size-oblivious decision (HF's ``if batch_size != position_ids.shape[0]``) or of a branch whose
    other side computes the same at 1 (``is_causal = q_len > 1``: a 1x1 causal mask allows all).
    The build admits size 1 in this trace only after running it there against eager."""
    import numpy as np

    from aot.sympy_text import evaluate_vectorized

    out = []
    for g in raw:
        if len(g.symbols) != 1:
            continue
        (sym,) = g.symbols
        lo, hi = ranges.get(sym, (0, 0))
        if lo != 1 or hi < 2:
            continue
        values = np.arange(1, min(hi, 64) + 1, dtype=np.int64)
        mask = np.broadcast_to(evaluate_vectorized(g.text, {sym: values}), values.shape).astype(bool)
        if not mask[0] and mask[1:].all():
            out.append(g)
    return out


def example_size(d: Dim, bounds: tuple[int, int]) -> int:
    """The size ``d`` is traced at within ``bounds`` (a part of its range): its example, moved into
    them, and onto a multiple of ``multiple_of``."""
    lo, hi = bounds
    m = d.multiple_of
    size = min(max(d.example_size, lo), hi)
    if size % m:
        size = size // m * m if size // m * m >= lo else -(-size // m) * m
    if size == m and 2 * m <= hi:  # a quotient of 1 is one torch would specialize
        size = 2 * m
    return size


def dim_of_name(name: str) -> str:
    """The Dim a symbol's name speaks of: ``(height//8)`` (the quotient a ``multiple_of=8`` Dim
    is traced by) is ``height``."""
    return name[1:].split("//", 1)[0] if name.startswith("(") else name


def declared_multiple(d: Dim, model_path: Path):
    """``d % m == 0`` as a guard of the model file: the line that declares ``multiple_of`` (the
    first that names the Dim and ``multiple_of``), or the Dim itself when none is found."""
    from aot.spec import _dim_text
    from aot.tracer.guards import RawGuard

    line, code = 0, _dim_text(d)
    try:
        for k, text in enumerate(model_path.read_text().splitlines(), 1):
            if "multiple_of" in text and (f'"{d.name}"' in text or f"'{d.name}'" in text):
                line, code = k, text.strip()
                break
    except (OSError, UnicodeDecodeError):
        pass
    return RawGuard(
        text=f"{d.name} % {d.multiple_of} == 0",
        symbols=(d.name,),
        file=display_path(str(model_path), model_path),
        line=line,
        code=code,
    )


def _guards(
    spec: ModelSpec,
    static: dict[str, int],
    ranges: dict[str, tuple[int, int]],
    raw: list,
    multiples: dict[str, tuple[int, Any]] | None = None,
) -> Guards:
    from dataclasses import replace

    from aot.tracer.guards import GuardSimplifier

    simplifier = GuardSimplifier(ranges, multiples)
    simplifier.add(raw)
    declared = {d.name: d.multiple_of for d in spec.dims() if d.multiple_of > 1}
    return Guards(
        inputs=tuple(
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
        ),
        symbols=tuple(
            replace(g, declared_multiple=declared[g.name]) if g.name in declared else g
            for g in simplifier.symbol_guards()
        ),
        relations=simplifier.relation_guards(),
    )


def region_name(spec: ModelSpec, ranges: dict[str, tuple[int, int]]) -> str:
    """What a program covers, where it differs from the declared ranges: ``batch == 1``."""
    parts = []
    for d in spec.dims():
        lo, hi = ranges[d.name]
        if (lo, hi) != (d.min, d.max):
            parts.append(f"{d.name} == {lo}" if lo == hi else f"{lo} <= {d.name} <= {hi}")
    return ", ".join(parts) or "general"


def symbol_names(
    ep, spec: ModelSpec, check: bool = False, static: dict[str, int] | None = None
) -> dict[Any, str]:
    """Map the export's size symbols to the model file's Dim names via the traced input shapes."""
    import torch

    static = static or {}
    names: dict[Any, str] = {}
    nodes = user_input_nodes(ep, spec)
    for inp in spec.inputs:
        val = nodes[inp.name].meta["val"]
        for d, (declared, size) in enumerate(zip(inp.shape, val.shape)):
            if not isinstance(declared, Dim) or declared.name in static:
                continue
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            m = declared.multiple_of
            if m > 1 and expr is not None and expr.is_Mul and expr.as_coeff_Mul()[0] == m:
                root = expr.as_coeff_Mul()[1]
                if root.is_Symbol:  # traced as m * q: q is the Dim's quotient by m
                    names.setdefault(root, f"({declared.name}//{m})")
                    continue
            if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
                if check:
                    raise TraceError(specialized(inp.name, d, declared.name, size))
                continue
            names.setdefault(size.node.expr, declared.name)
    return names


def _source_names(shape_env, spec: ModelSpec, module, by_keyword: bool = False) -> dict[Any, str]:
    """Each size symbol → the declared Dim of the input dim it was read from (``L['inputs']
    ['image'].size()[0]``: by forward's parameter names, or by position), for symbols that export
    later replaced by another."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return {}
    inputs = {i.name: i for i in spec.inputs}
    if not by_keyword:
        inputs = {p: i for p, i in zip(params, spec.inputs)}
    names: dict[Any, str] = {}
    for sym, sources in getattr(shape_env, "var_to_sources", {}).items():
        for src in sources:
            idx = getattr(src, "idx", None)
            path, cur = [], getattr(src, "base", None)
            while cur is not None and getattr(cur, "local_name", None) is None:
                if not hasattr(cur, "index"):
                    break
                path.append(str(cur.index))
                cur = getattr(cur, "base", None)
            local = getattr(cur, "local_name", None)
            if local is None or not isinstance(idx, int):
                continue
            inp = inputs.get(".".join([local, *reversed(path)]))
            if inp is not None and 0 <= idx < len(inp.shape) and isinstance(inp.shape[idx], Dim):
                names.setdefault(sym, inp.shape[idx].name)
    return names
