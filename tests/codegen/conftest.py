"""Fixtures for codegen tests: the small pattern models of ``tests/codegen/models``, traced, fused
and compiled (sm_90 only, to keep CI short) once per session, and packed as bundles."""

from __future__ import annotations

from pathlib import Path

import pytest

PATTERNS = Path(__file__).resolve().parent / "models"
PATTERN_ARCHS = ("sm_90",)


class PatternFactory:
    def __init__(self, base: Path):
        self.base = base
        self.cache: dict[str, tuple] = {}

    def __call__(self, name: str):
        """``(traced, compiled, bundle path, model path)`` of ``models/<name>.py``."""
        if name not in self.cache:
            from aot.codegen import generate
            from aot.packager import pack
            from aot.tracer import load_model_file, trace

            model = PATTERNS / f"{name}.py"
            traced = trace(load_model_file(model))
            messages: list[str] = []
            compiled = generate(traced, PATTERN_ARCHS, progress=messages.append)
            out = self.base / f"{name}.tpk"
            pack(compiled, out)
            self.cache[name] = (traced, compiled, out, model, messages)
        return self.cache[name]


@pytest.fixture(scope="session")
def pattern(tmp_path_factory) -> PatternFactory:
    return PatternFactory(tmp_path_factory.mktemp("patterns"))
