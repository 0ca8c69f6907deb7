"""Fused kernel (pointwise-tiled): aten.permute.default, aten.view.default, aten.mul.Tensor, aten.add.Tensor.

grid: ((16*batch + 63)//64, 1,); rows = 16*batch, columns = 30
"""

import triton
import triton.language as tl

ROWS = tl.constexpr(64)
BLOCK_R = tl.constexpr(32)


@triton.jit
def fused_mul_add(in0, in1, in2, out0, s_batch):
    # in0: *fp16, in1: *fp16, in2: *fp16, out0: *fp16, s_batch: i32
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    r_mask = r < 16*s_batch
    c = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    c_mask = c < 30
    rc_mask = r_mask & c_mask
    v0 = tl.load(in0 + (c * 16 + (r % 16) + (r // 16) * 480), mask=rc_mask, other=0).to(tl.float32)
    v1 = tl.load(in1 + (c * 16 + (r % 16) + (r // 16) * 480), mask=rc_mask, other=0).to(tl.float32)
    v2 = tl.load(in2 + ((r % 16)), mask=r_mask, other=0).to(tl.float32)
    v3 = (v1 * v2)
    v4 = (v0 + v3)
    tl.store(out0 + (c + r * 30), v4.to(tl.float16), mask=rc_mask)
