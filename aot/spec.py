"""The model-file API: how a model file declares what to build.

A model file is ordinary Python that defines ``spec = ModelSpec(...)`` at module level::

    batch = Dim("batch", 1, 64, buckets=(1, 8, 64), paddable=True)
    spec = ModelSpec(
        module=make_mlp,                              # zero-argument callable -> nn.Module
        inputs=[Input("x", (batch, 1024))],           # ints are static sizes, Dims are dynamic
        dtype="float16",
    )

Everything here is plain data (stdlib only); the tracer turns it into torch objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aot.admissible import admits
from aot.errors import SpecError
from aot.schema import Bucket, Guards

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int8", "uint8", "int16", "int32", "int64", "bool")
DTYPES = FLOAT_DTYPES + INT_DTYPES
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# An input's name is a path into forward's arguments: ``pixel_values``, ``inputs.image`` (a dict's
# key), ``past.0`` (a tuple's element).
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}(\.([A-Za-z_][A-Za-z0-9_]{0,63}|[0-9]{1,4}))*$")
MAX_DIM = 1 << 31


@dataclass(frozen=True)
class Dim:
    """A dynamic input dimension with an inclusive range ``min <= value <= max``.

    ``buckets``: sizes to capture CUDA graphs for (default: powers of two up to ``max``).
    ``paddable``: a call may be padded up to a bucket along this dim (checked at build time).
    ``example``: the size used to trace and to make the example inputs.
    """

    name: str
    min: int
    max: int
    buckets: tuple[int, ...] | None = None
    paddable: bool = False
    example: int | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise SpecError(f"Dim name {self.name!r} is not an identifier; use letters, digits and _")
        if not (1 <= self.min <= self.max <= MAX_DIM):
            raise SpecError(
                f"Dim {self.name!r}: expected 1 <= min <= max <= {MAX_DIM}, got min={self.min} max={self.max}"
            )
        if self.buckets is not None:
            object.__setattr__(self, "buckets", tuple(sorted(set(self.buckets))))
            bad = [b for b in self.buckets if not self.min <= b <= self.max]
            if bad:
                raise SpecError(f"Dim {self.name!r}: buckets {bad} fall outside {self.min}..{self.max}")
        if self.example is not None and not self.min <= self.example <= self.max:
            raise SpecError(f"Dim {self.name!r}: example {self.example} falls outside {self.min}..{self.max}")

    @property
    def example_size(self) -> int:
        if self.example is not None:
            return self.example
        return min(self.max, max(self.min, 4))

    def default_buckets(self) -> tuple[int, ...]:
        if self.buckets is not None:
            return self.buckets
        sizes, b = [], 1
        while b < self.max:
            if b >= self.min:
                sizes.append(b)
            b *= 2
        sizes.append(self.max)
        return tuple(sizes)


@dataclass(frozen=True)
class Input:
    """One positional input of ``forward``: its name, shape (ints and Dims) and dtype.

    ``dtype=None`` means the model's dtype. ``low``/``high`` bound the values of example inputs
    (integer inputs such as token ids need them).
    """

    name: str
    shape: tuple[int | Dim, ...]
    dtype: str | None = None
    low: float = -1.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not _PATH.match(self.name) or len(self.name) > 256:
            raise SpecError(
                f"input name {self.name!r} is not an identifier, or a path of them into a nested "
                f"argument (`inputs.image`, `past.0`)"
            )
        object.__setattr__(self, "shape", tuple(self.shape))
        for size in self.shape:
            if isinstance(size, bool) or not isinstance(size, (int, Dim)):
                raise SpecError(f"input {self.name!r}: shape entries must be ints or Dims, got {size!r}")
            if isinstance(size, int) and not 0 <= size <= MAX_DIM:
                raise SpecError(f"input {self.name!r}: static size {size} out of range")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SpecError(f"input {self.name!r}: dtype {self.dtype!r} is not one of {DTYPES}")
        if not self.low < self.high:
            raise SpecError(f"input {self.name!r}: expected low < high, got {self.low}, {self.high}")


@dataclass(frozen=True)
class ModelSpec:
    """What to build: the module, its inputs, dtype and optional weights file.

    ``module``: an ``nn.Module`` or a zero-argument callable returning one.
    ``weights``: a safetensors file (relative to the model file) loaded into the module's
    state dict; ``aotpack build --weights`` overrides it.
    ``seed``: seeds module construction and example inputs, so builds are reproducible.
    ``kwargs``: constant keyword arguments of ``forward`` (``{"return_dict": True}``): plain
    ``bool``/``int``/``float``/``str``/``None``, fixed in the bundle. A ``forward`` that takes
    ``use_cache`` gets ``use_cache=False`` unless given here: a bundle keeps no cache to return.
    ``allow_narrowing``: build even when the traced programs cannot cover every declared size
    (the bundle then admits less than declared, as its guards say); without it such a build fails.

    Inputs are passed to ``forward`` by keyword when every input's name is one of its parameters
    (``input_ids``, ``attention_mask``: an unmodified HF model), else by position.
    """

    module: Any
    inputs: tuple[Input, ...]
    dtype: str = "float32"
    weights: str | None = None
    name: str | None = None
    seed: int = 0
    example_inputs: Callable[..., Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    allow_narrowing: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        for k, v in self.kwargs.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))):
                raise SpecError(
                    f"ModelSpec kwargs[{k!r}] is a {type(v).__name__}; constant keyword arguments must be "
                    f"bool, int, float, str or None (tensors are Inputs)"
                )
        clash = sorted(set(self.kwargs) & {i.name for i in self.inputs})
        if clash:
            raise SpecError(f"{clash} are both Inputs and constant kwargs; keep one")
        if not self.inputs:
            raise SpecError("ModelSpec needs at least one Input")
        if self.dtype not in FLOAT_DTYPES:
            raise SpecError(f"ModelSpec dtype {self.dtype!r} is not one of {FLOAT_DTYPES}")
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise SpecError(f"input names must be unique, got {names}")
        for a in names:
            for b in names:
                if b.startswith(a + "."):
                    raise SpecError(f"input {a!r} is a tensor and also holds {b!r}; name the leaves only")
        dims: dict[str, Dim] = {}
        for d in self.dims():
            if d.name in dims and dims[d.name] != d:
                raise SpecError(f"two different Dims are named {d.name!r}; give them distinct names")
            dims[d.name] = d

    def dims(self) -> list[Dim]:
        """Every distinct Dim, in order of first appearance."""
        seen: dict[str, Dim] = {}
        for inp in self.inputs:
            for size in inp.shape:
                if isinstance(size, Dim):
                    seen.setdefault(size.name, size)
        return list(seen.values())


def plan_buckets(spec: ModelSpec, guards: Guards) -> tuple[Bucket, ...]:
    """The CUDA-graph buckets of a build: declared (or default) sizes that the guards admit; the largest admitted size is
    always a bucket, so every admitted call fits one. Symbols a program traced as static have
    no buckets in it."""
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
