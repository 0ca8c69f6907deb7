"""Steps of weights alone, computed once at build time (constant folding).

Some models compute on their parameters in every forward: timm's weight-standardized convolutions
(the NF-Nets, BiT) normalize each filter with a batch norm over the weight, ``weight_norm``
(wav2vec 2's positional convolution) divides by the weight's norm, a relative-position bias gathers
from its table by a fixed index (Swin). Such a step reads nothing a call gives, so every call would
compute the same tensor again, and a library-free bundle would need a kernel for each such op
(``var_mean`` has none). ``Lowering`` instead evaluates a step whose tensor arguments are all
weights or results of folded steps, with ATen on the build machine, and stores the result as a
weight of the bundle where a step that is not folded reads it (``folded.<digest>``: named by its
bytes, so the programs of one bundle name the same tensor alike). A weight that only folded steps
read is left out of the program.

Not folded: views (a transposed weight feeding a matmul stays a view of the stored weight, as the
GEMM forms expect), steps without a tensor argument (``arange``, ``full``: cheap to make, and
their results may be large), and steps whose result is larger than their tensor arguments and
than ``FOLD_MAX_GROWTH_BYTES`` (an outer product or a broadcast would store more than it saves).
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any

import torch
import torch.fx

FOLD_MAX_GROWTH_BYTES = 1 << 20  # a folded result may be larger than its inputs up to this
FOLDED_PREFIX = "folded."


def _nodes(a: Any) -> list[torch.fx.Node]:
    if isinstance(a, torch.fx.Node):
        return [a]
    if isinstance(a, (list, tuple)):
        return [n for v in a for n in _nodes(v)]
    if isinstance(a, dict):
        return [n for v in a.values() for n in _nodes(v)]
    return []


def _static(val: Any) -> bool:
    """A tensor (or tuple of tensors) whose every size is a number, not a symbol."""
    if isinstance(val, (tuple, list)):
        return all(v is None or _static(v) for v in val)
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)


def _nbytes(val: Any) -> int:
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _writes(target: torch._ops.OpOverload) -> bool:
    """An op that writes one of its arguments (in place)."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _is_view(target: torch._ops.OpOverload) -> bool:
    """An op whose result aliases an argument: a view."""
    return any(r.alias_info is not None for r in target._schema.returns)


def constant_step(node: torch.fx.Node, constants: dict[torch.fx.Node, Any]) -> str | None:
    """How ``node`` (an ATen call) of weights alone is computed at build time: "fold" (its result
    a constant, the step gone), "view" (a view of a constant: a constant to later folds, the step
    kept for the steps that are not folded); None: it reads more than weights, writes, or grows."""
    target = node.target
    if (
        not isinstance(target, torch._ops.OpOverload)
        or _writes(target)
        or not _reads_constants(node, constants)
    ):
        return None
    if _is_view(target):  # one view, not pieces (split, chunk, unbind: their items stay steps)
        return "view" if isinstance(node.meta.get("val"), torch.Tensor) else None
    tensors = {a for a in _nodes(node.args) + _nodes(node.kwargs) if a in constants}
    grown = _nbytes(node.meta.get("val")) - sum(_nbytes(constants[a]) for a in tensors)
    return "fold" if grown <= FOLD_MAX_GROWTH_BYTES else None


def _reads_constants(node: torch.fx.Node, constants: dict[torch.fx.Node, Any]) -> bool:
    """Whether ``node``'s tensor arguments are all constants (at least one), its other node
    arguments numbers, and its result of static sizes."""
    args = _nodes(node.args) + _nodes(node.kwargs)
    tensors = [a for a in args if isinstance(a.meta.get("val"), torch.Tensor)]
    if not tensors or any(a not in constants for a in tensors):
        return False
    # the other node arguments are sizes: a number traced from a static size, never a symbol
    if any(not isinstance(a.meta.get("val"), (int, float, bool)) for a in args if a not in tensors):
        return False
    return _static(node.meta.get("val"))


def evaluate(node: torch.fx.Node, constants: dict[torch.fx.Node, Any]) -> Any:
    """``node``'s result from the constant tensors of its arguments (ATen on the CPU); None where
    ATen's CPU kernels cannot compute it (an op in a half-precision dtype they lack): it stays a
    step, computed where the bundle runs."""

    def real(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return constants[a] if a in constants else a.meta["val"]
        if isinstance(a, (list, tuple)):
            return type(a)(real(v) for v in a)
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    try:
        with torch.no_grad():
            out = node.target(*real(node.args), **{k: real(v) for k, v in node.kwargs.items()})
    except (RuntimeError, NotImplementedError):
        return None
    return tuple(out) if isinstance(out, (tuple, list)) else out


def item(node: torch.fx.Node, constants: dict[torch.fx.Node, Any]) -> Any:
    """A ``getitem`` of a folded step's results, or None where ``node`` is not one."""
    if node.target is operator.getitem and node.args[0] in constants:
        return constants[node.args[0]][node.args[1]]
    return None


def folded_name(tensor: torch.Tensor) -> str:
    """A folded weight's name, from its dtype, shape and bytes."""
    t = tensor.detach().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return FOLDED_PREFIX + h.hexdigest()[:16]
