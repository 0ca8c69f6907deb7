"""GEMM candidate vec_1x2x512 (fused): GEMM.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch*seq, N = 8, K = 32, float16;
grid: (4, (batch*seq + 0)//1,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(1)
BLOCK_N = tl.constexpr(2)
BLOCK_K = tl.constexpr(512)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_mm_vec_1x2x512(a_ptr, w0_ptr, out0_ptr, M):
    # a_ptr: *fp16, w0_ptr: *fp16, out0_ptr: *fp16, M: i32
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 8
    mask = mask_m[:, None] & mask_n[None, :]
    # this block's rows of W, every K step, before the wait (see kernel_module)
    rk = 0 + tl.arange(0, BLOCK_K)
    w0_0 = tl.load(w0_ptr + rn[:, None] * 32 + rk[None, :], mask=mask_n[:, None] & (rk[None, :] < 32), other=0.0)  # [BLOCK_N, BLOCK_K]
    if GDC:  # let the kernel after start (and load its weights), then wait for the kernel before
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    part0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    rk = 0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rm[:, None] * 32 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 32), other=0.0)
    part0 += w0_0.to(tl.float32) * a.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
    acc0 = tl.sum(part0, axis=1)[None, :]
    tl.store(out0_ptr + rm[:, None] * 8 + rn[None, :], acc0.to(tl.float16), mask=mask)
