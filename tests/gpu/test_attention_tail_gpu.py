"""The decode attention run at the end of the q/k/v GEMV (``aot.codegen.attention_tail``) on a
GPU: Llama-3.2-1B's and Qwen3-0.6B's shapes (``LAYERS`` layers, bfloat16) built with
``AOTPACK_ATTENTION_TAIL=on`` (off by default: measured slower) at 1 and 2 rows.

    pytest -m gpu tests/gpu/test_attention_tail_gpu.py

Never run in CI (no GPU there).
"""

from __future__ import annotations

import pytest

from tests.gpu.test_gemm_norm_gpu import LAYERS, build_shaped, decode_plans, verified_kernels

pytestmark = pytest.mark.gpu

NEW_TOKENS = 40


@pytest.mark.parametrize("warps", [None, "8"])  # the GEMV's (the default); the attention kernel's
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-0.6b"])  # qwen3: each q and k head normed
def test_the_joined_kernel_verifies(model, warps, tmp_path_factory):
    """At one row each layer's q/k/v GEMV runs the attention (no attention kernel of its own);
    ``aot.verify.device.verify`` passes with the joined kernels among those it checked (the rows,
    the attention's output and both caches against the projection's and the attention's steps),
    at the GEMV's warps and at 8."""
    from aot.codegen.attention_tail import ENV, WARPS_ENV

    env = {ENV: "on", **({WARPS_ENV: warps} if warps else {})}
    path, compiled, arch = build_shaped(model, tmp_path_factory, (1, 2), env)
    _, plans = decode_plans(compiled, arch)
    joined = [n for n in plans[(1,)] if n.endswith("_attention")]
    assert len(joined) == LAYERS, plans[(1,)]
    assert not any(n.startswith("decode_attention") for n in plans[(1,)]), plans[(1,)]
    assert set(joined) <= verified_kernels(path)


def test_the_joined_kernel_decodes_the_tokens_of_the_two_kernels(tmp_path_factory):
    """Greedy decoding at batch 1 from the bundle with the joined kernel and from the bundle
    without it (the attention a kernel of its own): the same tokens, on every step, replayed
    through CUDA graphs of one step and of several, and again after the first call (the counters
    left zeroed). The joined kernel runs the GEMV's warps, so the GEMV sums over K in its own order
    (at 8 warps another order: tokens of random weights parted at step 14 of 8 layers on an H100,
    and at step 13 of this test's on an H200; the module docstring)."""
    import aot.loader
    from aot.codegen.attention_tail import ENV

    joined, _, _ = build_shaped("llama-3.2-1b", tmp_path_factory, (1, 2), {ENV: "on"})
    apart, _, _ = build_shaped("llama-3.2-1b", tmp_path_factory, (1, 2), {ENV: "off"})
    a = aot.loader.load(joined, device="cuda")
    b = aot.loader.load(apart, device="cuda")
    prompts = [[11, 5003, 77, 902, 4]]
    want = b.generate(prompts, NEW_TOKENS)
    assert a.generate(prompts, NEW_TOKENS) == want
    assert a.generate(prompts, NEW_TOKENS, steps_per_launch=1) == want
    assert a.generate(prompts, NEW_TOKENS) == want
    assert a.generate([[3, 9]], NEW_TOKENS) == b.generate([[3, 9]], NEW_TOKENS)
