"""``gemm_reduce_ln_small.py``'s block (both Linears with a bias) at batch buckets 1 and 8: at one
row both GEMMs run one-row forms, at 8 rows the first in K slices (its reduce adds the bias), the
second a tile form after the add + LayerNorm kernel where the sites stay apart
(``AOTPACK_REDUCE_NORM=off``). For where a bias is loaded (``gemm_render.EARLY_BIAS``)."""

import sys
from functools import partial
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_reduce_norm import Block  # noqa: E402

from aot import Dim, Input, ModelSpec  # noqa: E402

K, N, OUT = 2048, 640, 64

batch = Dim("batch", 1, 8, buckets=(1, 8), paddable=True)
spec = ModelSpec(
    module=partial(Block, K, N, OUT, nn.LayerNorm, True),
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, N))],
    dtype="float16",
)
