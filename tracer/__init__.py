"""Trace stage: model file → ``Traced``.

``torch.export`` with the model file's dynamic dims, decomposition to core ATen (attention,
matmuls and convolution stay library calls), guard collection with the user's file:line for each,
and lowering to a device-neutral ``Program``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aot.errors import SpecError, TraceError
from aot.schema import Bucket, Guards, InputGuard, Program, SymbolGuard, TreeSpec
from aot.spec import Dim, ModelSpec
from aot.stages import Traced, TracedProgram

__all__ = ["load_model_file", "trace", "export_model", "export_programs", "guard_manifest", "guard_manifest_text",
           "example_inputs", "call_model", "instantiate"]

# ATen ops kept whole (library calls at run time) even where a decomposition exists.
KEEP_OPS = ("scaled_dot_product_attention.default",)

_PACKAGE_DIRS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {Path(__file__).parent, Path(__file__).parent.parent / "aot", Path(__file__).parent.parent / "codegen",
              Path(__file__).parent.parent / "packager", Path(__file__).parent.parent / "loader"}
)


def load_model_file(path: str | os.PathLike) -> ModelSpec:
    """Import a model file and return its module-level ``spec``."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"model file {path} does not exist")
    mod_name = f"aot_model_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise SpecError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None
    except Exception as e:
        frame = _user_frame(traceback.extract_tb(e.__traceback__))
        where = f"{frame.filename}:{frame.lineno}" if frame else str(path)
        raise SpecError(f"{where}: importing the model file failed: {type(e).__name__}: {e}{_import_hint(e)}") from None
    spec = getattr(module, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise SpecError(
            f"{path} defines no `spec = aot.ModelSpec(...)` at module level "
            f"(found {type(spec).__name__}); see the README's model file section"
        )
    if spec.name is None:
        object.__setattr__(spec, "name", path.stem)
    object.__setattr__(spec, "extra", {**spec.extra, "path": str(path.resolve())})
    return spec


def _import_hint(e: BaseException) -> str:
    """What to do about a known environment problem somewhere in ``e``'s chain."""
    seen = 0
    while e is not None and seen < 16:
        if "torchvision::" in str(e):
            return ("; torchvision was built for another torch (the package index's wheels are CUDA builds, and "
                    "transformers imports torchvision when Pillow is installed): install the torchvision that "
                    "matches this torch, e.g. `pip install torchvision --index-url https://download.pytorch.org/whl/cpu`")
        e, seen = e.__cause__ or e.__context__, seen + 1
    return ""


def _is_user_file(filename: str) -> bool:
    """A frame of the user's code or a library the model uses (transformers, timm): not torch,
    the standard library or aotpack itself."""
    if not filename or filename.startswith("<"):
        return False
    real = os.path.realpath(filename)
    import torch

    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    stdlib = os.path.dirname(os.path.realpath(os.__file__)) + os.sep
    return not (real.startswith(torch_dir) or real.startswith(stdlib) or real.startswith(_PACKAGE_DIRS))


def _user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost user or library frame; only frames inside aotpack's own call into the model
    count (``frames`` is outermost first), so a launcher or test runner is never blamed."""
    ours = [os.path.realpath(f.filename).startswith(_PACKAGE_DIRS) for f in frames]
    end = len(frames)
    while end and ours[end - 1]:  # aotpack's own hook that asked (the guard-site recorder)
        end -= 1
    start = next((i + 1 for i in range(end - 1, -1, -1) if ours[i]), 0)
    inner = frames[start:end]
    for fr in reversed(inner):
        if _is_user_file(fr.filename):
            return fr
    return None


# A folder holding one of these is the root of the model's project; guard sites are shown
# relative to it, so a manifest reads the same on every checkout.
_ROOT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")


def _project_root(model_path: Path) -> Path:
    start = model_path.resolve().parent
    for folder in (start, *start.parents):
        if any((folder / marker).exists() for marker in _ROOT_MARKERS):
            return folder
    return start.parent


def _library_roots() -> list[str]:
    """Folders packages are installed in (site-packages and the like), longest first."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths().get(k, "") for k in ("purelib", "platlib")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return sorted({os.path.realpath(r) + os.sep for r in roots if r}, key=len, reverse=True)


def _display_path(filename: str, model_path: Path) -> str:
    """A guard site as it reads on every machine: a library file relative to the folder it is
    installed in (``transformers/masking_utils.py``), the user's relative to their project."""
    real = os.path.realpath(filename)
    for root in _library_roots():
        if real.startswith(root):
            return os.path.relpath(real, root)
    rel = os.path.relpath(real, _project_root(model_path))
    return rel if not rel.startswith("..") else real


@contextlib.contextmanager
def _record_guard_sites(sites: dict[int, traceback.FrameSummary | None]) -> Iterator[None]:
    """Remember the user's (or the model library's) frame for every guard the shape environment
    records.

    Export runs the model's Python live (non-strict), so that frame is on the stack when a guard
    is added; torch's own location often points inside torch (e.g. a reshape's meta).
    """
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    original = ShapeEnv._get_sloc

    def get_sloc(self, framework_loc=None):
        sloc = original(self, framework_loc)
        sites[id(sloc)] = _user_frame(traceback.extract_stack())
        return sloc

    ShapeEnv._get_sloc = get_sloc
    try:
        yield
    finally:
        ShapeEnv._get_sloc = original


def example_inputs(spec: ModelSpec, sizes: dict[str, int] | None = None, seed: int | None = None) -> dict[str, Any]:
    """Deterministic example inputs for ``spec`` at the given symbol sizes (default: examples)."""
    import torch

    sizes = sizes or {d.name: d.example_size for d in spec.dims()}
    gen = torch.Generator().manual_seed(spec.seed if seed is None else seed)
    out = {}
    for inp in spec.inputs:
        shape = [sizes[s.name] if isinstance(s, Dim) else s for s in inp.shape]
        dtype = getattr(torch, inp.dtype or spec.dtype)
        if dtype.is_floating_point:
            t = torch.rand(shape, generator=gen, dtype=torch.float32) * (inp.high - inp.low) + inp.low
            out[inp.name] = t.to(dtype)
        elif dtype == torch.bool:
            out[inp.name] = torch.rand(shape, generator=gen) < 0.5
        else:
            out[inp.name] = torch.randint(int(inp.low), int(inp.high), shape, generator=gen, dtype=dtype)
    if spec.example_inputs is not None:
        custom = spec.example_inputs(sizes)
        out.update({k: v for k, v in custom.items()})
    return out


def instantiate(spec: ModelSpec, weights: str | None = None):
    """Build the module in the spec's dtype, in eval mode, with weights loaded if given."""
    import torch

    torch.manual_seed(spec.seed)
    module = spec.module
    if not isinstance(module, torch.nn.Module):
        try:
            module = module()
        except Exception as e:
            frame = _user_frame(traceback.extract_tb(e.__traceback__))
            where = f"{frame.filename}:{frame.lineno}: " if frame else ""
            raise SpecError(f"{where}constructing the module failed: {type(e).__name__}: {e}") from None
        if not isinstance(module, torch.nn.Module):
            raise SpecError(f"spec.module must be an nn.Module or return one, got {type(module).__name__}")
    weights = weights or spec.weights
    if weights:
        path = Path(weights)
        if not path.is_absolute() and "path" in spec.extra:
            path = Path(spec.extra["path"]).parent / path
        _load_weights(module, path)
    return module.to(getattr(torch, spec.dtype)).eval()


def instantiate_shapes_only(spec: ModelSpec):
    """The module ``instantiate`` builds, with uninitialized weights (no init, no weights file),
    or None when the module cannot be built that way.

    Export never reads a parameter's or buffer's value (it traces with fake tensors), so the
    guards are those of the real module; what this saves is weight initialization, seconds for
    a model of 100M+ parameters. The module is built on the meta device, then given empty CPU
    storage so that devices match the example inputs as in a full build.
    """
    import torch

    if isinstance(spec.module, torch.nn.Module):
        return None
    try:
        with torch.device("meta"):
            module = spec.module()
        if not isinstance(module, torch.nn.Module):
            return None
        return module.to(getattr(torch, spec.dtype)).to_empty(device="cpu").eval()
    except Exception:
        return None


def _load_weights(module, path: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise SpecError(f"weights file {path} does not exist")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise SpecError(f"weights file {path} is not a valid safetensors file: {e}") from None
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise SpecError(
            f"weights file {path} does not match the module: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise SpecError(
                f"weights file {path}: {k} has shape {tuple(v.shape)}, the module expects {tuple(expected[k].shape)}"
            )
    module.load_state_dict(state, strict=True)


def _export_error(e: Exception, spec: ModelSpec) -> TraceError:
    model_path = Path(spec.extra.get("path", "model.py"))
    frame = _user_frame(traceback.extract_tb(e.__traceback__))
    where = f"{_display_path(frame.filename, model_path)}:{frame.lineno}: " if frame else ""
    code = f" ({frame.line.strip()})" if frame and frame.line else ""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    name = type(e).__name__
    if "DataDependent" in name or "data-dependent" in str(e).lower():
        hint = "the model branches on tensor values; use torch.cond, or torch._check to state the assumption"
    elif "Constraint" in name or "specializ" in str(e).lower():
        hint = "a Dim was specialized or its range conflicts with the code; make that dim static or change the code"
    else:
        hint = "change the model so torch.export can trace it (https://pytorch.org/docs/stable/export.html)"
    return TraceError(f"{where}cannot export the model{code}: {name}: {first[:300]}; {hint}")


# How many programs one build may trace to cover the declared ranges, and how many separate
# intervals of one symbol's uncovered sizes it traces (an odd/even split is never covered this way).
MAX_PROGRAMS = 8
MAX_REGIONS = 2


def call_plan(spec: ModelSpec, module) -> tuple[bool, dict[str, Any]]:
    """How ``forward`` is called: by keyword (every Input names one of its parameters) or by
    position, and the constant keyword arguments (``spec.kwargs``, plus ``use_cache=False`` for
    a ``forward`` that takes it)."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        params = {}
    names = [i.name.split(".")[0] for i in spec.inputs]
    by_keyword = bool(params) and all(n in params for n in names)
    if not by_keyword and any("." in i.name for i in spec.inputs):
        raise SpecError(f"inputs {[i.name for i in spec.inputs]} name nested arguments, so each must start with a "
                        f"parameter of forward {list(params)}")
    if not by_keyword and any(n in params for n in names) and spec.kwargs:
        raise SpecError(f"inputs {names} only partly match forward's parameters {list(params)}; name every "
                        f"Input after a parameter so the constant kwargs can be passed by keyword")
    constants = dict(spec.kwargs)
    unknown = [k for k in constants if params and k not in params and not any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())]
    if unknown:
        raise SpecError(f"ModelSpec kwargs {unknown} are not parameters of forward {list(params)}")
    if "use_cache" in params and "use_cache" not in constants and "use_cache" not in names:
        constants["use_cache"] = False
    return by_keyword, constants


def call_model(spec: ModelSpec, module, inputs: dict[str, Any]) -> Any:
    """Run the eager module on ``inputs`` (by input name) the way the bundle's trace called it."""
    from aot.pytree import nest

    by_keyword, constants = call_plan(spec, module)
    if by_keyword:
        return module(**nest({i.name: inputs[i.name] for i in spec.inputs}), **constants)
    return module(*(inputs[i.name] for i in spec.inputs), **constants)


def _tree_spec(ts, none_leaves: set[int] = frozenset(), counter: list[int] | None = None) -> TreeSpec:
    """torch's pytree spec of the outputs → the bundle's ``TreeSpec`` (plain data); the flat
    outputs in ``none_leaves`` (by position) were ``None``."""
    from collections import OrderedDict

    from aot.pytree import type_name

    counter = [0] if counter is None else counter
    if ts.is_leaf():
        counter[0] += 1
        return TreeSpec(kind="none" if counter[0] - 1 in none_leaves else "tensor")
    cls = ts.type
    if cls is type(None):
        return TreeSpec(kind="none")
    kids = ts.children() if callable(getattr(ts, "children", None)) else ts.children_specs
    children = tuple(_tree_spec(c, none_leaves, counter) for c in kids)
    if cls is tuple or cls is list:
        return TreeSpec(kind=cls.__name__, children=children)
    if isinstance(ts.context, type) and hasattr(ts.context, "_fields"):  # a named tuple
        return TreeSpec(kind="record", type=type_name(ts.context), keys=tuple(ts.context._fields), children=children)
    keys = ts.context
    if isinstance(keys, (list, tuple)) and len(keys) == len(children) and all(isinstance(k, str) for k in keys):
        kind = "dict" if cls in (dict, OrderedDict) else "record"
        return TreeSpec(kind=kind, type="" if kind == "dict" else type_name(cls), keys=tuple(keys), children=children)
    raise TraceError(f"the model returns a {cls.__name__}, which a bundle cannot rebuild; return tensors in "
                     f"tuples, lists, dicts with string keys, dataclasses or ModelOutputs")


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
    # Symbols whose only exclusion was size 1 from a size-oblivious guard that export's own
    # ranges do not enforce (HF's ``if batch_size != position_ids.shape[0]``): admitted, and
    # checked against eager at size 1 by the build; ``strict`` holds the guards without that.
    relaxed: tuple[str, ...] = ()
    strict: Guards | None = None


def _user_input_nodes(ep, spec: ModelSpec) -> dict[str, Any]:
    """Each declared input's placeholder in the exported graph (constant kwargs have none),
    matched by its path in forward's arguments (``inputs.image``)."""
    from torch.export.graph_signature import InputKind, TensorArgument
    from torch.utils._pytree import MappingKey, SequenceKey, tree_flatten_with_path, tree_unflatten

    nodes = [n for n in ep.graph.nodes if n.op == "placeholder"]
    every = [(n, sp) for n, sp in zip(nodes, ep.graph_signature.input_specs) if sp.kind == InputKind.USER_INPUT]
    user = [(n, sp) for n, sp in every if isinstance(sp.arg, TensorArgument)]
    names = [i.name for i in spec.inputs]
    in_spec = ep.call_spec.in_spec
    if in_spec is not None and in_spec.num_leaves == len(every):
        paths = {}
        for path, leaf in tree_flatten_with_path(tree_unflatten(list(range(len(every))), in_spec))[0]:
            keys = [str(k.key) if isinstance(k, MappingKey) else str(k.idx) for k in path[1:]
                    if isinstance(k, (MappingKey, SequenceKey))]
            if path and isinstance(path[0], SequenceKey) and path[0].idx == 1:  # kwargs
                paths[".".join(keys)] = every[leaf][0]
        if all(n in paths for n in names):
            return {n: paths[n] for n in names}
    by_name = {sp.arg.name: n for n, sp in user}
    if all(n in by_name for n in names):
        return {n: by_name[n] for n in names}
    if len(user) != len(names):
        raise TraceError(f"the exported graph takes {len(user)} tensor inputs, the model file declares "
                         f"{len(names)} ({names})")
    return {name: n for name, (n, _) in zip(names, user)}


def export_model(spec: ModelSpec, weights: str | None = None, fast: bool = False,
                 ranges: dict[str, tuple[int, int]] | None = None, module: Any = None) -> Exported:
    """``torch.export`` the model with its declared dims and collect the simplified guards.

    ``ranges`` restricts symbols to sub-ranges of their declared ones (``lo == hi``: static).
    ``fast``: export a module with uninitialized weights (``instantiate_shapes_only``): the same
    guards, for callers that need only them (``aotpack guards``/``check``); if that module does
    not export, the full module is exported instead. ``module``: reuse one already built.
    """
    import torch
    import torch.fx.experimental._config as fx_config
    from torch.export import Dim as TorchDim
    from torch.export import export

    from aot.tracer.guards import RawGuard
    from aot.tracer.symtext import to_text

    start = time.perf_counter()
    model_path = Path(spec.extra.get("path", "model.py"))
    ranges = ranges or {d.name: (d.min, d.max) for d in spec.dims()}
    if module is None:
        module = instantiate_shapes_only(spec) if fast else None
        if module is None:
            fast, module = False, instantiate(spec, weights)
    sizes = {d.name: min(max(d.example_size, ranges[d.name][0]), ranges[d.name][1]) for d in spec.dims()}
    examples = example_inputs(spec, sizes)
    by_keyword, constants = call_plan(spec, module)
    constants, bound = _split_constants(module, constants)

    def dims_of(inp):
        return {d: TorchDim.DYNAMIC(min=ranges[s.name][0], max=ranges[s.name][1])
                for d, s in enumerate(inp.shape)
                if isinstance(s, Dim) and ranges[s.name][0] < ranges[s.name][1]} or None

    if by_keyword:
        from aot.pytree import nest

        args, kwargs = (), {**nest({i.name: examples[i.name] for i in spec.inputs}), **constants}
        dynamic: Any = {**nest({i.name: dims_of(i) for i in spec.inputs}), **{k: None for k in constants}}
    else:
        args, kwargs = tuple(examples[i.name] for i in spec.inputs), dict(constants)
        dynamic = tuple(dims_of(i) for i in spec.inputs)
        if constants:
            dynamic = {**dict(zip(_positional_names(module, len(args)), dynamic)), **{k: None for k in constants}}
    sites: dict[int, traceback.FrameSummary | None] = {}
    try:
        with (_record_guard_sites(sites), fx_config.patch(backed_size_oblivious=True), torch.no_grad(),
              _bound_forward(module, bound)):
            ep = export(module, args, kwargs, dynamic_shapes=dynamic)
    except Exception as e:
        if fast:
            return export_model(spec, weights, ranges=ranges)
        raise _export_error(e, spec) from None

    static = {name: lo for name, (lo, hi) in ranges.items() if lo == hi}
    names = _symbol_names(ep, spec, check=True, static=static)
    user_vals = [n.meta["val"] for n in _user_input_nodes(ep, spec).values()]
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
        raw.append(
            RawGuard(
                text=to_text(g.expr, names),
                symbols=tuple(sorted(names[s] for s in g.expr.free_symbols)),
                file=_display_path(frame.filename, model_path) if frame else "<torch>",
                line=frame.lineno if frame else 0,
                code=(frame.line or "").strip() if frame else "",
            )
        )
    dynamic_ranges = {d.name: ranges[d.name] for d in spec.dims() if d.name not in static}
    relaxable = _oblivious_guards(ep, names, raw, dynamic_ranges)
    binding = [g for g in raw if g not in relaxable]
    guards = _guards(spec, static, dynamic_ranges, binding)
    strict = _guards(spec, static, dynamic_ranges, raw) if relaxable else None
    relaxed = tuple(sorted({g.symbols[0] for g in relaxable}))
    return Exported(ep=ep, module=module, examples=examples, guards=guards, buckets=_buckets(spec, guards),
                    start=start, ranges=dict(ranges), name=_region_name(spec, ranges), relaxed=relaxed,
                    strict=strict)


def _oblivious_guards(ep, names: dict, raw: list, ranges: dict[str, tuple[int, int]]) -> list:
    """Guards that exclude only size 1 of one symbol declared from 1: the ``>= 2`` side of a
    size-oblivious decision (HF's ``if batch_size != position_ids.shape[0]``) or of a branch whose
    other side computes the same at 1 (``is_causal = q_len > 1``: a 1x1 causal mask allows all).
    The build admits size 1 in this trace only after running it there against eager."""
    import numpy as np

    from aot.tracer.symtext import evaluate_vectorized

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


def _guards(spec: ModelSpec, static: dict[str, int], ranges: dict[str, tuple[int, int]], raw: list) -> Guards:
    from aot.tracer.guards import GuardSimplifier

    simplifier = GuardSimplifier(ranges)
    simplifier.add(raw)
    return Guards(
        inputs=tuple(
            InputGuard(
                name=i.name,
                dtype=i.dtype or spec.dtype,
                shape=tuple((str(static[s.name]) if s.name in static else s.name) if isinstance(s, Dim) else str(s)
                            for s in i.shape),
            )
            for i in spec.inputs
        ),
        symbols=simplifier.symbol_guards(),
        relations=simplifier.relation_guards(),
    )


def _check_relaxed(spec: ModelSpec, ex: Exported, module) -> str | None:
    """Run the exported program at size 1 of each relaxed symbol against the eager ``module``
    (whose weights it takes); the reason it may not be relaxed, or None when every output matches."""
    import torch

    from aot.tracer.lower import tensor_leaves as leaves
    from aot.tracer.padding import PAD_TOLERANCE

    by_keyword, constants = call_plan(spec, module)
    constants, _ = _split_constants(module, constants)  # the rest are bound inside the trace
    base = {d.name: min(max(d.example_size, ex.ranges[d.name][0]), ex.ranges[d.name][1]) for d in spec.dims()}
    try:  # the size-1 call must reach the graph, not the guard check export wraps around it
        graph = ex.ep.module(check_guards=False)
    except TypeError:  # torch without the option checks input ranges only, which admit 1
        graph = ex.ep.module()
    if module is not ex.module:  # traced with uninitialized weights (the guards-only path)
        graph.load_state_dict(module.state_dict(), strict=False)
    smallest = {d.name: ex.ranges[d.name][0] for d in spec.dims()}
    for sym, others in ((s, o) for s in ex.relaxed for o in (base, smallest)):
        inputs = example_inputs(spec, {**others, sym: 1}, seed=spec.seed + 3)
        try:
            with torch.no_grad():
                want = leaves(call_model(spec, module, inputs))
                if by_keyword:
                    got = leaves(graph(**{i.name: inputs[i.name] for i in spec.inputs}, **constants))
                else:
                    got = leaves(graph(*(inputs[i.name] for i in spec.inputs), **constants))
        except Exception as e:
            return f"the trace fails at {sym} = 1: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        for w, g in zip(want, got):
            if w.shape != g.shape:
                return f"at {sym} = 1 the trace gives shape {list(g.shape)}, eager {list(w.shape)}"
            if w.dtype.is_floating_point:
                err = (w.float() - g.float()).abs().max().item() if w.numel() else 0.0
                scale = max(1.0, w.float().abs().max().item() if w.numel() else 1.0)
                if not err <= PAD_TOLERANCE[spec.dtype] * scale:
                    return f"at {sym} = 1 the trace differs from eager by {err:.3g}"
            elif not torch.equal(w, g):
                return f"at {sym} = 1 the trace differs from eager"
    return None


def _split_constants(module, constants: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Constant kwargs that ``forward`` names (passed to export) and those it collects in
    ``**kwargs`` (bound to ``forward`` while exporting: export cannot take ``dynamic_shapes`` for
    them)."""
    import inspect

    params = inspect.signature(module.forward).parameters
    named = {k: v for k, v in constants.items() if k in params}
    return named, {k: v for k, v in constants.items() if k not in params}


@contextlib.contextmanager
def _bound_forward(module, bound: dict[str, Any]) -> Iterator[None]:
    """``module.forward`` with ``bound`` keyword arguments fixed, for the duration."""
    import functools

    if not bound:
        yield
        return
    module.forward = functools.partial(type(module).forward.__get__(module), **bound)
    try:
        yield
    finally:
        del module.forward


def _positional_names(module, n: int) -> list[str]:
    import inspect

    return list(inspect.signature(module.forward).parameters)[:n]


def _region_name(spec: ModelSpec, ranges: dict[str, tuple[int, int]]) -> str:
    """What a program covers, where it differs from the declared ranges: ``batch == 1``."""
    parts = []
    for d in spec.dims():
        lo, hi = ranges[d.name]
        if (lo, hi) != (d.min, d.max):
            parts.append(f"{d.name} == {lo}" if lo == hi else f"{lo} <= {d.name} <= {hi}")
    return ", ".join(parts) or "general"


def _symbol_names(ep, spec: ModelSpec, check: bool = False, static: dict[str, int] | None = None) -> dict[Any, str]:
    """Map the export's size symbols to the model file's Dim names via the traced input shapes."""
    import torch

    static = static or {}
    names: dict[Any, str] = {}
    nodes = _user_input_nodes(ep, spec)
    for inp in spec.inputs:
        val = nodes[inp.name].meta["val"]
        for d, (declared, size) in enumerate(zip(inp.shape, val.shape)):
            if not isinstance(declared, Dim) or declared.name in static:
                continue
            if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
                if check:
                    raise TraceError(
                        f"input {inp.name!r} dim {d} ({declared.name}) was specialized to {size} while "
                        f"tracing; make it a static size or remove the code that fixes it"
                    )
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


def _uncovered(g, lo: int, hi: int) -> list[tuple[int, int]]:
    """The sizes in ``lo..hi`` that ``g`` does not admit, as maximal intervals."""
    import numpy as np

    if hi - lo >= (1 << 22):
        return [] if (g.min, g.max) == (lo, hi) and g.modulus == 1 and not g.excluded else [(lo, hi)] * 99
    v = np.arange(lo, hi + 1, dtype=np.int64)
    ok = (v >= g.min) & (v <= g.max) & np.isin(v % max(g.modulus, 1), g.residues if g.modulus > 1 else (0,))
    ok &= ~np.isin(v, g.excluded)
    bad = v[~ok]
    if bad.size == 0:
        return []
    breaks = np.nonzero(np.diff(bad) != 1)[0]
    starts = np.concatenate([[bad[0]], bad[breaks + 1]])
    ends = np.concatenate([bad[breaks], [bad[-1]]])
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def export_programs(spec: ModelSpec, weights: str | None = None, fast: bool = False,
                    allow_narrowing: bool | None = None, progress=None) -> list[Exported]:
    """Export the model over its declared ranges, and again over every part of them that the
    first trace's guards do not admit (``batch == 1`` beside ``2 <= batch <= 64``), until the
    programs together cover the declared ranges: the ahead-of-time counterpart of Dynamo's cache
    of guarded graphs. A part that cannot be covered (an odd size a reshape forbids, a model that
    fails to trace there) fails the build with the guard's site, unless ``allow_narrowing``.
    """
    say = progress or (lambda msg: None)
    allow = spec.allow_narrowing if allow_narrowing is None else allow_narrowing
    programs: list[Exported] = []
    failures: list[str] = []
    module = real = None

    def cover(ranges: dict[str, tuple[int, int]]) -> None:
        nonlocal module, real
        if len(programs) >= MAX_PROGRAMS:
            failures.append(f"{_region_name(spec, ranges)}: more than {MAX_PROGRAMS} programs would be needed")
            return
        try:
            ex = export_model(spec, weights, fast, ranges, module=module)
        except TraceError as e:
            if not programs:
                raise
            failures.append(f"{_region_name(spec, ranges)}: {e}")
            return
        module = ex.module
        if ex.relaxed:
            if fast and real is None:  # the check runs the model: it needs real weights
                real = instantiate(spec, weights)
            why = _check_relaxed(spec, ex, real if fast else ex.module)
            if why is None:
                say(f"  {', '.join(ex.relaxed)} = 1 runs the general trace: checked against eager")
            else:
                say(f"  {', '.join(ex.relaxed)} = 1 needs a program of its own: {why}")
                ex = replace(ex, guards=ex.strict, buckets=_buckets(spec, ex.strict), relaxed=(), strict=None)
        if programs:
            say(f"  traced a program for {ex.name} (the general trace's guards exclude it)")
        programs.append(ex)
        symbols = {g.name: g for g in ex.guards.symbols}
        fixed = dict(ranges)
        for d in spec.dims():
            lo, hi = ranges[d.name]
            if lo == hi:
                continue
            g = symbols[d.name]
            parts = _uncovered(g, lo, hi)
            if len(parts) > MAX_REGIONS:
                why = "; ".join(f"{s.text} at {s.file}:{s.line}: {s.code}" for s in g.sources) or "tracing"
                failures.append(f"{d.name} {lo}..{hi} admits only {_admitted_text(g)} ({why})")
            else:
                for a, b in parts:
                    cover({**fixed, d.name: (a, b)})
            fixed[d.name] = (g.min, g.max)

    cover({d.name: (d.min, d.max) for d in spec.dims()})
    if failures and not allow:
        raise TraceError(
            "the build cannot cover every declared size: " + " | ".join(failures)
            + "; change the model at those lines, declare narrower Dims, or accept the narrower contract with "
              "--allow-narrowing (ModelSpec(allow_narrowing=True))"
        )
    return programs


def _admitted_text(g) -> str:
    from aot.guardtext import admissible_text

    return admissible_text(g)


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
    for d in spec.dims():
        per = [{g.name: g for g in p.guards.symbols}.get(d.name) for p in programs]
        general = per[0]
        if d.max - d.min >= MAX_RANGE:
            symbols.append(general)
            continue
        values = np.arange(d.min, d.max + 1, dtype=np.int64)
        mask = np.zeros(values.shape, dtype=bool)
        for p, g in zip(programs, per):
            if g is None:  # static in that program
                mask |= values == p.ranges[d.name][0]
            else:
                m = (values >= g.min) & (values <= g.max) & ~np.isin(values, g.excluded)
                if g.modulus > 1:
                    m &= np.isin(values % g.modulus, g.residues)
                mask |= m
        shape = describe_mask(values, mask)
        if shape is None:
            raise TraceError(f"no program admits any size of {d.name}")
        # Every program's guards stay listed: they say why the programs split where they do.
        sources = list(dict.fromkeys(src for g in per if g is not None for src in g.sources))
        symbols.append(SymbolGuard(
            name=d.name, declared_min=d.min, declared_max=d.max, min=shape.lo, max=shape.hi,
            modulus=shape.modulus, residues=shape.residues, excluded=shape.excluded,
            sources=tuple(sorted(sources, key=lambda s: (s.file, s.line, s.text))),
        ))
    declared_inputs = tuple(
        InputGuard(name=i.name, dtype=i.dtype or spec.dtype,
                   shape=tuple(s.name if isinstance(s, Dim) else str(s) for s in i.shape))
        for i in spec.inputs
    )
    return Guards(inputs=declared_inputs, symbols=tuple(symbols), relations=first.relations,
                  specializations=first.specializations)


def program_entries(spec: ModelSpec, programs: list[Exported], buckets: list[tuple[Bucket, ...]] | None = None):
    """``ProgramEntry`` per program (for the manifest); empty when there is only one."""
    from aot.schema import ProgramEntry

    if len(programs) == 1:
        return ()
    buckets = buckets or [p.buckets for p in programs]
    return tuple(ProgramEntry(name=p.name, guards=p.guards, buckets=b) for p, b in zip(programs, buckets))


def guard_manifest(spec: ModelSpec, archs: tuple[str, ...], weights: str | None = None):
    """The guard manifest (``aot.manifest_text.GuardManifest``) a build of ``spec`` for ``archs``
    would have, from export alone: no weight init, decomposition or kernels."""
    import torch

    from aot.manifest_text import GuardManifest, program_lines
    from aot.schema import SCHEMA_VERSION
    from aot.stages import environment

    programs = export_programs(spec, weights, fast=True, allow_narrowing=True)
    guards = contract(spec, programs)
    return GuardManifest(name=spec.name or "model", guards=guards,
                         environment=environment(archs, torch.__version__.split("+")[0]),
                         buckets=_buckets(spec, guards), schema_version=SCHEMA_VERSION,
                         dtype=spec.dtype, programs=program_lines(program_entries(spec, programs)))


def guard_manifest_text(spec: ModelSpec, archs: tuple[str, ...], weights: str | None = None) -> str:
    """The guard manifest text of a model file (see ``guard_manifest``)."""
    from aot.manifest_text import render

    return render(guard_manifest(spec, archs, weights))


def _lower(spec: ModelSpec, exported: Exported, progress=None) -> tuple[Program, dict[str, Any], tuple[Bucket, ...]]:
    """Decompose one export to core ATen, lower it to a ``Program``, and check its padding."""
    import torch
    import torch.fx.experimental._config as fx_config
    from torch.export import default_decompositions

    from aot.tracer.lower import Lowering, symbol_sources
    from aot.tracer.padding import check_padding

    # keep attention (and friends) whole; everything else to core ATen
    table = default_decompositions()
    for name in KEEP_OPS:
        packet, overload = name.split(".")
        table.pop(getattr(getattr(torch.ops.aten, packet), overload), None)
    try:
        with fx_config.patch(backed_size_oblivious=True):
            ep = exported.ep.run_decompositions(table)
    except Exception as e:
        raise _export_error(e, spec) from None
    static = {n: lo for n, (lo, hi) in exported.ranges.items() if lo == hi}
    nodes = _user_input_nodes(ep, spec)
    order = sorted(spec.inputs, key=lambda i: list(ep.graph.nodes).index(nodes[i.name]))
    lowering = Lowering(ep, [i.name for i in order], _symbol_names(ep, spec, static=static))
    program, weight_tensors = lowering.run()
    # Inputs keep their declared dim names even where export unified two Dims (the guards then
    # hold the relation between them); sizes read from the inputs bind every declared symbol.
    declared = {g.name: g.shape for g in exported.guards.inputs}
    inputs = tuple(replace(i, spec=replace(i.spec, shape=declared[i.name])) for i in program.inputs)
    program = replace(program, inputs=inputs, symbols=symbol_sources(inputs),
                      output_tree=_tree_spec(ep.call_spec.out_spec, lowering.none_outputs))
    buckets = check_padding(spec, exported, progress)
    return program, weight_tensors, buckets


def trace(spec: ModelSpec, weights: str | None = None, progress=None, allow_narrowing: bool | None = None) -> Traced:
    """Export, decompose, collect guards and lower ``spec`` to a ``Traced``: one program, or
    several when one trace cannot cover the declared ranges (see ``export_programs``)."""
    import torch

    from aot.tracer.lower import tensor_leaves as leaves

    exported = export_programs(spec, weights, allow_narrowing=allow_narrowing, progress=progress)
    lowered = [_lower(spec, ex, progress) for ex in exported]
    weight_tensors = lowered[0][1]
    for (_, w, _), ex in zip(lowered[1:], exported[1:]):
        if set(w) != set(weight_tensors) or any(not torch.equal(w[k], weight_tensors[k]) for k in w):
            raise TraceError(f"the program for {ex.name} uses other weights than the general one; aotpack "
                             f"expects every program of a model to share its parameters")
    main = exported[0]
    with torch.no_grad():
        ref = call_model(spec, main.module, main.examples)
    noise = _half_precision_noise(spec, main.module, main.examples, leaves(ref))
    programs = tuple(TracedProgram(name=ex.name, program=p, guards=ex.guards, buckets=b)
                     for ex, (p, _, b) in zip(exported, lowered))
    guards = contract(spec, exported)
    return Traced(
        name=spec.name or "model",
        dtype=spec.dtype,
        program=programs[0].program,
        guards=guards,
        weights=weight_tensors,
        reference_inputs=main.examples,
        reference_outputs=tuple(o.detach().contiguous() for o in leaves(ref)),
        buckets=programs[0].buckets if len(programs) == 1 else _buckets(spec, guards),
        torch_version=torch.__version__.split("+")[0],
        trace_seconds=time.perf_counter() - main.start,
        programs=programs if len(programs) > 1 else (),
        reference_noise=noise,
    )


def _half_precision_noise(spec: ModelSpec, module, examples: dict[str, Any], outputs: list) -> float:
    """For a float16/bfloat16 model: max |eager - eager float32| / max |eager float32| over the
    floating outputs at the example inputs; 0.0 for other dtypes."""
    import copy

    import torch

    from aot.tracer.lower import tensor_leaves

    if spec.dtype not in ("float16", "bfloat16"):
        return 0.0
    wide = copy.deepcopy(module).float()
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in examples.items()}
    with torch.no_grad():
        exact = tensor_leaves(call_model(spec, wide, inputs))
    worst = 0.0
    for half, ref in zip(outputs, exact):
        if ref.is_floating_point() and ref.numel():
            scale = ref.abs().max().item()
            if scale > 0:
                worst = max(worst, (half.float() - ref).abs().max().item() / scale)
    return round(worst, 6)


def _buckets(spec: ModelSpec, guards: Guards) -> tuple[Bucket, ...]:
    """Declared (or default) bucket sizes that the guards admit; the largest admitted size is
    always a bucket, so every admitted call fits one. Symbols a program traced as static have
    no buckets in it."""
    from aot.guardtext import admits

    symbols = {g.name: g for g in guards.symbols}
    out = []
    for d in spec.dims():
        g = symbols.get(d.name)
        if g is None:
            continue
        sizes = {s for s in d.default_buckets() if admits(g, s)}
        sizes.add(g.max)
        out.append(Bucket(symbol=d.name, sizes=tuple(sorted(sizes)), paddable=d.paddable))
    return tuple(out)
