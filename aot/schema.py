"""The bundle schema: every record a ``.tpk`` holds, as frozen dataclasses of primitives.

This is the one file that defines the on-disk format. Change a field and you must bump
``SCHEMA_VERSION`` (``tests/aot/test_schema.py`` fails otherwise): a new optional field is a minor
bump, anything a loader of the same major could misread is a major bump.

Records are (de)serialized with ``to_json`` / ``from_json``, which validate every field's type,
so a hostile manifest becomes a ``BundleError``, never an ``AttributeError`` deep in the loader.

A step's arguments are ``Arg`` values: JSON scalars, lists, and small tagged records, each stored
as a one-key object::

    Buf      {"buf": "addmm_3"}       a buffer of the program
    Sym      {"sym": "batch*seq"}     a size expression, evaluated per call
    SymBool  {"symbool": "seq > 1"}   a size comparison, evaluated to a bool per call
    DType    {"dtype": "float16"}
    Device   {"device": "runtime"}    the device the bundle is loaded on
    Layout   {"layout": "strided"}
    MemoryFormat  {"memory_format": "contiguous_format"}
    SpecialFloat  {"float": "inf"}    inf, -inf and nan (JSON has no literal for them)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from aot.errors import BundleError

SCHEMA_VERSION = (1, 2)
FORMAT_NAME = "aotpack-bundle"
# The oldest torch whose ATen ops the loader has been checked against.
TORCH_MIN = "2.11"

# Archive layout: every member path is one of these.
MANIFEST_PATH = "manifest.json"
PROGRAM_PATH = "program.json.zst"
WEIGHTS_PATH = "weights.safetensors"
REFERENCE_PATH = "reference.safetensors"
GUARDS_PATH = "guards.txt"
KERNELS_DIR = "kernels/"
KERNEL_SOURCE_FORMAT = "kernels/{kernel}.py"
KERNEL_CUBIN_FORMAT = "kernels/{kernel}.{arch}.cubin"
WEIGHTS_ALIGNMENT = 64

# Reference tensors are stored under these prefixes in REFERENCE_PATH.
REFERENCE_INPUT_PREFIX = "input."
REFERENCE_OUTPUT_PREFIX = "output."


class StepKind(str, enum.Enum):
    ATEN = "aten"
    KERNEL = "kernel"


class ParamKind(str, enum.Enum):
    PTR = "ptr"  # a tensor
    I32 = "i32"  # a runtime size
    I64 = "i64"


class TreeKind(str, enum.Enum):
    TENSOR = "tensor"
    NONE = "none"
    TUPLE = "tuple"
    LIST = "list"
    DICT = "dict"
    RECORD = "record"


# ---------------------------------------------------------------------------------------------
# Step arguments: tagged records (see the module docstring).


@dataclass(frozen=True)
class Buf:
    TAG: ClassVar[str] = "buf"
    name: str


@dataclass(frozen=True)
class Sym:
    TAG: ClassVar[str] = "sym"
    text: str


@dataclass(frozen=True)
class SymBool:
    TAG: ClassVar[str] = "symbool"
    text: str


@dataclass(frozen=True)
class DType:
    TAG: ClassVar[str] = "dtype"
    name: str


@dataclass(frozen=True)
class Device:
    TAG: ClassVar[str] = "device"
    name: str = "runtime"


@dataclass(frozen=True)
class Layout:
    TAG: ClassVar[str] = "layout"
    name: str


@dataclass(frozen=True)
class MemoryFormat:
    TAG: ClassVar[str] = "memory_format"
    name: str


@dataclass(frozen=True)
class SpecialFloat:
    TAG: ClassVar[str] = "float"
    name: str  # "inf", "-inf" or "nan"


TAGGED_ARGS: tuple[type, ...] = (Buf, Sym, SymBool, DType, Device, Layout, MemoryFormat, SpecialFloat)
_BY_TAG: dict[str, type] = {cls.TAG: cls for cls in TAGGED_ARGS}
# Which values each tag admits, where the set is closed; the loader refuses anything else.
ARG_VALUES: dict[type, frozenset[str]] = {
    Device: frozenset({"runtime"}),
    Layout: frozenset({"strided"}),
    MemoryFormat: frozenset({"contiguous_format", "preserve_format", "channels_last"}),
    SpecialFloat: frozenset({"inf", "-inf", "nan"}),
}
# A step argument: a JSON scalar, a tagged record, or a list of arguments.
Arg = None | bool | int | float | str | Buf | Sym | SymBool | DType | Device | Layout | MemoryFormat | SpecialFloat | list


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
        (tag, value), = data.items()
        cls = _BY_TAG.get(tag)
        if cls is not None and isinstance(value, str) and value in ARG_VALUES.get(cls, (value,)):
            return cls(value)
    raise _fail(path, "a step argument (scalar, list, or one of " + ", ".join(_BY_TAG) + ")", data)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype and shape; each size is expression text (``"768"``, ``"batch*seq"``)."""

    dtype: str
    shape: tuple[str, ...]


@dataclass(frozen=True)
class NamedTensor:
    name: str
    spec: TensorSpec


@dataclass(frozen=True)
class SymbolSource:
    """Where a symbol's value is read at call time: ``inputs[input].shape[dim]``."""

    symbol: str
    input: str
    dim: int


@dataclass(frozen=True)
class Step:
    """One step of the program.

    ``StepKind.ATEN``: ``target`` is an ATen overload (``aten.addmm.default``) called with
    ``args``/``kwargs``; its results bind to ``outputs`` (``None`` for results nobody uses).
    ``StepKind.KERNEL``: ``target`` is a kernel id from ``Program.kernels``; ``args`` are the
    kernel's runtime arguments in parameter order (``Buf`` for pointers, ``Sym`` for sizes),
    ``grid`` its launch grid, and ``reference`` the ATen steps it replaces (what the CPU path runs
    and ``aotpack verify`` compares against).
    """

    kind: StepKind
    target: str
    args: tuple[Arg, ...]
    kwargs: dict[str, Arg]
    outputs: tuple[str | None, ...]
    grid: tuple[str, ...] = ()
    reference: tuple[Step, ...] = ()


@dataclass(frozen=True)
class KernelParam:
    name: str
    kind: ParamKind
    dtype: str = ""


@dataclass(frozen=True)
class Kernel:
    """A fused Triton kernel: source kept for review, cubins per arch, launch metadata."""

    id: str
    name: str
    source: str
    params: tuple[KernelParam, ...]
    num_warps: int
    num_stages: int
    shared: dict[str, int]  # arch -> dynamic shared memory bytes
    archs: tuple[str, ...]
    ops: tuple[str, ...]  # the ATen ops it fuses
    config: dict[str, Any]  # block sizes and the heuristic that chose them
    bytes_moved: str  # estimate of bytes read + written, as expression text
    scratch_params: int = 2  # trailing pointer params Triton's ABI appends


@dataclass(frozen=True)
class TreeSpec:
    """The structure of a model's outputs, so the runner returns what the model returned.

    ``kind``: ``TENSOR`` (the next flat output), ``NONE``, ``TUPLE``, ``LIST``, ``DICT``, or
    ``RECORD`` (a dataclass, named tuple or HF ``ModelOutput``: ordered ``keys``, its class named
    in ``type`` for display; the loader returns an ``aot.pytree.Record``, never the class).
    """

    kind: TreeKind
    type: str = ""
    keys: tuple[str, ...] = ()
    children: tuple[TreeSpec, ...] = ()


@dataclass(frozen=True)
class Program:
    """A straight-line program over named buffers with symbolic sizes.

    ``variants``: further programs of the same model, each traced under its own guards (e.g. a
    ``batch == 1`` specialization beside the general trace); ``Manifest.programs`` holds their
    guards, in the same order after this one's. They share this program's weights.
    """

    inputs: tuple[NamedTensor, ...]
    weights: tuple[NamedTensor, ...]
    buffers: dict[str, TensorSpec]
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    symbols: tuple[SymbolSource, ...]
    kernels: tuple[Kernel, ...] = ()
    output_tree: TreeSpec | None = None
    variants: tuple[Program, ...] = ()


@dataclass(frozen=True)
class InputGuard:
    """Declared contract of one input: dtype, rank, and per-dim size (int text or symbol)."""

    name: str
    dtype: str
    shape: tuple[str, ...]


@dataclass(frozen=True)
class GuardSource:
    """One guard discovered while tracing, with the user's line that caused it."""

    text: str  # its effect, simplified: "seq >= 9", "seq % 2 == 0"
    file: str
    line: int
    code: str


@dataclass(frozen=True)
class SymbolGuard:
    """A dynamic symbol's admissible set: ``min <= v <= max``, ``v % modulus in residues``,
    ``v not in excluded``; ``declared_*`` is what the model file asked for."""

    name: str
    declared_min: int
    declared_max: int
    min: int
    max: int
    modulus: int = 1
    residues: tuple[int, ...] = (0,)
    excluded: tuple[int, ...] = ()
    sources: tuple[GuardSource, ...] = ()


@dataclass(frozen=True)
class Relation:
    """A residual guard over several symbols, as a boolean expression."""

    expr: str
    source: GuardSource


@dataclass(frozen=True)
class Environment:
    """What the serving host must offer. ``cuda_built``: the CUDA release of the ptxas that
    compiled the cubins (``"13.4"``); a driver of an older CUDA major cannot load them (the
    loader checks). Empty when the bundle has no kernels."""

    archs: tuple[str, ...]
    torch_built: str
    torch_min: str
    triton_built: str
    python_built: str
    cuda_built: str = ""


@dataclass(frozen=True)
class Guards:
    inputs: tuple[InputGuard, ...]
    symbols: tuple[SymbolGuard, ...]
    relations: tuple[Relation, ...]
    specializations: tuple[GuardSource, ...] = ()


@dataclass(frozen=True)
class Bucket:
    """CUDA-graph sizes for one symbol; ``paddable`` only when the build checked padding."""

    symbol: str
    sizes: tuple[int, ...]
    paddable: bool = False
    pad_check: str = ""  # what the build checked, e.g. "max abs diff 0 on real rows at seq=3->4"


@dataclass(frozen=True)
class ProgramEntry:
    """One program of the bundle: the guards a call must satisfy to run it, and its buckets.

    A call runs the first program whose guards admit it; ``Manifest.guards`` is the bundle's
    contract as a whole (every size some program admits)."""

    name: str  # what it covers, e.g. "batch == 1"; "general" for the first
    guards: Guards
    buckets: tuple[Bucket, ...]


@dataclass(frozen=True)
class BucketMemory:
    """The peak activation memory a CUDA-graph capture at these sizes holds."""

    sizes: dict[str, int]
    peak_bytes: int


@dataclass(frozen=True)
class BuildStats:
    """What the build did and measured, for ``aotpack inspect`` and for verification."""

    steps: int = 0  # steps of the first program
    aten_ops_replaced: int = 0  # ATen ops the first program stands for (kernels counted by what they fuse)
    kernels: int = 0  # distinct kernels, all programs
    kernel_steps: int = 0  # kernel launches of the first program
    aten_ops_fused: int = 0
    fallbacks: int = 0  # kernels that failed to compile and stayed ATen calls
    unfused_ops: int = 0  # ops the fuser does not know (library calls)
    activations_folded: int = 0
    weights_padded: int = 0
    weights_bytes: int = 0
    programs: int = 1
    # Half-precision models: how far eager at the model dtype is from eager float32 on the example
    # inputs, relative to the output scale (what ``aotpack verify`` may expect at best).
    reference_noise: float = 0.0
    memory_plan: tuple[BucketMemory, ...] = ()  # one per bucket combination, largest first


@dataclass(frozen=True)
class Member:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    format: str
    schema_version: tuple[int, int]
    name: str
    dtype: str
    guards: Guards
    environment: Environment
    buckets: tuple[Bucket, ...]
    members: dict[str, Member]
    ops: tuple[str, ...]  # every ATen overload the program calls; the loader checks they exist
    stats: BuildStats = BuildStats()
    # When set, WEIGHTS_PATH is not inside the archive but in this file beside it (``--split-weights``);
    # its sha256 and size are still in ``members``.
    external_weights: str = ""
    # Empty for a bundle of one program (its guards and buckets are the fields above); else one
    # entry per program, in dispatch order: ``Program`` itself, then ``Program.variants``.
    programs: tuple[ProgramEntry, ...] = ()


# ---------------------------------------------------------------------------------------------
# Generic, validating JSON (de)serialization.


def to_json(obj: Any) -> Any:
    """A dataclass tree → JSON-ready primitives (tuples become lists, enums their values, tagged
    arguments one-key objects)."""
    if isinstance(obj, TAGGED_ARGS):
        return {obj.TAG: _tagged_value(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    return obj


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, fixed separators, trailing newline."""
    return (json.dumps(to_json(obj), sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False) + "\n").encode()


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _fail(path: str, expected: str, got: Any) -> BundleError:
    shown = type(got).__name__ if not isinstance(got, (int, str)) else repr(got)[:60]
    return BundleError(f"bundle field {path}: expected {expected}, got {shown}")


def _decode(tp: Any, data: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if tp == Arg:
        return _decode_arg(data, path)
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
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise _fail(path, f"an object ({tp.__name__})", data)
        hints = _hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(data) - names
        if unknown:
            raise _fail(path, f"fields of {tp.__name__}", f"unknown {sorted(unknown)[:3]}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = _decode(hints[f.name], data[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _fail(path, f"field {f.name!r}", "nothing")
        return tp(**kwargs)
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
    if tp is int:
        if type(data) is not int:
            raise _fail(path, "an integer", data)
        return data
    if tp is float:
        if type(data) not in (int, float):
            raise _fail(path, "a number", data)
        return float(data)
    if tp is str:
        if type(data) is not str:
            raise _fail(path, "a string", data)
        return data
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
            {"sizes": {k: int(v) for k, v in (kv.split("=") for kv in key.split(",") if "=" in kv)}, "peak_bytes": peak}
            for key, peak in plan.items() if isinstance(key, str) and key
        ]
    return {**data, "stats": typed}


RECORDS: tuple[type, ...] = (
    TensorSpec, NamedTensor, SymbolSource, *TAGGED_ARGS, Step, KernelParam, Kernel, TreeSpec, Program, InputGuard,
    GuardSource, SymbolGuard, Relation, Environment, Guards, Bucket, ProgramEntry, BucketMemory, BuildStats, Member,
    Manifest,
)
ENUMS: tuple[type[enum.Enum], ...] = (StepKind, ParamKind, TreeKind)


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
