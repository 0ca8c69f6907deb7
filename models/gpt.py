"""A GPT-2-small-shaped decoder: 12 layers, d=768, 12 heads, vocab 50257, causal SDPA.

Token ids in, logits out; dynamic batch and sequence length. Weights are random (seeded) unless
``--weights`` gives a safetensors file with this module's state dict.
"""

import torch
import torch.nn.functional as F
from torch import nn

from aot import Dim, Input, ModelSpec

VOCAB = 50257
N_CTX = 1024
D_MODEL = 768
N_HEAD = 12
N_LAYER = 12


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):  # x: [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(D_MODEL, dim=2)
        q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)  # [B, H, T, C/H]
        k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.proj = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(D_MODEL)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D_MODEL)
        self.wpe = nn.Embedding(N_CTX, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):  # idx: [B, T] int64
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # [B, T, VOCAB]


batch = Dim("batch", 1, 32, paddable=True)
seq = Dim(
    "seq", 1, N_CTX, buckets=(1, 16, 32, 64, 128, 256, 512, 1024), paddable=True
)  # causal: later tokens never reach earlier ones
spec = ModelSpec(
    module=GPT,
    inputs=[Input("idx", (batch, seq), dtype="int64", low=0, high=VOCAB)],
    dtype="float16",
)
