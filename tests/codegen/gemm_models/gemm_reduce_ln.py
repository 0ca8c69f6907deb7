"""``gemm_reduce_norm.py`` with GPT-2's norm: a split-K GEMM (with a bias) whose output only a
residual add and a LayerNorm read, then a GEMM of the normed rows: h = r + Linear(3072 → 768)(x),
y = Linear(768 → 2304)(layer_norm(h)), float16, batch buckets 1, 8 and 32 (paddable), one token a
row ([B, 1, K]). GPT-2's MLP down projection, the next layer's ``ln_1`` and its q/k/v projection:
at 8 and 32 rows the built-in entry runs the first in K slices and the second's plain form after
the add + LayerNorm kernel, so ``gemm_pairs`` joins them (the reduce runs the LayerNorm) unless
``AOTPACK_REDUCE_NORM`` is ``rms`` or ``off``."""

import sys
from functools import partial
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_reduce_norm import Block  # noqa: E402

from aot import Dim, Input, ModelSpec  # noqa: E402

K, N, OUT = 3072, 768, 2304

batch = Dim("batch", 1, 32, buckets=(1, 8, 32), paddable=True)
spec = ModelSpec(
    module=partial(Block, K, N, OUT, nn.LayerNorm, True),
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, N))],
    dtype="float16",
)
