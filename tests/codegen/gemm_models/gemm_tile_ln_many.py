"""A block at 33-128 rows (a prompt at batch 1) whose two GEMMs both run the 64-row tile: h = r +
Linear(512 → 640)(x), y = Linear(640 → 64)(layer_norm(h)), float16, batch buckets 64 and 128
(paddable). The shape of GPT-2's o projection, the residual add + ``ln_2`` and fc at 128 tokens:
K below 1024, so no K slices and no reduce to run the LayerNorm in; with
``AOTPACK_TILE_STATS=on`` (``gemm_pairs.TILE_STATS``) the first tile writes its rows' statistics
over its columns and the second applies the LayerNorm after its products from them, and the add
+ LayerNorm kernel goes. 640 columns make 20 tiles of 32 (the statistics of 20 tiles a row, not a
power of two)."""

import sys
from functools import partial
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_reduce_norm import Block  # noqa: E402

from aot import Dim, Input, ModelSpec  # noqa: E402

K, N, OUT = 512, 640, 64

batch = Dim("batch", 33, 128, buckets=(64, 128), paddable=True)
spec = ModelSpec(
    module=partial(Block, K, N, OUT, nn.LayerNorm, True),
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, N))],
    dtype="float16",
)
