"""GEMMs at 33-128 rows: h = r + Linear(4096 → 96)(x), then Linear(96 → 2048)(h) + Linear(1024 → 2048)(z),
float16, batch buckets 64 and 128 (paddable; no bucket of 1-32 rows, whose forms the interpreter
would run at 100 rows too). By default (``gemm_defaults.MANY_ROWS``) ``tilem_64x64x128`` at K = 96
(N 2048); with ``AOTPACK_MANY_ROWS=on`` also ``tilem_64x32x128`` at K = 4096 with N = 96 (the
residual add in its epilogue) and at K = 1024."""

from torch import nn

from aot import Dim, Input, ModelSpec

K, N, OUT, SIDE = 4096, 96, 2048, 1024


class Many(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Linear(K, N, bias=False)
        self.wide = nn.Linear(N, OUT, bias=False)
        self.side = nn.Linear(SIDE, OUT, bias=False)

    def forward(self, x, r, z):  # x: [B, K], r: [B, N], z: [B, SIDE]
        return self.wide(r + self.down(x)) + self.side(z)


batch = Dim("batch", 33, 128, buckets=(64, 128), paddable=True)
spec = ModelSpec(
    module=Many,
    inputs=[Input("x", (batch, K)), Input("r", (batch, N)), Input("z", (batch, SIDE))],
    dtype="float16",
)
