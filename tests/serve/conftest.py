"""Bundles for the serving tests, built once per session without kernels (the serving path runs
the CPU reference either way), and helpers to start servers on free loopback ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.conftest import model_path

MODELS = Path(__file__).with_name("models")  # serving-specific model files


def build(name: str, out: Path) -> Path:
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    path = MODELS / f"{name}.py" if (MODELS / f"{name}.py").is_file() else model_path(name)
    pack(generate(trace(load_model_file(path)), ("sm_80",), fuse=False), out)
    return out


class Bundles:
    """``bundles("branchy")`` → path of a kernel-free bundle of tests/data/branchy.py (or of
    tests/serve/models/NAME.py), built once."""

    def __init__(self, base: Path):
        self.base, self.paths = base, {}

    def __call__(self, name: str) -> Path:
        if name not in self.paths:
            self.paths[name] = build(name, self.base / f"{name}.tpk")
        return self.paths[name]


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> Bundles:
    return Bundles(tmp_path_factory.mktemp("serve-bundles"))


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    sockets, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports
