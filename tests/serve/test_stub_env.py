"""What Triton's Python backend stub is given: tritonserver's environment leads the stub's embedded
Python to this interpreter (its folder first on PATH, its libpython first on LD_LIBRARY_PATH, its
site and PYTHONPATH folders for the model), and a model refuses to load where the stub would move tensor bytes wrongly (numpy 2
under nvidia-pytriton 0.7's stubs). No tritonserver runs here."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from aot.errors import EnvError
from aot.serve.triton import TritonDist, server_env, site_dirs
from aot.serve.triton_model import ENV_SITE_DIRS, check_numpy_bridge


def dist(tmp_path: Path) -> TritonDist:
    return TritonDist(
        server=tmp_path / "bin" / "tritonserver",
        libs=tmp_path / "nvidia_pytriton.libs",
        backend=tmp_path / "backends" / "python",
        stub=tmp_path / "stub",
    )


def test_this_interpreter_comes_first_for_the_stub(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/elsewhere")
    monkeypatch.setenv("PYTHONPATH", "/given/one:/given/two")
    monkeypatch.setenv(ENV_SITE_DIRS, "/more:/given/one")
    env = server_env(dist(tmp_path))
    here = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(here, "python3")):
        assert env["PATH"] == f"{here}:/usr/bin:/bin"
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert libs[-2:] == [str(tmp_path / "nvidia_pytriton.libs"), "/elsewhere"]
    if sysconfig.get_config_var("LIBDIR"):
        assert libs[0] == sysconfig.get_config_var("LIBDIR")
    # the stub's Python ignores PYTHONPATH: its folders reach the model as site folders, after these
    assert env[ENV_SITE_DIRS].split(":") == site_dirs() + ["/given/one", "/given/two", "/more"]


class Bridge:
    """A stand-in for ``triton_python_backend_utils``: ``Tensor`` whose C++ round trip keeps the
    bytes, or (``broken``) reads every element as the first, as the numpy-1 stubs do under numpy 2."""

    def __init__(self, broken: bool):
        bridge = self

        class Tensor:
            def __init__(self, name: str, array: np.ndarray):
                self.array = array

            def to_dlpack(self) -> np.ndarray:
                return self.array

            @staticmethod
            def from_dlpack(name: str, capsule: np.ndarray) -> Tensor:
                return Tensor(name, np.full_like(capsule, capsule[0]) if bridge.broken else capsule.copy())

            def as_numpy(self) -> np.ndarray:
                return self.array

        self.broken, self.Tensor = broken, Tensor


def test_a_sound_stub_passes_the_numpy_check():
    check_numpy_bridge(Bridge(broken=False))


def test_a_stub_that_reads_tensors_wrongly_is_refused_with_the_fix():
    with pytest.raises(EnvError) as caught:
        check_numpy_bridge(Bridge(broken=True))
    assert str(caught.value) == (
        f"Triton's Python backend stub reads tensors wrongly under numpy {np.__version__} "
        "(read back [1.0, 1.0, 1.0, 1.0] for [1.0, 2.0, 3.0, 4.0]): nvidia-pytriton's stubs need numpy<2. "
        f"Install numpy<2 in the environment of the stub's Python ({sys.executable}): it runs "
        "isolated, so PYTHONPATH does not reach it"
    )
