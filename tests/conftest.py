"""Shared fixtures: example models traced once and bundles built once per test session (the API,
not the CLI). ``built`` hands on bundle paths and, for tests that look at a stage's output, the
``Traced`` and ``Compiled`` objects they were made from. ``run_aotpack`` runs the command line in
this process.

The suite runs in pytest-xdist workers (``-n auto --dist loadfile`` in pyproject.toml): each test
file stays in one worker, so its module fixtures are built once; session fixtures are built in each
worker that needs them, one worker at a time (``one_worker_at_a_time``), so that the second reads
the kernels the first compiled from the kernel cache instead of compiling them again beside it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
DATA = Path(__file__).resolve().parent / "data"
# The archs ``built`` compiles for unless a test names others: one arch (every kernel the codegen
# writes is compiled once, by one ptxas); the tests about several archs (arch picking, a bundle's
# cubins and CUDA releases per arch, its guards' env archs) build for ``TWO_ARCHS``.
DEFAULT_ARCHS = ("sm_90",)
TWO_ARCHS = ("sm_80", "sm_90")
# The timeout of every subprocess a test starts: a guard against a hang only, far above what any
# test's work needs on a loaded 2-core machine (the heaviest, the slow run's interpreter checks,
# take minutes of CPU). A test bounds its work (sizes, launches, models), never its time.
HANG_GUARD_S = 3600
# Workers of ``-n auto``: each imports torch and builds the session fixtures its tests need, so more
# than a few cost more than they give.
MAX_WORKERS = 4


warnings.filterwarnings("ignore", category=FutureWarning)


def model_path(name: str) -> Path:
    for base in (MODELS, DATA):
        p = base / f"{name}.py"
        if p.is_file():
            return p
    raise FileNotFoundError(name)


def pytest_xdist_auto_num_workers(config) -> int:
    """How many workers ``-n auto`` starts: one per CPU this process may use, at most
    ``MAX_WORKERS``, and none (the tests run in this process) for a single test file, which loadfile
    would hand to one worker anyway. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    here = config.invocation_params.dir
    paths = {arg.split("::")[0] for arg in config.args}
    if len(paths) == 1 and (here / next(iter(paths))).is_file():
        return 0
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


_WORKER_BUILDS: list[str] = []  # the real-model build lines xdist workers handed on


def _realmodel_builds() -> list[str]:
    module = sys.modules.get("tests.realmodels.conftest")
    return module.build_summary() if module is not None else []


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker only
    if workeroutput is not None:
        workeroutput["realmodel_builds"] = _realmodel_builds()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _WORKER_BUILDS.extend(getattr(node, "workeroutput", {}).get("realmodel_builds", []))


def pytest_terminal_summary(terminalreporter) -> None:
    lines = _realmodel_builds() + _WORKER_BUILDS
    if lines:
        terminalreporter.section("real-model builds (seconds on this machine)")
        for line in lines:
            terminalreporter.write_line(line)


@contextlib.contextmanager
def one_worker_at_a_time(tmp_path_factory, key: str) -> Iterator[None]:
    """Hold a lock named ``key`` shared by the xdist workers of this run (a file beside their
    temporary folders) for the block; without xdist it is a plain block."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    from filelock import FileLock

    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    with FileLock(str(tmp_path_factory.getbasetemp().parent / f"{name}.lock")):
        yield


def run_aotpack(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``aotpack ARGS`` in this process, as the console script runs it (``aot.cli.main``): its exit
    code, stdout and stderr, as a subprocess would give them, without starting Python and importing
    torch again. What a command changes in the process is put back afterwards: the working
    directory, the environment (``--verbose`` sets a variable), ``--quiet`` and warning filters."""
    from click.testing import CliRunner

    from aot.cli import main
    from aot.cli.progress import PROGRESS

    here, quiet = os.getcwd(), PROGRESS.quiet
    code = 0
    with warnings.catch_warnings(), CliRunner().isolation(env={}) as (stdout, stderr, _):
        saved_env = dict(os.environ)
        try:
            if cwd is not None:
                os.chdir(cwd)
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            os.chdir(here)
            os.environ.clear()
            os.environ.update(saved_env)
            PROGRESS.quiet = quiet
    return subprocess.CompletedProcess(
        ["aotpack", *args], code, stdout.getvalue().decode(), stderr.getvalue().decode()
    )


class BundleFactory:
    """Each model is traced once, generated once per arch set and packed once. Callers must not
    change what they are handed: other tests get the same objects."""

    def __init__(self, base: Path, lock=contextlib.nullcontext):
        self.base = base
        self.lock = lock  # key -> context manager: one xdist worker at a time builds a model
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
                with self.lock(f"built-{name}-{'-'.join(key[1])}"):
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
    return BundleFactory(
        tmp_path_factory.mktemp("bundles"), lambda key: one_worker_at_a_time(tmp_path_factory, key)
    )
