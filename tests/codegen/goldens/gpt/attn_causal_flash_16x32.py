"""Attention candidate flash_16x32: causal softmax(q k^T * 0.125) v, online, fp32 accumulation.

q, k, v: [B, H, T, D] head views of row-major projections, B = batch, T = seq,
H = 12, D = 64, float16; out: [B, T, H * D] rows.
grid: (12*batch, (seq + 15)//16,)
"""

import triton
import triton.language as tl

BLOCK_M = tl.constexpr(16)
BLOCK_N = tl.constexpr(32)
BLOCK_D = tl.constexpr(64)
HEAD_DIM = tl.constexpr(64)
HEADS = tl.constexpr(12)
Q_WIDTH = tl.constexpr(2304)
Q_COLUMN = tl.constexpr(0)
K_WIDTH = tl.constexpr(2304)
K_COLUMN = tl.constexpr(768)
V_WIDTH = tl.constexpr(2304)
V_COLUMN = tl.constexpr(1536)
OUT_WIDTH = tl.constexpr(768)
SCALE_LOG2E = tl.constexpr(0.18033688011112042)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def attn_causal_flash_16x32(q_ptr, k_ptr, v_ptr, out_ptr, T):
    # q_ptr: *fp16, k_ptr: *fp16, v_ptr: *fp16, out_ptr: *fp16, T: i32
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = bh // HEADS
    h = bh % HEADS
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rq = b * T + rm  # the queries' rows of the projections
    q = tl.load(q_ptr + rq[:, None] * Q_WIDTH + (Q_COLUMN + h * HEAD_DIM) + rd[None, :], mask=(rm < T)[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float('-inf'), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M)
    for start in range(0, hi, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        rk = b * T + rn
        valid_n = rn < T
        k = tl.load(k_ptr + rk[None, :] * K_WIDTH + (K_COLUMN + h * HEAD_DIM) + rd[:, None], mask=valid_n[None, :], other=0.0)
        s = tl.dot(q, k) * SCALE_LOG2E  # scores in log2 units
        keep = (rn[None, :] <= rm[:, None]) & valid_n[None, :]
        s = tl.where(keep, s, float('-inf'))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rk[:, None] * V_WIDTH + (V_COLUMN + h * HEAD_DIM) + rd[None, :], mask=valid_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(out_ptr + rq[:, None] * OUT_WIDTH + h * HEAD_DIM + rd[None, :], acc.to(tl.float16), mask=(rm < T)[:, None])
