"""A stacked gate/up past 8 MiB a half: Linear(1024 → 2 x 4608) cut in halves, SiLU(gate) * up
(a SwiGLU MLP's first half, 9 MiB a half in float16), batch buckets 1 and 8: at 8 rows the
built-in entry's whole swapped form, the site's 9216 rows of W being wide
(``gemm_defaults.BUILT_IN_LARGE``), where N = 4608 alone would take the K-sliced form."""

import torch
from torch import nn

from aot import Dim, Input, ModelSpec

K, N = 1024, 4608


class GateUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(K, 2 * N, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


batch = Dim("batch", 1, 8, buckets=(1, 8))
spec = ModelSpec(module=GateUp, inputs=[Input("x", (batch, K))], dtype="float16")
