"""Mixture-of-Experts on the GPU: the grouped GEMM kernel (``aot.codegen.grouped_gemm``) at real
models' expert shapes against a float32 matmul per expert on the same inputs (the kernel must be
no further from it than 1e-2 of the output's scale in half precision, 1e-4 in float32), and tiny
Mixtral and Qwen3-MoE bundles built on the CPU generating the CPU's tokens on the GPU (fp32), with
CUDA graphs captured lazily, all at load, and without graphs. Prints the kernel's time beside the
library's bfloat16 ``_grouped_mm`` and a dense all-experts ``bmm`` (for the record, not asserted).

    pytest -m gpu tests/gpu/test_moe_gpu.py -s
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu

MAX_BATCH, MAX_CONTEXT, NEW_TOKENS = 4, 16, 6
# (name, dtype, routed rows S = tokens * top_k, K, N, experts): Qwen3-30B-A3B's gate/up and down
# projections (128 experts, top 8) at decode (batch 1 and 8) and a 512-token prefill; Mixtral-8x7B's
# gate/up at decode (8 experts, top 2, a 14336 intermediate size).
SHAPES = [
    ("qwen3_gate_up_b1", "bfloat16", 8, 2048, 1536, 128),
    ("qwen3_down_b8", "float16", 64, 768, 2048, 128),
    ("qwen3_gate_up_prefill", "bfloat16", 4096, 2048, 1536, 128),
    ("mixtral_gate_up_b1", "float16", 2, 4096, 28672, 8),
    ("small_fp32", "float32", 37, 256, 512, 8),
]


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _kernel(site, block, tmp_path):
    from aot.codegen.grouped_gemm import render_grouped_gemm

    r = render_grouped_gemm(site, block)
    path = tmp_path / f"{r.name}.py"
    path.write_text(r.source)
    spec = importlib.util.spec_from_file_location(r.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, r.name), r


def _timed(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000  # us


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_grouped_gemm_matches_a_matmul_per_expert_on_gpu(shape, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen.grouped_gemm import GroupedSite, block_m

    name, dtype, S, K, N, E = shape
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, E, (S,), device="cuda", generator=gen).sort().values
    offsets = torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32)
    x = torch.randn(S, K, device="cuda", generator=gen).to(dt)
    w = (torch.randn(E, N, K, device="cuda", generator=gen) / K**0.5).to(dt)  # transformers' [E, N, K]
    site = GroupedSite(
        step=0, rows="x", weights="w", offsets="o", out="y", s=str(S), k=K, n=N, experts=E,
        transposed=True, dtype=dtype,
    )  # fmt: skip
    block = block_m(site, {})
    kernel, r = _kernel(site, block, tmp_path)
    grid = ((S + block - 1) // block + E, int(r.grid[1]))
    y = torch.full((S, N), float("nan"), dtype=dt, device="cuda")

    def run():
        kernel[grid](x, w, offsets, y, S, num_warps=r.num_warps, num_stages=r.num_stages)

    run()
    torch.cuda.synchronize()
    ref = torch.zeros(S, N, device="cuda")
    start = 0
    for e, end in enumerate(offsets.tolist()):
        ref[start:end] = x[start:end].float() @ w[e].float().T
        start = end
    assert not y.isnan().any()
    tol = 1e-4 if dtype == "float32" else 1e-2
    err = (y.float() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), err
    kernel_us = _timed(run)
    dense_us = _timed(lambda: torch.bmm(x.expand(E, S, K), w.transpose(1, 2)))
    library = ""
    if dt == torch.bfloat16:
        library_us = _timed(lambda: torch._grouped_mm(x, w.transpose(1, 2), offsets))
        library = f", library bf16 _grouped_mm {library_us:.1f} us"
    print(
        f"\n{name}: grouped GEMM kernel {kernel_us:.1f} us, dense all-experts bmm {dense_us:.1f} us{library}"
    )


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "dbrx", "jetmoe"])
def bundle(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.lm.test_moe import factory

    spec = causal_lm(factory(request.param), max_batch=MAX_BATCH, max_context=MAX_CONTEXT, name=request.param)
    path = tmp_path_factory.mktemp("gpu_moe") / f"{request.param}.tpk"
    pack(generate(trace(spec), (_arch(),)), path)
    return path


@pytest.mark.parametrize("capture", ["lazy", "all", "none"])
def test_gpu_generates_the_cpu_tokens(bundle, capture):
    import aot.loader

    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [4]]
    cpu = aot.loader.load(bundle, device="cpu")
    gpu = aot.loader.load(bundle, device="cuda", capture=capture)
    want = cpu.generate(prompts, NEW_TOKENS)
    assert gpu.generate(prompts, NEW_TOKENS) == want
    assert gpu.generate(prompts, NEW_TOKENS) == want  # replaying the graphs the first run captured
    assert gpu.generate([1, 2, 3], NEW_TOKENS) == cpu.generate([1, 2, 3], NEW_TOKENS)
