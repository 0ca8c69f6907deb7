"""An attention block's output projection, the residual add, Llama's RMSNorm and the stacked
gate/up with SiLU(gate) * up, at 2-16 rows (decode at batch 2-16): h = r + o(x), then
silu(gate(norm(h))) * up(norm(h)) and h. float16 (Triton's interpreter computes bfloat16's
``tl.dot`` wrongly; the join takes bfloat16 sites only, so its test lets float16 in), batch
bucket 8 (paddable). The first GEMM's
weights are small (o: 512 → 2048), so it runs the built-in 16-row tile (``gemv_16x32x128``);
each half of the stacked gate/up (2048 → 2560) is past 8 MiB, so it runs the swapped form
(``fews_16x64x128``) after the RMSNorm kernel, and the two join through the first tile's
per-tile sums of squares (``gemm_stats``, ``gemm_pairs.TILE_STATS``)."""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_rms import RMSNorm  # noqa: E402  (Llama's, as transformers writes it)

from aot import Dim, Input, ModelSpec  # noqa: E402

K, HIDDEN, INTERMEDIATE = 512, 1024, 4224


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.o = nn.Linear(K, HIDDEN, bias=False)
        self.norm = RMSNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)

    def forward(self, x, r):  # x: [B, 1, K], r: [B, 1, HIDDEN]
        h = r + self.o(x)
        a = self.norm(h)
        return torch.nn.functional.silu(self.gate(a)) * self.up(a), h


batch = Dim("batch", 1, 16, buckets=(8,), paddable=True)
spec = ModelSpec(
    module=Block,
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, HIDDEN))],
    dtype="float16",
)
