"""GPU arch names (``aot.archs``) and which cubins a device loads (``aot.loader.gpu.pick_arch``)."""

from __future__ import annotations

import re

import pytest

from aot.archs import Arch, arch_number, arch_of, parse_arch, sort_key
from aot.errors import CodegenError, EnvError


@pytest.mark.parametrize(
    "text, arch",
    [
        ("sm_90", Arch(9, 0)),
        ("sm_90a", Arch(9, 0, True)),
        ("90", Arch(9, 0)),
        ("sm_100a", Arch(10, 0, True)),
        ("sm_86", Arch(8, 6)),
    ],
)
def test_an_arch_is_spelled_three_ways(text, arch):
    assert parse_arch(text) == arch
    assert parse_arch(arch.name) == arch and arch_number(text) == arch.number


@pytest.mark.parametrize("text", ["sm_9", "sm_90b", "compute_90", "", "sm_1000", "9.0"])
def test_what_is_no_arch_is_refused(text):
    with pytest.raises(ValueError, match="is not a CUDA arch such as sm_90, sm_90a or 90"):
        parse_arch(text)


def test_archs_order_by_capability():
    assert sorted(["sm_100", "sm_90a", "sm_80", "sm_90", "sm_86"], key=sort_key) == [
        "sm_80",
        "sm_86",
        "sm_90",
        "sm_90a",
        "sm_100",
    ]
    assert arch_of((9, 0)) == "sm_90" and arch_of((12, 0)) == "sm_120"


def test_the_build_takes_each_spelling_and_names_it_sm():
    from aot.codegen import parse_archs

    assert parse_archs("sm_80, 90a,sm_90,sm_80") == ("sm_80", "sm_90a", "sm_90")
    with pytest.raises(CodegenError, match=r"^--arch expects a comma list like sm_80,sm_90; got 'sm_9'$"):
        parse_archs("sm_9")


@pytest.mark.parametrize(
    "archs, capability, picked",
    [
        (("sm_90a",), (9, 0), "sm_90a"),  # an sm_90a build runs on an H100/H200
        (("sm_80", "sm_90a"), (9, 0), "sm_90a"),
        (("sm_90", "sm_90a"), (9, 0), "sm_90"),
        (("sm_80", "sm_90"), (9, 0), "sm_90"),
        (("sm_80", "sm_90"), (8, 9), "sm_80"),
        (("sm_80", "sm_86"), (8, 9), "sm_86"),
        (("sm_80", "sm_90a"), (8, 6), "sm_80"),
        (("sm_100",), (10, 3), "sm_100"),
    ],
)
def test_the_loader_picks_the_cubins_a_device_runs(archs, capability, picked):
    from aot.loader.gpu import pick_arch

    assert pick_arch(archs, capability) == picked


@pytest.mark.parametrize(
    "archs, capability, message",
    [
        (
            ("sm_90a",),
            (10, 0),
            "this GPU is sm_100, the bundle has cubins for sm_90a; rebuild with --arch sm_90a,sm_100",
        ),
        (
            ("sm_80a",),
            (8, 6),
            "this GPU is sm_86, the bundle has cubins for sm_80a; rebuild with --arch sm_80a,sm_86",
        ),
        (
            ("sm_90",),
            (8, 9),
            "this GPU is sm_89, the bundle has cubins for sm_90; rebuild with --arch sm_90,sm_89",
        ),
        (
            ("bogus",),
            (9, 0),
            "this GPU is sm_90, the bundle has cubins for bogus; rebuild with --arch bogus,sm_90",
        ),
    ],
)
def test_no_cubin_for_the_device_is_an_env_error(archs, capability, message):
    from aot.loader.gpu import pick_arch

    with pytest.raises(EnvError) as e:
        pick_arch(archs, capability)
    assert str(e.value) == message


def test_build_options_are_frozen_checked_and_hash_themselves():
    import dataclasses

    from aot.stages import BuildOptions

    options = BuildOptions(("sm_80", "sm_90a"), gemm_candidates=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.fuse = False
    assert options.hash() == BuildOptions(("sm_80", "sm_90a"), gemm_candidates=True).hash()
    assert options.hash() != BuildOptions(("sm_80", "sm_90a")).hash()
    assert len({options, BuildOptions(("sm_80", "sm_90a"), gemm_candidates=True)}) == 1
    for bad, message in [
        (dict(archs="sm_90"), "BuildOptions.archs is a tuple of arch names"),
        (dict(archs=()), "BuildOptions.archs is a tuple of arch names"),
        (dict(archs=("90",)), "must be distinct sm_ names, got ('90',); use ('sm_90',)"),
        (dict(archs=("sm_90", "sm_90")), "must be distinct sm_ names"),
        (dict(archs=("sm_9",)), "is not a CUDA arch"),
        (dict(fuse=1), "BuildOptions.fuse is True or False, got 1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            BuildOptions(**bad)
