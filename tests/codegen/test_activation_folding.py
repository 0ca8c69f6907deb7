"""Folding addmm → [view] → gelu(tanh)/relu into one _addmm_activation library call."""

import pytest
import torch

from aot.codegen.activation_folding import fold_activations
from aot.loader.program import AtenProgram
from aot.schema import Buf
from aot.tracer import example_inputs, load_model_file
from tests.conftest import model_path


@pytest.mark.slow
def test_gpt_folds_every_mlp_gelu_and_matches(built):
    spec = load_model_file(model_path("gpt"))
    traced = built.traced("gpt")  # shared with the other tests of this session
    folded, n = fold_activations(traced.program)
    assert n == 12  # one tanh-GELU per layer
    targets = [s.target for s in folded.steps]
    assert targets.count("aten._addmm_activation.default") == 12
    assert "aten.gelu.default" not in targets
    sizes = {"batch": 2, "seq": 9}
    inputs = example_inputs(spec, sizes, seed=5)
    want = AtenProgram(traced.program, dict(traced.weights), torch.device("cpu"))(inputs, sizes)[0]
    got = AtenProgram(folded, dict(traced.weights), torch.device("cpu"))(inputs, sizes)[0]
    # fp16: the epilogue applies GELU to the fp16 matmul result instead of in fp32
    assert (got.float() - want.float()).abs().max().item() <= 2e-2


def test_exact_gelu_and_shared_outputs_are_left_alone():
    from aot.schema import NamedTensor, Program, Step, TensorSpec

    spec = TensorSpec("float32", ("4", "4"))
    steps = (
        Step("aten", "aten.addmm.default", (Buf("b"), Buf("x"), Buf("w")), {}, ("mm",)),
        Step("aten", "aten.gelu.default", (Buf("mm"),), {}, ("g",)),  # exact GELU: not the epilogue's
        Step("aten", "aten.addmm.default", (Buf("b"), Buf("x"), Buf("w")), {}, ("mm2",)),
        Step("aten", "aten.relu.default", (Buf("mm2"),), {}, ("r",)),
        Step("aten", "aten.add.Tensor", (Buf("r"), Buf("mm2")), {}, ("out",)),  # mm2 used twice
    )
    program = Program(
        inputs=(NamedTensor("x", spec),),
        weights=(NamedTensor("w", spec), NamedTensor("b", TensorSpec("float32", ("4",)))),
        buffers={n: spec for n in ("mm", "g", "mm2", "r", "out")},
        steps=steps,
        outputs=("g", "out"),
        symbols=(),
    )
    assert fold_activations(program) == (program, 0)
