"""GEMM candidate gemv_16x16x256 (fused): GEMM + bias.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch, N = 1000, K = 512, float16;
grid: ((batch + 15)//16, 63,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(16)
BLOCK_N = tl.constexpr(16)
BLOCK_K = tl.constexpr(256)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_addmm_gemv_16x16x256(a_ptr, w0_ptr, b0_ptr, out0_ptr, M):
    # a_ptr: *fp16, w0_ptr: *fp16, b0_ptr: *fp16, out0_ptr: *fp16, M: i32
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 1000
    mask = mask_m[:, None] & mask_n[None, :]
    # the biases (weights) before the wait, in registers for the epilogue
    b0_e = tl.load(b0_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, 512, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * 512 + rk[None, :], mask=mask_m[:, None], other=0.0)
        w0 = tl.load(w0_ptr + rn[None, :] * 512 + rk[:, None], mask=mask_n[None, :], other=0.0)  # W^T tile: [BLOCK_K, BLOCK_N]
        acc0 = tl.dot(a, w0, acc0)
    acc0 = acc0 + b0_e
    tl.store(out0_ptr + rm[:, None] * 1000 + rn[None, :], acc0.to(tl.float16), mask=mask)
