"""Sympy expressions (as torch's shape environment produces them) → size-expression text in the grammar of
``aot.symexpr``, and a numpy evaluator of that text used to simplify guards over their bounded ranges.
Build-time only (sympy, numpy): the loader never imports it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import numpy as np
import sympy
from torch.utils._sympy import functions as tfn

from aot.errors import TraceError
from aot.symexpr import fold, parse


def to_text(expr: sympy.Basic, names: Mapping[sympy.Symbol, str]) -> str:
    """Render ``expr`` in the grammar of ``aot.symexpr`` with symbols renamed by ``names``."""
    return _render(sympy.sympify(expr), names)


_FLOATS = (tfn.IntTrueDiv, tfn.FloatTrueDiv, tfn.ToFloat, sympy.Float)


def to_float_text(expr: sympy.Basic, names: Mapping[sympy.Symbol, str]) -> str:
    """A float computed from sizes (torch's ``SymFloat``: ``IntTrueDiv(4, h//7)``, an interpolation's
    scale) in the float grammar of ``aot.symexpr`` (``floats=True``): true division ``/``, float
    constants, and integer size arithmetic below them. ``TraceError`` for other float functions
    (``sqrt``, powers of floats)."""
    e = sympy.sympify(expr)
    if not any(isinstance(a, _FLOATS) for a in sympy.preorder_traversal(e)):
        return _render(e, names)
    if isinstance(e, sympy.Float):
        value = float(e)
        if not abs(value) < float(1 << 62):
            raise TraceError(f"the float {value!r} computed from sizes is not finite")
        return repr(value)
    if isinstance(e, (tfn.IntTrueDiv, tfn.FloatTrueDiv)):
        return f"({to_float_text(e.args[0], names)})/({to_float_text(e.args[1], names)})"
    if isinstance(e, tfn.ToFloat):  # an integer made float: adding 0.0 does it exactly (|v| < 2**53)
        return f"({to_float_text(e.args[0], names)} + 0.0)"
    if isinstance(e, sympy.Add):
        return " + ".join(f"({to_float_text(a, names)})" for a in sorted(e.args, key=sympy.default_sort_key))
    if isinstance(e, sympy.Mul):
        return "*".join(f"({to_float_text(a, names)})" for a in sorted(e.args, key=sympy.default_sort_key))
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) == -1:
        return f"1.0/({to_float_text(e.base, names)})"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and 0 < int(e.exp) <= 8:
        return "*".join([f"({to_float_text(e.base, names)})"] * int(e.exp))
    raise TraceError(
        f"cannot express the float {e} ({type(e).__name__}) computed from sizes in a bundle: aotpack stores "
        f"true division, + - * of sizes and float constants"
    )


def _scaled_size(e: sympy.Basic) -> tuple[tuple[int, int], sympy.Basic] | None:
    """((p, q), x) where ``e`` rounds a positive float constant c = p / q times a size x to an
    integer (``TruncToInt(1.5 * ToFloat(h))``: ``F.interpolate``'s output size by a scale
    factor), else None. Every float is p / 2**k; with p below 2**20 the float product is exact for
    every size below 2**33, so its floor is ``(p * x) // q`` (truncation is floor: sizes are
    non-negative)."""
    if not isinstance(e, (tfn.TruncToInt, tfn.FloorToInt, tfn.CeilToInt)) or not isinstance(
        e.args[0], sympy.Mul
    ):
        return None
    factors = sympy.Mul.make_args(e.args[0])
    floats = [f for f in factors if isinstance(f, sympy.Float)]
    sizes = [f for f in factors if isinstance(f, tfn.ToFloat)]
    if len(floats) != 1 or len(sizes) != 1 or len(factors) != 2:
        return None
    c = float(floats[0])
    if not 0 < c < float(1 << 20):
        return None
    p, q = c.as_integer_ratio()
    return ((p, q), sizes[0].args[0]) if p < (1 << 20) else None


def _paren(expr: sympy.Basic, names: Mapping[sympy.Symbol, str]) -> str:
    text = _render(expr, names)
    if isinstance(expr, (sympy.Symbol, sympy.Integer)) and not text.startswith("-"):
        return text
    return f"({text})"


def _render(e: sympy.Basic, names: Mapping[sympy.Symbol, str]) -> str:
    if e is sympy.true:
        return "1"
    if e is sympy.false:
        return "0"
    if isinstance(e, sympy.Symbol):
        if e not in names:
            raise TraceError(
                f"size symbol {e} does not come from an input dim: a size depends on tensor values "
                f"(torch.nonzero, masked_select, .item()); a bundle's shapes follow its inputs' shapes alone"
            )
        return names[e]
    if isinstance(e, sympy.Integer):
        return str(int(e))
    if isinstance(e, sympy.Add):
        terms = sorted(e.args, key=sympy.default_sort_key)
        out = _render(terms[0], names)
        for t in terms[1:]:
            text = _render(t, names)
            out += f" - {text[1:]}" if text.startswith("-") else f" + {text}"
        return out
    if isinstance(e, sympy.Mul):
        coeff, rest = e.as_coeff_Mul()
        factors = sorted(sympy.Mul.make_args(rest), key=sympy.default_sort_key)
        if coeff.is_Rational and not coeff.is_Integer:
            raise TraceError(f"size expression {e} has a fraction; aotpack handles integer sizes only")
        parts = [_paren(f, names) for f in factors]
        if coeff == -1:
            return "-" + "*".join(parts)
        if coeff != 1:
            parts.insert(0, str(int(coeff)))
        return "*".join(parts)
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and 0 < int(e.exp) <= 8:
        return "*".join([_paren(e.base, names)] * int(e.exp))
    if isinstance(e, (tfn.FloorDiv, tfn.CleanDiv)):
        return f"{_paren(e.args[0], names)}//{_paren(e.args[1], names)}"
    if isinstance(e, tfn.CeilDiv):
        a, b = _paren(e.args[0], names), _paren(e.args[1], names)
        return f"-((-{a})//{b})"
    if isinstance(e, (tfn.Mod, tfn.PythonMod, sympy.Mod)):
        return f"{_paren(e.args[0], names)} % {_paren(e.args[1], names)}"
    if isinstance(e, tfn.ModularIndexing):
        a, b, c = (_paren(x, names) for x in e.args)
        return f"({a}//{b}) % {c}"
    if isinstance(e, tfn.Identity):
        return _render(e.args[0], names)
    if isinstance(e, tfn.PowByNatural) and e.args[1].is_Integer and 0 < int(e.args[1]) <= 8:
        return "*".join([_paren(e.args[0], names)] * int(e.args[1]))
    if isinstance(e, tfn.Where):  # c is 0/1 in the evaluators: c*a + (1 - c)*b
        c, a, b = (_render(x, names) for x in e.args)
        return f"({c})*({a}) + (1 - ({c}))*({b})"
    if isinstance(e, (tfn.TruncToInt, tfn.FloorToInt, tfn.CeilToInt)) and isinstance(
        e.args[0], tfn.IntTrueDiv
    ):
        a, b = (_paren(x, names) for x in e.args[0].args)
        if isinstance(e, tfn.CeilToInt):
            return f"-((-{a})//{b})"
        return f"{a}//{b}"  # sizes are non-negative: truncation is floor division
    scaled = _scaled_size(e)
    if scaled is not None:  # floor(1.5 * h): an interpolation's size by a fractional scale factor
        (p, q), x = scaled
        a = f"{p}*{_paren(x, names)}" if p != 1 else _paren(x, names)
        return f"-((-{a})//{q})" if isinstance(e, tfn.CeilToInt) else f"({a})//{q}"
    if isinstance(e, (sympy.Max, sympy.Min, tfn.Max, tfn.Min)):
        fn = "max" if isinstance(e, (sympy.Max, tfn.Max)) else "min"
        args = sorted(e.args, key=sympy.default_sort_key)
        return f"{fn}({', '.join(_render(a, names) for a in args)})"
    rel = {sympy.Eq: "==", sympy.Ne: "!=", sympy.Lt: "<", sympy.Le: "<=", sympy.Gt: ">", sympy.Ge: ">="}
    for cls, op in rel.items():
        if isinstance(e, cls):
            return f"{_render(e.lhs, names)} {op} {_render(e.rhs, names)}"
    if isinstance(e, sympy.And):
        return " and ".join(_paren_bool(a, names) for a in sorted(e.args, key=sympy.default_sort_key))
    if isinstance(e, sympy.Or):
        return " or ".join(_paren_bool(a, names) for a in sorted(e.args, key=sympy.default_sort_key))
    if isinstance(e, sympy.Not):
        return f"not ({_render(e.args[0], names)})"
    shown = str(e)
    for sym, name in names.items():
        shown = shown.replace(str(sym), name)
    raise TraceError(
        f"cannot express the size expression {shown} ({type(e).__name__}) in a bundle: aotpack stores integer "
        f"+ - * // %, comparisons and min/max of the declared Dims; make that size static in the model file or "
        f"compute it without {type(e).__name__}"
    )


def _paren_bool(e: sympy.Basic, names: Mapping[sympy.Symbol, str]) -> str:
    return f"({_render(e, names)})"


def _where_nonzero(b):
    return np.where(b == 0, 1, b)


class _Arrays:
    """The numpy algebra of ``aot.symexpr.fold``: every symbol an int64 array (broadcasting)."""

    BINARY: dict[str, Callable] = {
        "+": np.add,
        "-": np.subtract,
        "*": np.multiply,
        "//": lambda a, b: np.floor_divide(a, _where_nonzero(b)),
        "%": lambda a, b: np.mod(a, _where_nonzero(b)),
    }
    COMPARE: dict[str, Callable] = {
        "==": np.equal,
        "!=": np.not_equal,
        "<": np.less,
        "<=": np.less_equal,
        ">": np.greater,
        ">=": np.greater_equal,
    }

    def __init__(self, env: Mapping[str, np.ndarray]) -> None:
        self.env = env

    def const(self, value: int):
        return np.int64(value)

    def name(self, name: str):
        return self.env[name]

    def binary(self, op: str, a, b):
        return self.BINARY[op](a, b)

    def compare(self, op: str, a, b):
        return self.COMPARE[op](a, b)

    def neg(self, a):
        return np.negative(a)

    def not_(self, a):
        return np.logical_not(a)

    def boolean(self, op: str, parts: list):
        return functools.reduce(np.logical_and if op == "and" else np.logical_or, parts)

    def call(self, fn: str, args: list):
        return functools.reduce(np.maximum if fn == "max" else np.minimum, args)


def evaluate_vectorized(text: str, env: Mapping[str, np.ndarray]) -> np.ndarray:
    """Evaluate expression text over numpy int64 arrays (broadcasting), for guard simplification."""
    return np.asarray(fold(parse(text), _Arrays(env)))
