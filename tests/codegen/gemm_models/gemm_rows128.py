"""GEMMs at 33-128 rows: h = r + Linear(4096 → 96)(x), then Linear(96 → 64)(h) + Linear(1024 → 64)(z),
float16, batch buckets 1, 32 and 128 (paddable): at 128 rows, with ``AOTPACK_MANY_ROWS=128``, the forms for 33-128 rows
(``gemm_defaults.many_row_forms``): the swapped form of 128 rows in K slices at K = 4096 (with the
residual add) and K = 1024, ``tile_64x32x128`` at K = 96."""

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


batch = Dim("batch", 1, 128, buckets=(1, 32, 128), paddable=True)
spec = ModelSpec(
    module=Down,
    inputs=[Input("x", (batch, K)), Input("r", (batch, N)), Input("z", (batch, SIDE))],
    dtype="float16",
)
