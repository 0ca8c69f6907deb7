"""Which ATen ops the fuser knows, and how each becomes nodes of a kernel's value graph.

Every step of the program is one of:

- ``view``: a reshape/permute/expand/slice/select/split…; never materialized inside a kernel,
  folded into index arithmetic (``Node.remap``);
- ``generator``: values that depend only on the index (``arange``, ``full``…), recomputed
  wherever they are used;
- ``pointwise``: one value per output element from inputs at broadcast positions;
- ``reduction``: reduces trailing dims (sum, mean, amax, var, softmax, layer norm…) with its
  prologue and epilogue expressed as pointwise nodes around ``reduce`` nodes;
- ``library``: everything else (matmul, convolution, attention, embedding, pooling, and every op
  this module does not know). A library step stays an ATen call, so an unknown op never fails a
  build.

``lower`` turns one step into nodes; a node's Triton expression is a format string over its
inputs' values, computed in fp32 for half types (rounded only where the program casts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aot.codegen import index as ix
from aot.codegen.index import Lin, Size
from aot.schema import Buf, SpecialFloat, Step, Sym, TensorSpec

# dtype of the program → type values are computed in inside a kernel
COMPUTE = {
    "float16": "fp32",
    "bfloat16": "fp32",
    "float32": "fp32",
    "float64": "fp64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "bool": "i1",
}
# dtype of the program → Triton pointer element type
STORAGE = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "bool": "i1",
}
TL_TYPE = {
    "fp16": "tl.float16",
    "bf16": "tl.bfloat16",
    "fp32": "tl.float32",
    "fp64": "tl.float64",
    "i8": "tl.int8",
    "u8": "tl.uint8",
    "i16": "tl.int16",
    "i32": "tl.int32",
    "i64": "tl.int64",
    "i1": "tl.int1",
}
ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
FLOATS = {"float16", "bfloat16", "float32", "float64"}

VIEW_OPS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.permute.default",
    "aten.transpose.int",
    "aten.t.default",
    "aten.expand.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.squeeze.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.alias.default",
    "aten.detach.default",
    "aten.split_with_sizes.default",
    "aten.split.Tensor",
    "aten.unbind.int",
    "aten.narrow.default",
}
GENERATOR_OPS = {
    "aten.arange.default",
    "aten.arange.start",
    "aten.arange.start_step",
    "aten.full.default",
    "aten.full_like.default",
    "aten.scalar_tensor.default",
    "aten.fill.Scalar",
    "aten.zeros_like.default",
    "aten.ones_like.default",
    "aten.zeros.default",
    "aten.ones.default",
    "aten.new_zeros.default",
    "aten.new_ones.default",
    "aten.new_full.default",
}
REDUCTION_OPS = {
    "aten.native_layer_norm.default",
    "aten._softmax.default",
    "aten._log_softmax.default",
    "aten.sum.dim_IntList",
    "aten.sum.default",
    "aten.mean.dim",
    "aten.mean.default",
    "aten.amax.default",
    "aten.amin.default",
    "aten.var.correction",
    "aten.var_mean.correction",
    "aten.logsumexp.default",
}


class Unsupported(Exception):
    """This step (with these arguments) cannot be part of a kernel; it stays a library call."""


@dataclass(eq=False)
class Node:
    """A value inside a kernel.

    kind ``load``: element of root buffer ``buf``; ``op``: ``fmt`` over the inputs' values (each
    cast to ``casts[i]`` first when given; ``"@ty"``: first rounded to the input's own half
    dtype, for ops whose result jumps, like casts to int and comparisons), ``$idx`` in ``fmt`` is
    the node's own flat index;
    ``remap``: the input at ``remap(index)``; ``reduce``: ``reduce`` ("sum", "max", "min") of the
    input over its last ``width`` elements per row.
    """

    kind: str
    shape: tuple[Size, ...]
    dtype: str
    inputs: tuple[Node, ...] = ()
    fmt: str = ""
    casts: tuple[str | None, ...] = ()
    buf: str = ""
    remap: Callable[[Lin], Lin] | None = None
    reduce: str = ""
    width: Size = ix.ONE

    @property
    def ty(self) -> str:
        return COMPUTE[self.dtype]


def returns_view(target: str) -> bool:
    """Whether an ATen op returns a view of an input (its schema's first return aliases)."""
    import torch

    try:
        _, name, overload = target.split(".")
        schema = getattr(getattr(torch.ops.aten, name), overload)._schema
    except (AttributeError, ValueError, RuntimeError):
        return False
    return bool(schema.returns) and schema.returns[0].alias_info is not None


def classify(step: Step, buffers: dict[str, TensorSpec]) -> str:
    """``view`` | ``generator`` | ``pointwise`` | ``reduction`` | ``library`` (see module doc)."""
    name = step.target
    if step.kind != "aten":
        return "library"
    specs = [buffers.get(o) for o in step.outputs if o is not None]
    if not specs or any(s is None or s.dtype not in COMPUTE for s in specs):
        return "library"
    if name in VIEW_OPS:
        return "view"
    if name in GENERATOR_OPS:
        return "generator"
    if name in POINTWISE:
        return "pointwise"
    if name in REDUCTION_OPS:
        return "reduction"
    return "library"


# ---------------------------------------------------------------------------------------------
# Building nodes


class Builder:
    """Resolves a step's arguments to nodes; records each output buffer's node."""

    def __init__(
        self,
        buffers: dict[str, TensorSpec],
        inputs: dict[str, TensorSpec],
        not_roots: frozenset[str] = frozenset(),
    ):
        self.buffers = buffers
        self.known = inputs  # specs of program inputs and weights
        self.not_roots = not_roots  # buffers a kernel must not read through a pointer (ATen views)
        self.env: dict[str, Node] = {}
        self.roots: dict[str, Node] = {}

    def spec(self, name: str) -> TensorSpec:
        spec = self.buffers.get(name) or self.known.get(name)
        if spec is None:
            raise Unsupported(f"buffer {name} has no spec")
        return spec

    def shape(self, name: str) -> tuple[Size, ...]:
        return tuple(ix.parse_size(s) for s in self.spec(name).shape)

    def tensor(self, arg: Any) -> Node:
        if not isinstance(arg, Buf):
            raise Unsupported(f"expected a tensor argument, got {str(arg)[:40]}")
        name = arg.name
        if name in self.env:
            return self.env[name]
        if name not in self.roots:
            if name in self.not_roots:
                raise Unsupported(f"{name} is a view made by a library call")
            spec = self.spec(name)
            if spec.dtype not in COMPUTE:
                raise Unsupported(f"dtype {spec.dtype}")
            self.roots[name] = Node("load", self.shape(name), spec.dtype, buf=name)
        return self.roots[name]

    def out(self, step: Step, i: int = 0) -> tuple[str | None, tuple[Size, ...], str]:
        name = step.outputs[i] if i < len(step.outputs) else None
        if name is None:
            return None, (), ""
        return name, self.shape(name), self.spec(name).dtype

    def set(self, name: str | None, node: Node) -> None:
        if name is not None:
            self.env[name] = node


def is_tensor(arg: Any) -> bool:
    return isinstance(arg, Buf)


def literal(value: Any, ty: str) -> str:
    """A scalar argument as Triton source of compute type ``ty``."""
    if isinstance(value, SpecialFloat):
        value = float(value.name)
    if isinstance(value, Sym):
        size = ix.parse_size(value.text)
        if size.is_Integer:
            return literal(int(size), ty)
        text = ix.triton_size(size)
        return f"({text})" if ty.startswith("i") else f"({text}).to(tl.float32)" if ty == "fp32" else text
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        raise Unsupported(f"scalar argument {str(value)[:40]}")
    if ty in ("fp32", "fp64"):
        v = float(value)
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else '-float("inf")'
        return repr(v)
    if ty == "i1":
        return "1" if value else "0"
    if isinstance(value, float) and not value.is_integer():
        raise Unsupported(f"float scalar {value} in integer arithmetic")
    return str(int(value))


def _operand(b: Builder, arg: Any, ty: str) -> tuple[Node | None, str]:
    """(node, None) for a tensor, (None, literal) for a scalar."""
    if is_tensor(arg):
        return b.tensor(arg), ""
    return None, literal(arg, ty)


def pointwise(shape, dtype, fmt: str, operands: list[tuple[Node | None, str]], ty: str | None) -> Node:
    """Node computing ``fmt`` over ``operands`` (tensors cast to ``ty``; scalars already literal)."""
    inputs, casts, slots = [], [], []
    for node, lit in operands:
        if node is None:
            slots.append(lit)
        else:
            slots.append(f"${len(inputs)}")
            inputs.append(node)
            casts.append(ty)
    text = re.sub(r"\$(\d+)", lambda m: slots[int(m.group(1))], fmt)
    return Node("op", shape, dtype, tuple(inputs), text, tuple(casts))


def _common_type(operands: list[tuple[Node | None, str]], scalars: list[Any]) -> str:
    tys = [n.dtype for n, _ in operands if n is not None]
    if any(t == "float64" for t in tys):
        return "fp64"
    if any(t in FLOATS for t in tys) or any(
        isinstance(s, (float, SpecialFloat)) for s in scalars
    ):
        return "fp32"
    if any(t == "int64" for t in tys) or not tys:
        return "i64"
    if all(t == "bool" for t in tys) and not scalars:
        return "i1"
    return "i32" if all(t in ("int32", "int16", "int8", "uint8", "bool") for t in tys) else "i64"


# ---------------------------------------------------------------------------------------------
# Pointwise ops: name → (format over operands "$0", "$1"…, tensor-args positions)


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
    b.set(name, pointwise(shape, dtype, fmt, [_operand(b, step.args[0], ty)], f"@{ty}" if rounding else ty))


def _lower_binary(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    a, c = step.args[0], step.args[1]
    target = step.target
    alpha = step.kwargs.get("alpha", step.args[2] if len(step.args) > 2 else 1)
    ops = [_operand(b, a, ty), _operand(b, c, ty)]
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
        mode = step.kwargs.get("rounding_mode", step.args[2] if len(step.args) > 2 else None)
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
        if ty not in ("fp32", "fp64"):
            raise Unsupported("integer remainder")
        fmt = "($0 - tl.floor($0 / $1) * $1)"
    else:
        fmt = _BINARY[target]
        if dtype == "bool":
            raise Unsupported(f"{target} on bool")
    b.set(name, pointwise(shape, dtype, fmt, ops, ty))


def _lower_compare(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    op = _COMPARE[step.target.split(".")[1]]
    scalars = [a for a in step.args[:2] if not is_tensor(a)]
    probe = [(b.tensor(a), "") if is_tensor(a) else (None, "") for a in step.args[:2]]
    ty = _common_type(probe, scalars)
    ops = [_operand(b, a, ty) for a in step.args[:2]]
    node = pointwise(shape, dtype, f"($0 {op} $1)", ops, ty)
    node.casts = tuple(f"@{c}" for c in node.casts)  # compare the half values the program compares
    b.set(name, node)


def _lower_logical(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    if step.target == "aten.logical_not.default":
        b.set(name, pointwise(shape, dtype, "($0 == 0)", [_operand(b, step.args[0], None)], None))
        return
    if step.target.startswith("aten.bitwise_"):
        if dtype != "bool":
            raise Unsupported("integer bitwise ops")
        if step.target == "aten.bitwise_not.default":
            b.set(name, pointwise(shape, dtype, "($0 == 0)", [_operand(b, step.args[0], "i1")], "i1"))
            return
        sym = {"and": "&", "or": "|", "xor": "^"}[step.target.split(".")[1].split("_")[1]]
        ops = [_operand(b, a, "i1") for a in step.args[:2]]
        b.set(name, pointwise(shape, dtype, f"($0 {sym} $1)", ops, "i1"))
        return
    ops = [_operand(b, a, None) for a in step.args[:2]]
    b.set(name, pointwise(shape, dtype, _LOGICAL[step.target], ops, None))


def _lower_where(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    cond = b.tensor(step.args[0])
    a, c = _operand(b, step.args[1], ty), _operand(b, step.args[2], ty)
    node = pointwise(shape, dtype, "tl.where($0, $1, $2)", [(cond, ""), a, c], ty)
    node.casts = ("i1",) + node.casts[1:]
    b.set(name, node)


def _lower_masked_fill(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    x, mask, value = b.tensor(step.args[0]), b.tensor(step.args[1]), step.args[2]
    node = pointwise(shape, dtype, "tl.where($0, $1, $2)", [(mask, ""), _operand(b, value, ty), (x, "")], ty)
    node.casts = tuple("i1" if n is mask else ty for n in node.inputs)
    b.set(name, node)


def _lower_clamp(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    target = step.target
    if target == "aten.clamp.default":
        lo = step.kwargs.get("min", step.args[1] if len(step.args) > 1 else None)
        hi = step.kwargs.get("max", step.args[2] if len(step.args) > 2 else None)
    elif target == "aten.clamp_min.default":
        lo, hi = step.args[1], None
    elif target == "aten.clamp_max.default":
        lo, hi = None, step.args[1]
    elif target == "aten.hardtanh.default":
        lo = step.args[1] if len(step.args) > 1 else step.kwargs.get("min_val", -1.0)
        hi = step.args[2] if len(step.args) > 2 else step.kwargs.get("max_val", 1.0)
    else:  # relu6
        lo, hi = 0.0, 6.0
    if is_tensor(lo) or is_tensor(hi):
        raise Unsupported("tensor clamp bounds")
    fmt = "$0"
    if lo is not None:  # where() keeps NaN as torch.clamp does
        fmt = f"tl.where({fmt} < {literal(lo, ty)}, {literal(lo, ty)}, {fmt})"
    if hi is not None:
        fmt = f"tl.where({fmt} > {literal(hi, ty)}, {literal(hi, ty)}, {fmt})"
    b.set(name, pointwise(shape, dtype, fmt, [_operand(b, step.args[0], ty)], ty))


def _lower_leaky_relu(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    slope = step.args[1] if len(step.args) > 1 else step.kwargs.get("negative_slope", 0.01)
    fmt = f"tl.where($0 > 0.0, $0, $0 * {literal(slope, 'fp32')})"
    b.set(name, pointwise(shape, dtype, fmt, [_operand(b, step.args[0], "fp32")], COMPUTE[dtype]))


def _lower_gelu(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    approx = step.kwargs.get("approximate", step.args[1] if len(step.args) > 1 else "none")
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
    b.set(name, pointwise(shape, dtype, fmt, [_operand(b, step.args[0], ty)], ty))


def _lower_softplus(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    beta = step.args[1] if len(step.args) > 1 else step.kwargs.get("beta", 1)
    threshold = step.args[2] if len(step.args) > 2 else step.kwargs.get("threshold", 20)
    be, th = literal(beta, "fp32"), literal(threshold, "fp32")
    fmt = f"tl.where($0 * {be} > {th}, $0, tl.log(1.0 + tl.exp($0 * {be})) / {be})"
    b.set(name, pointwise(shape, dtype, fmt, [_operand(b, step.args[0], "fp32")], COMPUTE[dtype]))


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
        b.set(name, pointwise(shape, dtype, fmt, [_operand(b, step.args[1], ty)], ty))
        return
    e = step.args[1]
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
    b.set(name, pointwise(shape, dtype, fmt, [_operand(b, step.args[0], ty)], ty))


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
    eps = step.args[6] if len(step.args) > 6 else step.kwargs.get("eps", 1e-5)

    def channel(arg: Any) -> Node | None:
        if arg is None:
            return None
        param = b.tensor(arg)
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


def _lower_generator(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    t = step.target
    if t.startswith("aten.arange."):
        args = list(step.args)
        if t == "aten.arange.default":
            start, step_size = 0, 1
        elif t == "aten.arange.start":
            start, step_size = args[0], 1
        else:
            start, step_size = args[0], (args[2] if len(args) > 2 else step.kwargs.get("step", 1))
        idx_ty = "fp32" if ty in ("fp32", "fp64") else ty
        fmt = f"($idx).to({TL_TYPE[idx_ty]})"
        if step_size != 1:
            fmt = f"({fmt} * {literal(step_size, idx_ty)})"
        if start != 0:
            fmt = f"({literal(start, idx_ty)} + {fmt})"
        node = Node("op", shape, dtype, (), f"{fmt}.to({TL_TYPE[ty]})")
    else:
        if t in ("aten.full.default", "aten.new_full.default"):
            value = step.args[1] if t == "aten.full.default" else step.args[2]
        elif t in ("aten.full_like.default", "aten.fill.Scalar"):
            value = step.args[1]
        elif t == "aten.scalar_tensor.default":
            value = step.args[0]
        elif "zeros" in t:
            value = 0
        else:
            value = 1
        if is_tensor(value):
            raise Unsupported(f"{t} with a tensor value")
        node = Node("op", shape, dtype, (), f"tl.full([], {literal(value, ty)}, {TL_TYPE[ty]})")
    b.set(name, node)


# ---------------------------------------------------------------------------------------------
# Views: output index → input index


def _lower_view(b: Builder, step: Step) -> None:
    t = step.target
    x = b.tensor(step.args[0])
    in_shape = x.shape
    if t in ("aten.split_with_sizes.default", "aten.split.Tensor", "aten.unbind.int"):
        dim = step.args[2] if len(step.args) > 2 else step.kwargs.get("dim", 0)
        if t == "aten.unbind.int":
            dim = step.args[1] if len(step.args) > 1 else step.kwargs.get("dim", 0)
        dim = _norm_dim(dim, len(in_shape))
        if t == "aten.split.Tensor":
            piece = ix.size_of(step.args[1])
            starts = [piece * i for i in range(len(step.outputs))]
        elif t == "aten.split_with_sizes.default":
            starts, acc = [], ix.ZERO
            for size in step.args[1]:
                starts.append(acc)
                acc = acc + ix.size_of(size)
        else:
            starts = [ix.sympy.Integer(i) for i in range(len(step.outputs))]
        for out, start in zip(step.outputs, starts):
            if out is not None:
                b.set(out, _slice_node(x, b.shape(out), dim, start, 1, squeeze=t == "aten.unbind.int"))
        return
    name, shape, dtype = b.out(step)
    if t in (
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.alias.default",
        "aten.detach.default",
    ):
        b.set(name, Node("remap", shape, dtype, (x,), remap=lambda lin: lin))
        return
    if t in ("aten.permute.default", "aten.transpose.int", "aten.t.default"):
        n = len(in_shape)
        if t == "aten.permute.default":
            perm = [_norm_dim(d, n) for d in step.args[1]]
        else:
            perm = list(range(n))
            if n >= 2:
                d0, d1 = (
                    (_norm_dim(step.args[1], n), _norm_dim(step.args[2], n))
                    if t == "aten.transpose.int"
                    else (0, 1)
                )
                perm[d0], perm[d1] = perm[d1], perm[d0]

        def permute(lin: Lin, perm=perm, shape=shape, in_shape=in_shape) -> Lin:
            per = ix.unflatten(lin, shape)
            back = [ix.const_lin(ix.ZERO)] * len(perm)
            for k, p in enumerate(perm):
                back[p] = per[k]
            return ix.flatten(back, in_shape)

        b.set(name, Node("remap", shape, dtype, (x,), remap=permute))
        return
    if t == "aten.expand.default":

        def expand(lin: Lin, shape=shape, in_shape=in_shape) -> Lin:
            return ix.broadcast_in(lin, shape, in_shape)

        b.set(name, Node("remap", shape, dtype, (x,), remap=expand))
        return
    if t == "aten.select.int":
        dim = _norm_dim(step.args[1], len(in_shape))
        index = step.args[2]
        idx = ix.size_of(index) if not (isinstance(index, int) and index < 0) else in_shape[dim] + index
        b.set(name, _slice_node(x, shape, dim, idx, 1, squeeze=True))
        return
    if t in ("aten.slice.Tensor", "aten.narrow.default"):
        args = list(step.args) + [None] * 5
        dim = _norm_dim(args[1] if args[1] is not None else step.kwargs.get("dim", 0), len(in_shape))
        start = (
            args[2]
            if t == "aten.narrow.default"
            else (args[2] if args[2] is not None else step.kwargs.get("start"))
        )
        stride = (
            1
            if t == "aten.narrow.default"
            else (args[4] if args[4] is not None else step.kwargs.get("step", 1))
        )
        if start is None:
            start = 0
        if not isinstance(stride, int) or stride < 1:
            raise Unsupported(f"slice step {stride!r}")
        if isinstance(start, int) and start < 0:
            start_size = in_shape[dim] + start
            if not start_size.is_Integer and not isinstance(start_size, ix.sympy.Symbol):
                start_size = ix.sympy.Max(start_size, 0)
            elif start_size.is_Integer and start_size < 0:
                start_size = ix.ZERO
        else:
            start_size = ix.size_of(start)
        b.set(name, _slice_node(x, shape, dim, start_size, stride))
        return
    raise Unsupported(f"view {t}")


def _norm_dim(d: Any, n: int) -> int:
    if not isinstance(d, int) or isinstance(d, bool):
        raise Unsupported(f"dim {d!r}")
    if not -max(n, 1) <= d < max(n, 1):
        raise Unsupported(f"dim {d} of rank {n}")
    return d + n if d < 0 else d


def _slice_node(x: Node, out_shape, dim: int, start: Size, stride: int, squeeze: bool = False) -> Node:
    """Output index → input index for ``x[..., start::stride (dim), ...]`` (``squeeze``: select)."""
    in_shape = x.shape

    def slice_(lin: Lin) -> Lin:
        per = ix.unflatten(lin, out_shape)
        if squeeze:
            per = per[:dim] + [ix.const_lin(ix.ZERO)] + per[dim:]
        d = per[dim]
        moved = ix.make_lin([(c * stride, f) for c, f in d.terms], d.const * stride + start)
        per[dim] = ix.derived(moved, in_shape[dim]) if moved.const != ix.ZERO or stride != 1 else moved
        return ix.flatten(per, in_shape)

    return Node("remap", out_shape, x.dtype, (x,), remap=slice_)


# ---------------------------------------------------------------------------------------------
# Reductions over trailing dims


def _trailing(dims: Any, rank: int) -> int:
    """Number of trailing dims reduced; ``Unsupported`` unless ``dims`` are exactly the last ones."""
    if dims is None or dims == []:
        return rank
    if isinstance(dims, int):
        dims = [dims]
    norm = sorted({_norm_dim(d, rank) for d in dims})
    if norm != list(range(rank - len(norm), rank)):
        raise Unsupported(f"reduction over dims {dims} (only trailing dims are fused)")
    return len(norm)


def _reduce(kind: str, src: Node, k: int, dtype: str, shape=None) -> Node:
    keep = src.shape[: len(src.shape) - k] + (ix.ONE,) * k
    width = ix.numel(src.shape[len(src.shape) - k :])
    return Node("reduce", shape if shape is not None else keep, dtype, (src,), reduce=kind, width=width)


def _op(shape, dtype, fmt, inputs, ty="fp32") -> Node:
    return Node("op", shape, dtype, tuple(inputs), fmt, (ty,) * len(inputs))


def _acc_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32" if dtype in FLOATS else "int64"


def _lower_reduction(b: Builder, step: Step) -> None:
    t = step.target
    x = b.tensor(step.args[0])
    rank = len(x.shape)
    name, shape, dtype = b.out(step)

    if t == "aten.native_layer_norm.default":
        k = len(step.args[1])
        if k > rank or k == 0:
            raise Unsupported("layer norm over no dims")
        width = ix.numel(x.shape[rank - k :])
        w = b.tensor(step.args[2]) if step.args[2] is not None else None
        bias = b.tensor(step.args[3]) if step.args[3] is not None else None
        eps = literal(step.args[4], "fp32")
        n = literal(Sym(ix.size_text(width)) if not width.is_Integer else int(width), "fp32")
        s1 = _reduce("sum", _op(x.shape, "float32", "$0", [x]), k, "float32")
        mean = _op(s1.shape, "float32", f"($0 / {n})", [s1])
        centered = _op(x.shape, "float32", "($0 - $1)", [x, mean])
        s2 = _reduce("sum", _op(x.shape, "float32", "($0 * $0)", [centered]), k, "float32")
        rstd = _op(s1.shape, "float32", f"tl.rsqrt($0 / {n} + {eps})", [s2])
        inputs, fmt = [centered, rstd], "($0 * $1)"
        if w is not None:
            fmt = f"({fmt} * ${len(inputs)})"
            inputs.append(w)
        if bias is not None:
            fmt = f"({fmt} + ${len(inputs)})"
            inputs.append(bias)
        b.set(name, _op(x.shape, dtype, fmt, inputs))
        for i, stat in ((1, mean), (2, rstd)):
            out, out_shape, out_dtype = b.out(step, i)
            if out is not None:
                b.set(out, Node("remap", out_shape, out_dtype, (stat,), remap=lambda lin: lin))
        return

    if t in ("aten._softmax.default", "aten._log_softmax.default"):
        if _norm_dim(step.args[1], rank) != max(rank - 1, 0):
            raise Unsupported("softmax over a dim that is not the last")
        ty = COMPUTE[dtype]
        m = _reduce("max", _op(x.shape, "float32", "$0", [x]), 1, "float32")
        shifted = _op(x.shape, "float32", "($0 - $1)", [x, m])
        e = _op(x.shape, "float32", "tl.exp($0)", [shifted])
        s = _reduce("sum", e, 1, "float32")
        if t == "aten._softmax.default":
            b.set(name, _op(x.shape, dtype, "($0 / $1)", [e, s], ty if ty == "fp64" else "fp32"))
        else:
            b.set(name, _op(x.shape, dtype, "($0 - tl.log($1))", [shifted, s]))
        return

    if t in ("aten.sum.default", "aten.mean.default"):
        dims = None
    else:
        dims = step.args[1] if len(step.args) > 1 else step.kwargs.get("dim")
    k = _trailing(dims, rank)
    width = ix.numel(x.shape[rank - k :])
    n = literal(Sym(ix.size_text(width)) if not width.is_Integer else int(width), "fp32")
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
        if t == "aten.var_mean.correction":
            out, out_shape, out_dtype = b.out(step, 1)
            if out is not None:
                b.set(
                    out,
                    _op(
                        out_shape,
                        out_dtype,
                        "$0",
                        [Node("remap", out_shape, "float32", (mean,), remap=lambda lin: lin)],
                    ),
                )
    elif t == "aten.logsumexp.default":
        if x.dtype not in FLOATS:
            raise Unsupported("logsumexp of integers")
        m = _reduce("max", _op(x.shape, "float32", "$0", [x]), k, "float32")
        safe = _op(m.shape, "float32", 'tl.where(tl.abs($0) == float("inf"), 0.0, $0)', [m])
        s = _reduce("sum", _op(x.shape, "float32", "tl.exp($0 - $1)", [x, safe]), k, "float32", shape)
        safe_out = Node("remap", shape, "float32", (safe,), remap=lambda lin: lin)
        b.set(name, _op(shape, dtype, "(tl.log($0) + $1)", [s, safe_out]))
    else:
        raise Unsupported(t)


# ---------------------------------------------------------------------------------------------

POINTWISE: dict[str, Callable[[Builder, Step], None]] = {}
for _n in _UNARY_FLOAT:
    POINTWISE[_n] = _lower_unary
for _n in _UNARY_ANY:
    POINTWISE[_n] = _lower_unary
for _n in (
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
):
    POINTWISE[_n] = _lower_binary
for _c in _COMPARE:
    POINTWISE[f"aten.{_c}.Tensor"] = _lower_compare
    POINTWISE[f"aten.{_c}.Scalar"] = _lower_compare
for _n in (
    "aten.logical_and.default",
    "aten.logical_or.default",
    "aten.logical_xor.default",
    "aten.logical_not.default",
    "aten.bitwise_not.default",
    "aten.bitwise_and.Tensor",
    "aten.bitwise_or.Tensor",
    "aten.bitwise_xor.Tensor",
):
    POINTWISE[_n] = _lower_logical
POINTWISE.update(
    {
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
        "aten._to_copy.default": _lower_cast,
        "aten.copy.default": _lower_copy,
        "aten._native_batch_norm_legit_no_training.default": _lower_batch_norm,
    }
)


def lower(b: Builder, step: Step) -> None:
    """Add the nodes of ``step`` to ``b``; ``Unsupported`` when it cannot be fused."""
    kind = classify(step, b.buffers)
    try:
        if kind == "view":
            _lower_view(b, step)
        elif kind == "generator":
            _lower_generator(b, step)
        elif kind == "pointwise":
            POINTWISE[step.target](b, step)
        elif kind == "reduction":
            _lower_reduction(b, step)
        else:
            raise Unsupported(f"{step.target} is a library call")
    except (IndexError, KeyError, TypeError, ValueError, ix.IndexError_) as e:
        raise Unsupported(f"{step.target}: {type(e).__name__}: {e}") from None
