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
from pathlib import Path
from typing import Any, Iterator

from aot.errors import SpecError, TraceError
from aot.schema import Bucket, Guards, InputGuard
from aot.spec import Dim, ModelSpec
from aot.stages import Traced

__all__ = ["load_model_file", "trace", "example_inputs"]

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


def _display_path(filename: str, model_path: Path) -> str:
    base = model_path.resolve().parent.parent
    rel = os.path.relpath(os.path.realpath(filename), base)
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


def trace(spec: ModelSpec, weights: str | None = None) -> Traced:
    """Export, decompose, collect guards and lower ``spec`` to a ``Traced``."""
    import torch
    import torch.fx.experimental._config as fx_config
    from torch.export import Dim as TorchDim
    from torch.export import default_decompositions, export

    from aot.tracer.guards import GuardSimplifier
    from aot.tracer.lower import Lowering, dtype_name
    from aot.tracer.symtext import to_text

    start = time.perf_counter()
    model_path = Path(spec.extra.get("path", "model.py"))
    module = instantiate(spec, weights)
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
        raise _export_error(e, spec) from None

    # symbols → declared names, read off the traced inputs' shapes
    user_vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"][-len(spec.inputs):]
    names: dict[Any, str] = {}
    for inp, val in zip(spec.inputs, user_vals):
        for d, (declared, size) in enumerate(zip(inp.shape, val.shape)):
            if isinstance(declared, Dim):
                if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
                    raise TraceError(
                        f"input {inp.name!r} dim {d} ({declared.name}) was specialized to {size} while "
                        f"tracing; make it a static size or remove the code that fixes it"
                    )
                names.setdefault(size.node.expr, declared.name)
    shape_env = user_vals[0].fake_mode.shape_env if hasattr(user_vals[0], "fake_mode") else None

    raw = []
    if shape_env is not None:
        from aot.tracer.guards import RawGuard

        for g in shape_env.guards:
            frame = sites.get(id(g.sloc))
            expr = g.expr
            if not expr.free_symbols:
                continue
            text = to_text(expr, names)
            raw.append(
                RawGuard(
                    text=text,
                    symbols=tuple(sorted(names[s] for s in expr.free_symbols)),
                    file=_display_path(frame.filename, model_path) if frame else "<torch>",
                    line=frame.lineno if frame else 0,
                    code=(frame.line or "").strip() if frame else "",
                )
            )
    declared = {d.name: (d.min, d.max) for d in spec.dims()}
    simplifier = GuardSimplifier(declared)
    simplifier.add(raw)

    # keep attention (and friends) whole; everything else to core ATen
    table = default_decompositions()
    for op_name_ in KEEP_OPS:
        packet, overload = op_name_.split(".")
        table.pop(getattr(getattr(torch.ops.aten, packet), overload), None)
    try:
        with fx_config.patch(backed_size_oblivious=True):
            ep = ep.run_decompositions(table)
    except Exception as e:
        raise _export_error(e, spec) from None
    user_vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"][-len(spec.inputs):]
    names = {}
    for inp, val in zip(spec.inputs, user_vals):
        for declared_size, size in zip(inp.shape, val.shape):
            if isinstance(declared_size, Dim) and isinstance(size, torch.SymInt):
                names.setdefault(size.node.expr, declared_size.name)

    program, weight_tensors = Lowering(ep, [i.name for i in spec.inputs], names).run()

    with torch.no_grad():
        ref = module(*args)
    ref_outputs = tuple(ref) if isinstance(ref, (tuple, list)) else (ref,)

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
    buckets = tuple(Bucket(symbol=d.name, sizes=d.default_buckets(), paddable=d.paddable) for d in spec.dims())
    del dtype_name
    return Traced(
        name=spec.name or model_path.stem,
        dtype=spec.dtype,
        program=program,
        guards=guards,
        weights=weight_tensors,
        reference_inputs=examples,
        reference_outputs=tuple(o.detach().contiguous() for o in ref_outputs),
        buckets=buckets,
        torch_version=torch.__version__.split("+")[0],
        trace_seconds=time.perf_counter() - start,
    )
