"""GEMM candidates with row-norm (RMSNorm) prologues, a Llama decoder's MLP half at K = 600 (not a
multiple of any BLOCK_K: vec_1x2x512 takes two K steps, the second partial): h = x + r, then
RMSNorm as transformers' Llama writes it (fp32 statistics, the cast back before the weight) →
gate and up (stacked into one GEMM) → SiLU(gate) * up → down, + h; then RMSNorm of that sum →
Linear(600→48). Both sums are read later (h by the second residual add, the second one is an
output), so the GEMMs that absorb the norm kernels write them. bfloat16; ``gemm_rms16.py`` and
``gemm_rms32.py`` are the same in float16 and float32."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec

HIDDEN, INTERMEDIATE, OUT = 600, 64, 48


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = RMSNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.norm2 = RMSNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, OUT, bias=False)

    def forward(self, x, r):  # x, r: [B, HIDDEN]
        h = x + r
        n = self.norm1(h)
        h2 = h + self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))
        return self.proj(self.norm2(h2)), h2


batch = Dim("batch", 1, 8, buckets=(1, 8))


def make_spec(dtype: str) -> ModelSpec:
    return ModelSpec(
        module=Block,
        inputs=[Input("x", (batch, HIDDEN)), Input("r", (batch, HIDDEN))],
        dtype=dtype,
    )


spec = make_spec("bfloat16")
