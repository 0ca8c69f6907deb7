"""A size computed by a fractional scale factor (``F.interpolate(scale_factor=1.5)`` on a
symbolic map: ``TruncToInt(1.5 * ToFloat(h))``) is stored as integer arithmetic, ``(3*h)//2``,
which the loaders evaluate exactly as the float product's floor is, for every size a Dim
declares."""

from __future__ import annotations

import math

import pytest


@pytest.mark.parametrize("c", [1.5, 0.5, 0.75, 2.5, 1.25, 0.3125, 3.0])
def test_a_size_times_a_float_rounds_as_python_does(c):
    import sympy
    import torch.utils._sympy.functions as tfn

    from aot.symexpr import compile_expr
    from aot.sympy_text import to_text

    h = sympy.Symbol("s0", integer=True, positive=True)
    for fn, py in ((tfn.TruncToInt, math.trunc), (tfn.FloorToInt, math.floor), (tfn.CeilToInt, math.ceil)):
        text = to_text(fn(sympy.Float(c) * tfn.ToFloat(h)), {h: "h"})
        expr = compile_expr(text)
        for v in [*range(0, 4097), 2**31 - 1, 2**32 + 7]:
            assert expr({"h": v}) == py(c * float(v)), (c, fn.__name__, v, text)


@pytest.mark.parametrize("c", [0.1, 1 / 3, 1e-7])
def test_a_float_of_many_bits_is_refused_naming_the_expression(c):
    """Its product with a size rounds (0.1 is p / 2**56 with p of 53 bits): no integer
    expression matches it at every size, so the build says which size it cannot store."""
    import sympy
    import torch.utils._sympy.functions as tfn

    from aot.errors import TraceError
    from aot.sympy_text import to_text

    h = sympy.Symbol("s0", integer=True, positive=True)
    with pytest.raises(TraceError, match="TruncToInt"):
        to_text(tfn.TruncToInt(sympy.Float(c) * tfn.ToFloat(h)), {h: "h"})
