"""Weights from the bundle's safetensors member to the device.

On CUDA each tensor is copied host → device straight out of the member's bytes (read and sha256
checked once): the safetensors header is parsed and bounds-checked here, and each tensor is a
zero-copy view of those bytes until its own transfer, so the host holds one copy of the weights
and the GPU one allocation holding every weight at an aligned offset — no transient second copy
on the GPU.
"""

from __future__ import annotations

import json
import struct
import warnings

import torch

from aot.aten import DTYPES
from aot.dtypes import ITEMSIZE, SAFETENSORS
from aot.errors import BundleError
from aot.layout import has_order, to_order
from aot.manifest_text import static_size
from aot.schema import TensorSpec

# safetensors dtype names → torch dtypes, and their sizes in bytes
_DTYPES = {code: DTYPES[name] for code, name in SAFETENSORS.items() if name in DTYPES}  # code -> torch dtype
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
        and info["dtype"] in _DTYPES
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


def parse_safetensors(
    data: bytes, where: str, max_header: int = MAX_HEADER
) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name → (dtype, shape, begin, end) with offsets into ``data``; every field validated. A
    header over ``max_header`` bytes is refused before it is parsed."""
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


WEIGHT_ALIGN = 256  # bytes: every weight of the one device allocation starts at a multiple


def to_device(
    data: bytes,
    device: torch.device,
    where: str,
    keep: set[str],
    max_header: int = MAX_HEADER,
    orders: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of ``data`` named in ``keep`` on ``device`` (the rest are never copied: a call
    starts from the weights it keeps, so tensors nobody reads would cost every call), each laid
    out in its memory order from ``orders`` (``aot.layout``; row-major where absent).

    On a GPU every weight is a view of one allocation, its bytes copied straight into place: the
    caching allocator serves a tensor of 1–10 MiB from a 20 MiB segment, so weights allocated one
    by one took 18 MiB more than their size for the mlp example (64 MiB of 8 MiB matrices)."""
    hosts = host_tensors(data, where, keep, max_header, orders or {})
    if device.type != "cuda":
        return {name: host.to(device, copy=True) for name, (host, _) in hosts.items()}
    return one_allocation(hosts, device)


def host_tensors(
    data: bytes, where: str, keep: set[str], max_header: int, orders: dict[str, tuple[int, ...]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (the tensor as the program sees it, its bytes in memory order)} for the tensors of
    ``data`` named in ``keep``: views of ``data``, but for a tensor whose order from ``orders``
    differs from the file's row-major one (a copy of its own)."""
    entries = parse_safetensors(data, where, max_header)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer on read-only bytes: the view is only read
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    hosts = {}
    for name, (dtype, shape, begin, end) in entries.items():
        if name in keep:
            host = raw[begin:end].view(dtype).reshape(shape)
            if name in orders and not has_order(host, orders[name]):
                host = to_order(host, orders[name])  # a copy of its own, in memory order
                hosts[name] = (host, torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage()))
            else:
                hosts[name] = (host, raw[begin:end])
    return hosts


def one_allocation(hosts: dict[str, tuple[torch.Tensor, torch.Tensor]], device) -> dict[str, torch.Tensor]:
    """{name: (tensor, its bytes in memory order)} → the tensors on ``device`` as views of one
    allocation, each at a multiple of ``WEIGHT_ALIGN`` bytes, with the host tensor's strides."""
    offsets, total = {}, 0
    for name, (_, stored) in hosts.items():
        offsets[name] = total
        total += -(-stored.numel() // WEIGHT_ALIGN) * WEIGHT_ALIGN
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    out = {}
    for name, (host, stored) in hosts.items():
        start = offsets[name]
        flat[start : start + stored.numel()].copy_(stored)  # the file's bytes straight into place
        typed = flat.view(host.dtype)  # the allocation's size and offsets are multiples of every itemsize
        out[name] = typed.as_strided(host.shape, host.stride(), start // host.element_size())
    return out
