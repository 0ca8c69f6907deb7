"""Fixtures of the real-model suite: the libraries imported on a CPU torch, and each model's bundle
built once per session, stage by stage, so that a failure names the stage it happened in.

``zoo_build(name)`` hands on a ``Build``: the spec, the eager module, the loaded ``Runner``, seconds per
stage, or the failed stage and its one-line error (the build is tried once; every test of that
model reports the same failure). The terminal summary lists every build with its timings.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("sm_90",)  # one arch keeps CI short; tests/gpu builds sm_80 + sm_90
_LIBRARIES: dict[str, str | None] = {}  # library -> why it cannot be used here (None: it can)
_BUILDS: dict[str, Build] = {}


def import_torchvision():
    """``import torchvision`` on a CPU torch.

    The package index's torchvision wheels are built for CUDA torch: with the CPU torch their C
    ops (``torchvision::nms``, ``roi_align``, ...) do not load, and ``torchvision/_meta_registrations``
    fails on ``torch.library.register_fake("torchvision::nms")`` with ``RuntimeError: operator
    torchvision::nms does not exist``. Classification models never call those ops, so while
    importing, a fake impl registered for a ``torchvision::`` op that does not exist is dropped;
    ``register_fake`` is restored afterwards. transformers needs this too: with Pillow installed its
    model classes import torchvision (``Could not import module 'LlamaConfig'`` otherwise).
    """
    module = sys.modules.get("torchvision")
    if module is not None and hasattr(module, "models"):
        return module
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # a failed import leaves its submodules behind
    original = torch.library.register_fake

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            namespace, _, opname = op.partition("::")
            if not hasattr(getattr(torch.ops, namespace), opname.split(".")[0]):
                func = args[0] if args else kwargs.get("func")
                return func if func is not None else (lambda fn: fn)
        return original(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        import torchvision
    finally:
        torch.library.register_fake = original
    return torchvision


CAUSAL_LM_MODEL_FILE = """
import sys
sys.path.insert(0, {root!r})
from aot.hf import causal_lm
from {module} import factory
from tests.realmodels.conftest import import_torchvision

try:
    import_torchvision()  # as transformers needs it on a CPU torch where torchvision is installed
except ModuleNotFoundError:
    pass  # without it, transformers' model classes import as they are

spec = causal_lm(factory({kind!r}), {arguments})
"""


def causal_lm_model_file(module: str, kind: str, **arguments: Any) -> str:
    """A model file of ``causal_lm(factory(kind), **arguments)``, ``factory`` from the test module
    ``module``, for a fresh Python (the interpreter check's subprocess): the repository on its
    path, transformers' model classes imported as this suite imports them."""
    listed = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return CAUSAL_LM_MODEL_FILE.format(root=str(ROOT), module=module, kind=kind, arguments=listed)


def _why_unusable(library: str) -> str | None:
    try:
        import_torchvision()
    except Exception as e:  # transformers runs without torchvision; timm and the zoo's CNNs do not
        if not (library == "transformers" and isinstance(e, ModuleNotFoundError) and e.name == "torchvision"):
            return f"torchvision does not import on torch {torch.__version__}: {_one_line(e)}"
    try:
        if library == "transformers":
            # the top-level import succeeds even where the model classes cannot load
            from transformers import BertModel  # noqa: F401
        else:
            __import__(library)
    except Exception as e:
        return f"{library} does not import here: {_one_line(e)}"
    return None


def unusable(library: str) -> str | None:
    """Why ``library`` (transformers, timm, torchvision) cannot be imported here, or None."""
    if library not in _LIBRARIES:
        _LIBRARIES[library] = _why_unusable(library)
    return _LIBRARIES[library]


def require(library: str) -> None:
    """Skip the calling test, saying why, when ``library`` cannot be imported here."""
    why = unusable(library)
    if why is not None:
        pytest.skip(why)


@dataclass
class Build:
    """One model's build: what each stage produced and took, or where it failed."""

    name: str
    spec: Any = None
    module: Any = None  # the eager module, built from the same spec
    runner: Any = None
    path: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    failure: str | None = None  # "<stage>: <Type>: <first line>"

    def ok(self) -> Build:
        """Fail the calling test with the failed stage and its error."""
        if self.failure is not None:
            pytest.fail(f"{self.name}: {self.failure}", pytrace=False)
        return self


def _trace_stage(e: BaseException) -> str:
    """Which part of ``trace`` raised: export (torch.export, or the programs cannot cover the
    declared ranges), lowering (decompose and lower to a Program), or the eager reference run."""
    if "cannot cover every declared size" in str(e):
        return "narrowed guards (build refused)"
    names = [f.name for f in traceback.extract_tb(e.__traceback__)]
    for fn, stage in (("_lower", "lowering"), ("export_programs", "export"), ("call_model", "reference")):
        if fn in names:
            return stage
    return "trace"


def _one_line(e: BaseException) -> str:
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:400]}"


def build(name: str, make_spec: Callable[[], Any], base: Path) -> Build:
    """Spec → trace → generate → pack → load, timing each stage; stops at the first failure."""
    from aot.codegen import generate
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import instantiate, trace

    b = Build(name)
    stage = "spec"
    try:
        start = time.perf_counter()
        b.spec = make_spec()
        b.module = instantiate(b.spec)
        b.seconds["spec"] = time.perf_counter() - start
        stage, start = "trace", time.perf_counter()
        try:
            traced = trace(b.spec)
        except Exception as e:
            stage = _trace_stage(e)
            raise
        b.seconds["trace"] = time.perf_counter() - start
        stage, start = "codegen", time.perf_counter()
        compiled = generate(traced, ARCHS)
        b.seconds["generate"] = time.perf_counter() - start
        stage, start = "pack", time.perf_counter()
        b.path = base / f"{name}.tpk"
        pack(compiled, b.path)
        b.seconds["pack"] = time.perf_counter() - start
        stage, start = "load", time.perf_counter()
        b.runner = load(b.path, device="cpu")
        b.seconds["load"] = time.perf_counter() - start
    except Exception as e:
        b.failure = f"{stage}: {_one_line(e)}"
    return b


@pytest.fixture(scope="session")
def zoo_build(tmp_path_factory) -> Callable[..., Build]:
    """``zoo_build(name)`` → the zoo model's ``Build``; ``zoo_build(key, make_spec)`` for a variant spec."""
    from tests.realmodels.zoo import ZOO

    base = tmp_path_factory.mktemp("realmodels")

    def get(key: str, make_spec: Callable[[], Any] | None = None) -> Build:
        if key not in _BUILDS:
            _BUILDS[key] = build(key, make_spec or ZOO[key], base)
        return _BUILDS[key]

    return get


def build_summary() -> list[str]:
    """One line per real-model build of this process: its stages' seconds, or where it failed.
    The terminal summary shows them (``tests/conftest.py`` gathers them from xdist workers)."""
    lines = []
    for key, b in _BUILDS.items():
        times = " ".join(f"{k} {v:.1f}" for k, v in b.seconds.items())
        build_s = b.seconds.get("trace", 0.0) + b.seconds.get("generate", 0.0)
        status = f"FAILED at {b.failure}" if b.failure else f"trace+generate {build_s:.1f}"
        programs = f" programs {len(b.runner.programs)}" if b.runner is not None else ""
        lines.append(f"{key:34s} {status}  ({times}){programs}")
    return lines
