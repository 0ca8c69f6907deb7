"""What a step will allocate and compute, known before it runs.

The memory bound (``aot.memory``) holds each step's result to its declared buffer, but a
result can only be measured after the step allocated it: a bundle accepted under 64 MiB could
allocate 2 GiB on every call before it was refused. So just before each step runs, its result's
size is computed from its arguments (the tensors it gets are real by then) for every op whose
result can outgrow its operands (``result_elements``: factories, broadcasting, matrix products,
repeats, pads, lookups, resampling) and held to the declared bytes; and the call's arithmetic
(``flops_of``: 2·m·n·k for matrix products, likewise for convolutions and attention, one operation
an element elsewhere) is summed and held to the caller's ``max_flops`` before the step that would
pass it. No meta tensors: their kernels import what the loader may not (sympy, torch._dynamo).
Ops left out run as before and are held to their bytes once they ran.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from aot.dtypes import ITEMSIZE
from aot.errors import BundleError, EnvError
from aot.op_contracts import ELEMENTWISE
from aot.schema import Program

MATMULS = frozenset(
    {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten._addmm_activation.default"}
)
FACTORIES = {  # op → position of its size argument
    "aten.full.default": 0,
    "aten.zeros.default": 0,
    "aten.ones.default": 0,
    "aten.new_full.default": 1,
    "aten.new_zeros.default": 1,
    "aten.new_ones.default": 1,
}
_BROADCASTING = frozenset(ELEMENTWISE) | {"aten.where.self", "aten.clamp.Tensor", "aten.masked_fill.Tensor"}


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def _broadcast(shapes: list[tuple[int, ...]]) -> int:
    """Elements of the broadcast of ``shapes`` (an upper bound where they do not broadcast)."""
    out = list(max(shapes, key=len))
    rank = len(out)
    for shape in shapes:
        k = rank - len(shape)
        for i, d in enumerate(shape):
            if d != 1 and d != out[k + i]:
                out[k + i] = d if out[k + i] == 1 else max(d, out[k + i])
    return math.prod(out)


def _product(values: Any) -> int | None:
    if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
        return None
    return math.prod(max(v, 0) for v in values)


def result_elements(op: str, args: list, kwargs: dict) -> int | None:
    """Elements of the step's (first) result, from its arguments; None where the op's result
    cannot outgrow its operands or is not modelled here."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if op in FACTORIES:
        size = args[FACTORIES[op]] if len(args) > FACTORIES[op] else kwargs.get("size")
        return _product(size)
    if op.startswith("aten.arange."):
        bounds = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        start, end, step = (0, *bounds, 1)[-3:] if len(bounds) == 1 else (*bounds, 1)[:3]
        if not step or not all(math.isfinite(v) for v in (start, end, step)):
            return None
        return max(0, math.ceil((end - start) / step))
    if op in MATMULS and len(tensors) >= 2:
        a, b = _shape(tensors[-2]), _shape(tensors[-1])
        return math.prod(a[:-1]) * (b[-1] if b else 1)
    if op in _BROADCASTING and tensors:
        return _broadcast([_shape(t) for t in tensors])
    if op == "aten.repeat.default" and tensors and len(args) > 1:
        repeats = _product(args[1])
        return None if repeats is None else tensors[0].numel() * repeats
    if op == "aten.constant_pad_nd.default" or "_pad" in op:
        pads = args[1] if len(args) > 1 else None
        if not tensors or _product(pads) is None and pads != []:
            return None
        shape = list(_shape(tensors[0]))
        for i in range(len(pads) // 2):
            if i < len(shape):
                shape[-1 - i] += pads[2 * i] + pads[2 * i + 1]
        return math.prod(max(s, 0) for s in shape)
    if op == "aten.embedding.default" and len(tensors) >= 2:
        return tensors[1].numel() * math.prod(_shape(tensors[0])[1:])
    if op.startswith("aten.upsample_") and tensors and len(args) > 1:
        out = _product(args[1]) if args[1] is not None else None
        return None if out is None else math.prod(_shape(tensors[0])[:2]) * out
    if op == "aten.cat.default" and args and isinstance(args[0], list):
        return sum(t.numel() for t in args[0] if isinstance(t, torch.Tensor))
    return None


def flops_of(op: str, args: list, elements: int | None) -> int:
    """Operations of one step from its operands' shapes: 2·m·n·k for matrix products, 2 per
    multiply-add of a convolution and of attention's two products, else one per element read or
    written."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if op in MATMULS and len(tensors) >= 2:
        a, b = _shape(tensors[-2]), _shape(tensors[-1])
        return 2 * math.prod(a) * (b[-1] if b else 1)
    if op == "aten.convolution.default" and len(tensors) >= 2:
        x, w = _shape(tensors[0]), _shape(tensors[1])
        if len(x) >= 3 and len(w) >= 3:  # at most one output position per input position and stride 1
            return 2 * x[0] * math.prod(x[2:]) * math.prod(w)
    if op == "aten.scaled_dot_product_attention.default" and len(tensors) >= 3:
        q, k = _shape(tensors[0]), _shape(tensors[1])
        return 4 * math.prod(q) * (k[-2] if len(k) >= 2 else 1)
    return sum(t.numel() for t in tensors) + (elements or 0)


def itemsizes(program: Program) -> dict[str, int]:
    return {name: ITEMSIZE.get(spec.dtype, 8) for name, spec in program.buffers.items()}


class Budget:
    """One call's bounds: each result's declared bytes at the call's sizes, and ``max_flops``."""

    __slots__ = ("declared", "itemsizes", "max_flops", "flops", "sizes")

    def __init__(
        self, declared: dict[str, int], itemsizes: dict[str, int], max_flops: int | None, sizes: dict
    ):
        self.declared, self.itemsizes, self.max_flops, self.sizes = declared, itemsizes, max_flops, sizes
        self.flops = 0

    def before(self, index: str, op: str, outputs: tuple, args: list, kwargs: dict) -> None:
        """``BundleError`` if the step would make more than its declared bytes; ``EnvError`` if the
        call would pass ``max_flops`` with it. Called just before the op runs."""
        elements = result_elements(op, args, kwargs)
        name = outputs[0] if outputs else None
        if elements is not None and name in self.declared:
            made = elements * self.itemsizes.get(name, 1)
            if made > self.declared[name]:
                raise BundleError(
                    f"{index}{op} would make {name[:60]!r} of {made} bytes at sizes {_sizes_text(self.sizes)}, "
                    f"its buffer declares {self.declared[name]}; refused before it ran: the program is wrong, "
                    f"rebuild the bundle"
                )
        if self.max_flops is not None:
            self.flops += flops_of(op, args, elements)
            if self.flops > self.max_flops:
                raise EnvError(
                    f"a call at sizes {_sizes_text(self.sizes)} would compute more than {self.flops:.3g} "
                    f"operations (by {index}{op}), more than max_flops {self.max_flops:.3g}; refused before "
                    f"that step ran: call with smaller inputs, or load with a larger max_flops"
                )


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())) or "static sizes"
