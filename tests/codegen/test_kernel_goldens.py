"""Golden Triton source of every kernel the codegen tests build.

Each pattern model (``tests/codegen/models``) and each example model the fusion tests build has
its kernels' source under ``goldens/<model>/<kernel>.py``; a change to what the codegen writes
shows up as a diff there. Regenerate with ``AOTPACK_UPDATE_GOLDEN=1 pytest tests/codegen``.

The kernel source is generated in a fresh process per group of models, in a fixed order: inside
one long-lived process the index text can still depend on what was rendered before (sympy's
caches), which a fresh build never sees (``tests/e2e/test_reproducible_builds.py`` pins fresh
builds byte for byte); this test pins what the codegen writes. Each model is built for the archs
its fixture builds it for (the pattern models for ``PATTERN_ARCHS``), so that the two share their
compiled kernels through the kernel cache.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.codegen.conftest import PATTERN_ARCHS, PATTERNS
from tests.conftest import DEFAULT_ARCHS, HANG_GUARD_S, ROOT, model_path

GOLDENS = Path(__file__).resolve().parent / "goldens"
UPDATE = os.environ.get("AOTPACK_UPDATE_GOLDEN") == "1"
PATTERN_MODELS = sorted(p.stem for p in PATTERNS.glob("*.py"))
EXAMPLE_MODELS = ("mlp", "gpt", "cnn", "branchy")  # the models test_fusion builds

GENERATE = """
import json, sys
from aot.codegen import generate
from aot.tracer import load_model_file, trace
archs, out = tuple(sys.argv[1].split(",")), {}
for path in sys.argv[2:]:
    kernels = generate(trace(load_model_file(path)), archs).program.kernels
    out[path] = [[k.name, k.source] for k in kernels]
print(json.dumps(out))
"""


def fresh_sources(paths: list[Path], archs: tuple[str, ...]) -> dict[Path, list]:
    """Each model's kernels as (name, source), built for ``archs`` in one fresh process in the
    given order."""
    r = subprocess.run(
        [sys.executable, "-c", GENERATE, ",".join(archs), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout.strip().splitlines()[-1])
    return {Path(p): [SimpleNamespace(name=n, source=src) for n, src in ks] for p, ks in data.items()}


def golden_files(kernels) -> dict[str, str]:
    """``<kernel name>.py`` → source, in program order; a repeated name gets ``_2``, ``_3``…"""
    files: dict[str, str] = {}
    for k in kernels:
        stem, n = k.name, 1
        while f"{stem}.py" in files:
            n += 1
            stem = f"{k.name}_{n}"
        files[f"{stem}.py"] = k.source
    return files


def check_goldens(model: str, kernels) -> None:
    folder = GOLDENS / model
    files = golden_files(kernels)
    if UPDATE:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.py"):
            if stale.name not in files:
                stale.unlink()
        for name, source in files.items():
            (folder / name).write_text(source)
        return
    assert folder.is_dir(), f"no goldens in {folder}; create them with AOTPACK_UPDATE_GOLDEN=1"
    have = sorted(p.name for p in folder.glob("*.py"))
    assert have == sorted(files), f"{model}: golden kernels {have}, generated {sorted(files)}"
    for name, source in files.items():
        expected = (folder / name).read_text()
        assert source == expected, (
            f"{model}/{name} differs from its golden (AOTPACK_UPDATE_GOLDEN=1 regenerates):\n"
            + "".join(
                difflib.unified_diff(
                    expected.splitlines(True), source.splitlines(True), "golden", "generated"
                )
            )
        )


def test_pattern_kernel_sources_match_goldens():
    sources = fresh_sources([PATTERNS / f"{m}.py" for m in PATTERN_MODELS], PATTERN_ARCHS)
    for model in PATTERN_MODELS:
        check_goldens(model, sources[PATTERNS / f"{model}.py"])


@pytest.mark.slow
def test_example_kernel_sources_match_goldens():
    sources = fresh_sources([model_path(m) for m in EXAMPLE_MODELS], DEFAULT_ARCHS)  # as test_fusion
    for model in EXAMPLE_MODELS:
        check_goldens(model, sources[model_path(model)])
