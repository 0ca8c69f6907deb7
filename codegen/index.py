"""Index arithmetic of fused kernels: sizes as sympy, flat indices as sums of digit fragments.

Inside a kernel every value is addressed by its *flat* row-major index. A reshape keeps the flat
index; a permute, expand, slice or broadcast splits it into per-dim indices, changes them and
joins them again. Indices are kept as ``const + sum(coef * ((base // div) % mod))`` so that a
split followed by a join cancels (``(r // T) * T + r % T`` is ``r`` again): kernels do no needless
division, and a reduction kernel can prove that a row value is read at its own row.

Sizes are sympy expressions over positive integer symbols named after the model's dims;
``parse_size`` reads the program's size text and ``size_text`` writes it back (for grids and
arguments), ``triton_size`` renders it for kernel source.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy
from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

from aot.errors import BundleError
from aot.layout import inverse
from aot.schema import Sym
from aot.symexpr import fold, parse
from aot.sympy_text import to_text

Size = sympy.Expr
ZERO = sympy.Integer(0)
ONE = sympy.Integer(1)


class InexpressibleIndex(Exception):
    """An index the algebra cannot express; the caller keeps the ops unfused."""


# ---------------------------------------------------------------------------------------------
# Sizes


@functools.cache
def symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, positive=True)


class _Sizes:
    """The sympy algebra of ``aot.symexpr.fold`` for sizes (no comparisons or booleans: a size
    is never one)."""

    BINARY = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
        "//": FloorDiv,
        "%": PythonMod,
    }

    def const(self, value: int) -> Size:
        return sympy.Integer(value)

    def name(self, name: str) -> Size:
        return symbol(name)

    def binary(self, op: str, a: Size, b: Size) -> Size:
        return self.BINARY[op](a, b)

    def neg(self, a: Size) -> Size:
        return -a

    def call(self, fn: str, args: list[Size]) -> Size:
        return (sympy.Max if fn == "max" else sympy.Min)(*args)

    def _not_a_size(self, *args) -> Size:
        raise InexpressibleIndex("a size expression holds a comparison or boolean")

    compare = not_ = boolean = _not_a_size


@functools.lru_cache(maxsize=4096)
def parse_size(text: str) -> Size:
    """Size text of the program (``"seq*batch"``, ``"768"``, ``"seq//2"``) → sympy."""
    try:
        return canon(fold(parse(text), _Sizes()))
    except BundleError as e:
        raise InexpressibleIndex(f"size expression {text!r} is outside the size grammar: {e}") from None


def size_of(value) -> Size:
    """A step argument that is a size: an int or a ``Sym``."""
    if isinstance(value, bool):
        raise InexpressibleIndex(f"expected a size, got {value!r}")
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, Sym):
        return parse_size(value.text)
    raise InexpressibleIndex(f"expected a size, got {value!r}")


def canon(e) -> Size:
    """The canonical (expanded) form of a size, so equal sizes compare equal."""
    return sympy.expand(sympy.sympify(e))


def same(a: Size, b: Size) -> bool:
    return canon(a - b) == ZERO


def numel(shape: tuple[Size, ...]) -> Size:
    return canon(sympy.Mul(*shape)) if shape else ONE


def size_text(expr: Size) -> str:
    """sympy → the expression text of ``aot.symexpr`` (grids, arguments)."""
    return to_text(expr, {s: s.name for s in expr.free_symbols})


def param_name(sym: sympy.Symbol) -> str:
    return f"s_{sym.name}"


def triton_size(e: Size) -> str:
    """sympy size → Triton source over the kernel's size parameters (``s_batch``)."""
    if isinstance(e, sympy.Integer):
        return str(int(e))
    if isinstance(e, sympy.Symbol):
        return param_name(e)
    if isinstance(e, sympy.Add):
        terms = sorted(e.args, key=sympy.default_sort_key)
        out = triton_size(terms[0])
        for t in terms[1:]:
            text = triton_size(t)
            out += f" - {text[1:]}" if text.startswith("-") else f" + {text}"
        return f"({out})"
    if isinstance(e, sympy.Mul):
        coeff, rest = e.as_coeff_Mul()
        if not coeff.is_Integer:
            raise InexpressibleIndex(f"size {e} is not an integer expression")
        parts = [triton_size(f) for f in sorted(sympy.Mul.make_args(rest), key=sympy.default_sort_key)]
        if coeff == -1:
            return "-" + "*".join(parts)
        if coeff != 1:
            parts.insert(0, str(int(coeff)))
        return "*".join(parts)
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and 0 < int(e.exp) <= 8:
        return "*".join([triton_size(e.base)] * int(e.exp))
    if isinstance(e, FloorDiv):
        return f"({triton_size(e.args[0])} // {triton_size(e.args[1])})"
    if isinstance(e, (PythonMod, Mod, sympy.Mod)):
        return f"({triton_size(e.args[0])} % {triton_size(e.args[1])})"
    if isinstance(e, (sympy.Max, sympy.Min)):
        fn = "tl.maximum" if isinstance(e, sympy.Max) else "tl.minimum"
        args = sorted(e.args, key=sympy.default_sort_key)
        out = triton_size(args[0])
        for a in args[1:]:
            out = f"{fn}({out}, {triton_size(a)})"
        return out
    raise InexpressibleIndex(f"cannot render size {e} ({type(e).__name__}) in a kernel")


class _FloatSource:
    """The algebra of ``aot.symexpr.fold`` for a float computed from sizes (``aot.schema.SymFloat``,
    an interpolation's scale ``4 / (h // 7)``) as kernel source: integer parts stay sympy sizes
    (rendered by ``triton_size``), a part holding a float constant or a true division becomes
    float64 source, so the kernel computes the value as the loaders do in Python (float64, each
    operation rounded once)."""

    def const(self, value: int | float) -> Size | str:
        return sympy.Integer(value) if isinstance(value, int) else repr(float(value))

    def name(self, name: str) -> Size:
        return symbol(name)

    @staticmethod
    def _f64(v: Size | str) -> str:
        if isinstance(v, str):
            return v
        return repr(float(int(v))) if v.is_Integer else f"({triton_size(v)}).to(tl.float64)"

    def binary(self, op: str, a: Size | str, b: Size | str) -> Size | str:
        if op != "/" and not isinstance(a, str) and not isinstance(b, str):
            return _Sizes.BINARY[op](a, b)
        if op in ("//", "%"):
            raise InexpressibleIndex(f"{op} of a float computed from sizes")
        return f"({self._f64(a)} {op} {self._f64(b)})"

    def neg(self, a: Size | str) -> Size | str:
        return f"(-{a})" if isinstance(a, str) else -a

    def call(self, fn: str, args: list[Size | str]) -> Size:
        if any(isinstance(a, str) for a in args):
            raise InexpressibleIndex(f"{fn} of a float computed from sizes")
        return _Sizes().call(fn, args)

    def _not_a_float(self, *args) -> Size:
        raise InexpressibleIndex("a float computed from sizes holds a comparison or boolean")

    compare = not_ = boolean = _not_a_float


def triton_float(text: str) -> str:
    """A float computed from sizes (``aot.schema.SymFloat``'s text) → float64 Triton source over the
    kernel's size parameters; ``InexpressibleIndex`` outside the grammar."""
    try:
        value = fold(parse(text), _FloatSource(), floats=True)
    except BundleError as e:
        raise InexpressibleIndex(f"float expression {text!r} is outside the float grammar: {e}") from None
    return _FloatSource._f64(value)


def float32_literal(value: float) -> str:
    """A float32 constant as Triton source: the value rounded to float32 first."""
    return f"{float(np.float32(value))!r}"


def pixel_scale(n_in: Size, n_out: Size, factor: float | None, in_text: str, out_text: str) -> str:
    """Triton source of an image dim's source-index scale as ATen computes it without aligned
    corners (``area_pixel_compute_scale``): one over a given factor (in float64, then rounded to
    float32), else the input's size over the output's in float32, correctly rounded; a constant
    where both sizes are static, else over ``in_text`` and ``out_text`` (the symbolic sizes as the
    kernel names them)."""
    if factor is not None:
        return float32_literal(1.0 / factor)
    if n_in.is_Integer and n_out.is_Integer:
        return float32_literal(np.float32(int(n_in)) / np.float32(max(int(n_out), 1)))

    def f32(n: Size, text: str) -> str:
        if n.is_Integer:
            return float32_literal(int(n))
        return f"{text if text.isidentifier() else f'({text})'}.to(tl.float32)"

    return f"tl.math.div_rn({f32(n_in, in_text)}, {f32(n_out, out_text)})"


@functools.lru_cache(maxsize=65536)
def divides(b: Size, a: Size) -> bool:
    """Whether ``b`` divides ``a`` for every value of the symbols (as polynomials)."""
    if b == ONE or a == b:
        return True
    if a == ZERO:
        return True
    # every term of the expanded quotient must be an integer multiple of a monomial: ``cancel``
    # spreads a numeric denominator over an expanded sum (``(x + 1)*(y + 1) / 16`` comes back as
    # ``x*y/16 + x/16 + y/16 + 1/16``), whose ``fraction`` has denominator 1
    for term in sympy.Add.make_args(canon(sympy.cancel(a / b))):
        coeff, rest = term.as_coeff_Mul()
        if not coeff.is_Integer or any(
            isinstance(f, sympy.Pow) and f.exp.is_negative for f in sympy.Mul.make_args(rest)
        ):
            return False
    return True


@functools.lru_cache(maxsize=65536)
def quotient(a: Size, b: Size) -> Size:
    return canon(sympy.cancel(a / b)) if b != ONE else a


# ---------------------------------------------------------------------------------------------
# Flat indices


@dataclass(frozen=True)
class Frag:
    """``(base // div) % mod`` with ``0 <= base < extent``; ``mod is None``: no modulo needed."""

    base: str | Lin  # an atom of the kernel ("x", "r", "c") or a derived index
    extent: Size
    div: Size = ONE
    mod: Size | None = None

    @property
    def span(self) -> Size:
        """Number of values the fragment takes."""
        if self.mod is not None:
            return self.mod
        return (
            quotient(self.extent, self.div)
            if divides(self.div, self.extent)
            else FloorDiv(self.extent + self.div - 1, self.div)
        )


@dataclass(frozen=True)
class Lin:
    """``const + sum(coef * frag)``; build through ``make_lin`` so equal indices compare equal."""

    terms: tuple[tuple[Size, Frag], ...] = ()
    const: Size = ZERO

    @property
    def atoms(self) -> frozenset[str]:
        out: set[str] = set()
        for _, f in self.terms:
            out |= f.base.atoms if isinstance(f.base, Lin) else {f.base}
        return frozenset(out)


def _sort_key(term: tuple[Size, Frag]):
    coef, f = term
    base = (0, f.base) if isinstance(f.base, str) else (1, repr(f.base))
    return base, sympy.default_sort_key(f.div), sympy.default_sort_key(coef)


def _simplify_frag(f: Frag) -> Frag | None:
    """None when the fragment is always 0."""
    if f.mod is not None and f.mod == ONE:
        return None
    if divides(f.extent, f.div):  # base < extent <= div
        return None
    if f.mod is not None and divides(f.div, f.extent) and divides(quotient(f.extent, f.div), f.mod):
        return Frag(f.base, f.extent, f.div, None)
    return f


def make_lin(terms, const: Size = ZERO) -> Lin:
    """Normalize: drop zero fragments, add equal fragments, merge adjacent digits of one base."""
    acc: dict[Frag, Size] = {}
    for coef, f in terms:
        coef = canon(coef)
        f = _simplify_frag(
            Frag(f.base, canon(f.extent), canon(f.div), None if f.mod is None else canon(f.mod))
        )
        if f is None or coef == ZERO:
            continue
        acc[f] = acc.get(f, ZERO) + coef
    changed = True
    while changed:
        changed = False
        items = list(acc.items())
        for f_lo, c_lo in items:
            for f_hi, c_hi in items:
                if f_hi is f_lo or f_lo.base != f_hi.base or f_lo.mod is None:
                    continue
                # c_hi * ((b // (d*m)) % M) + c_lo * ((b // d) % m) == c_lo * ((b // d) % (m*M))
                if f_hi.div == canon(f_lo.div * f_lo.mod) and c_hi == canon(c_lo * f_lo.mod):
                    merged = Frag(
                        f_lo.base,
                        f_lo.extent,
                        f_lo.div,
                        None if f_hi.mod is None else canon(f_lo.mod * f_hi.mod),
                    )
                    del acc[f_lo], acc[f_hi]
                    merged = _simplify_frag(merged)
                    if merged is not None:
                        acc[merged] = canon(acc.get(merged, ZERO) + c_lo)
                    changed = True
                    break
            if changed:
                break
    return Lin(
        tuple(sorted(((canon(c), f) for f, c in acc.items() if canon(c) != ZERO), key=_sort_key)),
        canon(const),
    )


def atom(name: str, extent: Size) -> Lin:
    return make_lin([(ONE, Frag(name, extent))])


def const_lin(value: Size) -> Lin:
    return Lin((), sympy.sympify(value))


def derived(lin: Lin, extent: Size) -> Lin:
    """An opaque index with values in ``[0, extent)`` (a sliced or selected dim), kept whole so
    that it stays one digit of the flat index."""
    if lin == Lin() or (lin.const == ZERO and len(lin.terms) == 1 and lin.terms[0][0] == ONE):
        return lin
    return make_lin([(ONE, Frag(lin, extent))])


def strides(shape: tuple[Size, ...]) -> list[Size]:
    out, acc = [], ONE
    for s in reversed(shape):
        out.append(acc)
        acc = canon(acc * s)
    return out[::-1]


def flatten(per_dim: list[Lin], shape: tuple[Size, ...]) -> Lin:
    """Per-dim indices into ``shape`` → the flat row-major index."""
    terms, const = [], ZERO
    for lin, st in zip(per_dim, strides(shape)):
        terms += [(c * st, f) for c, f in lin.terms]
        const += lin.const * st
    return make_lin(terms, const)


def _split(term: tuple[Size, Frag], boundary: Size) -> list[tuple[Size, Frag]] | None:
    """Split a digit term at ``boundary`` when the boundary falls strictly inside its range."""
    coef, f = term
    if not divides(coef, boundary) or boundary == coef:
        return None
    q = quotient(boundary, coef)
    span = f.span
    if not divides(q, span) or q == span:
        return None
    lo = Frag(f.base, f.extent, f.div, q)
    hi = Frag(f.base, f.extent, f.div * q, None if f.mod is None else quotient(f.mod, q))
    return [(coef, lo), (boundary, hi)]


@functools.lru_cache(maxsize=65536)
def nonneg(e: Size) -> bool:
    """Provably ``e >= 0`` for all sizes: every coefficient of the expanded polynomial is >= 0."""
    e = canon(e)
    if e.is_Number:
        return bool(e >= 0)
    # dims are >= 1: with d = 1 + d', d' >= 0, nonnegative coefficients prove it
    shifted = canon(e.subs({s: s + 1 for s in e.free_symbols if isinstance(s, sympy.Symbol)}))
    if shifted.is_Number:
        return bool(shifted >= 0)
    return all(c >= 0 for c in shifted.as_coefficients_dict().values())


def unflatten(lin: Lin, shape: tuple[Size, ...]) -> list[Lin]:
    """Flat index into ``shape`` → per-dim indices (``(flat // stride) % size``).

    Digits are split where a dim boundary falls inside them and then given to the dim whose
    stride divides their coefficient; when the digits of the lower dims provably never carry into
    a higher one, each dim's index is its digits. Otherwise the flat index is divided out.
    """
    if len(shape) == 0:
        return []
    if len(shape) == 1:
        return [lin]
    st = strides(shape)
    total = numel(shape)
    if lin.const == ZERO:
        terms = list(lin.terms)
        for b in st[:-1]:
            out = []
            for t in terms:
                parts = _split(t, b)
                out += parts if parts else [t]
            terms = out
        dims: list[list] = [[] for _ in shape]
        ok = True
        for coef, f in terms:
            k = next((k for k in range(len(shape)) if divides(st[k], coef)), None)
            if k is None:
                ok = False
                break
            dims[k].append((coef, f))
        top = ZERO  # largest value of the digits of dims >= k
        for k in range(len(shape) - 1, -1, -1):
            top = top + sum((c * (f.span - 1) for c, f in dims[k]), ZERO)
            if not nonneg(st[k] * shape[k] - 1 - top):
                ok = False
                break
        if ok:
            return [make_lin([(quotient(c, st[k]), f) for c, f in dims[k]]) for k in range(len(shape))]
    if (
        lin.const == ZERO
        and len(lin.terms) == 1
        and lin.terms[0][0] == ONE
        and lin.terms[0][1].div == ONE
        and lin.terms[0][1].mod is None
    ):
        base, extent = lin.terms[0][1].base, lin.terms[0][1].extent
    else:
        base, extent = lin, total
    return [
        make_lin([(ONE, Frag(base, extent, st[k], None if k == 0 else shape[k]))]) for k in range(len(shape))
    ]


def permuted(shape: tuple[Size, ...], order: tuple[int, ...]) -> tuple[Size, ...]:
    """The dims of ``shape`` as they lie in memory in ``order`` (``aot.layout``)."""
    return tuple(shape[d] for d in order)


def through_permute(
    lin: Lin, in_shape: tuple[Size, ...], perm: Sequence[int], out_shape: tuple[Size, ...] | None = None
) -> Lin:
    """The flat index into ``x.permute(perm)`` (of ``out_shape``; ``x`` of ``in_shape``) → the
    flat index into ``x``."""
    per = unflatten(lin, permuted(in_shape, perm) if out_shape is None else out_shape)
    back: list[Lin] = [const_lin(ZERO)] * len(perm)
    for k, d in enumerate(perm):
        back[d] = per[k]
    return flatten(back, in_shape)


def to_memory(lin: Lin, shape: tuple[Size, ...], order: tuple[int, ...]) -> Lin:
    """The flat index of a tensor of ``shape`` → its offset when laid out in memory in ``order``
    (the tensor is ``stored.permute(inverse(order))``)."""
    return through_permute(lin, permuted(shape, order), inverse(order), shape)


def from_memory(lin: Lin, shape: tuple[Size, ...], order: tuple[int, ...]) -> Lin:
    """The inverse of ``to_memory``: an offset in memory → the flat (row-major) index (the
    memory is ``tensor.permute(order)``)."""
    return through_permute(lin, shape, order)


def same_shape(a: tuple[Size, ...], b: tuple[Size, ...]) -> bool:
    return len(a) == len(b) and all(x == y or same(x, y) for x, y in zip(a, b))


def broadcast_in(lin: Lin, out_shape: tuple[Size, ...], in_shape: tuple[Size, ...]) -> Lin:
    """Index of the output of a broadcasting op → index of one of its inputs."""
    if same_shape(out_shape, in_shape):
        return lin
    if len(in_shape) == 0:
        return const_lin(ZERO)
    if numel(in_shape) == ONE:
        return const_lin(ZERO)
    per = unflatten(lin, out_shape)[len(out_shape) - len(in_shape) :]
    tail = out_shape[len(out_shape) - len(in_shape) :]
    per = [const_lin(ZERO) if s == ONE and t != ONE else p for p, s, t in zip(per, in_shape, tail)]
    return flatten(per, in_shape)


# ---------------------------------------------------------------------------------------------
# Kernel source of an index


def _enclosed(text: str) -> bool:
    """Whether ``text`` is one parenthesised group: ``(a + b)`` yes, ``(a) * (b)`` no."""
    if not text.startswith("("):
        return False
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i == len(text) - 1
    return False


def _group(text: str) -> str:
    """``text`` as one operand: parenthesised once, however it was built."""
    return text if _enclosed(text) else f"({text})"


def _atomic(e: Size) -> str:
    text = triton_size(e)
    return text if isinstance(e, (sympy.Integer, sympy.Symbol)) and not text.startswith("-") else _group(text)


def triton_index(lin: Lin) -> str:
    """Triton source of an index over the kernel's atoms and size parameters."""
    parts = []
    for coef, f in lin.terms:
        base = f.base if isinstance(f.base, str) else _group(triton_index(f.base))
        text = base
        if f.div != ONE:
            text = f"({text} // {_atomic(f.div)})"
        if f.mod is not None:
            text = f"({text} % {_atomic(f.mod)})"
        if coef != ONE:
            text = f"{text} * {_atomic(coef)}"
        parts.append(text)
    if lin.const != ZERO or not parts:
        parts.append(triton_size(lin.const))
    return " + ".join(parts)
