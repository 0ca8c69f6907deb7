"""Symbolic size expressions as text, and a small safe evaluator for them.

Bundles store sizes such as ``batch*seq*768`` and guards such as ``seq % 2 == 0`` as text. The
loader never calls ``eval``: ``compile_expr`` parses the text with ``ast`` once, accepts only
integer arithmetic (``+ - * // %``), comparisons, ``and``/``or``/``not``, ``max``/``min`` and
symbol names, and turns it into a tree of closures that evaluates in microseconds. A float scalar
computed from sizes (an interpolation's scale ``4/(height//7)``) is the same grammar plus true
division ``/`` and finite float constants, compiled with ``floats=True``: a size never admits them.

The grammar is defined once, by ``fold``; other interpretations of the same text (numpy arrays
for guard simplification, sympy for kernel index arithmetic) are ``Algebra`` instances beside
the code that needs them, so the build and the loader can never read a size differently.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from aot.errors import BundleError

MAX_TEXT = 4096
MAX_DEPTH = 64
# Syntax-tree nodes of one expression: each costs a closure call per evaluation (1024: about 0.1 ms).
# The longest a build writes has about 20 (a launch grid's ceiling division); the grammar's random
# expressions in the tests reach 600; text of MAX_TEXT chars could hold 2000.
MAX_NODES = 1024
MAX_VALUE = 1 << 62
CACHE_SIZE = 4096  # compiled expressions kept (a GPT-2 program has a few hundred distinct ones)

T = TypeVar("T")

# The grammar's operators by name; every interpretation of the text (integers here, numpy arrays
# in ``aot.sympy_text``, sympy in ``aot.codegen.index``) maps these names to its own operations.
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}
_FLOAT_BINARY = {**_BINARY, ast.Div: "/"}
_COMPARE = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_FUNCTIONS = ("max", "min")
MAX_ARGS = 8


class Algebra(Protocol[T]):
    """One interpretation of the size-expression grammar: how to build a value of type ``T``
    from each construct. ``fold`` walks the text and calls these; it alone decides what the
    grammar admits."""

    def const(self, value: int) -> T: ...  # a float too, in a float expression
    def name(self, name: str) -> T: ...
    def binary(self, op: str, a: T, b: T) -> T: ...  # + - * // % (and / in a float expression)
    def compare(self, op: str, a: T, b: T) -> T: ...  # == != < <= > >=
    def neg(self, a: T) -> T: ...
    def not_(self, a: T) -> T: ...
    def boolean(self, op: str, parts: list[T]) -> T: ...  # and / or
    def call(self, fn: str, args: list[T]) -> T: ...  # max / min


def parse(text: str) -> ast.expr:
    """``text`` → its syntax tree, or ``BundleError`` (bounded size, ASCII, no NUL)."""
    if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
        raise BundleError(f"symbolic expression must be a non-empty string of at most {MAX_TEXT} chars")
    if "\x00" in text:
        raise BundleError("symbolic expression contains a NUL byte")
    if not text.isascii():  # symbol names are ASCII identifiers; keep the parser's input small
        raise BundleError(f"symbolic expression {ascii(text[:40])} is not ASCII")
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise BundleError(f"symbolic expression {text[:80]!r} does not parse: {e}") from None


def fold(node: ast.expr, algebra: Algebra[T], depth: int = 0, floats: bool = False) -> T:
    """Interpret a parsed expression in ``algebra``; ``BundleError`` for anything outside the grammar:
    integer constants, names, ``+ - * // %``, unary ``-``, ``not``, ``and``/``or``, one comparison,
    ``max``/``min`` of 1 to ``MAX_ARGS`` arguments, nested at most ``MAX_DEPTH`` deep; with
    ``floats``, also finite float constants and true division ``/``."""
    if depth > MAX_DEPTH:
        raise BundleError(f"symbolic expression nests deeper than {MAX_DEPTH}")
    d = depth + 1

    def sub(n: ast.expr) -> T:
        return fold(n, algebra, d, floats)

    if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        return algebra.const(int(node.value))
    if floats and isinstance(node, ast.Constant) and type(node.value) is float:
        if not abs(node.value) <= MAX_VALUE:  # also refuses nan
            raise BundleError(f"float expression holds the constant {node.value!r}; expected a finite float")
        return algebra.const(node.value)
    if isinstance(node, ast.Name):
        return algebra.name(node.id)
    binary = _FLOAT_BINARY if floats else _BINARY
    if isinstance(node, ast.BinOp) and type(node.op) in binary:
        return algebra.binary(binary[type(node.op)], sub(node.left), sub(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return algebra.neg(sub(node.operand))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return algebra.not_(sub(node.operand))
    if isinstance(node, ast.BoolOp):
        return algebra.boolean("and" if isinstance(node.op, ast.And) else "or", [sub(v) for v in node.values])
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        return algebra.compare(_COMPARE[type(node.ops[0])], sub(node.left), sub(node.comparators[0]))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
        and 1 <= len(node.args) <= MAX_ARGS
    ):
        return algebra.call(node.func.id, [sub(a) for a in node.args])
    raise BundleError(f"symbolic expression contains a forbidden construct: {type(node).__name__}")


# ---------------------------------------------------------------------------------------------
# Integers, as the loader evaluates them: compiled once into closures over a symbol environment.

Env = Mapping[str, int]
Fn = Callable[[Env], int]

_INT_BINARY: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
    "/": operator.truediv,  # float expressions only
}
_INT_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _checked(value: int) -> int:
    if not -MAX_VALUE <= value <= MAX_VALUE:  # a float's nan fails here too
        raise BundleError(f"symbolic expression overflowed: |{value}| > 2**62")
    return value


class _Closures:
    """The integer algebra: each construct becomes a closure ``env -> int``."""

    def __init__(self) -> None:
        self.symbols: set[str] = set()

    def const(self, value: int) -> Fn:
        value = _checked(value)

        def constant(env: Env) -> int:
            return value

        constant.value = value  # type: ignore[attr-defined]  # lets ``binary`` reject ``x // 0`` at load
        return constant

    def name(self, name: str) -> Fn:
        self.symbols.add(name)

        def lookup(env: Env) -> int:
            try:
                return env[name]
            except KeyError:
                raise BundleError(f"symbolic expression uses unknown symbol {name!r}") from None

        return lookup

    def binary(self, op: str, lhs: Fn, rhs: Fn) -> Fn:
        fn, divides = _INT_BINARY[op], op in ("//", "%", "/")
        if divides and getattr(rhs, "value", None) == 0:
            raise BundleError("symbolic expression divides by the constant 0")

        def binop(env: Env) -> int:
            b = rhs(env)
            if divides and b == 0:
                raise BundleError("symbolic expression divides by zero")
            return _checked(fn(lhs(env), b))

        return binop

    def compare(self, op: str, lhs: Fn, rhs: Fn) -> Fn:
        cmp = _INT_COMPARE[op]
        return lambda env: int(cmp(lhs(env), rhs(env)))

    def neg(self, inner: Fn) -> Fn:
        return lambda env: -inner(env)

    def not_(self, inner: Fn) -> Fn:
        return lambda env: int(not inner(env))

    def boolean(self, op: str, parts: list[Fn]) -> Fn:
        if op == "and":
            return lambda env: int(all(p(env) for p in parts))
        return lambda env: int(any(p(env) for p in parts))

    def call(self, fn: str, args: list[Fn]) -> Fn:
        pick = max if fn == "max" else min
        if len(args) == 1:
            return args[0]
        return lambda env: pick(a(env) for a in args)


@dataclass(frozen=True)
class Expr:
    """A compiled expression: call it with a mapping of symbol values."""

    text: str
    symbols: frozenset[str]
    fn: Fn
    nodes: int = 1  # syntax-tree nodes: what one evaluation costs

    def __call__(self, env: Env) -> int:
        return self.fn(env)

    @property
    def is_constant(self) -> bool:
        return not self.symbols


class FloatText(str):
    """Expression text of the float grammar (``aot.schema.SymFloat``), where a walk over a
    program's expressions yields it beside size texts: ``compile_expr(t, floats=isinstance(t, FloatText))``."""


def compile_expr(text: str, floats: bool = False) -> Expr:
    """Parse ``text`` into an ``Expr``; raises ``BundleError`` for anything outside the grammar
    (with ``floats``: the float grammar, for ``aot.schema.SymFloat``).

    Compiled expressions are immutable and cached: a program repeats the same few sizes."""
    if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
        raise BundleError(f"symbolic expression must be a non-empty string of at most {MAX_TEXT} chars")
    return _compile_text(text, bool(floats))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compile_text(text: str, floats: bool = False) -> Expr:
    algebra = _Closures()
    try:
        tree = parse(text)
        nodes = sum(1 for _ in ast.walk(tree))
        if nodes > MAX_NODES:
            raise BundleError(
                f"symbolic expression {text[:60]!r}… has {nodes} syntax nodes (limit {MAX_NODES})"
            )
        fn = fold(tree, algebra, floats=floats)
    except RecursionError:
        raise BundleError(f"symbolic expression nests deeper than {MAX_DEPTH}") from None
    if not algebra.symbols:
        fn({})  # a constant that overflows or divides by zero fails here, at load, not on a call
    return Expr(text, frozenset(algebra.symbols), fn, nodes)


def evaluate(text: str, env: Env) -> int:
    return compile_expr(text)(env)


def static_size(dim: str) -> int | None:
    """An input dim's text as a static size (ASCII digits, at most 19 of them: ``isdigit`` alone
    admits ``"²"`` and numbers too long for ``int``), else None: a symbol, or not a size at all."""
    if dim.isascii() and dim.isdigit() and len(dim) <= 19:
        return int(dim)
    return None
