"""Symbolic size expressions as text, and a small safe evaluator for them.

Bundles store sizes such as ``batch*seq*768`` and guards such as ``seq % 2 == 0`` as text. The
loader never calls ``eval``: ``compile_expr`` parses the text with ``ast`` once, accepts only
integer arithmetic (``+ - * // %``), comparisons, ``and``/``or``/``not``, ``max``/``min`` and
symbol names, and turns it into a tree of closures that evaluates in microseconds.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aot.errors import BundleError

MAX_TEXT = 4096
MAX_DEPTH = 64
MAX_VALUE = 1 << 62
CACHE_SIZE = 4096  # compiled expressions kept (a GPT-2 program has a few hundred distinct ones)

_BINOPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS: dict[type, Callable[[int, int], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_FUNCS: dict[str, Callable[..., int]] = {"max": max, "min": min}

Env = Mapping[str, int]
Fn = Callable[[Env], int]


def _checked(value: int) -> int:
    if not -MAX_VALUE <= value <= MAX_VALUE:
        raise BundleError(f"symbolic expression overflowed: |{value}| > 2**62")
    return value


def _compile(node: ast.AST, symbols: set[str], depth: int) -> Fn:
    if depth > MAX_DEPTH:
        raise BundleError(f"symbolic expression nests deeper than {MAX_DEPTH}")
    d = depth + 1
    if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        value = _checked(int(node.value))
        return lambda env: value
    if isinstance(node, ast.Name):
        name = node.id
        symbols.add(name)

        def lookup(env: Env) -> int:
            try:
                return env[name]
            except KeyError:
                raise BundleError(f"symbolic expression uses unknown symbol {name!r}") from None

        return lookup
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        op, lhs, rhs = _BINOPS[type(node.op)], _compile(node.left, symbols, d), _compile(node.right, symbols, d)
        if op in (operator.floordiv, operator.mod) and isinstance(node.right, ast.Constant) and not node.right.value:
            raise BundleError("symbolic expression divides by the constant 0")

        def binop(env: Env) -> int:
            b = rhs(env)
            if b == 0 and op in (operator.floordiv, operator.mod):
                raise BundleError("symbolic expression divides by zero")
            return _checked(op(lhs(env), b))

        return binop
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _compile(node.operand, symbols, d)
        return lambda env: -inner(env)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _compile(node.operand, symbols, d)
        return lambda env: int(not inner(env))
    if isinstance(node, ast.BoolOp):
        parts = [_compile(v, symbols, d) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda env: int(all(p(env) for p in parts))
        return lambda env: int(any(p(env) for p in parts))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
        cmp = _CMPOPS[type(node.ops[0])]
        lhs, rhs = _compile(node.left, symbols, d), _compile(node.comparators[0], symbols, d)
        return lambda env: int(cmp(lhs(env), rhs(env)))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCS
        and not node.keywords
        and 1 <= len(node.args) <= 8
    ):
        fn = _FUNCS[node.func.id]
        args = [_compile(a, symbols, d) for a in node.args]
        return lambda env: fn(a(env) for a in args) if len(args) > 1 else args[0](env)
    raise BundleError(f"symbolic expression contains a forbidden construct: {type(node).__name__}")


@dataclass(frozen=True)
class Expr:
    """A compiled expression: call it with a mapping of symbol values."""

    text: str
    symbols: frozenset[str]
    fn: Fn

    def __call__(self, env: Env) -> int:
        return self.fn(env)

    @property
    def is_constant(self) -> bool:
        return not self.symbols


def compile_expr(text: str) -> Expr:
    """Parse ``text`` into an ``Expr``; raises ``BundleError`` for anything outside the grammar.

    Compiled expressions are immutable and cached: a program repeats the same few sizes."""
    if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
        raise BundleError(f"symbolic expression must be a non-empty string of at most {MAX_TEXT} chars")
    return _compile_text(text)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compile_text(text: str) -> Expr:
    if "\x00" in text:
        raise BundleError("symbolic expression contains a NUL byte")
    if not text.isascii():  # symbol names are ASCII identifiers; keep the parser's input small
        raise BundleError(f"symbolic expression {ascii(text[:40])} is not ASCII")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise BundleError(f"symbolic expression {text[:80]!r} does not parse: {e}") from None
    symbols: set[str] = set()
    try:
        fn = _compile(tree.body, symbols, 0)
    except RecursionError:
        raise BundleError(f"symbolic expression nests deeper than {MAX_DEPTH}") from None
    if not symbols:
        fn({})  # a constant that overflows or divides by zero fails here, at load, not on a call
    return Expr(text, frozenset(symbols), fn)


def evaluate(text: str, env: Env) -> int:
    return compile_expr(text)(env)
