"""The minimum-driver environment guard: a bundle records, per arch, the CUDA release of the ptxas
that compiled its cubins (triton 3.9 compiles sm_80 with CUDA 12.9 and sm_90 with CUDA 13.4), and
the loader refuses a driver of an older CUDA major before loading any. The bundle of two archs
(``TWO_ARCHS``) is also where a cubin of each kernel for each arch is checked."""

from __future__ import annotations

import pytest

from aot import schema
from aot.errors import EnvError
from aot.loader.gpu import check_driver
from tests.conftest import TWO_ARCHS


def test_bundle_records_the_cuda_release_of_its_cubins(built):
    from aot.codegen.compile import ptxas_release
    from aot.loader import load

    recorded = load(built("mlp", TWO_ARCHS)).manifest.environment.cuda_built
    assert recorded == {arch: ptxas_release(arch) for arch in ("sm_80", "sm_90")}
    for release in recorded.values():
        assert release.count(".") == 1 and all(p.isdigit() for p in release.split(".")), release


def test_a_bundle_of_two_archs_holds_a_cubin_of_each_kernel_for_each(built):
    from aot.loader.bundle import open_bundle

    bundle = open_bundle(built("mlp", TWO_ARCHS))
    try:
        program, manifest = bundle.program(), bundle.manifest
    finally:
        bundle.close()
    assert manifest.environment.archs == ("sm_80", "sm_90") and program.kernels
    assert sorted(n for n in manifest.members if n.endswith(".cubin")) == sorted(
        schema.KERNEL_CUBIN_FORMAT.format(kernel=k.id, arch=a)
        for k in program.kernels
        for a in ("sm_80", "sm_90")
    )
    assert all(k.archs == ("sm_80", "sm_90") and set(k.shared) == {"sm_80", "sm_90"} for k in program.kernels)


@pytest.mark.parametrize(
    "built_with, driver", [("12.9", 12000), ("12.9", 12080), ("12.9", 13000), ("13.0", 13020)]
)
def test_driver_of_the_same_or_newer_major_loads(built_with, driver):
    check_driver(built_with, driver)  # raises on refusal


def test_driver_of_an_older_major_is_refused_with_what_to_do():
    with pytest.raises(EnvError) as e:
        check_driver("13.0", 12080)
    assert str(e.value) == (
        "the bundle's kernels were compiled for CUDA 13.0 (needs a driver of CUDA 13.x or newer), this driver "
        "supports CUDA 12.8; update the NVIDIA driver, or rebuild with a triton whose ptxas is CUDA 12.x"
    )


def test_bundles_that_did_not_record_it_are_not_refused():
    check_driver("", 11000)


def test_dependent_launch_config_has_the_driver_api_layout():
    """``cuLaunchKernelEx`` reads ``CUlaunchConfig`` and ``CUlaunchAttribute`` as cuda.h lays them
    out (CUDA 12): three grid and three block dims, the shared bytes, the stream at 32, the
    attributes at 40 and their count at 48; an attribute is its id, 4 bytes of padding and a
    64-byte value."""
    import ctypes

    from aot.loader.cuda import _LaunchAttribute, _LaunchConfig

    offsets = {name: getattr(_LaunchConfig, name).offset for name, _ in _LaunchConfig._fields_}
    assert offsets == {"grid": 0, "block": 12, "shared": 24, "stream": 32, "attrs": 40, "num_attrs": 48}
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchAttribute.value.offset, ctypes.sizeof(_LaunchAttribute)) == (8, 72)


def test_dependent_launch_can_be_turned_off(monkeypatch):
    from aot.loader import cuda

    monkeypatch.setenv(cuda.DEPENDENT_LAUNCH_ENV, "0")
    assert cuda.dependent_launch_allowed(13000) is False  # without asking the driver, which may be absent
