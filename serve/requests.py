"""What a serving request must be before anything allocates for it.

A KServe v2 request declares each input's shape and carries its data; an engine that believes the
shape allocates for it (tritonserver's HTTP frontend aborts on a JSON body declaring
``[1, 2**40, 16]``; the Python backend's stub dies reading ``[1, 2**62, 16]``). ``RequestCheck``
refuses, as a ``GuardError`` with the runner's own text, any declared shape outside the bundle's
guards (rank, static sizes, each symbol's admissible set, the relations between them), and data
whose byte or value count is not what the shape needs. Each size is checked against its symbol
before the shapes meet as meta tensors (which hold no memory) for the relations.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

import torch

from aot.dtypes import ITEMSIZE, torch_dtypes
from aot.errors import GuardError
from aot.loader.guards import GuardChecker
from aot.schema import Guards

KSERVE_DTYPES = {  # KServe v2 datatype → torch dtype name
    "BOOL": "bool",
    "UINT8": "uint8",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "BF16": "bfloat16",
    "FP32": "float32",
    "FP64": "float64",
}
MAX_DATA_DEPTH = 32  # nesting of a JSON ``data`` array: one level per dim, at most


class RequestCheck:
    """The bundle's contract on declared shapes, for requests that have not been read yet."""

    def __init__(self, guards: Guards, wire_dtypes: Mapping[str, str] | None = None):
        """``wire_dtypes``: input name → the dtype a client sends, where the server casts it (see
        ``--io-dtype``); the bundle's own dtype otherwise."""
        self.checker = GuardChecker(guards, torch_dtypes())
        self.dtypes = {name: dtype_name for name, _, dtype_name, _ in self.checker.inputs}
        self.dtypes.update(wire_dtypes or {})
        self.names = list(self.checker.names)

    def shapes(self, shapes: Mapping[str, Sequence[int]], relations: bool = True) -> None:
        """``GuardError`` unless ``shapes`` (input name → declared shape) are what the bundle admits.
        ``relations=False``: each size alone (enough to bound what reading the inputs allocates;
        the runner checks the rest), without building meta tensors (about 20 µs a call)."""
        missing = [n for n in self.names if n not in shapes]
        extra = sorted(set(shapes) - set(self.names))
        if missing or extra:
            raise GuardError(f"expected inputs {self.names}, got {sorted(shapes)}")
        metas = []
        for name, dtype, _, dims in self.checker.inputs:
            shape = shapes[name]
            if len(shape) != len(dims):  # the runner's text, without reading a shape of any length
                raise GuardError(
                    f"input {name!r}: expected rank {len(dims)} [{', '.join(map(str, dims))}], "
                    f"got rank {len(shape)} {str(shape[:8])[:200]}"
                )
            for d, (want, got) in enumerate(zip(dims, shape)):
                if not isinstance(got, int) or isinstance(got, bool) or got < 0:
                    raise GuardError(f"input {name!r} dim {d}: expected a size, got {str(got)[:24]!r}")
                if type(want) is int and got != want:
                    raise GuardError(f"input {name!r} dim {d}: expected static size {want}, got {got}")
                if type(want) is not int:
                    self.checker.check_symbol(want, got, f"input {name!r} dim {d}")
            if relations:
                metas.append(torch.empty(shape, dtype=dtype, device="meta"))  # sizes admitted: no overflow
        if relations:
            self.checker.check(metas)

    def kserve(self, body: Any, binary: int | None = None) -> None:
        """``GuardError`` unless ``body`` (a parsed KServe v2 JSON request, or the JSON header of a
        binary one followed by ``binary`` bytes) declares admitted shapes of the expected datatypes,
        and carries exactly the data they need."""
        if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
            raise GuardError('expected a KServe v2 body {"inputs": [{"name", "shape", "datatype", "data"}]}')
        shapes: dict[str, list[int]] = {}
        entries = {}
        for entry in body["inputs"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise GuardError("each KServe v2 input needs a name, a shape, a datatype and its data")
            name = entry["name"]
            shape = entry.get("shape")
            if name in shapes:
                raise GuardError(f"input {name[:60]!r} given twice")
            if not isinstance(shape, list):
                raise GuardError(
                    f"input {name[:60]!r}: expected a shape (a list of sizes), got {str(shape)[:40]}"
                )
            shapes[name], entries[name] = shape, entry
        self.shapes(shapes)  # sizes are bounded from here on
        binary_bytes = 0
        for name in self.names:
            entry, shape = entries[name], shapes[name]
            want = self.dtypes[name]
            got = KSERVE_DTYPES.get(entry.get("datatype"), str(entry.get("datatype"))[:20])
            if got != want:
                raise GuardError(f"input {name!r}: expected datatype {_wire(want)}, got {_wire(got)}")
            count = prod(shape)
            params = entry.get("parameters")
            size = params.get("binary_data_size") if isinstance(params, dict) else None
            if size is not None:
                need = count * ITEMSIZE[want]
                if size != need:
                    raise GuardError(
                        f"input {name!r}: binary_data_size is {str(size)[:24]} bytes, shape {shape} of "
                        f"{_wire(want)} needs {need}"
                    )
                binary_bytes += need
                continue
            if "data" not in entry:
                raise GuardError(f"input {name!r}: no data (and no binary_data_size)")
            values = _count(entry["data"], count)
            if values != count:
                raise GuardError(f"input {name!r}: data holds {values} values, shape {shape} needs {count}")
        if (binary or 0) != binary_bytes:
            raise GuardError(
                f"the request carries {binary or 0} bytes of binary data, its inputs declare {binary_bytes}"
            )


def _wire(dtype: str) -> str:
    return next((k for k, v in KSERVE_DTYPES.items() if v == dtype), dtype)


def _count(data: Any, limit: int) -> int:
    """Scalars in a (nested) JSON array, counting no further than ``limit`` + 1."""
    count, stack = 0, [(data, 0)]
    while stack and count <= limit:
        value, depth = stack.pop()
        if isinstance(value, list):
            if depth >= MAX_DATA_DEPTH:
                raise GuardError(f"data nests deeper than {MAX_DATA_DEPTH} levels")
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, (bool, int, float)):
            count += 1
        else:
            raise GuardError(f"data holds a {type(value).__name__}, expected numbers")
    return count


def parse_kserve(data: bytes, header_length: int | None = None) -> tuple[Any, int | None]:
    """A KServe v2 request body as (its JSON, the bytes of binary data after it); ``GuardError``
    when it is not JSON."""
    if header_length is not None and not 0 <= header_length <= len(data):
        raise GuardError(
            f"Inference-Header-Content-Length is {header_length}, the body has {len(data)} bytes"
        )
    text = data if header_length is None else data[:header_length]
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise GuardError(f"the request body is not JSON: {str(e)[:200]}") from None
    return body, None if header_length is None else len(data) - header_length
