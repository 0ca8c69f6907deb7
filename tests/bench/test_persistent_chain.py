"""``bench/persistent_chain.py``'s L2 prefetch kernels without a GPU: every form the bench launches
(each prefetch mode, with and without ``evict_first`` W loads, the GEMV at K 2048 and 8192 and the
stand-in attention kernel) compiles for sm_90, and its PTX holds the prefetch the mode names
(``cp.async.bulk.prefetch.L2`` or ``prefetch.global.L2``), none where the mode is off, and the
dependent-launch wait; the attention also with its prefetch by blocks of their own (``SIDE``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import HANG_GUARD_S, ROOT


@pytest.mark.slow
def test_prefetch_kernels_compile_for_sm90():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "persistent_chain.py"), "--compile-only", "90"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(lines) == 29 and all(line.startswith("ok") for line in lines), done.stdout[-3000:]
