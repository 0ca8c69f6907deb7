"""A caller's integer inputs checked against the tables they index (``aot/loader/values.py``):
token ids at or past the vocabulary, negative ids and positions past their table are the caller's
error (``GuardError`` naming the input, the range and the value), not a broken bundle."""

from __future__ import annotations

import pytest
import torch

from aot.errors import GuardError
from aot.loader import load


@pytest.fixture(scope="module")
def runner(built):
    return load(built("tiny_lm", ("sm_90",)))  # vocabulary 97, 32 learned positions; the lm tests' build


def _prefill(runner, ids, positions):
    runner.reset()
    return runner.entry("prefill")(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([positions]),
        cache_position=torch.tensor([0, 1, 2]),
        attention_mask=torch.tensor([[1, 1, 1] + [0] * 29]),
    )


def test_the_bounds_are_the_tables_the_program_indexes(runner):
    bounds = {b[0]: b[1:] for e in runner._entries for b in e.value_bounds}
    assert bounds == {
        "input_ids": (0, 96, "tok.weight", "aten.embedding.default"),
        "position_ids": (0, 31, "pos.weight", "aten.embedding.default"),
    }


@pytest.mark.parametrize(
    "ids, positions, message",
    [
        (
            [1, 97, 3],
            [0, 1, 2],
            "input 'input_ids' holds 97, outside 0..96: it indexes the 97 rows of 'tok.weight'",
        ),
        (
            [1, -1, 3],
            [0, 1, 2],
            "input 'input_ids' holds -1, outside 0..96: it indexes the 97 rows of 'tok.weight'",
        ),
        (
            [1, 2, 3],
            [0, 1, 32],
            "input 'position_ids' holds 32, outside 0..31: it indexes the 32 rows of 'pos.weight'",
        ),
    ],
)
def test_values_out_of_range_are_the_callers_error(runner, ids, positions, message):
    """These were ``BundleError``s ("rebuild the bundle") from the lookup's IndexError."""
    with pytest.raises(GuardError) as e:
        _prefill(runner, ids, positions)
    assert (
        str(e.value)
        == message + " (aten.embedding.default); pass values in " + message.split("outside ")[1].split(":")[0]
    )
    _prefill(runner, [1, 96, 3], [0, 1, 2])  # the largest id and the runner keeps serving


def test_generated_positions_count_up_and_never_repeat_a_slot():
    # a causal LM's example: 8 tokens at slots 12..19, every earlier slot valid
    from aot.loader.values import integers_like

    gen = torch.Generator().manual_seed(0)
    cache_position = torch.arange(12, 20)
    assert integers_like(cache_position, [4], gen).tolist() == [12, 13, 14, 15]
    # longer than the example: moved down to end where it ended, never below 0
    assert integers_like(cache_position, [10], gen).tolist() == list(range(10, 20))
    assert integers_like(cache_position, [64], gen).tolist() == list(range(64))
    positions = integers_like(cache_position.expand(2, 8), [3, 5], gen)
    assert positions.tolist() == [list(range(12, 17))] * 3


def test_generated_masks_keep_the_pattern_and_token_ids_stay_in_range():
    from aot.loader.values import integers_like

    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(1, 32, dtype=torch.int64)
    mask[:, :20] = 1
    got = integers_like(mask, [2, 24], gen)
    assert got.tolist() == [[1] * 20 + [0] * 4] * 2
    assert got.is_contiguous()  # row-major, as a caller's: the runtime refuses strided inputs
    tokens = torch.tensor([[5, 900, 17]])
    drawn = integers_like(tokens, [4, 50], gen)
    assert drawn.dtype == torch.int64 and drawn.min() >= 5 and drawn.max() <= 900
    assert len(set(drawn.flatten().tolist())) > 50  # drawn, not the example repeated
