"""The build's ``--weights``: a safetensors file or a ``torch.save`` checkpoint (read with
``weights_only=True``), compared with the eager module holding the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from aot.errors import SpecError
from aot.tracer import load_model_file, trace
from aot.tracer.model import example_inputs, instantiate
from tests.conftest import model_path


@pytest.fixture(scope="module")
def spec():
    return load_model_file(model_path("small_mlp"))


@pytest.fixture(scope="module")
def trained(spec):
    """A state dict unlike the seeded initialisation, so loading it changes the outputs."""
    torch.manual_seed(123)
    module = spec.module()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return module.state_dict()


def _eager(spec, state):
    module = instantiate(spec)
    module.load_state_dict(state)
    with torch.no_grad():
        return module(example_inputs(spec)["x"])


@pytest.mark.parametrize("form", ["safetensors", "state_dict", "wrapped_ddp"])
def test_weights_from_safetensors_or_a_checkpoint(tmp_path, spec, trained, form):
    path = tmp_path / ("w.safetensors" if form == "safetensors" else "w.pt")
    if form == "safetensors":
        save_file(trained, path)
    elif form == "state_dict":
        torch.save(trained, path)
    else:  # a training script's checkpoint: DDP-prefixed names under "state_dict", plus extras
        torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in trained.items()}}, path)
    traced = trace(spec, weights=str(path))
    want = _eager(spec, trained)
    assert not torch.allclose(want, _eager(spec, instantiate(spec).state_dict()))  # the weights matter
    torch.testing.assert_close(traced.reference_outputs[0], want, rtol=0, atol=0)


def test_checkpoints_weights_only_refuses_are_spec_errors_that_say_how_to_convert(tmp_path, spec):
    pickled = tmp_path / "model.pt"
    torch.save(spec.module(), pickled)  # the whole module: needs its class, not weights only
    with pytest.raises(SpecError, match=r"torch.load\(weights_only=True\) refuses .*save_file"):
        trace(spec, weights=str(pickled))
    empty = tmp_path / "empty.pt"
    torch.save({"epoch": 3}, empty)
    with pytest.raises(SpecError, match="holds no state dict of tensors"):
        trace(spec, weights=str(empty))


def test_a_relative_weights_path_is_read_from_the_working_directory(tmp_path, spec, trained, monkeypatch):
    """``--weights w.safetensors`` names a file where the command runs, not beside the model file
    (a model file's own ``weights=`` stays relative to that file)."""
    save_file(trained, tmp_path / "w.safetensors")
    monkeypatch.chdir(tmp_path)
    traced = trace(spec, weights="w.safetensors")
    torch.testing.assert_close(traced.reference_outputs[0], _eager(spec, trained), rtol=0, atol=0)
