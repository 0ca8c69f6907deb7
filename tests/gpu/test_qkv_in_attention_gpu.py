"""The q/k/v projection's K slices summed in the decode attention kernel
(``aot.codegen.qkv_in_attention``) on a GPU: Llama-3.2-1B's shapes (``LAYERS`` layers, bfloat16)
built with it at 1 and 8 rows.

    pytest -m gpu tests/gpu/test_qkv_in_attention_gpu.py

Never run in CI (no GPU there).
"""

from __future__ import annotations

import pytest

from tests.gpu.test_gemm_norm_gpu import LAYERS, build_shaped, decode_plans, verified_kernels

pytestmark = pytest.mark.gpu


def test_the_attention_sums_the_qkv_slices_and_verifies(tmp_path_factory):
    """At 8 rows each layer runs q/k/v's partials and then the summing attention (no reduce
    kernel between them); ``aot.verify.device.verify`` passes with the summing attention among
    the kernels it checked (its output and both caches against the projection's and the
    attention's reference steps), and the one-row plan is the default's."""
    from aot.codegen.qkv_in_attention import ENV

    path, compiled, arch = build_shaped("llama-3.2-1b", tmp_path_factory, (1, 8), {ENV: "on"})
    _, plans = decode_plans(compiled, arch)
    names = plans[(8,)]
    summing = [n for n in names if n.startswith("decode_attention") and "_sums" in n]
    assert len(summing) == LAYERS, names
    for i, n in enumerate(names):
        if n in summing:
            assert names[i - 1].endswith("_partial"), names
    assert not any(n.startswith("decode_attention") and "_sums" in n for n in plans[(1,)])
    assert set(summing) <= verified_kernels(path)
