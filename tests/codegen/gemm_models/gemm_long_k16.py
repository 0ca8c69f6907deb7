"""A long-K GEMM (a down projection's shape, small): Linear(4096 → 96) + residual, then
Linear(96 → 64), float16, batch buckets 1 and 8: the split-K few-row forms take the first (K >=
``gemm_defaults.LONG_K``). Two GEMM sites, so the default build keeps them apart (one small GEMM
whose output is the program's goes to ``gemm.small_gemm_kernels``)."""

from torch import nn

from aot import Dim, Input, ModelSpec

K, N, OUT = 4096, 96, 64


class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Linear(K, N, bias=False)
        self.out = nn.Linear(N, OUT, bias=False)

    def forward(self, x, r):  # x: [B, K], r: [B, N]
        return self.out(r + self.down(x))


batch = Dim("batch", 1, 8, buckets=(1, 8))
spec = ModelSpec(module=Down, inputs=[Input("x", (batch, K)), Input("r", (batch, N))], dtype="float16")
