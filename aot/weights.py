"""The bundle's safetensors weights, read without torch: the header parsed and every entry
bounds-checked against the data, before any tensor is made from it (``aot.loader.weights`` makes
torch tensors of the entries, ``aot.runtime`` copies them into device memory).
"""

from __future__ import annotations

import json
import mmap
import struct

from aot.dtypes import ITEMSIZE, SAFETENSORS
from aot.errors import BundleError
from aot.schema import TensorSpec
from aot.symexpr import static_size

MAX_HEADER = 16 << 20  # JSON parsed into Python objects: keep it far below memory (GPT-2: 15 kB)
# What the header of a weights file may take per tensor the program declares: its name, dtype,
# shape and offsets as JSON (GPT-2: 92 bytes; long Hugging Face names stay under 300), plus room
# for a ``__metadata__`` object. A header beyond this is refused before it is parsed.
HEADER_BYTES_PER_TENSOR = 1024
HEADER_BYTES_BASE = 64 << 10
# Bytes a weights file may hold beyond its header and its tensors' data (padding between tensors).
SLACK_BYTES_PER_TENSOR = 64


def _is_int(v: object) -> bool:
    return type(v) is int  # not bool, not a float such as 1e400 (inf) or 2.5


def _well_typed(info: object) -> bool:
    """One header entry as safetensors writes it; anything else (lists, floats, nesting) is refused
    before a field is used."""
    return (
        isinstance(info, dict)
        and set(info) == {"dtype", "shape", "data_offsets"}
        and isinstance(info["dtype"], str)
        and info["dtype"] in SAFETENSORS
        and isinstance(info["shape"], list)
        and all(_is_int(s) for s in info["shape"])
        and isinstance(info["data_offsets"], list)
        and len(info["data_offsets"]) == 2
        and all(_is_int(x) for x in info["data_offsets"])
    )


def header_limit(tensors: int) -> int:
    """The largest safetensors header a file of ``tensors`` tensors may have."""
    return min(MAX_HEADER, HEADER_BYTES_BASE + HEADER_BYTES_PER_TENSOR * tensors)


def weights_size_limit(specs: dict[str, TensorSpec], where: str) -> int:
    """The largest weights file that can hold the tensors of ``specs`` (name -> static spec):
    its 8-byte length, the header, the data, and padding."""
    data = 0
    for name, spec in specs.items():
        n = ITEMSIZE.get(spec.dtype, 8)
        for size in spec.shape:
            dim = static_size(size)
            if dim is None:
                raise BundleError(f"{where}: weight {name[:60]!r} has size {size[:24]!r}; weights are static")
            n *= dim
        data += n
    return 8 + header_limit(len(specs)) + data + SLACK_BYTES_PER_TENSOR * len(specs)


def parse_header(
    data: bytes | memoryview | mmap.mmap, where: str, max_header: int = MAX_HEADER
) -> dict[str, tuple[str, list[int], int, int]]:
    """name → (dtype name, shape, begin, end) with offsets into ``data`` (bytes, or a map of the
    file: only the header is read); every field validated. A header over ``max_header`` bytes is
    refused before it is parsed."""
    if len(data) < 8:
        raise BundleError(f"{where}: safetensors data is {len(data)} bytes, too short for a header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > max_header:
        raise BundleError(
            f"{where}: safetensors header of {n} bytes, more than the {max_header} its tensors need; "
            f"not a file this loader wrote"
        )
    if 8 + n > len(data):
        raise BundleError(f"{where}: safetensors header claims {n} bytes of {len(data)}")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BundleError(f"{where}: safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise BundleError(f"{where}: safetensors header is not an object")
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not _well_typed(info):
            raise BundleError(
                f"{where}: malformed safetensors entry {name[:60]!r}: expected an object of a known "
                f"dtype name, a shape of ints and two integer data_offsets"
            )
        dtype, shape, (begin, end) = SAFETENSORS[info["dtype"]], info["shape"], info["data_offsets"]
        numel = 1
        for s in shape:
            if s < 0:
                raise BundleError(f"{where}: {name[:60]!r} has a negative size")
            numel *= s
        itemsize = ITEMSIZE[dtype]
        if (
            not 0 <= begin <= end <= len(data) - base
            or end - begin != numel * itemsize
            or (base + begin) % itemsize
        ):
            raise BundleError(
                f"{where}: {name[:60]!r} has offsets {begin}..{end} that do not fit its shape or the data"
            )
        out[name] = (dtype, shape, base + begin, base + end)
    return out
