"""Few-row GEMMs of long and middle K: h = r + Linear(4096 → 96)(x) (a down projection's shape,
narrow), then Linear(96 → 64)(h) + Linear(1024 → 64)(z), float16, batch buckets 1 and 8: the
split-K few-row forms take the first (K >= ``gemm_defaults.LONG_K``), the K-sliced form of middle
K the third (K >= 1024); the second's K is too short for either. Several GEMM sites, so the
default build keeps them apart (one small GEMM whose output is the program's goes to
``gemm.small_gemm_kernels``)."""

from torch import nn

from aot import Dim, Input, ModelSpec

K, N, OUT, SIDE = 4096, 96, 64, 1024


class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Linear(K, N, bias=False)
        self.out = nn.Linear(N, OUT, bias=False)
        self.side = nn.Linear(SIDE, OUT, bias=False)

    def forward(self, x, r, z):  # x: [B, K], r: [B, N], z: [B, SIDE]
        return self.out(r + self.down(x)) + self.side(z)


batch = Dim("batch", 1, 8, buckets=(1, 8))
spec = ModelSpec(
    module=Down,
    inputs=[Input("x", (batch, K)), Input("r", (batch, N)), Input("z", (batch, SIDE))],
    dtype="float16",
)
