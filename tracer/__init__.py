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
from aot.schema import Bucket, Guards, InputGuard
from aot.spec import Dim, ModelSpec
from aot.stages import Traced

__all__ = ["load_model_file", "trace", "export_model", "guard_manifest", "guard_manifest_text", "example_inputs"]

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
        raise SpecError(f"{where}: importing the model file failed: {type(e).__name__}: {e}") from None
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


def _is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    real = os.path.realpath(filename)
    import torch

    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    stdlib = os.path.dirname(os.path.realpath(os.__file__)) + os.sep
    return not (real.startswith(torch_dir) or real.startswith(stdlib) or real.startswith(_PACKAGE_DIRS)
                or "site-packages" in real)


def _user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    for fr in reversed(frames):
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


def _display_path(filename: str, model_path: Path) -> str:
    rel = os.path.relpath(os.path.realpath(filename), _project_root(model_path))
    return rel if not rel.startswith("..") else os.path.realpath(filename)


@contextlib.contextmanager
def _record_guard_sites(sites: dict[int, traceback.FrameSummary | None]) -> Iterator[None]:
    """Remember the user's frame for every guard the shape environment records.

    Export runs the model's Python live (non-strict), so the user's frame is on the stack when a
    guard is added; torch's own location often points inside torch (e.g. a reshape's meta).
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


@dataclass(frozen=True)
class Exported:
    """The result of ``export_model``: enough for guards; ``trace`` goes on to lower it."""

    ep: Any
    module: Any
    examples: dict[str, Any]
    guards: Guards
    buckets: tuple[Bucket, ...]
    start: float


def export_model(spec: ModelSpec, weights: str | None = None, fast: bool = False) -> Exported:
    """``torch.export`` the model with its declared dims and collect the simplified guards.

    ``fast``: export a module with uninitialized weights (``instantiate_shapes_only``): the same
    guards, for callers that need only them (``aotpack guards``/``check``); if that module does
    not export, the full module is exported instead.
    """
    import torch
    import torch.fx.experimental._config as fx_config
    from torch.export import Dim as TorchDim
    from torch.export import export

    from aot.tracer.guards import GuardSimplifier, RawGuard
    from aot.tracer.symtext import to_text

    start = time.perf_counter()
    model_path = Path(spec.extra.get("path", "model.py"))
    module = instantiate_shapes_only(spec) if fast else None
    if module is None:
        fast, module = False, instantiate(spec, weights)
    examples = example_inputs(spec)
    args = tuple(examples[i.name] for i in spec.inputs)
    dynamic = tuple(
        {d: TorchDim.DYNAMIC(min=s.min, max=s.max) for d, s in enumerate(i.shape) if isinstance(s, Dim)} or None
        for i in spec.inputs
    )
    sites: dict[int, traceback.FrameSummary | None] = {}
    try:
        with _record_guard_sites(sites), fx_config.patch(backed_size_oblivious=True), torch.no_grad():
            ep = export(module, args, dynamic_shapes=dynamic)
    except Exception as e:
        if fast:
            return export_model(spec, weights)
        raise _export_error(e, spec) from None

    names = _symbol_names(ep, spec, check=True)
    user_vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"][-len(spec.inputs):]
    fake_mode = next((v.fake_mode for v in user_vals if hasattr(v, "fake_mode")), None)
    if fake_mode is not None:
        # Inputs that share a size get one symbol after export (the others are replaced), but guards
        # recorded before that still name the originals: name every symbol by where it was read.
        names = {**names, **_source_names(fake_mode.shape_env, spec, module)}
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
    simplifier = GuardSimplifier({d.name: (d.min, d.max) for d in spec.dims()})
    simplifier.add(raw)
    guards = Guards(
        inputs=tuple(
            InputGuard(
                name=i.name,
                dtype=i.dtype or spec.dtype,
                shape=tuple(s.name if isinstance(s, Dim) else str(s) for s in i.shape),
            )
            for i in spec.inputs
        ),
        symbols=simplifier.symbol_guards(),
        relations=simplifier.relation_guards(),
    )
    return Exported(ep=ep, module=module, examples=examples, guards=guards, buckets=_buckets(spec, guards),
                    start=start)


def _symbol_names(ep, spec: ModelSpec, check: bool = False) -> dict[Any, str]:
    """Map the export's size symbols to the model file's Dim names via the traced input shapes."""
    import torch

    user_vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"][-len(spec.inputs):]
    names: dict[Any, str] = {}
    for inp, val in zip(spec.inputs, user_vals):
        for d, (declared, size) in enumerate(zip(inp.shape, val.shape)):
            if not isinstance(declared, Dim):
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


def _source_names(shape_env, spec: ModelSpec, module) -> dict[Any, str]:
    """Each size symbol → the declared Dim of the input dim it was read from (by ``forward``'s
    parameter order), for symbols that export later replaced by another."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return {}
    position = {p: i for i, p in enumerate(params)}
    names: dict[Any, str] = {}
    for sym, sources in getattr(shape_env, "var_to_sources", {}).items():
        for src in sources:
            local = getattr(getattr(src, "base", None), "local_name", None)
            idx = getattr(src, "idx", None)
            if local in position and position[local] < len(spec.inputs) and isinstance(idx, int):
                shape = spec.inputs[position[local]].shape
                if 0 <= idx < len(shape) and isinstance(shape[idx], Dim):
                    names.setdefault(sym, shape[idx].name)
    return names


def guard_manifest(spec: ModelSpec, archs: tuple[str, ...], weights: str | None = None):
    """The guard manifest (``aot.manifest_text.GuardManifest``) a build of ``spec`` for ``archs``
    would have, from export alone: no weight init, decomposition or kernels."""
    import torch

    from aot.manifest_text import GuardManifest
    from aot.schema import SCHEMA_VERSION
    from aot.stages import environment

    exported = export_model(spec, weights, fast=True)
    return GuardManifest(name=spec.name or "model", guards=exported.guards,
                         environment=environment(archs, torch.__version__.split("+")[0]),
                         buckets=exported.buckets, schema_version=SCHEMA_VERSION, dtype=spec.dtype)


def guard_manifest_text(spec: ModelSpec, archs: tuple[str, ...], weights: str | None = None) -> str:
    """The guard manifest text of a model file (see ``guard_manifest``)."""
    from aot.manifest_text import render

    return render(guard_manifest(spec, archs, weights))


def trace(spec: ModelSpec, weights: str | None = None, progress=None) -> Traced:
    """Export, decompose, collect guards and lower ``spec`` to a ``Traced``."""
    import torch
    import torch.fx.experimental._config as fx_config
    from torch.export import default_decompositions

    from aot.tracer.lower import Lowering, symbol_sources
    from aot.tracer.padding import check_padding

    exported = export_model(spec, weights)
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
    program, weight_tensors = Lowering(ep, [i.name for i in spec.inputs], _symbol_names(ep, spec)).run()
    # Inputs keep their declared dim names even where export unified two Dims (the guards then
    # hold the relation between them); sizes read from the inputs bind every declared symbol.
    declared = {g.name: g.shape for g in exported.guards.inputs}
    inputs = tuple(replace(i, spec=replace(i.spec, shape=declared[i.name])) for i in program.inputs)
    program = replace(program, inputs=inputs, symbols=symbol_sources(inputs))
    buckets = check_padding(spec, exported.guards, exported.buckets, exported.ep, exported.module, progress)

    args = tuple(exported.examples[i.name] for i in spec.inputs)
    with torch.no_grad():
        ref = exported.module(*args)
    ref_outputs = tuple(ref) if isinstance(ref, (tuple, list)) else (ref,)
    return Traced(
        name=spec.name or "model",
        dtype=spec.dtype,
        program=program,
        guards=exported.guards,
        weights=weight_tensors,
        reference_inputs=exported.examples,
        reference_outputs=tuple(o.detach().contiguous() for o in ref_outputs),
        buckets=buckets,
        torch_version=torch.__version__.split("+")[0],
        trace_seconds=time.perf_counter() - exported.start,
    )


def _buckets(spec: ModelSpec, guards: Guards) -> tuple[Bucket, ...]:
    """Declared (or default) bucket sizes that the guards admit; the largest admitted size is
    always a bucket, so every admitted call fits one."""
    from aot.guardtext import admits

    symbols = {g.name: g for g in guards.symbols}
    out = []
    for d in spec.dims():
        g = symbols[d.name]
        sizes = {s for s in d.default_buckets() if admits(g, s)}
        sizes.add(g.max)
        out.append(Bucket(symbol=d.name, sizes=tuple(sorted(sizes)), paddable=d.paddable))
    return tuple(out)
