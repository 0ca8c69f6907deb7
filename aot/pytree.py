"""Model outputs as trees: flatten them to tensors in a stable order, rebuild them from a ``TreeSpec``.

A model may return a tensor, a tuple or list, a dict, a dataclass, a named tuple, or an HF
``ModelOutput``. The bundle stores the tensors flat (``Program.outputs``) and the structure as a
``TreeSpec``: plain data, never pickle. The runner rebuilds the structure with ``unflatten``;
records (dataclasses, named tuples, ``ModelOutput``) come back as a ``Record``, which reads like
a ``ModelOutput`` (``out.logits``, ``out["logits"]``, ``out[0]``, ``out.to_tuple()``) without
importing the library that defined the class.

``leaves`` flattens the runner's outputs (and an eager model's tuples, dicts and ``ModelOutput`` objects)
to their tensors in the order the bundle stores them, which is how tests compare the two; the
build flattens eager outputs with torch's own pytree, as export does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from aot.errors import BundleError
from aot.schema import TreeKind, TreeSpec

MAX_DEPTH = 32


class Record(dict):
    """A named record of outputs (an HF ``ModelOutput``, a dataclass, a named tuple), rebuilt
    without its class: a dict in field order that also answers ``r.field`` and ``r[0]``."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str, items: Sequence[tuple[str, Any]]):
        super().__init__(items)
        self.type_name = type_name

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"{self.type_name or 'record'} has no field {name!r}; it has {list(self)}"
            ) from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())

    def __repr__(self) -> str:
        short = self.type_name.rsplit(".", 1)[-1] or "Record"
        return f"{short}({', '.join(f'{k}={v!r}' for k, v in self.items())})"


def type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "shape") and hasattr(x, "dtype")


def leaves(obj: Any) -> list[Any]:
    """The tensors of an output tree in storage order (``None`` fields carry none)."""
    out: list[Any] = []

    def walk(x: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(f"output nests deeper than {MAX_DEPTH}")
        if x is None:
            return
        if _is_tensor(x):
            out.append(x)
            return
        if isinstance(x, Mapping):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v, depth + 1)
        else:
            raise TypeError(
                f"output of type {type(x).__name__} is not a tensor, tuple, list or mapping of them"
            )

    walk(obj, 0)
    return out


def count(spec: TreeSpec) -> int:
    """How many tensors the tree holds."""
    return (spec.kind == TreeKind.TENSOR) + sum(count(c) for c in spec.children)


def leaf_paths(spec: TreeSpec | None, n: int) -> list[str]:
    """A name per tensor for display: ``logits``, ``hidden_states.0``; positions without a tree."""
    if spec is None:
        return [str(i) for i in range(n)]
    out: list[str] = []

    def walk(s: TreeSpec, path: str) -> None:
        if s.kind == TreeKind.TENSOR:
            out.append(path or "0")
        keys = (
            s.keys if s.kind in (TreeKind.DICT, TreeKind.RECORD) else [str(i) for i in range(len(s.children))]
        )
        for k, c in zip(keys, s.children):
            walk(c, f"{path}.{k}" if path else k)

    walk(spec, "")
    return out if len(out) == n else [str(i) for i in range(n)]


def validate(spec: TreeSpec, n_outputs: int) -> None:
    """Refuse trees no build writes (``from_json`` already refused unknown kinds): keys that do not match children, a tensor
    count other than the program's outputs, or nesting beyond ``MAX_DEPTH``."""

    def check(s: TreeSpec, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise BundleError(f"output tree nests deeper than {MAX_DEPTH}")
        if s.kind in (TreeKind.TENSOR, TreeKind.NONE) and s.children:
            raise BundleError(f"output tree: a {s.kind} leaf has children")
        if s.kind in (TreeKind.DICT, TreeKind.RECORD) and len(s.keys) != len(s.children):
            raise BundleError(f"output tree: {len(s.keys)} keys for {len(s.children)} children")
        for c in s.children:
            check(c, depth + 1)

    check(spec, 0)
    if count(spec) != n_outputs:
        raise BundleError(f"output tree holds {count(spec)} tensors, the program has {n_outputs} outputs")


def unflatten(spec: TreeSpec | None, flat: Sequence[Any]) -> Any:
    """Rebuild the model's output structure from its flat tensors. Without a tree (bundles of
    schema 1.0) one output comes back bare and several as a tuple."""
    if spec is None:
        return flat[0] if len(flat) == 1 else tuple(flat)
    it = iter(flat)
    return _build(spec, it)


def _build(spec: TreeSpec, it: Iterator[Any]) -> Any:
    kind = spec.kind
    if kind == TreeKind.TENSOR:
        return next(it)
    if kind == TreeKind.NONE:
        return None
    children = [_build(c, it) for c in spec.children]
    if kind == TreeKind.TUPLE:
        return tuple(children)
    if kind == TreeKind.LIST:
        return children
    if kind == TreeKind.DICT:
        return dict(zip(spec.keys, children))
    return Record(spec.type, list(zip(spec.keys, children)))


def match_leaves(spec: TreeSpec | None, n: int, obj: Any) -> list[Any]:
    """The tensors of ``obj`` in flat output order, where ``obj`` must be shaped like the model's
    output (``spec``; without one, a bare tensor for one output, a tuple or list for several):
    caller-provided output buffers. ``ValueError`` names the first place where it is not."""
    if spec is None:
        spec = (
            TreeSpec(TreeKind.TENSOR)
            if n == 1
            else TreeSpec(TreeKind.TUPLE, children=(TreeSpec(TreeKind.TENSOR),) * n)
        )
    out: list[Any] = []

    def walk(s: TreeSpec, x: Any, path: str) -> None:
        kind = s.kind
        if kind == TreeKind.TENSOR:
            if not _is_tensor(x):
                raise ValueError(f"{path or 'out'}: expected a tensor, got {type(x).__name__}")
            out.append(x)
        elif kind == TreeKind.NONE:
            if x is not None:
                raise ValueError(f"{path or 'out'}: the model returns None here, got {type(x).__name__}")
        elif kind in (TreeKind.TUPLE, TreeKind.LIST) or (
            kind == TreeKind.RECORD and isinstance(x, (tuple, list))  # a named tuple, by position
        ):
            if not isinstance(x, (tuple, list)) or len(x) != len(s.children):
                got = f"{type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list)) else type(x).__name__
                raise ValueError(f"{path or 'out'}: expected a sequence of {len(s.children)}, got {got}")
            for i, (c, v) in enumerate(zip(s.children, x)):
                walk(c, v, f"{path}[{i}]")
        else:  # DICT, RECORD: by key
            if not isinstance(x, Mapping) or list(x.keys()) != list(s.keys):
                got = list(x.keys()) if isinstance(x, Mapping) else type(x).__name__
                raise ValueError(f"{path or 'out'}: expected a mapping with keys {list(s.keys)}, got {got}")
            for k, c in zip(s.keys, s.children):
                walk(c, x[k], f"{path}[{k!r}]")

    walk(spec, obj, "")
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inputs by dotted name → forward's nested arguments: ``{"inputs.image": x, "past.0": k,
    "past.1": v}`` → ``{"inputs": {"image": x}, "past": (k, v)}`` (numbered levels are tuples)."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, _Level())
        node[parts[-1]] = value
    return {k: _tuples(v) for k, v in root.items()}


class _Level(dict):
    """A level ``nest`` made (a leaf value may itself be a dict)."""


def _tuples(node: Any) -> Any:
    if not isinstance(node, _Level):
        return node
    items = {k: _tuples(v) for k, v in node.items()}
    if items and all(k.isdigit() for k in items):
        if sorted(int(k) for k in items) != list(range(len(items))):
            raise ValueError(f"numbered inputs {sorted(items)} must be 0..{len(items) - 1}")
        return tuple(items[str(i)] for i in range(len(items)))
    return items


def flatten_inputs(kwargs: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of ``nest`` for a call: nested keyword arguments (``inputs={"image": x}``)
    spread into the bundle's dotted input names; values already named are kept as they are."""
    wanted = set(names)
    out: dict[str, Any] = {}

    def spread(prefix: str, value: Any, depth: int) -> None:
        if prefix in wanted or depth > MAX_DEPTH:
            out[prefix] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                spread(f"{prefix}.{k}", v, depth + 1)
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                spread(f"{prefix}.{i}", v, depth + 1)
        else:
            out[prefix] = value  # an unknown name: the guard check reports it

    for k, v in kwargs.items():
        spread(k, v, 0)
    return out
