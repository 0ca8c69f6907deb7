"""``gemm_reduce_ln.py``'s block at 33-128 rows (a prompt at batch 1): h = r + Linear(2048 →
640)(x), y = Linear(640 → 64)(layer_norm(h)), float16, batch buckets 64 and 128 (paddable; no
bucket of 1-32 rows, whose forms the interpreter would run at 100 rows too). By default
(``AOTPACK_MANY_ROWS=split``) the first runs ``tilem_splitk_64x32x128`` (K slices) and the second
the 64-row tile after the add + LayerNorm kernel, so ``gemm_pairs`` joins them: the reduce runs
the LayerNorm over rows of 640 (three chunks, the last one ragged)."""

import sys
from functools import partial
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_reduce_norm import Block  # noqa: E402

from aot import Dim, Input, ModelSpec  # noqa: E402

K, N, OUT = 2048, 640, 64

batch = Dim("batch", 33, 128, buckets=(64, 128), paddable=True)
spec = ModelSpec(
    module=partial(Block, K, N, OUT, nn.LayerNorm, True),
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, N))],
    dtype="float16",
)
