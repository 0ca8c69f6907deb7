"""Fused kernel (reduction-single): aten._to_copy.default, aten.mean.default.

grid: (1,); rows = 1, reduced extent = 32*batch*seq
"""

import triton
import triton.language as tl

ROWS = tl.constexpr(1)
BLOCK_R = tl.constexpr(8192)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def fused_cast_mean(in0, out0, s_batch, s_seq):
    # in0: *fp16, out0: *fp32, s_batch: i32, s_seq: i32
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, BLOCK_R)[None, :]
    c_mask = c < 32*s_batch*s_seq
    rc_mask = (r >= 0) & c_mask
    v0 = tl.load(in0 + (c), mask=c_mask, other=0).to(tl.float32)
    v1 = tl.sum(tl.where(rc_mask, v0, 0.0), axis=1, keep_dims=True)
    v2 = (v1 / (32*s_batch*s_seq).to(tl.float32))
    tl.store(out0 + (0 + 0 * r), v2)
