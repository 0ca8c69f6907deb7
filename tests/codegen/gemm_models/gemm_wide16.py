"""One GEMM past 8 MiB: Linear(2048 → 3072) (a q/k/v projection's shape, 12 MiB in float16),
float16, batch buckets 1 and 8: at 8 rows the built-in entry's swapped form in K slices
(``gemm_defaults.BUILT_IN_LARGE``)."""

from torch import nn

from aot import Dim, Input, ModelSpec

K, N = 2048, 3072

batch = Dim("batch", 1, 8, buckets=(1, 8))
spec = ModelSpec(module=lambda: nn.Linear(K, N, bias=False), inputs=[Input("x", (batch, K))], dtype="float16")
