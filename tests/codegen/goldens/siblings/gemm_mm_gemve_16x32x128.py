"""GEMM candidate gemve_16x32x128 (fused): GEMM.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch*seq, N = 168, K = 32, float16;
grid: ((batch*seq + 15)//16, 6,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(16)
BLOCK_N = tl.constexpr(32)
BLOCK_K = tl.constexpr(128)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_mm_gemve_16x32x128(a_ptr, w0_ptr, out0_ptr, M):
    # a_ptr: *fp16, w0_ptr: *fp16, out0_ptr: *fp16, M: i32
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 168
    mask = mask_m[:, None] & mask_n[None, :]
    # W's first K steps, before the wait (see kernel_module)
    rk = tl.arange(0, BLOCK_K)
    w0_e0 = tl.load(w0_ptr + rn[None, :] * 32 + rk[:, None], mask=mask_n[None, :] & (rk[:, None] < 32), other=0.0)
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if GDC:  # the early steps' A tiles now, held in registers through the loop (HOLD_EARLY_A)
        rk = tl.arange(0, BLOCK_K)
        a_e0 = tl.load(a_ptr + rm[:, None] * 32 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 32), other=0.0)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(128, 32, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * 32 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 32), other=0.0)
        w0 = tl.load(w0_ptr + rn[None, :] * 32 + rk[:, None], mask=mask_n[None, :] & (rk[:, None] < 32), other=0.0)  # W^T tile: [BLOCK_K, BLOCK_N]
        acc0 = tl.dot(a, w0, acc0)
    rk = tl.arange(0, BLOCK_K)  # K step 0: W loaded early
    if GDC:
        a = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a_e0], dtype=tl.float16, is_pure=False, pack=2)
    else:
        a = tl.load(a_ptr + rm[:, None] * 32 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 32), other=0.0)
    acc0 = tl.dot(a, w0_e0, acc0)
    tl.store(out0_ptr + rm[:, None] * 168 + rn[None, :], acc0.to(tl.float16), mask=mask)
