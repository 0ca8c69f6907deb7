"""On a GPU: library-free bundles of real models built on the build box
(``bench/gpu_test_bundles.py --image-sizes NAME``: ``$AOTPACK_GPU_BUNDLES/lf-NAME.tpk``; DINOv2,
DETR, YOLOS, Swin at declared image sizes, ...), as users ship them to a serving box with older
torch. At each symbol's smallest and largest admitted size and one between: the torch loader on
CUDA equals the bundle's CPU path (ATen's ops, equal to eager in CI; float32, 1e-4 of the
output's scale: the kernels sum in another order), and the runtime without torch equals the torch
loader bit for bit (the same cubins). Skipped where no such bundle was carried."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
BUNDLES = Path(os.environ.get("AOTPACK_GPU_BUNDLES", "bundles"))
PREBUILT = sorted(p.name for p in BUNDLES.glob("lf-*.tpk")) if BUNDLES.is_dir() else []


def admitted(g, pick: str) -> int:
    """The smallest, largest or a middle size symbol guard ``g`` admits."""
    values = [v for v in range(g.min, g.max + 1) if v % g.modulus in g.residues and v not in g.excluded]
    return {"min": values[0], "max": values[-1], "mid": values[len(values) // 2]}[pick]


def leaves(out) -> list:
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in leaves(o)]
    if isinstance(out, dict):
        return [x for o in out.values() for x in leaves(o)]
    return [out]


@pytest.mark.parametrize(
    "file", PREBUILT or [pytest.param("none", marks=pytest.mark.skip("no lf-*.tpk carried"))]
)
def test_prebuilt_library_free_bundles_equal_their_cpu_path_on_the_gpu(file):
    import torch

    import aot.runtime
    from aot.loader import load

    bundle = BUNDLES / file
    cpu, ref, rt = load(bundle, device="cpu"), load(bundle, device="cuda"), aot.runtime.load(bundle)
    symbols = ref.guards.symbols
    for pick in ("min", "mid", "max"):
        sizes = {name: admitted(g, pick) for name, g in symbols.items()}
        inputs = ref.inputs_at(sizes, seed=3)
        want = leaves(cpu(**{k: v.cpu() for k, v in inputs.items()}))
        got = leaves(ref(**inputs))
        assert len(got) == len(want), (file, sizes)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape, (file, sizes)
            if w.dtype.is_floating_point:
                scale = max(1.0, float(w.float().abs().nan_to_num().max()))
                torch.testing.assert_close(
                    g.cpu().float(), w.float(), rtol=0, atol=1e-4 * scale, equal_nan=True
                )
            else:
                assert torch.equal(g.cpu(), w), (file, sizes)
        mine = leaves(rt(**inputs))
        for m, g in zip(mine, got, strict=True):
            assert torch.equal(torch.from_dlpack(m), g), (file, sizes)
