"""GEMM candidate tileme_splitk3_64x32x128 (split-K reduce + epilogue): GEMM + bias.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch, N = 1024, K = 4096, float16;
grid: ((batch + 63)//64, 32,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(64)
BLOCK_N = tl.constexpr(32)
BLOCK_K = tl.constexpr(128)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_addmm_tileme_splitk3_64x32x128_reduce(ws_ptr, b0_ptr, out0_ptr, M):
    # ws_ptr: *fp32, b0_ptr: *fp16, out0_ptr: *fp16, M: i32
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 1024
    mask = mask_m[:, None] & mask_n[None, :]
    # the biases (weights) before the wait, in registers for the epilogue
    b0_e = tl.load(b0_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ks in tl.static_range(3):  # fixed order: the same bits on every run
        acc0 += tl.load(ws_ptr + ((ks * 1 + 0) * M + rm[:, None]) * 1024 + rn[None, :], mask=mask, other=0.0)
    acc0 = acc0 + b0_e
    tl.store(out0_ptr + rm[:, None] * 1024 + rn[None, :], acc0.to(tl.float16), mask=mask)
