"""Padding an unaligned matmul weight (GPT-2's 50257-row vocabulary) leaves results unchanged."""

import pytest
import torch

from aot.codegen.weight_padding import PAD_TO, pad_matmul_weights
from aot.loader.program import AtenProgram
from aot.tracer import example_inputs, load_model_file
from tests.conftest import model_path


@pytest.mark.slow
def test_gpt_vocabulary_is_padded_and_logits_unchanged(built):
    spec = load_model_file(model_path("gpt"))
    traced = built.traced("gpt")  # shared with the other tests of this session
    program, weights, n = pad_matmul_weights(traced.program, dict(traced.weights))
    assert n == 1
    assert weights["wte.weight"].shape == (50304, 768) and 50304 % PAD_TO == 0
    assert weights["wte.weight"][50257:].abs().max() == 0  # zero rows: never gathered, sliced away
    sizes = {"batch": 2, "seq": 9}
    inputs = example_inputs(spec, sizes, seed=3)
    want = AtenProgram(traced.program, dict(traced.weights), torch.device("cpu"))(inputs, sizes)[0]
    got = AtenProgram(program, weights, torch.device("cpu"))(inputs, sizes)[0]
    assert got.shape == want.shape == (2, 9, 50257)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_aligned_or_otherwise_used_weights_are_left_alone(built):
    traced = built.traced("mlp")  # 1024 and 4096 wide: already aligned
    assert pad_matmul_weights(traced.program, dict(traced.weights))[2] == 0
