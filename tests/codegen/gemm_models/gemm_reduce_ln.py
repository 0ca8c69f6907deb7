"""``gemm_reduce_norm.py`` with GPT-2's norm: a split-K GEMM (with a bias) whose output only a
residual add and a LayerNorm read, then a GEMM of the normed rows: h = r + Linear(3072 → 768)(x),
y = Linear(768 → 2304)(layer_norm(h)), float16, batch buckets 1, 8 and 32 (paddable), one token a
row ([B, 1, K]). GPT-2's MLP down projection, the next layer's ``ln_1`` and its q/k/v projection:
at 8 and 32 rows the built-in entry runs the first in K slices and the second's plain form after
the add + LayerNorm kernel, so ``gemm_pairs`` joins them (the reduce runs the LayerNorm) unless
``AOTPACK_REDUCE_NORM=off``."""

from torch import nn

from aot import Dim, Input, ModelSpec

K, N, OUT = 3072, 768, 2304


class Block(nn.Module):
    def __init__(self, k: int = K, n: int = N, out: int = OUT):
        super().__init__()
        self.down = nn.Linear(k, n)
        self.norm = nn.LayerNorm(n, eps=1e-5)
        self.proj = nn.Linear(n, out)

    def forward(self, x, r):  # x: [B, 1, K], r: [B, 1, N]
        h = r + self.down(x)
        return self.proj(self.norm(h)), h


batch = Dim("batch", 1, 32, buckets=(1, 8, 32), paddable=True)
spec = ModelSpec(
    module=Block,
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, N))],
    dtype="float16",
)
