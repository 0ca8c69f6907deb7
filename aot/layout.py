"""Memory layouts of a program's tensors: ``TensorSpec.order``, the dims from the outermost in
memory to the innermost. ``()`` is row-major (the default); ``CHANNELS_LAST`` is ``(0, 2, 3, 1)``
for an NCHW tensor stored as NHWC, the layout cuDNN convolves without transposing.

The codegen chooses orders (``aot.codegen.layouts``) and indexes its kernels' loads and stores by
them; the loader allocates kernel outputs in their order and lays out weights in theirs. A tensor
that reaches a kernel in another layout is copied into the declared one first, so an order is only
ever a matter of speed, never of results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aot.errors import BundleError

CHANNELS_LAST = (0, 2, 3, 1)


def check_order(order: Sequence[int], rank: int, where: str) -> tuple[int, ...]:
    """``order`` as a tuple when it is empty or a permutation of ``range(rank)``; else BundleError."""
    order = tuple(order)
    if order and sorted(order) != list(range(rank)):
        raise BundleError(
            f"{where}: memory order {list(order)} is not a permutation of the {rank} dims; "
            f"rebuild the bundle with a trusted aotpack"
        )
    return order


def is_row_major(order: Sequence[int]) -> bool:
    return not order or tuple(order) == tuple(range(len(order)))


def empty_ordered(shape: Sequence[int], order: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` whose dims lie in memory in ``order``."""
    if is_row_major(order):
        return torch.empty(list(shape), dtype=dtype, device=device)
    stored = torch.empty([shape[d] for d in order], dtype=dtype, device=device)
    return stored.permute(inverse(order))


def inverse(order: Sequence[int]) -> list[int]:
    back = [0] * len(order)
    for k, d in enumerate(order):
        back[d] = k
    return back


def has_order(t: torch.Tensor, order: Sequence[int]) -> bool:
    """Whether ``t`` is dense with its dims in memory in ``order`` (size-1 dims may lie anywhere)."""
    if is_row_major(order):
        return t.is_contiguous()
    if t.dim() != len(order):
        return False
    return t.permute(list(order)).is_contiguous()


def to_order(t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``t`` itself when laid out in ``order``, else a copy that is."""
    if has_order(t, order):
        return t
    if is_row_major(order):
        return t.contiguous()
    return t.permute(list(order)).contiguous().permute(inverse(order))
