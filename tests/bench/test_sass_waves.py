"""``bench/sass_waves.py`` on a model file's forward (``--model-file``, ``--bucket``), no GPU: the
plan's kernels at the bucket compiled for sm_90 and read, one row each, with the built-in small
form's early W loads counted before the wait where ``AOTPACK_SMALL_EARLY=on``; a bucket the
plans lack names the ones they have."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import HANG_GUARD_S, ROOT

MODEL = ROOT / "tests" / "codegen" / "gemm_models" / "gemm_tile_ln_few.py"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sass_waves.py"), "--model-file", str(MODEL), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, **env},
    )


def _rows(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in stdout.splitlines()[2:] if line.strip()}


@pytest.mark.slow  # four kernels compiled for sm_90
def test_a_model_files_plan_is_read_at_its_bucket():
    done = _run("--bucket", "8", AOTPACK_SMALL_EARLY="off")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith(f"{MODEL}, plan at bucket (8,) (sm_90)")
    rows = _rows(done.stdout)
    # GPT-2's o, ln_2 and fc at 8 rows: the two tiles joined through the first one's statistics
    assert set(rows) == {"gemm_addmm_gemv_16x32x128_stats", "gemm_ln_addmm_gemv_16x32x128_from_stats"}
    assert all(cols[2] == "0" for cols in rows.values())  # nothing loaded before the wait
    early = _rows(_run("--bucket", "8", AOTPACK_SMALL_EARLY="on").stdout)
    assert set(early) == {name.replace("_gemv_", "_gemve_") for name in rows}
    assert all(int(cols[2]) > 0 for cols in early.values())  # W's first steps before the wait
    wrong = _run("--bucket", "7")
    assert wrong.returncode != 0 and "the plans' buckets are [(8,), (32,)]" in wrong.stderr
