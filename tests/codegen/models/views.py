"""Views folded into index arithmetic: permute + contiguous copy, slices, expand, split, select."""

from torch import nn

from aot import Dim, Input, ModelSpec


class Views(nn.Module):
    def forward(self, x):  # x: [B, T, 6, 8]
        y = x.reshape(x.shape[0], x.shape[1], 48)[..., 8:32]  # [B, T, 24]
        t = x.permute(0, 2, 1, 3).contiguous()  # [B, 6, T, 8]: a materialized transpose
        a, b, c = y.split(8, dim=-1)  # [B, T, 8] each
        s = x[:, :, 1:5, ::2] * 2.0  # [B, T, 4, 4]
        e = a.unsqueeze(2).expand(-1, -1, 6, -1) + x  # [B, T, 6, 8]
        last = y[:, -1, :] + y[:, 0, :]  # select
        mid = y[:, 1:, :] - y[:, :-1, :]  # slices with a dynamic end
        return t, (b * c).sum(-1), s, e.transpose(1, 2) * 1.0, last, mid


batch = Dim("batch", 1, 4)
seq = Dim("seq", 2, 50, example=5)
spec = ModelSpec(module=Views, inputs=[Input("x", (batch, seq, 6, 8))], dtype="float16")
