"""GEMM candidate fewe_16x32x256 (fused): LayerNorm of a sum prologue + GEMM + bias + gelu_tanh.

C[M, N] = A[M, K] @ W[N, K]^T with M = batch*seq, N = 3072, K = 768, float16;
grid: ((batch*seq + 15)//16, 96,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(16)
BLOCK_N = tl.constexpr(32)
BLOCK_K = tl.constexpr(256)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gemm_ln_addmm_gelu_tanh_fewe_16x32x256(x_ptr, y_ptr, lnw_ptr, lnb_ptr, sum_ptr, w0_ptr, b0_ptr, out0_ptr, M):
    # x_ptr: *fp16, y_ptr: *fp16, lnw_ptr: *fp16, lnb_ptr: *fp16, sum_ptr: *fp16, w0_ptr: *fp16, b0_ptr: *fp16, out0_ptr: *fp16, M: i32
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < 3072
    mask = mask_m[:, None] & mask_n[None, :]
    # W's first K steps, before the wait (see kernel_module)
    rk = tl.arange(0, BLOCK_K)
    w0_e0 = tl.load(w0_ptr + rn[None, :] * 768 + rk[:, None], mask=mask_n[None, :], other=0.0)
    rk = 256 + tl.arange(0, BLOCK_K)
    w0_e1 = tl.load(w0_ptr + rn[None, :] * 768 + rk[:, None], mask=mask_n[None, :], other=0.0)
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rs0 = 0 + tl.arange(0, 256)
    xs0 = tl.load(x_ptr + rm[:, None] * 768 + rs0[None, :], mask=mask_m[:, None] & (rs0[None, :] < 768), other=0.0).to(tl.float32)
    xs0 = xs0 + tl.load(y_ptr + rm[:, None] * 768 + rs0[None, :], mask=mask_m[:, None] & (rs0[None, :] < 768), other=0.0).to(tl.float32)
    xs0 = xs0.to(tl.float16).to(tl.float32)
    rs1 = 256 + tl.arange(0, 256)
    xs1 = tl.load(x_ptr + rm[:, None] * 768 + rs1[None, :], mask=mask_m[:, None] & (rs1[None, :] < 768), other=0.0).to(tl.float32)
    xs1 = xs1 + tl.load(y_ptr + rm[:, None] * 768 + rs1[None, :], mask=mask_m[:, None] & (rs1[None, :] < 768), other=0.0).to(tl.float32)
    xs1 = xs1.to(tl.float16).to(tl.float32)
    rs2 = 512 + tl.arange(0, 256)
    xs2 = tl.load(x_ptr + rm[:, None] * 768 + rs2[None, :], mask=mask_m[:, None] & (rs2[None, :] < 768), other=0.0).to(tl.float32)
    xs2 = xs2 + tl.load(y_ptr + rm[:, None] * 768 + rs2[None, :], mask=mask_m[:, None] & (rs2[None, :] < 768), other=0.0).to(tl.float32)
    xs2 = xs2.to(tl.float16).to(tl.float32)
    if (tl.program_id(1) == 0):
        tl.store(sum_ptr + rm[:, None] * 768 + rs0[None, :], xs0.to(tl.float16), mask=mask_m[:, None] & (rs0[None, :] < 768))
        tl.store(sum_ptr + rm[:, None] * 768 + rs1[None, :], xs1.to(tl.float16), mask=mask_m[:, None] & (rs1[None, :] < 768))
        tl.store(sum_ptr + rm[:, None] * 768 + rs2[None, :], xs2.to(tl.float16), mask=mask_m[:, None] & (rs2[None, :] < 768))
    mean = (tl.sum(xs0, axis=1) + tl.sum(xs1, axis=1) + tl.sum(xs2, axis=1)) / 768
    dev0 = tl.where(rs0[None, :] < 768, xs0 - mean[:, None], 0.0)
    dev1 = tl.where(rs1[None, :] < 768, xs1 - mean[:, None], 0.0)
    dev2 = tl.where(rs2[None, :] < 768, xs2 - mean[:, None], 0.0)
    var = (tl.sum(dev0 * dev0, axis=1) + tl.sum(dev1 * dev1, axis=1) + tl.sum(dev2 * dev2, axis=1)) / 768
    rstd = 1.0 / tl.sqrt(var + 1e-05)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rk = tl.arange(0, BLOCK_K)  # K step 0: W loaded early
    xs = tl.load(x_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 768), other=0.0).to(tl.float32)
    xs = xs + tl.load(y_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 768), other=0.0).to(tl.float32)
    xs = xs.to(tl.float16).to(tl.float32)
    a = (xs - mean[:, None]) * rstd[:, None]
    a = a * tl.load(lnw_ptr + rk, mask=rk < 768, other=0.0).to(tl.float32)[None, :]
    a = a + tl.load(lnb_ptr + rk, mask=rk < 768, other=0.0).to(tl.float32)[None, :]
    a = tl.where(mask_m[:, None] & (rk[None, :] < 768), a, 0.0).to(tl.float16)
    acc0 = tl.dot(a, w0_e0, acc0)
    rk = 256 + tl.arange(0, BLOCK_K)  # K step 1: W loaded early
    xs = tl.load(x_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 768), other=0.0).to(tl.float32)
    xs = xs + tl.load(y_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 768), other=0.0).to(tl.float32)
    xs = xs.to(tl.float16).to(tl.float32)
    a = (xs - mean[:, None]) * rstd[:, None]
    a = a * tl.load(lnw_ptr + rk, mask=rk < 768, other=0.0).to(tl.float32)[None, :]
    a = a + tl.load(lnb_ptr + rk, mask=rk < 768, other=0.0).to(tl.float32)[None, :]
    a = tl.where(mask_m[:, None] & (rk[None, :] < 768), a, 0.0).to(tl.float16)
    acc0 = tl.dot(a, w0_e1, acc0)
    for k0 in range(512, 768, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 768), other=0.0).to(tl.float32)
        xs = xs + tl.load(y_ptr + rm[:, None] * 768 + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < 768), other=0.0).to(tl.float32)
        xs = xs.to(tl.float16).to(tl.float32)
        a = (xs - mean[:, None]) * rstd[:, None]
        a = a * tl.load(lnw_ptr + rk, mask=rk < 768, other=0.0).to(tl.float32)[None, :]
        a = a + tl.load(lnb_ptr + rk, mask=rk < 768, other=0.0).to(tl.float32)[None, :]
        a = tl.where(mask_m[:, None] & (rk[None, :] < 768), a, 0.0).to(tl.float16)
        w0 = tl.load(w0_ptr + rn[None, :] * 768 + rk[:, None], mask=mask_n[None, :], other=0.0)  # W^T tile: [BLOCK_K, BLOCK_N]
        acc0 = tl.dot(a, w0, acc0)
    acc0 = acc0 + tl.load(b0_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc0 = (0.5 * acc0 * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * (0.7978845608028654 * (acc0 + 0.044715 * acc0 * acc0 * acc0))) + 1.0))))
    tl.store(out0_ptr + rm[:, None] * 3072 + rn[None, :], acc0.to(tl.float16), mask=mask)
