"""On a GPU: the library-free kernels over symbolic maps of 2026-12-05 (CPU-checked there, in
Triton's interpreter): 2-D convolutions and pools over a declared range of image sizes, bilinear
resizes (one read in place through a permute and a view), pads by a symbolic amount of either
sign, ``sign``; and those of 2026-12-06: index reads by two or more index tensors inside
kernels, with floats of the sizes as kernel values (bicubic resizes as ``torch.export``
decomposes them, a caller's ``x[:, :, i, j]``), nearest resizes and antialiased ones. Each unit model of
``tests/codegen`` built ``--library-free`` for this GPU: the torch loader on CUDA equals eager
(float32, 1e-4 of the output's scale; convolutions and resizes sum in another order) at an odd
size, the smallest and the largest, and the runtime without torch equals the torch loader bit
for bit (the same cubins). A bundle built on the build box (``bench/gpu_test_bundles.py``:
``$AOTPACK_GPU_BUNDLES/symbolic-maps-CASE.tpk``) is taken where present, as users ship them; the
reference is then the CPU path of the same bundle (ATen's ops, equal to eager in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.codegen.test_convolution import IMAGES as CONVOLUTIONS
from tests.codegen.test_gather_index import MODEL as GATHERS
from tests.codegen.test_gather_index import index_inputs
from tests.codegen.test_padding import OVER_TIME as PADS
from tests.codegen.test_pooling import IMAGES as POOLS
from tests.codegen.test_resize import ANTIALIASED, NEAREST
from tests.codegen.test_resize import MODEL as RESIZES
from tests.codegen.test_resize import SIZES as RESIZE_SIZES
from tests.codegen.test_sign import MODEL as SIGNS

pytestmark = pytest.mark.gpu

IMAGE_SIZES = [
    {"batch": 2, "height": 13, "width": 27},
    {"batch": 1, "height": 8, "width": 8},
    {"batch": 3, "height": 40, "width": 40},
]
CASES = {
    "convolutions": (CONVOLUTIONS, IMAGE_SIZES),
    "pools": (POOLS, IMAGE_SIZES),
    "resizes": (RESIZES, RESIZE_SIZES),
    "nearest": (NEAREST, RESIZE_SIZES),
    "antialiased": (ANTIALIASED, RESIZE_SIZES),
    "pads": (PADS, [{"batch": 2, "samples": 13}, {"batch": 1, "samples": 5}, {"batch": 3, "samples": 40}]),
    "signs": (SIGNS, [{"batch": 2, "seq": 7}, {"batch": 1, "seq": 2}, {"batch": 3, "seq": 12}]),
    "gathers": (
        GATHERS,
        [
            {"batch": 2, "h": 5, "w": 11, "k": 3, "l": 5},
            {"batch": 1, "h": 2, "w": 2, "k": 1, "l": 1},
            {"batch": 3, "h": 12, "w": 7, "k": 4, "l": 2},
        ],
    ),
}
MAKE_INPUTS = {"gathers": index_inputs}  # indices inside their dims (eager raises outside)


BUNDLES = Path(os.environ.get("AOTPACK_GPU_BUNDLES", "bundles"))


def bundle_name(case: str) -> str:
    return f"symbolic-maps-{case}.tpk"


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_over_symbolic_maps_equal_eager_on_the_gpu(name, tmp_path):
    import torch

    import aot.runtime
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import instantiate, load_model_file, trace

    text, sizes = CASES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = load_model_file(path)
    bundle, module = BUNDLES / bundle_name(name), None
    if not bundle.exists():  # built here, against eager with the traced weights
        major, minor = torch.cuda.get_device_capability()
        compiled = generate(trace(spec), (f"sm_{major}{minor}",), gemm_candidates=True, library_free=True)
        bundle = tmp_path / f"{name}.tpk"
        pack(compiled, bundle)
        module = instantiate(spec)
    cpu = load(bundle, device="cpu") if module is None else None
    rt, ref = aot.runtime.load(bundle), load(bundle, device="cuda")
    for size in sizes:
        if name in MAKE_INPUTS:
            made = MAKE_INPUTS[name](size, torch.Generator().manual_seed(0))
            inputs = {i.name: v.cuda() for i, v in zip(spec.inputs, made, strict=True)}
        else:
            inputs = {k: v.cuda() for k, v in ref.inputs_at(size).items()}
        with torch.no_grad():
            args = [v.cpu() for v in inputs.values()]
            want = module(*args) if module is not None else cpu(*args)
        got = ref(**inputs)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape, (name, size)
            scale = max(1.0, float(w.float().abs().nan_to_num().max()))
            torch.testing.assert_close(g.cpu().float(), w.float(), rtol=0, atol=1e-4 * scale, equal_nan=True)
        mine = rt(**inputs)
        mine = mine if isinstance(mine, (tuple, list)) else (mine,)
        for m, g in zip(mine, got, strict=True):
            assert torch.equal(torch.from_dlpack(m), g), (name, size)
