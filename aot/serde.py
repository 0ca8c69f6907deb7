"""Validating JSON (de)serialization of the schema's records (``aot.schema``).

``to_json`` turns a record tree into JSON primitives; ``from_json`` checks JSON against a record's
field types and builds it, so anything a hostile or stale bundle holds becomes a ``BundleError``
naming the field, expected vs got. ``upgrade_manifest`` reads older minor versions;
``schema_fingerprint`` is the text the schema-change test pins.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
import typing
from typing import Any, Union

from aot.errors import BundleError
from aot.schema import ARG_VALUES, ENUMS, RECORDS, TAGGED_ARGS, Arg, BuildStats

_BY_TAG: dict[str, type] = {cls.TAG: cls for cls in TAGGED_ARGS}


def _tagged_value(obj: Any) -> Any:
    return getattr(obj, dataclasses.fields(obj)[0].name)


def _decode_arg(data: Any, path: str, depth: int = 0) -> Any:
    if depth > 16:
        raise BundleError(f"bundle field {path}: step argument nested too deeply")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if isinstance(data, list):
        return [_decode_arg(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(data)]
    if isinstance(data, dict) and len(data) == 1:
        ((tag, value),) = data.items()
        cls = _BY_TAG.get(tag)
        if cls is not None and isinstance(value, str) and value in ARG_VALUES.get(cls, (value,)):
            return cls(value)
    raise _fail(path, "a step argument (scalar, list, or one of " + ", ".join(_BY_TAG) + ")", data)


def to_json(obj: Any) -> Any:
    """A dataclass tree → JSON-ready primitives (tuples become lists, enums their values, tagged
    arguments one-key objects)."""
    if isinstance(obj, TAGGED_ARGS):
        return {obj.TAG: _tagged_value(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_json(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.metadata.get("omit_empty") and not getattr(obj, f.name))
        }
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    return obj


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, fixed separators, trailing newline."""
    return (
        json.dumps(to_json(obj), sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    ).encode()


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _fail(path: str, expected: str, got: Any) -> BundleError:
    shown = type(got).__name__ if not isinstance(got, (int, str)) else repr(got)[:60]
    return BundleError(f"bundle field {path}: expected {expected}, got {shown}")


# Per record class: its field names, and each field's (name, type hint, required); worked out once,
# since a program decodes thousands of records (GPT-2's: ~11,000 values).
_FIELDS: dict[type, tuple[frozenset[str], tuple[tuple[str, Any, bool], ...]]] = {}


def _fields(cls: type) -> tuple[frozenset[str], tuple[tuple[str, Any, bool], ...]]:
    if cls not in _FIELDS:
        hints = _hints(cls)
        fields = dataclasses.fields(cls)
        _FIELDS[cls] = (
            frozenset(f.name for f in fields),
            tuple(
                (
                    f.name,
                    hints[f.name],
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                )
                for f in fields
            ),
        )
    return _FIELDS[cls]


def _decode(tp: Any, data: Any, path: str) -> Any:
    # the leaves first: most values are strings and integers
    if tp is str:
        if type(data) is not str:
            raise _fail(path, "a string", data)
        return data
    if tp is int:
        if type(data) is not int:
            raise _fail(path, "an integer", data)
        return data
    if tp is Any:
        return data
    if tp == Arg:
        return _decode_arg(data, path)
    if tp in _FIELDS or dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise _fail(path, f"an object ({tp.__name__})", data)
        names, fields = _fields(tp)
        if not names.issuperset(data):
            unknown = set(data) - names
            raise _fail(path, f"fields of {tp.__name__}", f"unknown {sorted(unknown)[:3]}")
        kwargs = {}
        for name, hint, required in fields:
            if name in data:
                kwargs[name] = _decode(hint, data[name], f"{path}.{name}")
            elif required:
                raise _fail(path, f"field {name!r}", "nothing")
        return tp(**kwargs)
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise _fail(path, "one of " + ", ".join(repr(m.value) for m in tp), data) from None
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        for opt in options:
            if opt is not type(None):
                return _decode(opt, data, path)
    if origin is tuple:
        if not isinstance(data, list):
            raise _fail(path, "a list", data)
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise _fail(path, f"a list of {len(args)}", f"{len(data)} items")
        return tuple(_decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin is dict:
        if not isinstance(data, dict):
            raise _fail(path, "an object", data)
        _, vt = typing.get_args(tp)
        return {k: _decode(vt, v, f"{path}.{k}") for k, v in data.items()}
    if tp is float:
        if type(data) not in (int, float):
            raise _fail(path, "a number", data)
        return float(data)
    if tp is bool:
        if type(data) is not bool:
            raise _fail(path, "a boolean", data)
        return data
    raise BundleError(f"bundle field {path}: unsupported schema type {tp!r}")


T = typing.TypeVar("T")


def from_json(cls: type[T], data: Any, path: str = "") -> T:
    """Validate JSON primitives against ``cls`` and build it; ``BundleError`` on any mismatch."""
    try:
        return _decode(cls, data, path or cls.__name__)
    except RecursionError:
        raise BundleError(f"bundle field {path or cls.__name__}: nested too deeply") from None


def upgrade_manifest(data: dict[str, Any]) -> dict[str, Any]:
    """A manifest of an older minor version, as JSON, brought to this version's fields: schema
    1.0 and 1.1 kept ``stats`` as a free-form object (its memory plan keyed ``"batch=8,seq=128"``)."""
    version = tuple(data.get("schema_version") or ())
    stats = data.get("stats")
    if version >= (1, 2) or not isinstance(stats, dict):
        return data
    known = {f.name for f in dataclasses.fields(BuildStats)}
    typed = {k: v for k, v in stats.items() if k in known and k != "memory_plan"}
    plan = stats.get("memory_plan")
    if isinstance(plan, dict):
        typed["memory_plan"] = [
            {"sizes": _plan_sizes(key), "peak_bytes": peak} for key, peak in plan.items() if key
        ]
    return {**data, "stats": typed}


_PLAN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=[0-9]{1,19}")


def _plan_sizes(key: str) -> dict[str, int]:
    """``"batch=8,seq=128"`` (a schema 1.0/1.1 memory-plan key) → ``{"batch": 8, "seq": 128}``."""
    parts = key.split(",")
    if not all(_PLAN_KEY.fullmatch(kv) for kv in parts):
        raise _fail("manifest.stats.memory_plan", "keys such as 'batch=8,seq=128'", key)
    return {k: int(v) for k, v in (kv.split("=") for kv in parts)}


def schema_fingerprint() -> str:
    """Text listing every record, field type and enum value; ``tests/aot/schema_fingerprint.txt``
    holds it for this ``SCHEMA_VERSION``, so a change shows in review as a diff of that file."""
    lines = []
    for cls in RECORDS:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            lines.append(f"{cls.__name__}.{f.name}: {_type_text(hints[f.name])}")
        if cls in TAGGED_ARGS:
            lines.append(f"{cls.__name__} is tagged {cls.TAG!r}")
    for e in ENUMS:
        lines.append(f"{e.__name__}: {', '.join(m.value for m in e)}")
    return "\n".join(lines) + "\n"


def _type_text(tp: Any) -> str:
    """A field type as stable text (no module paths, unions in declaration order)."""
    if tp is Any:
        return "Any"
    if tp is type(None):
        return "None"
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_text(a) for a in args)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    return getattr(tp, "__name__", str(tp))
