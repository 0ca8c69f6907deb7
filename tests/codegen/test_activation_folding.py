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


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
def test_the_folded_call_computes_the_unfolded_steps_on_the_cpu(activation):
    """The folded ``_addmm_activation`` takes the tanh GELU on the CPU too (ATen's CPU kernel
    applies the exact one, CUDA's the tanh one: ``aot.aten.OFF_CUDA``), so a bundle's CPU path
    computes what the model does: float32, within 1e-6 of the unfolded steps, where the exact
    GELU is 4e-4 away at these pre-activations."""
    from aot.schema import NamedTensor, Program, Step, TensorSpec

    x_spec, w_spec = TensorSpec("float32", ("3", "32")), TensorSpec("float32", ("32", "64"))
    out_spec = TensorSpec("float32", ("3", "64"))
    act = (
        Step("aten", "aten.gelu.default", (Buf("mm"),), {"approximate": "tanh"}, ("out",))
        if activation == "gelu_tanh"
        else Step("aten", "aten.relu.default", (Buf("mm"),), {}, ("out",))
    )
    program = Program(
        inputs=(NamedTensor("x", x_spec),),
        weights=(NamedTensor("w", w_spec), NamedTensor("b", TensorSpec("float32", ("64",)))),
        buffers={"mm": out_spec, "out": out_spec},
        steps=(Step("aten", "aten.addmm.default", (Buf("b"), Buf("x"), Buf("w")), {}, ("mm",)), act),
        outputs=("out",),
        symbols=(),
    )
    folded, n = fold_activations(program)
    assert n == 1 and [s.target for s in folded.steps] == ["aten._addmm_activation.default"]
    gen = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(32, 64, generator=gen) * 0.5, "b": torch.randn(64, generator=gen)}
    inputs = {"x": torch.randn(3, 32, generator=gen)}
    want = AtenProgram(program, dict(weights), torch.device("cpu"))(inputs, {})[0]
    got = AtenProgram(folded, dict(weights), torch.device("cpu"))(inputs, {})[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if activation == "gelu_tanh":  # the comparison can tell the two GELUs apart
        mm = torch.addmm(weights["b"], inputs["x"], weights["w"])
        assert (torch.nn.functional.gelu(mm) - want).abs().max() > 1e-4
