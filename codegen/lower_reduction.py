"""Lowering of reductions (sum, mean, amax/amin, var, logsumexp, vector norms, softmax, layer
and group norm): each becomes ``reduce`` nodes with its prologue and epilogue as pointwise nodes
around them. Statistics are accumulated in fp32 (fp64 for fp64, int64 for integer sums).

A reduction node reduces the trailing dims of its source. A sum, mean, amax/amin, var, logsumexp
or ``linalg_vector_norm`` over other dims (a mean over a ViT's tokens, ``[B, N, C] -> [B, C]``;
ConvNeXt-V2's L2 norm over each channel's image) reads its source through a permutation that
puts the reduced dims last, the kept dims in their order: the kept part's flat index is the
result's, with or without ``keepdim``; a softmax over another dim than the last reads its source
so and its result is read back. A layer norm over other dims than the last stays an ATen call
(``Unsupported``). The source writer (``kernel_source``) decides how a ``reduce`` node is
computed.
"""

from __future__ import annotations

import math
from typing import Any

from aot.codegen import index as ix
from aot.codegen.step_args import literal, norm_dim
from aot.codegen.triton_types import COMPUTE
from aot.codegen.valuegraph import Builder, Node, Unsupported, same_index
from aot.dtypes import FLOATS
from aot.schema import SpecialFloat, Step, Sym


def _to_trailing(x: Node, dims: Any) -> tuple[Node, int]:
    """``x`` read with the reduced ``dims`` last (the kept dims first, in their order), and how
    many dims are reduced."""
    rank = len(x.shape)
    if dims is None or dims == []:
        return x, rank
    if isinstance(dims, int):
        dims = [dims]
    reduced = sorted({norm_dim(d, rank) for d in dims})
    perm = [d for d in range(rank) if d not in reduced] + reduced
    if perm == list(range(rank)):
        return x, len(reduced)
    shape = tuple(x.shape[d] for d in perm)

    def permute(lin: ix.Lin, in_shape=x.shape, perm=perm, shape=shape) -> ix.Lin:
        return ix.through_permute(lin, in_shape, perm, shape)

    return Node("remap", shape, x.dtype, (x,), remap=permute), len(reduced)


def _reduce(kind: str, src: Node, k: int, dtype: str, shape=None) -> Node:
    keep = src.shape[: len(src.shape) - k] + (ix.ONE,) * k
    width = ix.numel(src.shape[len(src.shape) - k :])
    return Node("reduce", shape if shape is not None else keep, dtype, (src,), reduce=kind, width=width)


def _op(shape, dtype, fmt, inputs, ty="fp32") -> Node:
    return Node("op", shape, dtype, tuple(inputs), fmt, (ty,) * len(inputs))


def _acc_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32" if dtype in FLOATS else "int64"


def _count(width) -> str:
    """The number of reduced elements as an fp32 literal (a size expression when dynamic)."""
    return literal(Sym(ix.size_text(width)) if not width.is_Integer else int(width), "fp32")


def lower_reduction(b: Builder, step: Step) -> None:
    if step.target == "aten.native_layer_norm.default":
        _lower_layer_norm(b, step)
    elif step.target == "aten.native_group_norm.default":
        _lower_group_norm(b, step)
    elif step.target in ("aten._softmax.default", "aten._log_softmax.default"):
        _lower_softmax(b, step)
    else:
        _lower_dim_reduction(b, step)


def _lower_layer_norm(b: Builder, step: Step) -> None:
    x = b.tensor(step.args[0])
    rank = len(x.shape)
    name, _, dtype = b.out(step)
    k = len(step.args[1])
    if k > rank or k == 0:
        raise Unsupported("layer norm over no dims")
    width = ix.numel(x.shape[rank - k :])
    w = b.tensor(step.args[2]) if step.args[2] is not None else None
    bias = b.tensor(step.args[3]) if step.args[3] is not None else None
    eps = literal(step.args[4], "fp32")
    centered, mean, rstd = _statistics(x, k, width, eps)
    inputs, fmt = [centered, rstd], "($0 * $1)"
    if w is not None:
        fmt = f"({fmt} * ${len(inputs)})"
        inputs.append(w)
    if bias is not None:
        fmt = f"({fmt} + ${len(inputs)})"
        inputs.append(bias)
    b.set(name, _op(x.shape, dtype, fmt, inputs))
    _set_statistics(b, step, mean, rstd)


def _statistics(x: Node, k: int, width, eps: str) -> tuple[Node, Node, Node]:
    """A norm's statistics over the last ``k`` dims of ``x`` (``width`` elements; ``eps`` a
    literal): (``x`` less its mean, the mean, 1/std), summed in fp32, the deviations squared
    (no sum of squares to cancel)."""
    n = _count(width)
    s1 = _reduce("sum", _op(x.shape, "float32", "$0", [x]), k, "float32")
    mean = _op(s1.shape, "float32", f"($0 / {n})", [s1])
    centered = _op(x.shape, "float32", "($0 - $1)", [x, mean])
    s2 = _reduce("sum", _op(x.shape, "float32", "($0 * $0)", [centered]), k, "float32")
    return centered, mean, _op(s1.shape, "float32", f"tl.rsqrt($0 / {n} + {eps})", [s2])


def _set_statistics(b: Builder, step: Step, mean: Node, rstd: Node) -> None:
    """A norm step's second and third results, its mean and 1/std, where the program names them."""
    for i, stat in ((1, mean), (2, rstd)):
        out, out_shape, out_dtype = b.out(step, i)
        if out is not None:
            b.set(out, Node("remap", out_shape, out_dtype, (stat,), remap=same_index))


def _lower_group_norm(b: Builder, step: Step) -> None:
    """``native_group_norm(x, w, b, N, C, HxW, G, eps)`` of ``x`` ``[N, C, *]``: ``x`` read as
    ``[N, G, C / G * HxW]`` (the same flat index), normalized over its last dim as a layer norm
    is, then read back as ``x``'s shape and scaled and shifted per channel (PoolFormer's and
    ConvNeXt-style models' ``GroupNorm(1, C)``). Its mean and 1/std are ``[N, G]``."""
    x = b.tensor(step.args[0])
    name, shape, dtype = b.out(step)
    groups, eps = step.args[6], step.args[7]
    if len(x.shape) < 2 or type(groups) is not int or groups < 1 or not x.shape[1].is_Integer:
        raise Unsupported("group norm of a shape or group count it cannot split")
    channels = int(x.shape[1])
    if channels % groups:
        raise Unsupported("group norm: the groups do not divide the channels")
    width = ix.canon(ix.numel(x.shape[1:]) / groups)
    grouped = Node("remap", (x.shape[0], ix.sympy.Integer(groups), width), x.dtype, (x,), remap=same_index)
    centered, mean, rstd = _statistics(grouped, 1, width, literal(eps, "fp32"))
    normed = _op(grouped.shape, "float32", "($0 * $1)", [centered, rstd])
    inputs, fmt = [Node("remap", x.shape, "float32", (normed,), remap=same_index)], "$0"
    per_channel = (ix.sympy.Integer(channels),) + (ix.ONE,) * (len(x.shape) - 2)
    for arg_, op in ((step.args[1], "*"), (step.args[2], "+")):  # weight, then bias
        if arg_ is not None:
            t = b.tensor(arg_)
            fmt = f"({fmt} {op} ${len(inputs)})"
            inputs.append(Node("remap", per_channel, t.dtype, (t,), remap=same_index))
    b.set(name, _op(x.shape, dtype, fmt, inputs))
    _set_statistics(b, step, mean, rstd)


def _lower_softmax(b: Builder, step: Step) -> None:
    """Softmax or log-softmax over one dim; over another than the last (ResNeSt's split
    attention over its radix), of ``x`` read with that dim last, the result read back so."""
    x0 = b.tensor(step.args[0])
    rank = len(x0.shape)
    name, _, dtype = b.out(step)
    dim = norm_dim(step.args[1], rank) if rank else 0
    x, _ = _to_trailing(x0, [dim]) if rank > 1 and dim != rank - 1 else (x0, 1)
    ty = COMPUTE[dtype]
    m = _reduce("max", _op(x.shape, "float32", "$0", [x]), 1, "float32")
    shifted = _op(x.shape, "float32", "($0 - $1)", [x, m])
    e = _op(x.shape, "float32", "tl.exp($0)", [shifted])
    s = _reduce("sum", e, 1, "float32")
    if step.target == "aten._softmax.default":
        out = _op(x.shape, dtype, "($0 / $1)", [e, s], ty if ty == "fp64" else "fp32")
    else:
        out = _op(x.shape, dtype, "($0 - tl.log($1))", [shifted, s])
    if x is not x0:  # back to x's dims: the softmax dim from the last to ``dim``
        perm = list(range(rank - 1))
        perm.insert(dim, rank - 1)

        def back(lin: ix.Lin, in_shape=x.shape, perm=perm, shape=x0.shape) -> ix.Lin:
            return ix.through_permute(lin, in_shape, perm, shape)

        # x's dims from the outermost in x0's memory: x0 is x.permute(perm)
        out = Node("remap", x0.shape, dtype, (out,), remap=back, order=tuple(perm))
    b.set(name, out)


def _lower_dim_reduction(b: Builder, step: Step) -> None:
    """sum, mean, amax/amin, var(_mean), logsumexp over the ``dim`` argument (module docstring)."""
    t = step.target
    name, shape, dtype = b.out(step)
    if t in ("aten.sum.default", "aten.mean.default"):
        dims = None
    elif t == "aten.linalg_vector_norm.default":
        dims = step.args[2] if len(step.args) > 2 else step.kwargs.get("dim")
    else:
        dims = step.args[1] if len(step.args) > 1 else step.kwargs.get("dim")
    x, k = _to_trailing(b.tensor(step.args[0]), dims)
    rank = len(x.shape)
    n = _count(ix.numel(x.shape[rank - k :]))
    if t in ("aten.sum.dim_IntList", "aten.sum.default"):
        acc = _acc_dtype(dtype)
        b.set(name, _reduce("sum", _op(x.shape, acc, "$0", [x], COMPUTE[acc]), k, dtype, shape))
    elif t in ("aten.mean.dim", "aten.mean.default"):
        if dtype not in FLOATS:
            raise Unsupported("mean of integers")
        s = _reduce("sum", _op(x.shape, "float32", "$0", [x]), k, "float32", shape)
        b.set(name, _op(shape, dtype, f"($0 / {n})", [s]))
    elif t in ("aten.amax.default", "aten.amin.default"):
        if x.dtype not in FLOATS:
            raise Unsupported("integer amax/amin")
        kind = "max" if t == "aten.amax.default" else "min"
        b.set(name, _reduce(kind, _op(x.shape, "float32", "$0", [x]), k, dtype, shape))
    elif t in ("aten.var.correction", "aten.var_mean.correction"):
        _lower_variance(b, step, x, k, n)
    elif t == "aten.linalg_vector_norm.default":
        _lower_vector_norm(b, step, x, k)
    elif t == "aten.logsumexp.default":
        if x.dtype not in FLOATS:
            raise Unsupported("logsumexp of integers")
        m = _reduce("max", _op(x.shape, "float32", "$0", [x]), k, "float32")
        safe = _op(m.shape, "float32", 'tl.where(tl.abs($0) == float("inf"), 0.0, $0)', [m])
        s = _reduce("sum", _op(x.shape, "float32", "tl.exp($0 - $1)", [x, safe]), k, "float32", shape)
        safe_out = Node("remap", shape, "float32", (safe,), remap=same_index)
        b.set(name, _op(shape, dtype, "(tl.log($0) + $1)", [s, safe_out]))
    else:
        raise Unsupported(t)


def _lower_vector_norm(b: Builder, step: Step, x: Node, k: int) -> None:
    """``linalg_vector_norm`` over the last ``k`` dims: ``sum(|x| ** ord) ** (1 / ord)``, the
    largest (smallest) ``|x|`` for an ``ord`` of inf (-inf), the count of non-zeros for 0; summed
    in fp32. ConvNeXt-V2's global response norm: the L2 norm over each channel's image."""
    name, shape, dtype = b.out(step)
    if x.dtype not in FLOATS or dtype not in FLOATS:
        raise Unsupported("a vector norm of integers")
    order = step.args[1] if len(step.args) > 1 else step.kwargs.get("ord", 2)
    if isinstance(order, SpecialFloat):  # inf, -inf (a NaN order ATen refuses)
        order = float(order.name)
    if not isinstance(order, (int, float)) or isinstance(order, bool) or math.isnan(order):
        raise Unsupported(f"vector norm of order {order!r}")
    absolute = _op(x.shape, "float32", "tl.abs($0)", [x])
    if order in (float("inf"), float("-inf")):
        kind = "max" if order > 0 else "min"
        b.set(name, _reduce(kind, absolute, k, dtype, shape))
        return
    if order == 0:
        b.set(name, _reduce("sum", _op(x.shape, "float32", "($0 != 0).to(tl.float32)", [x]), k, dtype, shape))
        return
    power = {1: "$0", 2: "($0 * $0)"}.get(order, f"tl.exp({literal(float(order), 'fp32')} * tl.log($0))")
    s = _reduce("sum", _op(x.shape, "float32", power, [absolute]), k, "float32", shape)
    root = {1: "$0", 2: "tl.sqrt($0)"}.get(order, f"tl.exp(tl.log($0) / {literal(float(order), 'fp32')})")
    b.set(name, _op(shape, dtype, root, [s]))


def _lower_variance(b: Builder, step: Step, x: Node, k: int, n: str) -> None:
    """``var.correction`` and ``var_mean.correction`` over the last ``k`` dims (``n`` elements)."""
    name, shape, dtype = b.out(step)
    if x.dtype not in FLOATS:
        raise Unsupported("variance of integers")
    corr = step.kwargs.get("correction", 1)
    corr = 1 if corr is None else corr
    s1 = _reduce("sum", _op(x.shape, "float32", "$0", [x]), k, "float32")
    mean = _op(s1.shape, "float32", f"($0 / {n})", [s1])
    centered = _op(x.shape, "float32", "($0 - $1)", [x, mean])
    s2 = _reduce("sum", _op(x.shape, "float32", "($0 * $0)", [centered]), k, "float32", shape)
    denom = f"({n} - {literal(corr, 'fp32')})"
    b.set(name, _op(shape, dtype, f"($0 / tl.maximum({denom}, 0.0))", [s2]))
    if step.target == "aten.var_mean.correction":
        out, out_shape, out_dtype = b.out(step, 1)
        if out is not None:
            stat = Node("remap", out_shape, "float32", (mean,), remap=same_index)
            b.set(out, _op(out_shape, out_dtype, "$0", [stat]))
