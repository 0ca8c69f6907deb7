"""A split-K GEMM whose output only a residual add and an RMSNorm read, then a GEMM of the normed
rows: h = r + Linear(4096 → 2048)(x), y = Linear(2048 → 64)(rms_norm(h)), float16, batch
buckets 1, 8 and 32 (paddable), one token a row as in a decode step ([B, 1, K]: each Linear a
view, the GEMM and a view back, so the first site's steps have A's view between them). The shape
of a decoder layer's down projection, the next layer's norm and a projection after it: at 8 and 32
rows the built-in entry runs the first in K slices and the second as a swapped form after the norm
kernel, so ``gemm_pairs`` joins them (the reduce runs the norm) unless ``AOTPACK_REDUCE_NORM=off``."""

import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_rms import RMSNorm  # noqa: E402  (Llama's, as transformers writes it)

from aot import Dim, Input, ModelSpec  # noqa: E402

K, N, OUT = 4096, 2048, 64


class Block(nn.Module):
    """``norm``: the norm's class (RMSNorm; ``gemm_reduce_ln.py``: LayerNorm), ``bias``: the
    Linears'."""

    def __init__(self, k: int = K, n: int = N, out: int = OUT, norm: type = RMSNorm, bias: bool = False):
        super().__init__()
        self.down = nn.Linear(k, n, bias=bias)
        self.norm = norm(n)
        self.proj = nn.Linear(n, out, bias=bias)

    def forward(self, x, r):  # x: [B, 1, K], r: [B, 1, N]
        h = r + self.down(x)
        return self.proj(self.norm(h)), h


batch = Dim("batch", 1, 32, buckets=(1, 8, 32), paddable=True)
spec = ModelSpec(
    module=Block,
    inputs=[Input("x", (batch, 1, K)), Input("r", (batch, 1, N))],
    dtype="float16",
)
