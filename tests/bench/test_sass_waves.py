"""``bench/sass_waves.py`` on a model file's forward (``--model-file``, ``--bucket``), no GPU: the
plan's kernels at the bucket compiled for sm_90 and read, one row each, with the built-in small
form's early W loads counted before the wait where ``AOTPACK_SMALL_EARLY=on`` (without it only the
bias and the column sums load there), and the 128-row tiles' loads after their last asynchronous
copy gone where ``AOTPACK_HOLD_EARLY_A=on``; a bucket the plans lack names the ones they have."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import HANG_GUARD_S, ROOT

MODELS = ROOT / "tests" / "codegen" / "gemm_models"
MODEL = MODELS / "gemm_tile_ln_few.py"


def _run(*args: str, model=MODEL, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sass_waves.py"), "--model-file", str(model), *args],
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
    # before the wait only the weights outside the K loop: the first tile's bias, the second's bias
    # and its column sums u and c (EARLY_BIAS)
    assert {name: cols[2] for name, cols in rows.items()} == {
        "gemm_addmm_gemv_16x32x128_stats": "1",
        "gemm_ln_addmm_gemv_16x32x128_from_stats": "2",
    }
    early = _rows(_run("--bucket", "8", AOTPACK_SMALL_EARLY="on").stdout)
    assert set(early) == {name.replace("_gemv_", "_gemve_") for name in rows}
    # W's first steps before the wait as well
    assert all(
        int(early[name.replace("_gemv_", "_gemve_")][2]) > int(cols[2]) + 4 for name, cols in rows.items()
    )
    wrong = _run("--bucket", "7")
    assert wrong.returncode != 0 and "the plans' buckets are [(8,), (32,)]" in wrong.stderr


@pytest.mark.slow  # six kernels compiled for sm_90
def test_the_held_a_tiles_leave_no_load_after_the_copies():
    """gemm_tile_ln_many at 128 rows: two 64-row tiles with W's first K step before the wait; by
    default each reads that step's A tile after its K loop's copies (8 loads there, a round trip
    at the tile's end), with ``AOTPACK_HOLD_EARLY_A=on`` none (the tile loaded after the wait)."""
    model = MODELS / "gemm_tile_ln_many.py"
    plain, held = (_run("--bucket", "128", model=model, AOTPACK_HOLD_EARLY_A=v) for v in ("off", "on"))
    assert plain.returncode == 0 and held.returncode == 0, plain.stderr[-2000:] + held.stderr[-2000:]
    tiles = [line.split() for line in plain.stdout.splitlines()[2:] if "tileme_" in line]
    assert len(tiles) == 2 and all(cols[-1] == "8" for cols in tiles)
    held_tiles = [line.split() for line in held.stdout.splitlines()[2:] if "tileme_" in line]
    assert len(held_tiles) == 2 and all(cols[-1] == "0" for cols in held_tiles)
    assert all(cols[3] == "8" for cols in held_tiles)  # W's step and the bias before the wait, as before
