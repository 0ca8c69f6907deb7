"""The model-file API: how a model file declares what to build.

A model file is ordinary Python that defines ``spec = ModelSpec(...)`` at module level::

    batch = Dim("batch", 1, 64, buckets=(1, 8, 64), paddable=True)
    spec = ModelSpec(
        module=make_mlp,                              # zero-argument callable -> nn.Module
        inputs=[Input("x", (batch, 1024))],           # ints are static sizes, Dims are dynamic
        dtype="float16",
    )

A stateful model (an LLM with a static KV cache) declares its cache as state inputs and its
entry points, each the same ``forward`` with some Dims fixed::

    batch, seq = Dim("batch", 1, 8), Dim("seq", 1, 512)
    spec = ModelSpec(
        module=make_lm,
        inputs=[
            Input("input_ids", (batch, seq), dtype="int64", low=0, high=vocab),
            Input("key_cache_0", (batch, heads, 512, head_dim), state=True),   # runner-owned
            ...
        ],
        entry_points=(EntryPoint("prefill"), EntryPoint("decode", {"seq": 1})),
    )

Everything here is plain data (stdlib only); the tracer turns it into torch objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aot.admissible import MAX_DIM, admits
from aot.errors import SpecError
from aot.schema import Bucket, Guards

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int8", "uint8", "int16", "int32", "int64", "bool")
DTYPES = FLOAT_DTYPES + INT_DTYPES
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# An input's name is a path into forward's arguments: ``pixel_values``, ``inputs.image`` (a dict's
# key), ``past.0`` (a tuple's element).
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}(\.([A-Za-z_][A-Za-z0-9_]{0,63}|[0-9]{1,4}))*$")


@dataclass(frozen=True)
class Dim:
    """A dynamic input dimension with an inclusive range ``min <= value <= max``.

    ``buckets``: sizes to capture CUDA graphs for (default: powers of two up to ``max``).
    ``paddable``: a call may be padded up to a bucket along this dim (checked at build time).
    ``example``: the size used to trace and to make the example inputs.
    ``multiple_of``: only multiples of this are admitted (``Dim("height", 32, 512, multiple_of=32)``):
    what a windowed or strided model needs when its arithmetic depends on the size modulo a
    stride (Swin's windows, SegFormer's overlapping patches). The model is traced over the
    multiples alone, so one program covers them; the loader refuses any other size with a
    ``GuardError`` that names the multiple (pad or resize the input to one). ``min`` and ``max``
    must be multiples.
    """

    name: str
    min: int
    max: int
    buckets: tuple[int, ...] | None = None
    paddable: bool = False
    example: int | None = None
    multiple_of: int = 1

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise SpecError(f"Dim name {self.name!r} is not an identifier; use letters, digits and _")
        if not (1 <= self.min <= self.max <= MAX_DIM):
            raise SpecError(
                f"Dim {self.name!r}: expected 1 <= min <= max <= {MAX_DIM}, got min={self.min} max={self.max}"
            )
        m = self.multiple_of
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= self.max:
            raise SpecError(
                f"Dim {self.name!r}: multiple_of must be an int in 1..{self.max} (max), got {m!r}"
            )
        if m > 1:
            bad = {k: v for k, v in (("min", self.min), ("max", self.max)) if v % m}
            if bad:
                fix = {"min": -(-self.min // m) * m, "max": self.max // m * m}
                raise SpecError(
                    f"Dim {self.name!r}: multiple_of={m}, but "
                    + ", ".join(f"{k}={v}" for k, v in bad.items())
                    + (" is no multiple" if len(bad) == 1 else " are no multiples")
                    + f" of {m}; declare "
                    + ", ".join(f"{k}={fix[k]}" for k in bad)
                )
        if self.buckets is not None:
            object.__setattr__(self, "buckets", tuple(sorted(set(self.buckets))))
            off = [b for b in self.buckets if b % m]
            if off:
                raise SpecError(f"Dim {self.name!r}: buckets {off} are no multiples of {m} (multiple_of)")
            bad = [b for b in self.buckets if not self.min <= b <= self.max]
            if bad:
                raise SpecError(f"Dim {self.name!r}: buckets {bad} fall outside {self.min}..{self.max}")
        if self.example is not None and not self.min <= self.example <= self.max:
            raise SpecError(f"Dim {self.name!r}: example {self.example} falls outside {self.min}..{self.max}")
        if self.example is not None and self.example % m:
            raise SpecError(f"Dim {self.name!r}: example {self.example} is no multiple of {m} (multiple_of)")

    @property
    def example_size(self) -> int:
        if self.example is not None:
            return self.example
        m = self.multiple_of
        if m > 1:  # two multiples: a quotient of 1 is one torch would specialize
            return min(self.max, max(self.min, 2 * m))
        return min(self.max, max(self.min, 4))

    def default_buckets(self) -> tuple[int, ...]:
        """Declared buckets, or powers of two up to ``max`` (times ``multiple_of``), and ``max``."""
        if self.buckets is not None:
            return self.buckets
        sizes, b = [], self.multiple_of
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

    ``state=True``: the runner owns this tensor, not the caller. The loader allocates it once,
    zero-initialised, at the maximum of its dims (only the first dim may be a Dim: the batch; the
    rest are static), and passes it to every call, which ``forward`` receives as an ordinary
    tensor argument and may update in place (``k_cache[:, :, cache_position] = k``,
    ``index_copy_``, ``index_put_``). A call on ``b`` rows sees rows ``0..b-1`` of it;
    ``Runner.reset`` zeroes it.
    """

    name: str
    shape: tuple[int | Dim, ...]
    dtype: str | None = None
    low: float = -1.0
    high: float = 1.0
    state: bool = False

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
        if not isinstance(self.state, bool):
            raise SpecError(f"input {self.name!r}: state must be True or False, got {self.state!r}")
        if self.state:
            if not self.shape:
                raise SpecError(f"state input {self.name!r} is a scalar; state must have at least one dim")
            dynamic = [i for i, s in enumerate(self.shape) if isinstance(s, Dim)]
            if any(i != 0 for i in dynamic):
                raise SpecError(
                    f"state input {self.name!r}: only its first dim (the batch) may be a Dim, got a Dim at "
                    f"dim {[i for i in dynamic if i != 0][0]}; make the other dims static (the maximum size)"
                )


@dataclass(frozen=True)
class EntryPoint:
    """One entry point of a bundle: ``forward`` exported with some Dims fixed to a size.

    ``EntryPoint("prefill")`` keeps every Dim dynamic; ``EntryPoint("decode", {"seq": 1})``
    exports ``forward`` again with ``seq`` fixed to 1. Each entry point is a program of its own
    (its own guards, buckets and kernels); all share the weights and the state.

    ``kwargs``: constant keyword arguments of ``forward`` for this entry point alone, over
    ``ModelSpec.kwargs`` (``{"phase": "encode"}``: one forward that runs an encoder in one entry
    point and a decoder step in the others); the same plain types as ``ModelSpec.kwargs``.
    """

    name: str
    sizes: dict[str, int] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SpecError(f"entry point name {self.name!r} is not an identifier; use letters, digits and _")
        if not isinstance(self.sizes, dict):
            raise SpecError(
                f"entry point {self.name!r}: sizes must be a dict {{dim name: size}}, got {self.sizes!r}"
            )
        object.__setattr__(self, "sizes", dict(self.sizes))
        for k, v in self.sizes.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(
                    f"entry point {self.name!r}: sizes must map Dim names to ints, got {k!r}: {v!r}"
                )
        if not isinstance(self.kwargs, dict):
            raise SpecError(
                f"entry point {self.name!r}: kwargs must be a dict {{parameter: constant}}, got {self.kwargs!r}"
            )
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        for k, v in self.kwargs.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))):
                raise SpecError(
                    f"entry point {self.name!r}: kwargs[{k!r}] is a {type(v).__name__}; constant keyword "
                    f"arguments must be bool, int, float, str or None (tensors are Inputs)"
                )

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.sizes.items())), tuple(sorted(self.kwargs.items()))))


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

    ``entry_points``: named variants of ``forward`` with some Dims fixed (``prefill``, ``decode``);
    empty means one unnamed entry point with every Dim dynamic. Each is traced as a program of its
    own; all share weights and state (``Input(state=True)``).

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
    entry_points: tuple[EntryPoint, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "entry_points", tuple(self.entry_points))
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
        where: dict[str, str] = {}
        for inp in self.inputs:
            for d in (s for s in inp.shape if isinstance(s, Dim)):
                if d.name in dims and dims[d.name] != d:
                    raise SpecError(
                        f"two different Dims are named {d.name!r}: {_dim_text(dims[d.name])} on input "
                        f"{where[d.name]!r} and {_dim_text(d)} on input {inp.name!r}; use one Dim for both, "
                        f"or give them distinct names"
                    )
                dims.setdefault(d.name, d)
                where.setdefault(d.name, inp.name)
        if all(i.state for i in self.inputs):
            raise SpecError("every Input is state; a call needs at least one input from the caller")
        for inp in self.inputs:
            if inp.state and inp.shape and isinstance(inp.shape[0], Dim):
                callers = {s.name for i in self.inputs if not i.state for s in i.shape if isinstance(s, Dim)}
                if inp.shape[0].name not in callers:
                    raise SpecError(
                        f"state input {inp.name!r}: its first dim {inp.shape[0].name!r} is no dim of a caller's "
                        f"input, so a call could not say how many rows it uses"
                    )
        seen_names: set[str] = set()
        for ep in self.entry_points:
            if not isinstance(ep, EntryPoint):
                raise SpecError(f"ModelSpec entry_points must be EntryPoint objects, got {ep!r}")
            if ep.name in seen_names:
                raise SpecError(f"two entry points are named {ep.name!r}; give them distinct names")
            seen_names.add(ep.name)
            clash = sorted(set(ep.kwargs) & {i.name for i in self.inputs})
            if clash:
                raise SpecError(
                    f"entry point {ep.name!r}: {clash} are both Inputs and constant kwargs; keep one"
                )
            for k, v in ep.sizes.items():
                d = dims.get(k)
                if d is None:
                    raise SpecError(
                        f"entry point {ep.name!r} fixes {k!r}, which is no Dim of the inputs {sorted(dims)}"
                    )
                if not d.min <= v <= d.max:
                    raise SpecError(
                        f"entry point {ep.name!r} fixes {k} = {v}, outside Dim {k!r}'s range {d.min}..{d.max}"
                    )
                if any(i.state and isinstance(i.shape[0], Dim) and i.shape[0].name == k for i in self.inputs):
                    raise SpecError(
                        f"entry point {ep.name!r} fixes {k!r}, the batch dim of the state; a program must keep "
                        f"the batch dynamic so that it can run on any rows of the state"
                    )

    def for_entry(self, ep: EntryPoint) -> ModelSpec:
        """This spec as entry point ``ep`` calls ``forward``: its constant kwargs over the spec's."""
        return replace(self, kwargs={**self.kwargs, **ep.kwargs}) if ep.kwargs else self

    def state_inputs(self) -> tuple[Input, ...]:
        """The inputs the runner owns (``Input(state=True)``), in declaration order."""
        return tuple(i for i in self.inputs if i.state)

    def dims(self) -> list[Dim]:
        """Every distinct Dim, in order of first appearance."""
        seen: dict[str, Dim] = {}
        for inp in self.inputs:
            for size in inp.shape:
                if isinstance(size, Dim):
                    seen.setdefault(size.name, size)
        return list(seen.values())


def _dim_text(d: Dim) -> str:
    """``Dim('batch', 1, 64)``, with the fields set beyond the range."""
    extra = "".join(
        f", {k}={v!r}"
        for k, v in (
            ("buckets", d.buckets),
            ("paddable", d.paddable),
            ("example", d.example),
            ("multiple_of", d.multiple_of > 1 and d.multiple_of),
        )
        if v
    )
    return f"Dim({d.name!r}, {d.min}, {d.max}{extra})"


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
