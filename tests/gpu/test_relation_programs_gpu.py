"""Programs traced for a relation's excluded sizes, on a GPU: the native-grid model
(``tests/data/native_grid.py``: a program for ``height == width`` and one for ``height != width``
on its 4x4 patch grid beside the general one) and DINOv2 at its native 28x28 grid give eager's
outputs with CUDA graphs captured lazily, all captured at load (bucket combinations that break a
program's relation are not captured), and without graphs.

    pytest -m gpu tests/gpu/test_relation_programs_gpu.py

Tolerance (float32): TF32 is off, so the GPU's results agree with the CPU eager ones to 1e-4 times
the largest output magnitude.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SIZES = {
    "native_grid": [(1, 16, 16), (2, 19, 19), (2, 16, 19), (1, 8, 8), (2, 23, 9), (2, 24, 24)],
    "dinov2": [(1, 28, 28), (2, 14, 56), (2, 30, 33), (3, 56, 56), (1, 23, 41)],
}


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _spec(name: str):
    if name == "native_grid":
        from aot.tracer import load_model_file
        from tests.conftest import model_path

        return load_model_file(model_path("native_grid"))
    from tests.realmodels.conftest import require
    from tests.realmodels.test_image_sizes import CASES

    require("transformers")
    return CASES["dinov2"][0]()


@pytest.fixture(scope="module", params=list(SIZES))
def built(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import instantiate, trace

    spec = _spec(request.param)
    path = tmp_path_factory.mktemp("relations") / f"{request.param}.tpk"
    pack(generate(trace(spec), (_arch(),)), path)
    return request.param, spec, instantiate(spec), path


@pytest.mark.parametrize("capture", ["lazy", "all", "none"])
def test_relation_programs_match_eager_on_the_gpu(built, capture):
    from aot.loader import load
    from aot.pytree import leaves
    from aot.tracer import call_model, example_inputs

    name, spec, module, path = built
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runner = load(path, device="cuda", capture=capture)
    assert len(runner.programs) == 3, runner.programs
    for batch, height, width in SIZES[name]:
        sizes = {"batch": batch, "height": height, "width": width}
        inputs = example_inputs(spec, sizes, seed=batch + height + width)
        with torch.no_grad():
            want = leaves(call_model(spec, module, inputs))
        for _ in range(2):  # the second call replays the graph the first captured
            got = leaves(runner(**{k: v.cuda() for k, v in inputs.items()}))
            for g, w in zip(got, want):
                assert g.shape == w.shape, sizes
                scale = max(1.0, w.abs().max().item())
                assert (g.cpu() - w).abs().max().item() <= 1e-4 * scale, f"{name} at {sizes} ({capture})"
