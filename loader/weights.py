"""Weights from the bundle's safetensors member to the device.

On CUDA each tensor is copied host → device straight out of the member's bytes (read and sha256
checked once): the safetensors header is parsed and bounds-checked here, and each tensor is a
zero-copy view of those bytes until its own transfer, so the host holds one copy of the weights
and the GPU each tensor in its own (aligned) allocation — no transient second copy on the GPU.
"""

from __future__ import annotations

import json
import struct
import warnings

import torch

from aot.aten import DTYPES
from aot.dtypes import SAFETENSORS
from aot.errors import BundleError

# safetensors dtype names → torch dtypes, and their sizes in bytes
_DTYPES = {code: DTYPES[name] for code, name in SAFETENSORS.items() if name in DTYPES}  # code -> torch dtype
MAX_HEADER = 16 << 20  # JSON parsed into Python objects: keep it far below memory (GPT-2: 15 kB)


def _is_int(v: object) -> bool:
    return type(v) is int  # not bool, not a float such as 1e400 (inf) or 2.5


def _well_typed(info: object) -> bool:
    """One header entry as safetensors writes it; anything else (lists, floats, nesting) is refused
    before a field is used."""
    return (
        isinstance(info, dict)
        and set(info) == {"dtype", "shape", "data_offsets"}
        and isinstance(info["dtype"], str)
        and info["dtype"] in _DTYPES
        and isinstance(info["shape"], list)
        and all(_is_int(s) for s in info["shape"])
        and isinstance(info["data_offsets"], list)
        and len(info["data_offsets"]) == 2
        and all(_is_int(x) for x in info["data_offsets"])
    )


def parse_safetensors(data: bytes, where: str) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name → (dtype, shape, begin, end) with offsets into ``data``; every field validated."""
    if len(data) < 8:
        raise BundleError(f"{where}: safetensors data is {len(data)} bytes, too short for a header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
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
        dtype, shape, (begin, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        numel = 1
        for s in shape:
            if s < 0:
                raise BundleError(f"{where}: {name[:60]!r} has a negative size")
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
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


def to_device(data: bytes, device: torch.device, where: str) -> dict[str, torch.Tensor]:
    entries = parse_safetensors(data, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer on read-only bytes: the view is only read
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, (dtype, shape, begin, end) in entries.items():
        host = raw[begin:end].view(dtype).reshape(shape)
        out[name] = host.to(device, copy=True)
    return out
