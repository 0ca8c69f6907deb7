"""GEMM candidate vec_1x2x512 (fused): LayerNorm of a sum prologue + GEMM + bias + epilogue gelu.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch, N = 4096, K = 1024, float16;
grid: (2048, (batch + 0)//1,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(1)
BLOCK_N = tl.constexpr(2)
BLOCK_K = tl.constexpr(512)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_ln_addmm_epilogue_vec_1x2x512(x_ptr, y_ptr, lnw_ptr, lnb_ptr, sum_ptr, w0_ptr, b0_ptr, out0_ptr, M):
    # x_ptr: *fp16, y_ptr: *fp16, lnw_ptr: *fp16, lnb_ptr: *fp16, sum_ptr: *fp16, w0_ptr: *fp16, b0_ptr: *fp16, out0_ptr: *fp16, M: i32
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 4096
    mask = mask_m[:, None] & mask_n[None, :]
    # this block's rows of W, every K step, before the wait (see kernel_module)
    rk = 0 + tl.arange(0, BLOCK_K)
    w0_0 = tl.load(w0_ptr + rn[:, None] * 1024 + rk[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
    rk = 512 + tl.arange(0, BLOCK_K)
    w0_1 = tl.load(w0_ptr + rn[:, None] * 1024 + rk[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rs0 = 0 + tl.arange(0, 256)
    xs0 = tl.load(x_ptr + rm[:, None] * 1024 + rs0[None, :], mask=mask_m[:, None] & (rs0[None, :] < 1024), other=0.0).to(tl.float32)
    xs0 = xs0 + tl.load(y_ptr + rm[:, None] * 1024 + rs0[None, :], mask=mask_m[:, None] & (rs0[None, :] < 1024), other=0.0).to(tl.float32)
    xs0 = xs0.to(tl.float16).to(tl.float32)
    rs1 = 256 + tl.arange(0, 256)
    xs1 = tl.load(x_ptr + rm[:, None] * 1024 + rs1[None, :], mask=mask_m[:, None] & (rs1[None, :] < 1024), other=0.0).to(tl.float32)
    xs1 = xs1 + tl.load(y_ptr + rm[:, None] * 1024 + rs1[None, :], mask=mask_m[:, None] & (rs1[None, :] < 1024), other=0.0).to(tl.float32)
    xs1 = xs1.to(tl.float16).to(tl.float32)
    rs2 = 512 + tl.arange(0, 256)
    xs2 = tl.load(x_ptr + rm[:, None] * 1024 + rs2[None, :], mask=mask_m[:, None] & (rs2[None, :] < 1024), other=0.0).to(tl.float32)
    xs2 = xs2 + tl.load(y_ptr + rm[:, None] * 1024 + rs2[None, :], mask=mask_m[:, None] & (rs2[None, :] < 1024), other=0.0).to(tl.float32)
    xs2 = xs2.to(tl.float16).to(tl.float32)
    rs3 = 768 + tl.arange(0, 256)
    xs3 = tl.load(x_ptr + rm[:, None] * 1024 + rs3[None, :], mask=mask_m[:, None] & (rs3[None, :] < 1024), other=0.0).to(tl.float32)
    xs3 = xs3 + tl.load(y_ptr + rm[:, None] * 1024 + rs3[None, :], mask=mask_m[:, None] & (rs3[None, :] < 1024), other=0.0).to(tl.float32)
    xs3 = xs3.to(tl.float16).to(tl.float32)
    if (tl.program_id(0) == 0):
        tl.store(sum_ptr + rm[:, None] * 1024 + rs0[None, :], xs0.to(tl.float16), mask=mask_m[:, None] & (rs0[None, :] < 1024))
        tl.store(sum_ptr + rm[:, None] * 1024 + rs1[None, :], xs1.to(tl.float16), mask=mask_m[:, None] & (rs1[None, :] < 1024))
        tl.store(sum_ptr + rm[:, None] * 1024 + rs2[None, :], xs2.to(tl.float16), mask=mask_m[:, None] & (rs2[None, :] < 1024))
        tl.store(sum_ptr + rm[:, None] * 1024 + rs3[None, :], xs3.to(tl.float16), mask=mask_m[:, None] & (rs3[None, :] < 1024))
    mean = (tl.sum(xs0, axis=1) + tl.sum(xs1, axis=1) + tl.sum(xs2, axis=1) + tl.sum(xs3, axis=1)) / 1024
    dev0 = tl.where(rs0[None, :] < 1024, xs0 - mean[:, None], 0.0)
    dev1 = tl.where(rs1[None, :] < 1024, xs1 - mean[:, None], 0.0)
    dev2 = tl.where(rs2[None, :] < 1024, xs2 - mean[:, None], 0.0)
    dev3 = tl.where(rs3[None, :] < 1024, xs3 - mean[:, None], 0.0)
    var = (tl.sum(dev0 * dev0, axis=1) + tl.sum(dev1 * dev1, axis=1) + tl.sum(dev2 * dev2, axis=1) + tl.sum(dev3 * dev3, axis=1)) / 1024
    rstd = 1.0 / tl.sqrt(var + 1e-05)
    part0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    rk = 0 + tl.arange(0, BLOCK_K)
    xs = tl.load(x_ptr + rm[:, None] * 1024 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 1024), other=0.0).to(tl.float32)
    xs = xs + tl.load(y_ptr + rm[:, None] * 1024 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 1024), other=0.0).to(tl.float32)
    xs = xs.to(tl.float16).to(tl.float32)
    a = (xs - mean[:, None]) * rstd[:, None]
    a = a * tl.load(lnw_ptr + rk, mask=rk < 1024, other=0.0).to(tl.float32)[None, :]
    a = a + tl.load(lnb_ptr + rk, mask=rk < 1024, other=0.0).to(tl.float32)[None, :]
    a = tl.where(mask_m[:, None] & (rk[None, :] < 1024), a, 0.0).to(tl.float16)
    part0 += w0_0.to(tl.float32) * a.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
    rk = 512 + tl.arange(0, BLOCK_K)
    xs = tl.load(x_ptr + rm[:, None] * 1024 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 1024), other=0.0).to(tl.float32)
    xs = xs + tl.load(y_ptr + rm[:, None] * 1024 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 1024), other=0.0).to(tl.float32)
    xs = xs.to(tl.float16).to(tl.float32)
    a = (xs - mean[:, None]) * rstd[:, None]
    a = a * tl.load(lnw_ptr + rk, mask=rk < 1024, other=0.0).to(tl.float32)[None, :]
    a = a + tl.load(lnb_ptr + rk, mask=rk < 1024, other=0.0).to(tl.float32)[None, :]
    a = tl.where(mask_m[:, None] & (rk[None, :] < 1024), a, 0.0).to(tl.float16)
    part0 += w0_1.to(tl.float32) * a.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
    acc0 = tl.sum(part0, axis=1)[None, :]
    acc0 = acc0 + tl.load(b0_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    v0 = (0.5 * acc0 * (1.0 + tl.erf(acc0 * 0.7071067811865476)))
    tl.store(out0_ptr + rm[:, None] * 4096 + rn[None, :], v0.to(tl.float16), mask=mask)
