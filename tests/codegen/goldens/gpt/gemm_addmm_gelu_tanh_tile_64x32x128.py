"""GEMM candidate tile_64x32x128 (fused): GEMM + bias + gelu_tanh.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch*seq, N = 3072, K = 768, float16;
grid: ((batch*seq + 63)//64, 96,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(64)
BLOCK_N = tl.constexpr(32)
BLOCK_K = tl.constexpr(128)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_addmm_gelu_tanh_tile_64x32x128(a_ptr, w0_ptr, b0_ptr, out0_ptr, M):
    # a_ptr: *fp16, w0_ptr: *fp16, b0_ptr: *fp16, out0_ptr: *fp16, M: i32
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 3072
    mask = mask_m[:, None] & mask_n[None, :]
    # the biases (weights) before the wait, in registers for the epilogue
    b0_e = tl.load(b0_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, 768, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None], other=0.0)
        w0 = tl.load(w0_ptr + rn[None, :] * 768 + rk[:, None], mask=mask_n[None, :], other=0.0)  # W^T tile: [BLOCK_K, BLOCK_N]
        acc0 = tl.dot(a, w0, acc0)
    acc0 = acc0 + b0_e
    acc0 = (0.5 * acc0 * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * (0.7978845608028654 * (acc0 + 0.044715 * acc0 * acc0 * acc0))) + 1.0))))
    tl.store(out0_ptr + rm[:, None] * 3072 + rn[None, :], acc0.to(tl.float16), mask=mask)
