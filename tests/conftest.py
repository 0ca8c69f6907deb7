"""Shared fixtures: example models traced once and bundles built once per test session (the API,
not the CLI). ``built`` hands on bundle paths and, for tests that look at a stage's output, the
``Traced`` and ``Compiled`` objects they were made from."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
DATA = Path(__file__).resolve().parent / "data"
DEFAULT_ARCHS = ("sm_80", "sm_90")
# The timeout of every subprocess a test starts: a guard against a hang only, far above what any
# test's work needs on a loaded 2-core machine (the heaviest, the slow run's interpreter checks,
# take minutes of CPU). A test bounds its work (sizes, launches, models), never its time.
HANG_GUARD_S = 3600

warnings.filterwarnings("ignore", category=FutureWarning)


def model_path(name: str) -> Path:
    for base in (MODELS, DATA):
        p = base / f"{name}.py"
        if p.is_file():
            return p
    raise FileNotFoundError(name)


class BundleFactory:
    """Each model is traced once, generated once per arch set and packed once. Callers must not
    change what they are handed: other tests get the same objects."""

    def __init__(self, base: Path):
        self.base = base
        self._traced: dict[str, object] = {}
        self._compiled: dict[tuple[str, tuple[str, ...]], object] = {}
        self._fusion_inputs: dict[tuple[str, tuple[str, ...]], list] = {}
        self._paths: dict[tuple[str, tuple[str, ...]], Path] = {}

    def traced(self, name: str):
        """``Traced`` of ``models/<name>.py`` or ``tests/data/<name>.py``."""
        if name not in self._traced:
            from aot.tracer import load_model_file, trace

            self._traced[name] = trace(load_model_file(model_path(name)))
        return self._traced[name]

    def compiled(self, name: str, archs: tuple[str, ...] = DEFAULT_ARCHS):
        """``Compiled`` of the model for ``archs``."""
        key = (name, tuple(archs))
        if key not in self._compiled:
            import aot.codegen.partition as partition_module
            from aot.codegen import generate

            # record the program each partition call is given (one per traced program), so that a
            # test can check the fused program against exactly what fusion started from
            given, original = [], partition_module.partition

            def recording(program, *args, **kwargs):
                given.append(program)
                return original(program, *args, **kwargs)

            partition_module.partition = recording
            try:
                self._compiled[key] = generate(self.traced(name), key[1])
            finally:
                partition_module.partition = original
            self._fusion_inputs[key] = given
        return self._compiled[key]

    def fusion_inputs(self, name: str, archs: tuple[str, ...] = DEFAULT_ARCHS) -> list:
        """The programs fusion was given while compiling the model (the main one, then variants)."""
        self.compiled(name, archs)
        return self._fusion_inputs[(name, tuple(archs))]

    def __call__(self, name: str, archs: tuple[str, ...] = DEFAULT_ARCHS) -> Path:
        """Path of the model's bundle for ``archs``."""
        key = (name, tuple(archs))
        if key not in self._paths:
            from aot.packager import pack

            out = self.base / f"{name}-{'-'.join(key[1])}.tpk"
            pack(self.compiled(name, key[1]), out)
            self._paths[key] = out
        return self._paths[key]


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> BundleFactory:
    """``built("gpt")`` → path of a bundle of models/gpt.py, built once per session;
    ``built.traced("gpt")``, ``built.compiled("gpt")``: the stages' outputs it was made from."""
    return BundleFactory(tmp_path_factory.mktemp("bundles"))
