"""Fused kernel (pointwise): aten.permute.default, aten.view.default, aten.mul.Tensor, aten.add.Tensor, aten.clone.default.

grid: ((480*batch + 1023)//1024,)
"""

import triton
import triton.language as tl

BLOCK = tl.constexpr(1024)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def fused_mul_add_clone(in0, in1, in2, out0, out1, s_batch):
    # in0: *fp16, in1: *fp16, in2: *fp16, out0: *fp16, out1: *fp16, s_batch: i32
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x_mask = x < 480*s_batch
    v0 = tl.load(in0 + (x), mask=x_mask, other=0).to(tl.float32)
    v1 = tl.load(in1 + (x), mask=x_mask, other=0).to(tl.float32)
    v2 = tl.load(in2 + ((x % 16)), mask=x_mask, other=0).to(tl.float32)
    v3 = (v1 * v2)
    v4 = (v0 + v3)
    tl.store(out0 + ((x % 16) * 30 + ((x // 16) % 30) + (x // 480) * 480), v4.to(tl.float16), mask=x_mask)
    tl.store(out1 + (x), v4.to(tl.float16), mask=x_mask)
