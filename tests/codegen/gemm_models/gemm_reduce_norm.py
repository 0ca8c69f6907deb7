"""A split-K GEMM whose output only a residual add and an RMSNorm read, then a GEMM of the normed
rows: h = r + Linear(4096 → 2048)(x), y = Linear(2048 → 64)(rms_norm(h)), float16, batch
buckets 1, 8 and 32 (paddable). The shape of a decoder layer's down projection, the next layer's
norm and a projection after it: at 8 and 32 rows the built-in entry runs the first in K slices
and the second as a swapped form after the norm kernel, so ``gemm_pairs`` joins them (the
reduce runs the norm) where ``AOTPACK_REDUCE_NORM=on``."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec

K, N, OUT = 4096, 2048, 64


class RMSNorm(nn.Module):
    """Llama's: the mean of squares in float32, the normed row cast back, times the weight."""

    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Block(nn.Module):
    def __init__(self, k: int = K, n: int = N, out: int = OUT):
        super().__init__()
        self.down = nn.Linear(k, n, bias=False)
        self.norm = RMSNorm(n)
        self.proj = nn.Linear(n, out, bias=False)

    def forward(self, x, r):  # x: [B, K], r: [B, N]
        h = r + self.down(x)
        return self.proj(self.norm(h)), h


batch = Dim("batch", 1, 32, buckets=(1, 8, 32), paddable=True)
spec = ModelSpec(
    module=Block,
    inputs=[Input("x", (batch, K)), Input("r", (batch, N))],
    dtype="float16",
)
