"""A bundle's serving contract, read from its manifest, and the Triton model configuration it renders.

``serving_spec`` turns the guard manifest into what a serving engine needs: input and output names,
dtypes and shapes (``-1`` for a dynamic size), the batch symbol when requests may be joined along
dim 0, the largest batch, and the sizes the bundle captured CUDA graphs for. ``render_config`` writes
it as Triton's ``config.pbtxt`` for the Python backend model in ``aot.serve.triton_model``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from aot import schema
from aot.admissible import admits
from aot.errors import EnvError, printable
from aot.manifest_text import rows_note, static_size
from aot.pytree import leaf_paths
from aot.rows import row_mixing

# Triton's wire types for the dtypes a bundle's inputs and outputs may have.
TRITON_DTYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "bfloat16": "BF16",
    "float32": "FP32",
    "float64": "FP64",
}
# ``--io-dtype``: "" keeps the bundle's dtypes on the wire; "float32" carries half-precision inputs
# and outputs as float32 (cast inside the model backend), which KServe v2 JSON on Triton accepts.
IO_DTYPES = ("", "float32")
HALF_DTYPES = ("float16", "bfloat16")
DEFAULT_MAX_QUEUE_DELAY_US = 2000  # how long the first request of a batch may wait for company
BACKEND = "python"


@dataclass(frozen=True)
class TensorSlot:
    """One input or output as a serving engine sees it: ``dims`` are the full shape with ``-1`` for a
    dynamic size (the batch dim included; ``ServingSpec.dims`` drops it for a batching engine)."""

    name: str
    dtype: str  # torch dtype name, e.g. "float16"
    dims: tuple[int, ...]

    @property
    def triton_dtype(self) -> str:
        return TRITON_DTYPES[self.dtype]


@dataclass(frozen=True)
class ServingSpec:
    """What an engine needs to serve a bundle. ``batch_symbol`` is set when it is the first dim of
    every input and output and of no other dim: requests may then be joined along dim 0, up to
    ``max_batch_size`` rows (0: every request runs alone), and only when the build proved the rows
    along it independent (``SymbolGuard.rows_independent``): joining along any other dim would hand
    one client answers computed from another's inputs. ``preferred_batch_sizes``: the CUDA-graph
    buckets of the batch symbol above 1 (see ``preferred_sizes``)."""

    name: str
    inputs: tuple[TensorSlot, ...]
    outputs: tuple[TensorSlot, ...]
    batch_symbol: str
    max_batch_size: int
    buckets: tuple[int, ...]
    batching: str = ""  # why requests are, or are not, joined: one line for the operator
    io_dtype: str = ""  # the dtype half-precision inputs and outputs take on the wire ("": the bundle's)

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        return preferred_sizes(self.buckets, self.max_batch_size)

    def dims(self, slot: TensorSlot) -> tuple[int, ...]:
        """``slot``'s dims as Triton's config states them: without the batch dim when batching."""
        return slot.dims[1:] if self.max_batch_size else slot.dims


def preferred_sizes(buckets: tuple[int, ...], max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes Triton's dynamic batcher should aim for: the buckets (a call padded up to a
    bucket replays its CUDA graph), but not 1. A preferred size of 1 is always met at once, so a
    request that arrives alone is sent without waiting ``max_queue_delay`` for company: on the CPU
    test box, 16 concurrent single-row requests took 3 to 9 executions with 1 among the preferred
    sizes, and 2 without."""
    return tuple(b for b in sorted(set(buckets)) if 1 < b <= max_batch_size)


def output_names(program: schema.Program) -> list[str]:
    """A name per flat output: ``output`` for a lone tensor, else its path in the output tree
    (``logits``, ``pair.low``); a path that starts with a digit (tuple positions) gets ``output_``."""
    tree = program.output_tree
    if tree is None or tree.kind == schema.TreeKind.TENSOR:
        if len(program.outputs) == 1:
            return ["output"]
    paths = leaf_paths(tree, len(program.outputs))
    return [f"output_{p}" if p[:1].isdigit() else p for p in paths]


def _dims(shape: tuple[str, ...]) -> tuple[int, ...]:
    out = []
    for size in shape:
        static = static_size(size)
        out.append(static if static is not None else -1)
    return tuple(out)


def _output_spec(program: schema.Program, buffer: str) -> schema.TensorSpec:
    if buffer in program.buffers:
        return program.buffers[buffer]
    for t in (*program.inputs, *program.weights):
        if t.name == buffer:
            return t.spec
    raise EnvError(f"output buffer {buffer!r} has no tensor spec in the program; rebuild the bundle")


def _dtype(what: str, dtype: str) -> str:
    if dtype not in TRITON_DTYPES:
        raise EnvError(
            f"{what} has dtype {dtype}, which Triton cannot carry; expected one of {sorted(TRITON_DTYPES)}"
        )
    return dtype


def check_stateless(manifest: schema.Manifest, program: schema.Program) -> None:
    """Refuse a bundle with several entry points or state (a KV cache the program mutates): a
    request-response engine cannot keep state per client between calls."""
    entries = sorted({e.entry for e in manifest.programs if e.entry})
    state = sorted({*program.state, *(i.name for i in manifest.guards.inputs if i.state)})
    if len(entries) > 1 or state:
        what = f"{len(entries)} entry points" if len(entries) > 1 else f"{len(state)} state tensors"
        raise EnvError(
            f"bundle {manifest.name!r} is stateful ({what}); Triton and Ray Serve serve stateless "
            "bundles only: run it with `aotpack generate` (or the runner's entry points) instead"
        )


def serving_spec(
    manifest: schema.Manifest, program: schema.Program, name: str | None = None, io_dtype: str = ""
) -> ServingSpec:
    """The serving contract of a bundle from its manifest and (first) program. ``io_dtype``
    "float32": float16 and bfloat16 inputs and outputs are float32 on the wire, cast inside the
    model backend (Triton refuses FP16 and BF16 in KServe v2 JSON both ways)."""
    check_stateless(manifest, program)
    if io_dtype not in IO_DTYPES:
        raise EnvError(f"io_dtype must be one of {sorted(IO_DTYPES)}, got {io_dtype!r}")
    buckets = manifest.programs[0].buckets if manifest.programs else manifest.buckets
    inputs = tuple(
        TensorSlot(i.name, wire_dtype(_dtype(f"input {i.name!r}", i.dtype), io_dtype), _dims(i.shape))
        for i in manifest.guards.inputs
    )
    out_specs = [_output_spec(program, b) for b in program.outputs]
    outputs = tuple(
        TensorSlot(n, wire_dtype(_dtype(f"output {n!r}", s.dtype), io_dtype), _dims(s.shape))
        for n, s in zip(output_names(program), out_specs)
    )
    shapes = [i.shape for i in manifest.guards.inputs] + [s.shape for s in out_specs]
    symbols = {s.name: s for s in manifest.guards.symbols}
    first = _batch_symbol(shapes, set(symbols))
    batch, max_batch, batching = "", 0, ""
    if not first:
        batching = "no dynamic batching: the inputs' and outputs' first dims are not one dynamic dim"
    elif not symbols[first].rows_independent:
        why = printable(rows_note(symbols[first]))[:400] or (
            f"the bundle does not record whether rows along {first} are independent (built before "
            "aotpack checked it; rebuild it to batch)"
        )
        batching = f"no dynamic batching along {first}: {why}"
    elif mixing := _mixing(program, first, symbols):  # what the bundle says, checked against its program
        batching = (
            f"no dynamic batching along {first}: the bundle records its rows as independent, but its "
            f"program does not keep them apart: {printable(mixing)[:400]}"
        )
    else:
        batch = first
        # the bundle's whole contract (every program) bounds the rows one call may hold
        max_batch = symbols[batch].max
        batching = f"dynamic batching along {batch}: the build proved its rows independent"
    sizes: tuple[int, ...] = ()
    for b in buckets:
        if b.symbol == batch:
            sizes = b.sizes
    return ServingSpec(name or manifest.name, inputs, outputs, batch, max_batch, sizes, batching, io_dtype)


def _mixing(program: schema.Program, symbol: str, symbols: dict[str, schema.SymbolGuard]) -> str | None:
    """``aot.rows.row_mixing`` over every program of the bundle, other symbols at their least
    admitted size of two or more (where one is near their minimum)."""
    sizes = {
        name: next((v for v in range(max(g.min, 2), min(g.max, g.min + 64) + 1) if admits(g, v)), g.min)
        for name, g in symbols.items()
    }
    return next(
        (r for p in (program, *program.variants) if (r := row_mixing(p, symbol, sizes)) is not None), None
    )


def wire_dtype(dtype: str, io_dtype: str) -> str:
    """The dtype a tensor of ``dtype`` has on the wire under ``io_dtype``."""
    return io_dtype if io_dtype and dtype in HALF_DTYPES else dtype


def open_spec(bundle: str | os.PathLike, name: str | None = None, io_dtype: str = "") -> ServingSpec:
    """The serving contract of the bundle at ``bundle`` (verified; stateful bundles refused)."""
    from aot.loader import open_bundle

    opened = open_bundle(bundle)
    try:
        return serving_spec(opened.manifest, opened.program(), name, io_dtype)
    finally:
        opened.close()


def _batch_symbol(shapes: list[tuple[str, ...]], symbols: set[str]) -> str:
    """The symbol that is the first dim of every shape and appears in no other dim, else ""."""
    if not shapes or any(not s for s in shapes):
        return ""
    first = shapes[0][0]
    if first not in symbols or any(s[0] != first for s in shapes):
        return ""
    for shape in shapes:
        for size in shape[1:]:
            if size == first or first in _words(size):
                return ""
    return first


def _words(expr: str) -> set[str]:
    word, out = "", set()
    for c in expr + " ":
        if c.isalnum() or c == "_":
            word += c
        else:
            if word:
                out.add(word)
            word = ""
    return out


def _quote(text: str) -> str:
    return json.dumps(text)  # a protobuf text-format string literal accepts JSON's escapes


def render_config(
    spec: ServingSpec,
    parameters: dict[str, str],
    device: str = "cpu",
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US,
    instances: int = 1,
) -> str:
    """Triton's ``config.pbtxt`` for the bundle behind the Python backend. ``parameters`` reach the
    model's ``initialize`` (the bundle path, the device)."""
    if device not in ("cpu", "cuda"):
        raise EnvError(f"device must be 'cpu' or 'cuda', got {device!r}")
    lines = [
        f"name: {_quote(spec.name)}",
        f"backend: {_quote(BACKEND)}",
        f"max_batch_size: {spec.max_batch_size}",
    ]
    for kind, slots in (("input", spec.inputs), ("output", spec.outputs)):
        entries = []
        for slot in slots:
            dims = ", ".join(str(d) for d in spec.dims(slot))
            entries.append(
                f"  {{\n    name: {_quote(slot.name)}\n    data_type: TYPE_{slot.triton_dtype}\n"
                f"    dims: [ {dims} ]\n  }}"
            )
        lines.append(f"{kind} [\n" + ",\n".join(entries) + "\n]")
    if spec.max_batch_size:
        preferred = "".join(f"\n  preferred_batch_size: {b}" for b in spec.preferred_batch_sizes)
        lines.append(
            f"dynamic_batching {{{preferred}\n  max_queue_delay_microseconds: {int(max_queue_delay_us)}\n}}"
        )
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    lines.append(f"instance_group [\n  {{\n    count: {int(instances)}\n    kind: {kind}\n  }}\n]")
    extra = {"io_dtype": spec.io_dtype} if spec.io_dtype else {}
    for key, value in sorted({**parameters, "device": device, **extra}.items()):
        lines.append(f"parameters {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(value)} }}\n}}")
    return "\n".join(lines) + "\n"
