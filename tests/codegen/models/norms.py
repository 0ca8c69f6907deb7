"""Normalizations: layer norm (affine and not), RMS norm as LLaMA writes it, var_mean."""

import torch
import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec

D = 48


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.rms = RMSNorm(D)
        with torch.no_grad():
            self.ln.weight.copy_(torch.linspace(0.5, 2.0, D))
            self.ln.bias.copy_(torch.linspace(-0.2, 0.2, D))

    def forward(self, x):  # x: [B, T, D]
        h = x + torch.cos(x)
        a = self.ln(h)
        b = self.rms(h)
        c = F.layer_norm(x, (D,))
        var, mean = torch.var_mean(h.float(), dim=-1, keepdim=True)
        z = (h.float() - mean) / torch.sqrt(var + 1e-5)
        return a + b, c, z.to(x.dtype), h


batch = Dim("batch", 1, 4)
seq = Dim("seq", 1, 40, example=7)
spec = ModelSpec(module=Norms, inputs=[Input("x", (batch, seq, D))], dtype="float16")
