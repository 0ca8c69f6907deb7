"""A Linear whose bias a kernel computes (its bias scaled by the input ``s``), at batch buckets 1
and 8: the GEMM site's bias is no weight, so its forms load it after the wait for the kernel
before (``gemm_sites.Site.bias_weights``), where a weight's bias loads before it. K = 2048: at 8
rows the site runs in K slices and the reduce adds the bias. A second Linear (a weight's bias)
after it makes two sites (one alone would run ``gemm.small_gemm_kernels``' form)."""

from torch import nn
from torch.nn import functional as F

from aot import Dim, Input, ModelSpec

K, N, OUT = 2048, 640, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(K, N)
        self.out = nn.Linear(N, OUT)

    def forward(self, x, s):  # x: [B, K]; s: [N]
        return self.out(F.linear(x, self.lin.weight, self.lin.bias * s))


batch = Dim("batch", 1, 8, buckets=(1, 8), paddable=True)
spec = ModelSpec(module=Block, inputs=[Input("x", (batch, K)), Input("s", (N,))], dtype="float16")
