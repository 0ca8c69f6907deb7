"""Lowering of pointwise steps: one value per output element, from inputs at broadcast positions.

``POINTWISE`` maps each ATen op the fuser computes elementwise to its lowering, which adds an
``op`` node to the ``Builder`` (``valuegraph``); ``classify`` reads its keys. Formats are Triton
expressions over the operands ``$0``, ``$1``…, computed in the output's compute type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from aot.codegen import index as ix
from aot.codegen.index import Lin
from aot.codegen.lower_views import slice_node
from aot.codegen.step_args import arg, is_tensor, literal, norm_dim, operand
from aot.codegen.triton_types import COMPUTE, STORAGE, TL_TYPE
from aot.codegen.valuegraph import Builder, Node, Unsupported, pointwise_node, same_index
from aot.dtypes import FLOATS
from aot.schema import SpecialFloat, Step, SymFloat


def _common_type(operands: list[tuple[Node | None, str]], scalars: list[Any]) -> str:
    tys = [n.dtype for n, _ in operands if n is not None]
    if any(t == "float64" for t in tys):
        return "fp64"
    if any(t in FLOATS for t in tys) or any(isinstance(s, (float, SpecialFloat, SymFloat)) for s in scalars):
        return "fp32"
    if any(t == "int64" for t in tys) or not tys:
        return "i64"
    if all(t == "bool" for t in tys) and not scalars:
        return "i1"
    return "i32" if all(t in ("int32", "int16", "int8", "uint8", "bool") for t in tys) else "i64"


def _tanh(x: str) -> str:  # no libdevice: the interpreter that checks kernels on CPU lacks it
    return f"(1.0 - 2.0 / (tl.exp(2.0 * {x}) + 1.0))"


_UNARY_FLOAT = {
    "aten.exp.default": "tl.exp($0)",
    "aten.exp2.default": "tl.exp2($0)",
    "aten.log.default": "tl.log($0)",
    "aten.log2.default": "tl.log2($0)",
    "aten.log10.default": "(tl.log($0) * 0.4342944819032518)",
    "aten.log1p.default": "tl.log(1.0 + $0)",
    "aten.expm1.default": "(tl.exp($0) - 1.0)",
    "aten.sqrt.default": "tl.sqrt($0)",
    "aten.rsqrt.default": "tl.rsqrt($0)",
    "aten.sin.default": "tl.sin($0)",
    "aten.cos.default": "tl.cos($0)",
    "aten.tanh.default": _tanh("$0"),
    "aten.sigmoid.default": "tl.sigmoid($0)",
    "aten.erf.default": "tl.erf($0)",
    "aten.reciprocal.default": "(1.0 / $0)",
    "aten.silu.default": "($0 * tl.sigmoid($0))",
    "aten.floor.default": "tl.floor($0)",
    "aten.ceil.default": "tl.ceil($0)",
    "aten.trunc.default": "tl.where($0 < 0.0, tl.ceil($0), tl.floor($0))",
    "aten.hardsigmoid.default": "tl.minimum(tl.maximum($0 / 6.0 + 0.5, 0.0), 1.0)",
    "aten.hardswish.default": "($0 * tl.minimum(tl.maximum($0 + 3.0, 0.0), 6.0) / 6.0)",
    "aten.mish.default": f"($0 * {_tanh('tl.where($0 > 20.0, $0, tl.log(1.0 + tl.exp($0)))')})",
}
_UNARY_ANY = {
    "aten.neg.default": "(-$0)",
    "aten.abs.default": "tl.abs($0)",
    "aten.relu.default": "tl.where($0 < 0, 0, $0)",
    "aten.clone.default": "$0",
    "aten.lift_fresh_copy.default": "$0",
}
_BINARY = {  # float or int, result in the output's compute type
    "aten.mul.Tensor": "($0 * $1)",
    "aten.mul.Scalar": "($0 * $1)",
    "aten.maximum.default": "tl.where(($0 > $1) | ($0 != $0), $0, $1)",
    "aten.minimum.default": "tl.where(($0 < $1) | ($0 != $0), $0, $1)",
}
_COMPARE = {
    "eq": "==",
    "ne": "!=",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
}
_LOGICAL = {
    "aten.logical_and.default": "(($0 != 0) & ($1 != 0))",
    "aten.logical_or.default": "(($0 != 0) | ($1 != 0))",
    "aten.logical_xor.default": "(($0 != 0) ^ ($1 != 0))",
}


def _lower_unary(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    fmt = _UNARY_FLOAT.get(step.target) or _UNARY_ANY[step.target]
    ty = COMPUTE[dtype]
    if step.target in _UNARY_FLOAT and ty not in ("fp32", "fp64"):
        raise Unsupported(f"{step.target} on {dtype}")
    rounding = step.target in ("aten.floor.default", "aten.ceil.default", "aten.trunc.default")
    b.set(
        name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], ty)], f"@{ty}" if rounding else ty)
    )


def _lower_sign(b: Builder, step: Step) -> None:
    """``sign`` (DeBERTa-v2's and SEW-D's log-bucketed relative positions): 1, -1 or 0 in the
    output's compute type, 0 for NaN as ATen gives; a boolean its own sign."""
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    fmt = "$0" if dtype == "bool" else f"(($0 > 0).to({TL_TYPE[ty]}) - ($0 < 0).to({TL_TYPE[ty]}))"
    b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], ty)], ty))


def _lower_binary(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    a, c = step.args[0], step.args[1]
    target = step.target
    alpha = arg(step, 2, "alpha", 1)
    ops = [operand(b, a, ty), operand(b, c, ty)]
    if target.startswith(("aten.add.", "aten.sub.", "aten.rsub.")):
        sign = "-" if target.startswith(("aten.sub.", "aten.rsub.")) else "+"
        scaled = "$1" if alpha == 1 else f"($1 * {literal(alpha, ty)})"
        if target.startswith("aten.rsub."):
            ops.reverse()
        fmt = f"($0 {sign} {scaled})"
        if dtype == "bool" and sign == "+":
            fmt = "($0 | $1)"
        elif dtype == "bool":
            raise Unsupported("boolean subtraction")
    elif target.startswith("aten.div."):
        mode = arg(step, 2, "rounding_mode", None)
        if ty not in ("fp32", "fp64"):
            raise Unsupported(f"{target} producing {dtype}")
        fmt = {
            None: "($0 / $1)",
            "floor": "tl.floor($0 / $1)",
            "trunc": "tl.where($0 / $1 < 0.0, tl.ceil($0 / $1), tl.floor($0 / $1))",
        }.get(mode)
        if fmt is None:
            raise Unsupported(f"rounding mode {mode!r}")
    elif target.startswith("aten.remainder."):
        if ty in ("fp32", "fp64"):
            fmt = "($0 - tl.floor($0 / $1) * $1)"
        elif dtype != "bool":  # the divisor's sign, as Python's: C's ``%`` moved by the divisor
            fmt = (
                "tl.where($0 % $1 == 0, $0 % $1, tl.where(($0 % $1 < 0) == ($1 < 0), $0 % $1, $0 % $1 + $1))"
            )
        else:
            raise Unsupported("remainder on bool")
    elif target.startswith("aten.fmod."):  # the remainder with the dividend's sign (C's)
        if ty in ("fp32", "fp64"):
            fmt = "($0 - tl.where($0 / $1 < 0.0, tl.ceil($0 / $1), tl.floor($0 / $1)) * $1)"
        elif dtype != "bool":  # Triton's integer ``%`` truncates, as C's (on the GPU and interpreted)
            fmt = "($0 % $1)"
        else:
            raise Unsupported("fmod on bool")
    else:
        fmt = _BINARY[target]
        if dtype == "bool":
            raise Unsupported(f"{target} on bool")
    b.set(name, pointwise_node(shape, dtype, fmt, ops, ty))


def _lower_compare(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    op = _COMPARE[step.target.split(".")[1]]
    scalars = [a for a in step.args[:2] if not is_tensor(a)]
    probe = [(b.tensor(a), "") if is_tensor(a) else (None, "") for a in step.args[:2]]
    ty = _common_type(probe, scalars)
    ops = [operand(b, a, ty) for a in step.args[:2]]
    node = pointwise_node(shape, dtype, f"($0 {op} $1)", ops, ty)
    node.casts = tuple(f"@{c}" for c in node.casts)  # compare the half values the program compares
    b.set(name, node)


def _lower_logical(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    if step.target == "aten.logical_not.default":
        b.set(name, pointwise_node(shape, dtype, "($0 == 0)", [operand(b, step.args[0], None)], None))
        return
    if step.target.startswith("aten.bitwise_"):
        if dtype != "bool":
            raise Unsupported("integer bitwise ops")
        if step.target == "aten.bitwise_not.default":
            b.set(name, pointwise_node(shape, dtype, "($0 == 0)", [operand(b, step.args[0], "i1")], "i1"))
            return
        sym = {"and": "&", "or": "|", "xor": "^"}[step.target.split(".")[1].split("_")[1]]
        ops = [operand(b, a, "i1") for a in step.args[:2]]
        b.set(name, pointwise_node(shape, dtype, f"($0 {sym} $1)", ops, "i1"))
        return
    ops = [operand(b, a, None) for a in step.args[:2]]
    b.set(name, pointwise_node(shape, dtype, _LOGICAL[step.target], ops, None))


def _lower_where(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    cond = b.tensor(step.args[0])
    a, c = operand(b, step.args[1], ty), operand(b, step.args[2], ty)
    node = pointwise_node(shape, dtype, "tl.where($0, $1, $2)", [(cond, ""), a, c], ty)
    node.casts = ("i1",) + node.casts[1:]
    b.set(name, node)


def _lower_masked_fill(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    x, mask, value = b.tensor(step.args[0]), b.tensor(step.args[1]), step.args[2]
    node = pointwise_node(
        shape, dtype, "tl.where($0, $1, $2)", [(mask, ""), operand(b, value, ty), (x, "")], ty
    )
    node.casts = tuple("i1" if n is mask else ty for n in node.inputs)
    b.set(name, node)


def _lower_clamp(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    target = step.target
    if target == "aten.clamp.default":
        lo = arg(step, 1, "min", None)
        hi = arg(step, 2, "max", None)
    elif target == "aten.clamp_min.default":
        lo, hi = step.args[1], None
    elif target == "aten.clamp_max.default":
        lo, hi = None, step.args[1]
    elif target == "aten.hardtanh.default":
        lo = arg(step, 1, "min_val", -1.0)
        hi = arg(step, 2, "max_val", 1.0)
    else:  # relu6
        lo, hi = 0.0, 6.0
    if is_tensor(lo) or is_tensor(hi):
        raise Unsupported("tensor clamp bounds")
    fmt = "$0"
    if lo is not None:  # where() keeps NaN as torch.clamp does
        fmt = f"tl.where({fmt} < {literal(lo, ty)}, {literal(lo, ty)}, {fmt})"
    if hi is not None:
        fmt = f"tl.where({fmt} > {literal(hi, ty)}, {literal(hi, ty)}, {fmt})"
    b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], ty)], ty))


def _lower_leaky_relu(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    slope = arg(step, 1, "negative_slope", 0.01)
    fmt = f"tl.where($0 > 0.0, $0, $0 * {literal(slope, 'fp32')})"
    b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], "fp32")], COMPUTE[dtype]))


def _lower_gelu(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    approx = arg(step, 1, "approximate", "none")
    if approx == "tanh":
        inner = "0.7978845608028654 * ($0 + 0.044715 * $0 * $0 * $0)"
        fmt = f"(0.5 * $0 * (1.0 + {_tanh(f'({inner})')}))"
    elif approx == "none":
        fmt = "(0.5 * $0 * (1.0 + tl.erf($0 * 0.7071067811865476)))"
    else:
        raise Unsupported(f"gelu approximate={approx!r}")
    ty = COMPUTE[dtype]
    if ty not in ("fp32", "fp64"):
        raise Unsupported(f"gelu on {dtype}")
    b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], ty)], ty))


def _lower_softplus(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    beta = arg(step, 1, "beta", 1)
    threshold = arg(step, 2, "threshold", 20)
    be, th = literal(beta, "fp32"), literal(threshold, "fp32")
    fmt = f"tl.where($0 * {be} > {th}, $0, tl.log(1.0 + tl.exp($0 * {be})) / {be})"
    b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], "fp32")], COMPUTE[dtype]))


def _int_exponent(e: Any) -> int | None:
    if isinstance(e, bool):
        return None
    if isinstance(e, int) or (isinstance(e, float) and e.is_integer() and abs(e) <= 64):
        return int(e)
    return None


def _lower_pow(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    if step.target == "aten.pow.Scalar":  # scalar ** tensor
        base = step.args[0]
        if is_tensor(base) or not isinstance(base, (int, float)) or base <= 0 or ty not in ("fp32", "fp64"):
            raise Unsupported("pow.Scalar with a non-positive base")
        fmt = f"tl.exp2($0 * {math.log2(base)!r})"
        b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[1], ty)], ty))
        return
    e = step.args[1]
    if step.target == "aten.pow.Tensor_Tensor":  # BLOOM's ALiBi slopes: base ** arange
        if ty not in ("fp32", "fp64"):
            raise Unsupported(f"pow of two tensors on {dtype}")
        mag = "tl.exp2($1 * tl.log2(tl.abs($0)))"
        odd = f"tl.where(tl.floor($1 * 0.5) * 2.0 == $1, {mag}, -{mag})"  # a negative base: by the parity
        negative = f'tl.where($1 == tl.floor($1), {odd}, float("nan"))'  # NaN for a fractional power
        fmt = f"tl.where($1 == 0.0, 1.0, tl.where($0 == 1.0, 1.0, tl.where($0 < 0.0, {negative}, {mag})))"
        b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], ty), operand(b, e, ty)], ty))
        return
    if is_tensor(e):
        raise Unsupported("tensor exponent")
    n = _int_exponent(e)
    if n is not None and 0 <= n <= 4:
        fmt = "(" + " * ".join(["$0"] * n) + ")" if n else "($0 * 0 + 1)"
    elif n is not None and -4 <= n < 0 and ty in ("fp32", "fp64"):
        fmt = "(1.0 / (" + " * ".join(["$0"] * -n) + "))"
    elif e == 0.5 and ty in ("fp32", "fp64"):
        fmt = "tl.sqrt($0)"
    elif e == -0.5 and ty in ("fp32", "fp64"):
        fmt = "tl.rsqrt($0)"
    elif ty in ("fp32", "fp64") and isinstance(e, (int, float)):
        mag = f"tl.exp2({float(e)!r} * tl.log2(tl.abs($0)))"
        if n is not None and n % 2:
            fmt = f"tl.where($0 < 0.0, -{mag}, {mag})"
        elif n is not None:
            fmt = mag
        else:  # a negative base with a fractional exponent is NaN, as in torch
            fmt = f'tl.where($0 < 0.0, float("nan"), {mag})'
    else:
        raise Unsupported(f"pow with exponent {e!r} on {dtype}")
    b.set(name, pointwise_node(shape, dtype, fmt, [operand(b, step.args[0], ty)], ty))


def _lower_cast(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    x = b.tensor(step.args[0])
    ty = COMPUTE[dtype]
    if dtype in ("float16", "bfloat16"):  # the program asks for the rounding: keep it
        storage = TL_TYPE[STORAGE[dtype]]
        node = Node("op", shape, dtype, (x,), f"$0.to({storage}).to(tl.float32)", ("fp32",))
    elif dtype == "bool":
        node = Node("op", shape, dtype, (x,), "($0 != 0)", ("@",))
    else:  # to an integer: truncate the value the program had (a half value, not its fp32 register)
        node = Node("op", shape, dtype, (x,), "$0", ((f"@{ty}" if ty.startswith("i") else ty),))
    b.set(name, node)


def _lower_copy(b: Builder, step: Step) -> None:  # copy(dst, src): src broadcast into dst
    name, shape, dtype = b.out(step)
    src = b.tensor(step.args[1])
    b.set(name, Node("op", shape, dtype, (src,), "$0", (COMPUTE[dtype],)))


def _lower_batch_norm(b: Builder, step: Step) -> None:
    """``_native_batch_norm_legit_no_training``: per-channel affine map along dim 1."""
    if any(o is not None for o in step.outputs[1:]):
        raise Unsupported("batch norm statistics are used")
    name, shape, dtype = b.out(step)
    if len(shape) < 2:
        raise Unsupported("batch norm of rank < 2")
    x = b.tensor(step.args[0])
    eps = arg(step, 6, "eps", 1e-5)

    def channel(value: Any) -> Node | None:
        if value is None:
            return None
        param = b.tensor(value)
        xshape = shape

        def to_channel(lin: Lin) -> Lin:
            return ix.unflatten(lin, xshape)[1]

        return Node("remap", shape, param.dtype, (param,), remap=to_channel)

    w, bias, mean, var = (channel(a) for a in step.args[1:5])
    if mean is None or var is None:
        raise Unsupported("batch norm without running statistics")
    inputs, fmt = [x, mean, var], f"(($0 - $1) * tl.rsqrt($2 + {literal(eps, 'fp32')}))"
    if w is not None:
        fmt = f"({fmt} * ${len(inputs)})"
        inputs.append(w)
    if bias is not None:
        fmt = f"({fmt} + ${len(inputs)})"
        inputs.append(bias)
    b.set(name, Node("op", shape, dtype, tuple(inputs), fmt, ("fp32",) * len(inputs)))


def _lower_cat(b: Builder, step: Step) -> None:
    """``cat``: no copy of the pieces; each output element reads the one piece that holds it (RoPE's
    ``rotate_half`` becomes index arithmetic inside the kernel that uses it)."""
    name, shape, dtype = b.out(step)
    pieces = step.args[0]
    if not isinstance(pieces, (list, tuple)) or not pieces:
        raise Unsupported("cat of no tensors")
    dim = norm_dim(arg(step, 1, "dim", 0), len(shape))
    nodes, ends, end = [], [], ix.ZERO
    for piece in pieces:
        node = b.tensor(piece)
        if len(node.shape) != len(shape):
            raise Unsupported("cat of tensors of different ranks")
        if node.shape[dim] == ix.ZERO:
            continue  # an empty piece holds no element
        end = ix.canon(end + node.shape[dim])
        nodes.append(node)
        ends.append(end)
    if not nodes or not ix.same(end, shape[dim]):
        raise Unsupported("cat pieces do not add up to the output")
    ty = COMPUTE[dtype]
    cat = Node("cat", shape, dtype, tuple(nodes), casts=(ty,) * len(nodes), cat_dim=dim, cat_ends=tuple(ends))
    b.set(name, cat)


def _lower_constant_pad(b: Builder, step: Step) -> None:
    """``constant_pad_nd`` (``F.pad``; timm's "same" padding before a convolution): each padded dim
    a ``cat`` of the value's run, the tensor and the value's run, the value computed from the
    index where it is read; a negative pad crops (a slice). A pad that is a size expression (SEW's
    frames padded back to its input's length: 0 or 1 by their count's parity) may take either sign
    at the declared sizes: its run is a piece whose ends are expressions, and the cat's nested
    choice by the ends is the pad's meaning at either sign (a negative run is never chosen; the
    tensor's piece, read at the index less the low pad, ends where the output does)."""
    name, shape, dtype = b.out(step)
    x = b.tensor(step.args[0])
    pad = list(arg(step, 1, "pad", []))
    value = arg(step, 2, "value", 0)
    value = 0 if value is None else value
    rank = len(x.shape)
    if len(pad) % 2 or len(pad) // 2 > rank or is_tensor(value):
        raise Unsupported(f"constant_pad_nd with pad {pad!r}")
    try:
        pad = [p if type(p) is int else ix.size_of(p) for p in pad]
    except ix.InexpressibleIndex as e:
        raise Unsupported(f"constant_pad_nd with pad {pad!r}: {e}") from None
    ty = COMPUTE[dtype]
    fill = f"tl.full([], {literal(value, ty)}, {TL_TYPE[ty]})"
    node = x
    for i in range(len(pad) // 2):
        dim, low, high = rank - 1 - i, pad[2 * i], pad[2 * i + 1]
        crop_low, crop_high = (min(p, 0) if type(p) is int else 0 for p in (low, high))
        if crop_low or crop_high:  # a static crop first: the kept run of the dim
            kept = ix.canon(node.shape[dim] + crop_low + crop_high)
            cropped = node.shape[:dim] + (kept,) + node.shape[dim + 1 :]
            node = slice_node(node, cropped, dim, ix.sympy.Integer(-crop_low), 1)
        pieces, ends, end = [], [], ix.ZERO
        for run, piece in ((low, None), (None, node), (high, None)):
            size = (
                piece.shape[dim] if piece is not None else ix.canon(max(run, 0) if type(run) is int else run)
            )
            if size == ix.ZERO:
                continue
            part_shape = node.shape[:dim] + (size,) + node.shape[dim + 1 :]
            pieces.append(piece if piece is not None else Node("op", part_shape, dtype, (), fill))
            end = ix.canon(end + size)
            ends.append(end)
        padded = node.shape[:dim] + (end,) + node.shape[dim + 1 :]
        if len(pieces) > 1:
            node = Node(
                "cat",
                padded,
                dtype,
                tuple(pieces),
                casts=(ty,) * len(pieces),
                cat_dim=dim,
                cat_ends=tuple(ends),
            )
    if not all(ix.same(a, c) for a, c in zip(node.shape, shape)):
        raise Unsupported("constant_pad_nd: the pieces do not add up to the output")
    b.set(name, node if node is not x else Node("remap", shape, dtype, (x,), remap=same_index))


def _lower_slice_scatter(b: Builder, step: Step) -> None:
    """``slice_scatter(x, src, dim, start, end, 1)`` (an in-place op on a slice, functionalized:
    GhostNet's ``x += shortcut`` on a channel slice): a ``cat`` of ``x`` before the slice, ``src``
    and ``x`` after it, along a dim of static size."""
    name, shape, dtype = b.out(step)
    x, src = b.tensor(step.args[0]), b.tensor(step.args[1])
    rank = len(x.shape)
    dim = norm_dim(arg(step, 2, "dim", 0), rank)
    start, end, stride = arg(step, 3, "start", None), arg(step, 4, "end", None), arg(step, 5, "step", 1)
    size = x.shape[dim]
    whole = start in (None, 0) and (end is None or (type(end) is int and end >= 2**62))  # export: sys.maxsize
    if stride == 1 and whole and len(src.shape) == rank and ix.same(src.shape[dim], size):
        b.set(name, Node("remap", shape, dtype, (src,), remap=same_index))  # every element src's
        return
    if stride != 1 or not size.is_Integer or any(v is not None and type(v) is not int for v in (start, end)):
        raise Unsupported("slice_scatter of a step, a symbolic dim or bounds")
    start, end, _ = slice(start, end).indices(int(size))
    end = max(start, end)
    if len(src.shape) != rank or not ix.same(src.shape[dim], ix.sympy.Integer(end - start)):
        raise Unsupported("slice_scatter: the source does not fill the slice")
    ty = COMPUTE[dtype]
    pieces, ends = [], []
    for lo, hi, piece in ((0, start, x), (start, end, src), (end, int(size), x)):
        if hi <= lo:
            continue
        part = x.shape[:dim] + (ix.sympy.Integer(hi - lo),) + x.shape[dim + 1 :]
        pieces.append(piece if piece is src else slice_node(x, part, dim, ix.sympy.Integer(lo), 1))
        ends.append(ix.sympy.Integer(hi))
    if len(pieces) == 1:
        b.set(name, Node("remap", shape, dtype, (pieces[0],), remap=same_index))
        return
    b.set(
        name,
        Node(
            "cat", shape, dtype, tuple(pieces), casts=(ty,) * len(pieces), cat_dim=dim, cat_ends=tuple(ends)
        ),
    )


def _lower_upsample_nearest(b: Builder, step: Step) -> None:
    """``upsample_nearest2d`` (``F.interpolate(mode="nearest")``: HRNet's and FPNs' top-down
    paths) by a whole factor ``k`` per image dim: ``out[.., y, x] = in[.., y // k, x // k]``, index
    arithmetic that the kernel reading it folds in. ATen computes the source row as
    ``floor(y * (1 / k))`` in float32: the same wherever float32's ``1 / k`` is not below ``1 / k``
    (every power of two, 3, 5, ...; a float64 tensor's scale is a double: powers of two only);
    other factors and sizes that are not whole multiples stay ATen's."""
    from fractions import Fraction

    import numpy as np

    name, shape, dtype = b.out(step)
    x = b.tensor(step.args[0])
    scales = arg(step, 2, "scale_factors", None)
    if len(x.shape) != 4 or len(shape) != 4:
        raise Unsupported("upsample_nearest2d of a tensor that is not 4-D")
    factors = []
    for i, d in enumerate((2, 3)):
        n_in, n_out = x.shape[d], shape[d]
        if not (n_in.is_Integer and n_out.is_Integer) or int(n_in) == 0 or int(n_out) % int(n_in):
            _nearest_rows(b, step, x, shape, scales)  # any other size: the rows it reads, computed
            return
        k = int(n_out) // int(n_in)
        if scales is not None and (type(scales[i]) not in (int, float) or float(scales[i]) != k):
            raise Unsupported(f"upsample_nearest2d by {scales[i]!r} to {n_out} rows of {n_in}")
        if k & (k - 1) and (x.dtype == "float64" or Fraction(float(np.float32(1.0 / k))) < Fraction(1, k)):
            raise Unsupported(f"upsample_nearest2d by {k}: float32's 1 / {k} rounds down")
        factors.append(k)

    def remap(lin: Lin, shape=shape, in_shape=x.shape, factors=tuple(factors)) -> Lin:
        per = ix.unflatten(lin, shape)
        for d, k in zip((2, 3), factors):
            if k != 1:
                per[d] = ix.make_lin([(ix.ONE, ix.Frag(per[d], shape[d], ix.sympy.Integer(k)))])
        return ix.flatten(per, in_shape)

    b.set(name, Node("remap", shape, dtype, (x,), remap=remap))


def _nearest_rows(b: Builder, step: Step, x: Node, shape: tuple, scales) -> None:
    """``upsample_nearest2d`` to any size (symbolic, fewer rows, a fractional factor: DETR's
    masks, U-Nets at declared image sizes): a ``gather`` of ``x`` at the row and column each
    output position reads, ``min(floor(dst * scale), size - 1)`` with the product in float32 and
    ``scale`` the input's size over the output's (float32 division) or one over a given factor,
    as ATen's kernels compute it."""
    if x.dtype == "float64":
        raise Unsupported("upsample_nearest2d of float64 to a size that is not a whole multiple")
    if scales is not None and not (
        isinstance(scales, (list, tuple))
        and len(scales) == 2
        and all(type(f) in (int, float) and f > 0 for f in scales)
    ):
        raise Unsupported(f"upsample_nearest2d by {str(scales)[:40]}")
    indices = []
    for i, d in enumerate((2, 3)):
        n_in, n_out = x.shape[d], shape[d]
        factor = None if scales is None else float(scales[i])
        scale = ix.pixel_scale(n_in, n_out, factor, ix.triton_size(n_in), ix.triton_size(n_out))
        last = ix.triton_size(ix.canon(n_in - 1))
        fmt = f"tl.minimum((($idx).to(tl.float32) * {scale}).to(tl.int64), {last})"
        indices.append(Node("op", (n_out, ix.ONE) if d == 2 else (n_out,), "int64", (), fmt))
    gather_shape = (shape[2], shape[3])
    b.set(
        b.out(step)[0], Node("gather", shape, x.dtype, (x, *indices), gather_dim=2, gather_shape=gather_shape)
    )


def _lower_repeat(b: Builder, step: Step) -> None:
    """``repeat`` (XCiT's position encoding repeated over the batch): ``out[.., i, ..] =
    x[.., i % n, ..]`` along each repeated dim of ``x`` (``n`` its static size, the count any: BLOOM's
    ALiBi slopes repeated over the batch; a dim of one, any count), leading new dims read at 0:
    index arithmetic that the kernel reading it folds in."""
    name, shape, dtype = b.out(step)
    x = b.tensor(step.args[0])
    repeats = list(arg(step, 1, "repeats", []))
    new = len(repeats) - len(x.shape)
    if new < 0 or len(shape) != len(repeats):
        raise Unsupported("repeat with fewer repeats than dims")
    for r, n in zip(repeats[new:], x.shape):
        if r != 1 and n != ix.ONE and (not n.is_Integer or int(n) == 0):
            raise Unsupported("repeat of a symbolic or empty dim")

    def remap(lin: Lin, shape=shape, in_shape=x.shape, new=new, repeats=tuple(repeats)) -> Lin:
        per = ix.unflatten(lin, shape)[new:]
        for d, (r, n) in enumerate(zip(repeats[new:], in_shape)):
            if r != 1:
                per[d] = ix.make_lin([(ix.ONE, ix.Frag(per[d], shape[new + d], ix.ONE, n))])
        return ix.flatten(per, in_shape)

    b.set(name, Node("remap", shape, dtype, (x,), remap=remap))


POINTWISE: dict[str, Callable[[Builder, Step], None]] = {
    **dict.fromkeys(_UNARY_FLOAT, _lower_unary),
    **dict.fromkeys(_UNARY_ANY, _lower_unary),
    "aten.sign.default": _lower_sign,
    **dict.fromkeys(
        (
            "aten.add.Tensor",
            "aten.add.Scalar",
            "aten.sub.Tensor",
            "aten.sub.Scalar",
            "aten.rsub.Scalar",
            "aten.rsub.Tensor",
            "aten.mul.Tensor",
            "aten.mul.Scalar",
            "aten.div.Tensor",
            "aten.div.Scalar",
            "aten.div.Tensor_mode",
            "aten.div.Scalar_mode",
            "aten.maximum.default",
            "aten.minimum.default",
            "aten.remainder.Tensor",
            "aten.remainder.Scalar",
            "aten.fmod.Tensor",
            "aten.fmod.Scalar",
        ),
        _lower_binary,
    ),
    **{f"aten.{c}.{overload}": _lower_compare for c in _COMPARE for overload in ("Tensor", "Scalar")},
    **dict.fromkeys(
        (
            "aten.logical_and.default",
            "aten.logical_or.default",
            "aten.logical_xor.default",
            "aten.logical_not.default",
            "aten.bitwise_not.default",
            "aten.bitwise_and.Tensor",
            "aten.bitwise_or.Tensor",
            "aten.bitwise_xor.Tensor",
        ),
        _lower_logical,
    ),
    "aten.where.self": _lower_where,
    "aten.masked_fill.Scalar": _lower_masked_fill,
    "aten.masked_fill.Tensor": _lower_masked_fill,
    "aten.clamp.default": _lower_clamp,
    "aten.clamp_min.default": _lower_clamp,
    "aten.clamp_max.default": _lower_clamp,
    "aten.hardtanh.default": _lower_clamp,
    "aten.relu6.default": _lower_clamp,
    "aten.leaky_relu.default": _lower_leaky_relu,
    "aten.gelu.default": _lower_gelu,
    "aten.softplus.default": _lower_softplus,
    "aten.pow.Tensor_Scalar": _lower_pow,
    "aten.pow.Scalar": _lower_pow,
    "aten.pow.Tensor_Tensor": _lower_pow,
    "aten._to_copy.default": _lower_cast,
    "aten.copy.default": _lower_copy,
    "aten._native_batch_norm_legit_no_training.default": _lower_batch_norm,
    "aten.cat.default": _lower_cat,
    "aten.constant_pad_nd.default": _lower_constant_pad,
    "aten.slice_scatter.default": _lower_slice_scatter,
    "aten.upsample_nearest2d.vec": _lower_upsample_nearest,
    "aten.repeat.default": _lower_repeat,
}
