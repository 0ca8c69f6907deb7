"""A caller's integer inputs, checked against the tables they index.

Guards bound sizes, not values. A token id at or past the vocabulary, a negative id or a position
past its table was reported as a broken bundle on the CPU (the lookup's ``IndexError`` became a
``BundleError`` telling the user to rebuild) and is a NaN row (a kernel's masked load) or a device
assert that ends the process on a GPU. These are the caller's errors: ``value_bounds`` finds, at
load, every program input whose values a step uses as indices into a weight (an embedding, a
position table: ``embedding``, ``index_select``, ``index.Tensor``, ``gather``), directly or through
views and integer casts, and ``check_values`` holds each call's values to the rows there are
(``GuardError`` naming the input, the range and the bad value), on every device.

The model file's ``Input(..., low=, high=)`` is not the contract: it bounds the example inputs the
build draws (an attention mask declared ``low=1`` still takes zeros for padding).
"""

from __future__ import annotations

import torch

from aot.schema import Program
from aot.values import value_bounds as _value_bounds
from aot.values import value_error


def value_bounds(
    program: Program, weights: dict[str, torch.Tensor]
) -> tuple[tuple[str, int, int, str, str], ...]:
    """(input, lowest, highest, weight, op) for each caller's integer input whose values index
    rows ``lowest..highest`` of a weight (``aot.values.value_bounds``)."""
    return _value_bounds(program, {name: tuple(w.shape) for name, w in weights.items()})


def check_values(bounds: tuple[tuple[str, int, int, str, str], ...], inputs: dict[str, torch.Tensor]) -> None:
    """``GuardError`` unless each bounded input's values lie in its range (one reduction per
    input; on a GPU, one host sync)."""
    for name, low, high, table, op in bounds:
        values = inputs.get(name)
        if not isinstance(values, torch.Tensor) or not values.numel() or values.dtype == torch.bool:
            continue
        least, most = torch.stack(torch.aminmax(values.reshape(-1))).tolist()
        if least < low or most > high:
            raise value_error(name, least if least < low else most, low, high, table, op)
