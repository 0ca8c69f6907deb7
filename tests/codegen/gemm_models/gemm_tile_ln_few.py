"""``gemm_tile_ln_many.py``'s block at 2-32 rows (decode at batch 2-32, a short prompt): batch
buckets 8 and 32 (paddable). At 8 rows both GEMMs run the built-in 16-row tile
(``gemv_16x32x128``), at 32 rows ``BUILT_IN_32``'s 64-row tile (``tile_64x32x128``); both pairs
join through the first tile's row statistics with ``AOTPACK_TILE_STATS=on``, as at 33-128 rows."""

import sys
from functools import partial
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_reduce_norm import Block  # noqa: E402

from aot import Dim, Input, ModelSpec  # noqa: E402

K, N, OUT = 512, 640, 64

batch = Dim("batch", 1, 32, buckets=(8, 32), paddable=True)
spec = ModelSpec(
    module=partial(Block, K, N, OUT, nn.LayerNorm, True),
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, N))],
    dtype="float16",
)
