"""Shared fixtures: example bundles are built once per test session (the API, not the CLI)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
DATA = Path(__file__).resolve().parent / "data"

warnings.filterwarnings("ignore", category=FutureWarning)


def model_path(name: str) -> Path:
    for base in (MODELS, DATA):
        p = base / f"{name}.py"
        if p.is_file():
            return p
    raise FileNotFoundError(name)


class BundleFactory:
    def __init__(self, base: Path):
        self.base = base
        self.cache: dict[tuple[str, tuple[str, ...]], Path] = {}

    def __call__(self, name: str, archs: tuple[str, ...] = ("sm_80", "sm_90")) -> Path:
        key = (name, archs)
        if key not in self.cache:
            from aot.codegen import generate
            from aot.packager import pack
            from aot.tracer import load_model_file, trace

            out = self.base / f"{name}-{'-'.join(archs)}.tpk"
            pack(generate(trace(load_model_file(model_path(name))), archs), out)
            self.cache[key] = out
        return self.cache[key]


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> BundleFactory:
    """``built("gpt")`` → path of a bundle of models/gpt.py, built once per session."""
    return BundleFactory(tmp_path_factory.mktemp("bundles"))
