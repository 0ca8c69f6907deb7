"""Builds are reproducible: the same model built twice in two fresh processes, each with its own
empty kernel cache (``AOTPACK_CACHE_DIR``), its own working directory and a different
``PYTHONHASHSEED``, gives byte-identical archives, so every kernel source and cubin is compiled
again rather than read back from the first build's cache. One process also builds the model a
second time (warm cache, second trace in the same interpreter), which catches state that leaks
from one trace into the next."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from aot import schema
from tests.conftest import HANG_GUARD_S, ROOT, model_path

# pointwise: three distinct kernels (fp16, bool and int64 stores); small_mlp: fp16 weights,
# layer norms and a paddable dim. Two archs, so each arch's cubin is checked.
MODELS = {"pointwise": ROOT / "tests/codegen/models/pointwise.py", "small_mlp": model_path("small_mlp")}
ARCHS = "sm_80,sm_90"

BUILD = """
import sys
from aot.codegen import generate
from aot.packager import pack
from aot.tracer import load_model_file, trace

archs, out, times, models = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
for model in models:
    name = model.rsplit("/", 1)[1].removesuffix(".py")
    for i in range(times):
        pack(generate(trace(load_model_file(model)), tuple(archs)), f"{out}/{name}.{i}.tpk")
"""


def _start(base, seed: str, times: int) -> subprocess.Popen:
    base.mkdir()
    env = dict(
        os.environ,
        AOTPACK_CACHE_DIR=str(base / "kernel-cache"),
        PYTHONHASHSEED=seed,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-c", BUILD, ARCHS, str(base), str(times), *map(str, MODELS.values())]
    return subprocess.Popen(cmd, cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """``{(process, model, i): archive path}``: process "a" builds each model once, "b" twice."""
    base = tmp_path_factory.mktemp("reproducible")
    procs = {"a": _start(base / "a", "1", 1), "b": _start(base / "b", "2", 2)}  # run side by side
    for label, p in procs.items():
        _, err = p.communicate(timeout=HANG_GUARD_S)
        assert p.returncode == 0, f"build process {label} failed:\n{err[-4000:]}"
    paths = {
        (label, name, i): base / label / f"{name}.{i}.tpk"
        for label, times in (("a", 1), ("b", 2))
        for name in MODELS
        for i in range(times)
    }
    for label in procs:
        # each process filled its own cache, which it found empty: every cubin was compiled there
        # (were AOTPACK_CACHE_DIR ignored, both would read the shared cache and this would be empty)
        cache = base / label / "kernel-cache"
        built = {
            n for (lb, _, _), p in paths.items() if lb == label for n in _members(p) if n.endswith(".cubin")
        }
        assert len(list(cache.glob("??/*.cubin"))) == len(built), f"process {label}: {cache}"
        assert not list(cache.glob("??/*.tmp"))
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_builds_in_fresh_processes_with_empty_caches_are_byte_identical(builds, name):
    first, other = builds[("a", name, 0)], builds[("b", name, 0)]
    a, b = _members(first), _members(other)
    assert list(a) == list(b), "the archives hold different members, or in a different order"
    sources = [n for n in a if n.startswith(schema.KERNELS_DIR) and n.endswith(".py")]
    cubins = [n for n in a if n.endswith(".cubin")]
    assert sources and len(cubins) == 2 * len(sources)  # one cubin per kernel per arch
    differ = [n for n in a if a[n] != b[n]]
    assert not differ, f"{name}: members differ between the two builds: {differ}"
    assert first.read_bytes() == other.read_bytes(), f"{name}: same members, different archive bytes"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_a_second_build_in_the_same_process_is_byte_identical(builds, name):
    again = _members(builds[("b", name, 1)])
    first = _members(builds[("b", name, 0)])
    assert [n for n in first if first[n] != again.get(n)] == []
    assert builds[("b", name, 0)].read_bytes() == builds[("b", name, 1)].read_bytes()
