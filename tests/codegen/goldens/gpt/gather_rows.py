"""Embedding lookup: out[r, :] = W[ids[r], :] for batch*seq ids into a [50257, 768] float16 table.

An id outside the table gives a row of NaN (ATen's kernel would stop the process).
grid: (batch*seq, 1,)
"""

import triton
import triton.language as tl

ROWS = tl.constexpr(50257)
COLS = tl.constexpr(768)
BLOCK = tl.constexpr(1024)
GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel


@triton.jit
def gather_rows(w_ptr, ids_ptr, out_ptr):
    # w_ptr: *fp16, ids_ptr: *i64, out_ptr: *fp16
    if GDC:  # wait for the kernel before (its writes), then let the kernel after start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(ids_ptr + r).to(tl.int64)
    inside = (row >= 0) & (row < ROWS)
    safe = tl.where(inside, row, 0)
    v = tl.load(w_ptr + safe * COLS + cols, mask=cols < COLS)
    v = tl.where(inside, v, float('nan'))
    tl.store(out_ptr + r * COLS + cols, v, mask=cols < COLS)
