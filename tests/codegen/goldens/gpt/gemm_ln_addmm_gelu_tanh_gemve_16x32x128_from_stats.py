"""GEMM candidate gemve_16x32x128 (fused, its LayerNorm from the GEMM before's statistics per tile and the column sums): GEMM + bias + gelu_tanh.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch*seq, N = 3072, K = 768, float16;
grid: ((batch*seq + 15)//16, 96,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(16)
BLOCK_N = tl.constexpr(32)
BLOCK_K = tl.constexpr(128)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_ln_addmm_gelu_tanh_gemve_16x32x128_from_stats(a_ptr, w0_ptr, b0_ptr, out0_ptr, stats_ptr, u_ptr, M):
    # a_ptr: *fp16, w0_ptr: *fp16, b0_ptr: *fp16, out0_ptr: *fp16, stats_ptr: *fp32, u_ptr: *fp32, M: i32
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 3072
    mask = mask_m[:, None] & mask_n[None, :]
    # W's first K steps, before the wait (see kernel_module)
    rk = tl.arange(0, BLOCK_K)
    w0_e0 = tl.load(w0_ptr + rn[None, :] * 768 + rk[:, None], mask=mask_n[None, :], other=0.0)
    rk = 128 + tl.arange(0, BLOCK_K)
    w0_e1 = tl.load(w0_ptr + rn[None, :] * 768 + rk[:, None], mask=mask_n[None, :], other=0.0)
    # the biases (weights) before the wait, in registers for the epilogue
    b0_e = tl.load(b0_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    # the LayerNorm's column sums with W (weights: norm_sums)
    u = tl.load(u_ptr + rn, mask=mask_n, other=0.0)
    c = tl.zeros_like(u)
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # the LayerNorm's statistics from the first GEMM's 24 column tiles (gemm_stats)
    tiles = tl.arange(0, 32)
    tmask = (tiles < 24)[:, None] & mask_m[None, :]
    t_sum = tl.load(stats_ptr + (tiles[:, None] * 2) * M + rm[None, :], mask=tmask, other=0.0)
    t_m2 = tl.load(stats_ptr + (tiles[:, None] * 2 + 1) * M + rm[None, :], mask=tmask, other=0.0)
    if GDC:  # the early steps' A tiles now, held in registers through the loop (HOLD_EARLY_A)
        rk = tl.arange(0, BLOCK_K)
        a_e0 = tl.load(a_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None], other=0.0)
        rk = 128 + tl.arange(0, BLOCK_K)
        a_e1 = tl.load(a_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None], other=0.0)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(256, 768, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None], other=0.0)
        w0 = tl.load(w0_ptr + rn[None, :] * 768 + rk[:, None], mask=mask_n[None, :], other=0.0)  # W^T tile: [BLOCK_K, BLOCK_N]
        acc0 = tl.dot(a, w0, acc0)
    rk = tl.arange(0, BLOCK_K)  # K step 0: W loaded early
    if GDC:
        a = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a_e0], dtype=tl.float16, is_pure=False, pack=2)
    else:
        a = tl.load(a_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None], other=0.0)
    acc0 = tl.dot(a, w0_e0, acc0)
    rk = 128 + tl.arange(0, BLOCK_K)  # K step 1: W loaded early
    if GDC:
        a = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a_e1], dtype=tl.float16, is_pure=False, pack=2)
    else:
        a = tl.load(a_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None], other=0.0)
    acc0 = tl.dot(a, w0_e1, acc0)
    count = tl.minimum(768 - tiles * 32, 32).to(tl.float32)[:, None]
    mean = tl.sum(t_sum, axis=0) / 768
    dm = tl.where(tmask, t_sum / tl.maximum(count, 1.0) - mean[None, :], 0.0)
    var = (tl.sum(t_m2, axis=0) + tl.sum(count * dm * dm, axis=0)) / 768
    rstd = 1.0 / tl.sqrt(var + 1e-05)
    # A @ W^T = rstd * (scaled sum @ W^T) - rstd * mean * u + c: the LayerNorm applied once
    acc0 = acc0 * rstd[:, None] - (rstd * mean)[:, None] * u[None, :] + c[None, :]
    acc0 = acc0 + b0_e
    acc0 = (0.5 * acc0 * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * (0.7978845608028654 * (acc0 + 0.044715 * acc0 * acc0 * acc0))) + 1.0))))
    tl.store(out0_ptr + rm[:, None] * 3072 + rn[None, :], acc0.to(tl.float16), mask=mask)
