"""The user's model as the tracer sees it: built from its spec, given example inputs, and called
the way the bundle will be (keyword or positional inputs, nested arguments, constant kwargs).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aot.errors import SpecError, TraceError
from aot.schema import TreeKind, TreeSpec
from aot.spec import Dim, ModelSpec
from aot.tracer.sites import error_site, first_line, user_frame


def example_inputs(
    spec: ModelSpec, sizes: dict[str, int] | None = None, seed: int | None = None
) -> dict[str, Any]:
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
            frame = user_frame(traceback.extract_tb(e.__traceback__))
            where = f"{frame.filename}:{frame.lineno}: " if frame else ""
            raise SpecError(f"{where}constructing the module failed: {type(e).__name__}: {e}") from None
        if not isinstance(module, torch.nn.Module):
            raise SpecError(f"spec.module must be an nn.Module or return one, got {type(module).__name__}")
    if weights:  # given by the caller (the CLI's --weights): relative to the working directory
        _load_weights(module, Path(weights))
    elif spec.weights:  # declared in the model file: relative to that file
        path = Path(spec.weights)
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
    if not path.is_file():
        raise SpecError(f"weights file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    state = _read_checkpoint(path) if head[:2] in (b"PK", b"\x80\x02") else _read_safetensors(path)
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


def _read_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise SpecError(f"weights file {path} is not a valid safetensors file: {e}") from None


# Where training scripts put the state dict inside a checkpoint dictionary.
_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module")


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """A ``torch.save`` checkpoint (.pt/.pth/.bin), read with ``torch.load(weights_only=True)``:
    a state dict, or one under a usual key (``{"state_dict": ...}``), ``module.`` prefixes of
    DistributedDataParallel dropped. Only the build reads checkpoints; bundles hold safetensors."""
    import torch

    convert = (
        "save the state dict instead (torch.save(model.state_dict(), PATH)) or convert it: "
        "safetensors.torch.save_file(model.state_dict(), 'weights.safetensors')"
    )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpecError(
            f"weights file {path} is a pickled checkpoint that torch.load(weights_only=True) refuses "
            f"({first_line(e)[:160]}); {convert}"
        ) from None
    for key in _STATE_DICT_KEYS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise SpecError(f"weights file {path} holds no state dict of tensors; {convert}")
    if all(k.startswith("module.") for k in obj):
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


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
    if params:
        check_signature(spec, module, params, by_keyword)
    if not by_keyword and any("." in i.name for i in spec.inputs):
        raise SpecError(
            f"inputs {[i.name for i in spec.inputs]} name nested arguments, so each must start with a "
            f"parameter of forward {list(params)}"
        )
    if not by_keyword and any(n in params for n in names) and spec.kwargs:
        raise SpecError(
            f"inputs {names} only partly match forward's parameters {list(params)}; name every "
            f"Input after a parameter so the constant kwargs can be passed by keyword"
        )
    constants = dict(spec.kwargs)
    unknown = [
        k
        for k in constants
        if params
        and k not in params
        and not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    ]
    if unknown:
        raise SpecError(f"ModelSpec kwargs {unknown} are not parameters of forward {list(params)}")
    if "use_cache" in params and "use_cache" not in constants and "use_cache" not in names:
        constants["use_cache"] = False
    return by_keyword, constants


def check_signature(spec: ModelSpec, module, params, by_keyword: bool) -> None:
    """The spec's inputs and constant kwargs against ``forward``'s parameters, before any trace:
    a misspelled name, too many inputs or a required parameter left out is a spec mistake."""
    import difflib
    import inspect

    kinds = inspect.Parameter
    forward = f"{type(module).__name__}.forward({', '.join(params)})"
    names = [i.name.split(".")[0] for i in spec.inputs]
    for n in names:
        close = difflib.get_close_matches(n, [p for p in params if p not in names], n=1, cutoff=0.8)
        if n not in params and close:
            raise SpecError(f"Input {n!r} is not a parameter of {forward}; did you mean {close[0]!r}?")
    positional = [
        p for p, v in params.items() if v.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    takes_varargs = any(v.kind == kinds.VAR_POSITIONAL for v in params.values())
    if not by_keyword and takes_varargs and len(names) > len(positional):
        star = next(p for p, v in params.items() if v.kind == kinds.VAR_POSITIONAL)
        packed = names[len(positional) :]
        raise SpecError(
            f"{type(module).__name__}.forward takes {', '.join(packed)} through *{star}, which torch.export "
            f"cannot trace as separate inputs; give forward one parameter per Input "
            f"(forward(self, {', '.join(names)})), or wrap the model in a module whose forward does"
        )
    if not by_keyword and len(names) > len(positional) and not takes_varargs:
        raise SpecError(
            f"the spec declares {len(names)} inputs ({', '.join(names)}) but {forward} takes "
            f"{len(positional)} by position; remove the extra Inputs or name each after a parameter"
        )
    given = set(names if by_keyword else positional[: len(names)]) | set(spec.kwargs)
    missing = [
        p
        for p, v in params.items()
        if v.default is kinds.empty
        and v.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        and p not in given
    ]
    if missing:
        raise SpecError(
            f"{forward} requires {', '.join(missing)}, which the spec does not give; add an Input "
            f"named after each (or a constant in ModelSpec.kwargs)"
        )


def run_eager(spec: ModelSpec, module, inputs: dict[str, Any]) -> Any:
    """The eager outputs on inputs built from the spec; a failure there is a spec mistake (a
    wrong dtype, token ids without ``low``/``high``), raised as a SpecError."""
    import torch

    try:
        with torch.no_grad():
            return call_model(spec, module, inputs)
    except Exception as e:
        where, _ = error_site(e, Path(spec.extra.get("path", "model.py")))
        described = ", ".join(_described(spec, i) for i in spec.inputs)
        raise SpecError(
            f"{where}the model fails in eager PyTorch on inputs built from the spec "
            f"({described}): {type(e).__name__}: {first_line(e)[:200]}; fix the Inputs' shape, dtype or "
            f"low/high (token ids: dtype='int64', low=0, high=the vocabulary size)"
        ) from None


def binding_note(spec: ModelSpec, module) -> str | None:
    """``image → x``: how inputs not named after ``forward``'s parameters are passed, by position."""
    by_keyword, _ = call_plan(spec, module)
    names = [i.name for i in spec.inputs]
    params = positional_names(module, len(names))
    if by_keyword or names == params:
        return None
    return "inputs passed to forward by position: " + ", ".join(f"{n} → {p}" for n, p in zip(names, params))


def _described(spec: ModelSpec, inp) -> str:
    dtype = inp.dtype or spec.dtype
    dims = ", ".join(s.name if isinstance(s, Dim) else str(s) for s in inp.shape)
    values = "" if dtype == "bool" else f" in [{inp.low:g}, {inp.high:g})"
    return f"{inp.name} {dtype}[{dims}]{values}"


def call_model(spec: ModelSpec, module, inputs: dict[str, Any]) -> Any:
    """Run the eager module on ``inputs`` (by input name) the way the bundle's trace called it."""
    from aot.pytree import nest

    by_keyword, constants = call_plan(spec, module)
    if by_keyword:
        return module(**nest({i.name: inputs[i.name] for i in spec.inputs}), **constants)
    return module(*(inputs[i.name] for i in spec.inputs), **constants)


def split_constants(module, constants: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Constant kwargs that ``forward`` names (passed to export) and those it collects in
    ``**kwargs`` (bound to ``forward`` while exporting: export cannot take ``dynamic_shapes`` for
    them)."""
    import inspect

    params = inspect.signature(module.forward).parameters
    named = {k: v for k, v in constants.items() if k in params}
    return named, {k: v for k, v in constants.items() if k not in params}


@contextlib.contextmanager
def bound_forward(module, bound: dict[str, Any]) -> Iterator[None]:
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


def positional_names(module, n: int) -> list[str]:
    import inspect

    return list(inspect.signature(module.forward).parameters)[:n]


def user_input_nodes(ep, spec: ModelSpec) -> dict[str, Any]:
    """Each declared input's placeholder in the exported graph (constant kwargs have none),
    matched by its path in forward's arguments (``inputs.image``)."""
    from torch.export.graph_signature import InputKind, TensorArgument
    from torch.utils._pytree import MappingKey, SequenceKey, tree_flatten_with_path, tree_unflatten

    nodes = [n for n in ep.graph.nodes if n.op == "placeholder"]
    every = [
        (n, sp) for n, sp in zip(nodes, ep.graph_signature.input_specs) if sp.kind == InputKind.USER_INPUT
    ]
    user = [(n, sp) for n, sp in every if isinstance(sp.arg, TensorArgument)]
    names = [i.name for i in spec.inputs]
    in_spec = ep.call_spec.in_spec
    if in_spec is not None and in_spec.num_leaves == len(every):
        paths = {}
        for path, leaf in tree_flatten_with_path(tree_unflatten(list(range(len(every))), in_spec))[0]:
            keys = [
                str(k.key) if isinstance(k, MappingKey) else str(k.idx)
                for k in path[1:]
                if isinstance(k, (MappingKey, SequenceKey))
            ]
            if path and isinstance(path[0], SequenceKey) and path[0].idx == 1:  # kwargs
                paths[".".join(keys)] = every[leaf][0]
        if all(n in paths for n in names):
            return {n: paths[n] for n in names}
    by_name = {sp.arg.name: n for n, sp in user}
    if all(n in by_name for n in names):
        return {n: by_name[n] for n in names}
    if len(user) != len(names):
        raise TraceError(
            f"the exported graph takes {len(user)} tensor inputs, the model file declares "
            f"{len(names)} ({names})"
        )
    return {name: n for name, (n, _) in zip(names, user)}


def tree_spec(ts, none_leaves: set[int] = frozenset(), counter: list[int] | None = None) -> TreeSpec:
    """torch's pytree spec of the outputs → the bundle's ``TreeSpec`` (plain data); the flat
    outputs in ``none_leaves`` (by position) were ``None``."""
    from collections import OrderedDict

    from aot.pytree import type_name

    counter = [0] if counter is None else counter
    if ts.is_leaf():
        counter[0] += 1
        return TreeSpec(kind=TreeKind.NONE if counter[0] - 1 in none_leaves else TreeKind.TENSOR)
    cls = ts.type
    if cls is type(None):
        return TreeSpec(kind=TreeKind.NONE)
    kids = ts.children() if callable(getattr(ts, "children", None)) else ts.children_specs
    children = tuple(tree_spec(c, none_leaves, counter) for c in kids)
    if cls is tuple or cls is list:
        return TreeSpec(kind=TreeKind(cls.__name__), children=children)
    if isinstance(ts.context, type) and hasattr(ts.context, "_fields"):  # a named tuple
        return TreeSpec(
            kind=TreeKind.RECORD,
            type=type_name(ts.context),
            keys=tuple(ts.context._fields),
            children=children,
        )
    if issubclass(cls, tuple) and hasattr(cls, "n_sequence_fields"):
        # torch.return_types (x.max(dim), topk, ...): a tuple, so that `values, indices = out`
        # unpacks as eager's does (a Record, a dict, would iterate its keys)
        return TreeSpec(kind=TreeKind.TUPLE, children=children)
    keys = ts.context
    if (
        isinstance(keys, (list, tuple))
        and len(keys) == len(children)
        and all(isinstance(k, str) for k in keys)
    ):
        kind = TreeKind.DICT if cls in (dict, OrderedDict) else TreeKind.RECORD
        return TreeSpec(
            kind=kind,
            type="" if kind == TreeKind.DICT else type_name(cls),
            keys=tuple(keys),
            children=children,
        )
    raise TraceError(
        f"the model returns a {cls.__name__}, which a bundle cannot rebuild; return tensors in "
        f"tuples, lists, dicts with string keys, dataclasses or ModelOutputs"
    )
