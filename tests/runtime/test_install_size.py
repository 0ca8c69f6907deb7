"""aotpack-rt's install size (``bench/rt_install_size.py``): the distributions its dependencies pull
here, resolved from their metadata, hold no torch (nor triton, sympy), and together with the
runtime's own files take at most the issue's 60 MB installed (without the NumPy and trust extras);
the command exits 1 above a limit and names the dependency it cannot find."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("rt_install_size", ROOT / "bench" / "rt_install_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sizes():
    module = _module()
    try:
        return module, module.report()
    except LookupError as e:
        pytest.skip(f"aotpack-rt's dependencies are not installed here: {e}")


def test_the_runtime_installs_without_torch_in_60_mb(sizes):
    module, got = sizes
    assert {"cuda-bindings", "zstandard"} <= set(got["distributions"])
    assert got["forbidden_in_closure"] == []
    assert not set(got["distributions"]) & {"torch", "triton", "sympy", "numpy"}
    parts = sum(d["installed_bytes"] for d in got["distributions"].values()) + got["aotpack_rt_bytes"]
    assert got["installed_total_bytes"] == parts
    assert got["installed_total_bytes"] <= 60e6, got
    assert module.main(["--limit-mb", "60"]) == 0


def test_the_command_refuses_above_its_limit_and_without_a_dependency(sizes, capsys, monkeypatch):
    module, got = sizes
    assert module.main(["--limit-mb", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.strip().endswith("over the 1 MB limit")
    monkeypatch.setattr(module, "requirements", lambda extras=(): ["no-such-distribution-aotpack>=1"])
    assert module.main([]) == 1
    assert "no-such-distribution-aotpack>=1 is not installed here" in capsys.readouterr().err
