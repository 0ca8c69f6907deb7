"""Weights from the bundle's safetensors member to the device.

On CUDA each tensor is copied host → device straight out of the member's bytes (read and sha256
checked once): the safetensors header is parsed and bounds-checked here, and each tensor is a
zero-copy view of those bytes until its own transfer, so the host holds one copy of the weights
and the GPU one allocation holding every weight at an aligned offset — no transient second copy
on the GPU.
"""

from __future__ import annotations

import warnings

import torch

from aot.aten import DTYPES
from aot.dtypes import SAFETENSORS
from aot.errors import BundleError
from aot.layout import has_order, to_order
from aot.weights import MAX_HEADER, header_limit, parse_header, weights_size_limit

__all__ = ["header_limit", "parse_safetensors", "weights_size_limit"]

# safetensors dtype names → torch dtypes
_DTYPES = {name: DTYPES[name] for name in SAFETENSORS.values() if name in DTYPES}


def parse_safetensors(
    data: bytes, where: str, max_header: int = MAX_HEADER
) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name → (torch dtype, shape, begin, end) with offsets into ``data`` (``aot.weights.parse_header``)."""
    entries = parse_header(data, where, max_header)
    missing = sorted({dtype for dtype, *_ in entries.values()} - _DTYPES.keys())
    if missing:
        raise BundleError(f"{where}: weights of dtype {missing[0]}, which this torch does not have")
    return {name: (_DTYPES[dtype], shape, begin, end) for name, (dtype, shape, begin, end) in entries.items()}


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
