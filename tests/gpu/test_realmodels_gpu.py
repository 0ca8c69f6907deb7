"""Real models on a GPU: the zoo built on this machine and compared with eager on CUDA, and
bundles built on a CPU box (torch 2.13) checked against their own CPU path here.

    AOTPACK_REALMODEL_BUNDLES=out/rm-cpu pytest -m gpu tests/gpu/test_realmodels_gpu.py

Never run in CI (no GPU there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

# float32 on CUDA with TF32 off (with it, cuDNN convolutions round to a 10-bit mantissa and a deep
# network with trained-looking statistics moves by percents, in eager too): fused kernels and
# cuBLAS/cuDNN still reassociate sums, so allow 1e-3 of the output scale.
RTOL = 1e-3
CPU_BUNDLES = Path(os.environ.get("AOTPACK_REALMODEL_BUNDLES", "out/rm-cpu"))


def _zoo():
    from tests.realmodels.zoo import ZOO

    return ZOO


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield torch.device("cuda")
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("name", list(_zoo()))
def test_built_here_matches_eager_on_cuda_with_and_without_graphs(cuda, tmp_path, name):
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.pytree import leaves
    from aot.tracer import call_model, example_inputs, instantiate, trace

    case = _zoo()[name]
    spec = case.spec()
    path = tmp_path / f"{name}.tpk"
    pack(generate(trace(spec), ("sm_80", "sm_90")), path)
    module = instantiate(spec).to(cuda)
    for capture in ("lazy", "none"):
        runner = load(path, device="cuda", capture=capture)
        for sizes in case.sizes:
            inputs = {
                k: v.to(cuda) for k, v in example_inputs(spec, sizes, seed=7 + sum(sizes.values())).items()
            }
            with torch.no_grad():
                want = leaves(call_model(spec, module, inputs))
            got = leaves(runner(**inputs))
            for a, b in zip(got, want):
                scale = max(1.0, b.float().abs().max().item())
                err = (a.float() - b.float()).abs().max().item()
                assert err <= RTOL * scale, f"{name} {capture} at {sizes}: {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", sorted(p.stem for p in CPU_BUNDLES.glob("*.tpk")) or ["none"])
def test_bundles_built_on_the_cpu_box_verify_here(cuda, name):
    from aot.verify.device import passed, verify

    path = CPU_BUNDLES / f"{name}.tpk"
    if not path.is_file():
        pytest.skip(f"no bundles in {CPU_BUNDLES}")
    reports = verify(str(path), "cuda")
    assert reports
    bad = [r for r in reports if not passed(r, "float32")]
    assert not bad, bad
