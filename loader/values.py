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


def integers_like(example: torch.Tensor, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    """Integer (or bool) values at ``shape`` shaped like ``example``'s, for generated calls
    (``Runner.inputs_at``, ``aotpack verify``):

    - a mask (only 0 and 1) keeps the example's pattern, cropped or tiled: random 0/1 would mask
      whole rows, an ill-defined softmax no two devices agree on;
    - a run that counts up by one along the last dim (positions, the cache slots a call writes)
      goes on counting from the row's first value, moved down so that it ends where the example
      ended where it can (never below 0): random slots would repeat, and two writes to one slot
      leave whichever the device ran last;
    - anything else (token ids) is drawn uniformly from the range the example spans."""
    example = example.cpu()
    if not example.numel():
        return torch.zeros(shape, dtype=example.dtype)
    if example.dtype == torch.bool or set(example.unique().tolist()) <= {0, 1}:
        return fit(example, shape)
    if example.dim() and example.shape[-1] > 1 and bool((example.diff(dim=-1) == 1).all()):
        count = shape[-1]
        first = fit(example[..., :1], [*shape[:-1], 1])
        last = fit(example[..., -1:], [*shape[:-1], 1])
        start = torch.minimum(first, last + 1 - count).clamp(min=0)
        return (start + torch.arange(count, dtype=example.dtype)).to(example.dtype)
    low, high = int(example.min()), int(example.max()) + 1
    return torch.randint(low, max(high, low + 1), shape, generator=generator).to(example.dtype)


def fit(example: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``example`` cropped or repeated along each dim to ``shape``."""
    t = example
    for d, n in enumerate(shape):
        if t.shape[d] == 0:
            return torch.zeros(shape, dtype=example.dtype)
        reps = [1] * t.dim()
        reps[d] = -(-n // t.shape[d])
        t = t.repeat(reps).narrow(d, 0, n)
    return t.contiguous()  # row-major, as a caller's array is: narrow leaves the repeat's strides
