"""Small readers of a step's typed arguments (``aot.schema``: ``Buf``, ``Sym``, ``SpecialFloat``…)
for the lowerings: a positional-or-keyword argument, a dim, a scalar as Triton source.

Each raises ``Unsupported`` for an argument the fuser cannot express, so the step stays an ATen
call.
"""

from __future__ import annotations

import math
from typing import Any

from aot.codegen import index as ix
from aot.codegen.valuegraph import Builder, Node, Unsupported
from aot.schema import Buf, SpecialFloat, Step, Sym, SymFloat
from aot.symexpr import compile_expr


def is_tensor(arg: Any) -> bool:
    return isinstance(arg, Buf)


def arg(step: Step, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` of ``step`` when given positionally, else keyword ``name``, else ``default``."""
    return step.args[i] if len(step.args) > i else step.kwargs.get(name, default)


def norm_dim(d: Any, n: int) -> int:
    """A dim argument of a rank-``n`` tensor, made non-negative."""
    if not isinstance(d, int) or isinstance(d, bool):
        raise Unsupported(f"dim {d!r}")
    if not -max(n, 1) <= d < max(n, 1):
        raise Unsupported(f"dim {d} of rank {n}")
    return d + n if d < 0 else d


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
    if isinstance(value, SymFloat):  # a scale computed from sizes, per call (ATen: float64, then ty)
        expr = compile_expr(value.text, floats=True)
        if expr.is_constant:
            return literal(expr({}), ty)
        if ty not in ("fp32", "fp64"):
            raise Unsupported(f"float {value.text} computed from sizes in {ty} arithmetic")
        text = ix.triton_float(value.text)
        return f"({text}).to(tl.float32)" if ty == "fp32" else text
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


def operand(b: Builder, value: Any, ty: str | None) -> tuple[Node | None, str]:
    """(node, "") for a tensor argument, (None, literal) for a scalar."""
    if is_tensor(value):
        return b.tensor(value), ""
    return None, literal(value, ty)
