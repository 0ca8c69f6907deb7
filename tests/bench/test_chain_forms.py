"""The kernels of ``bench/tma_gemv.py`` (GEMVs whose weights stream through TMA, from host-side
tensor descriptors) and ``bench/attention_chain.py`` (decode attention forms, alone and in the q/k/v
GEMV's tail) against torch in Triton's interpreter: each bench's ``--check``, every form it can run
on the CPU reported ok (the tensor-core attention forms are checked on the GPU: the interpreter's
bfloat16 dot is not the GPU's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import HANG_GUARD_S, ROOT


@pytest.mark.parametrize("script,forms", [("tma_gemv.py", 8), ("attention_chain.py", 2)])
def test_bench_kernels_match_torch_in_the_interpreter(script, forms):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--check"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [line for line in done.stdout.splitlines() if line.rstrip().endswith(("ok", "WRONG"))]
    assert len(results) == forms and all(
        line.rstrip().endswith(": ok") or line.rstrip().endswith(" ok") for line in results
    ), done.stdout
