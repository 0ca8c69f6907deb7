"""A tiny decoder with a KV cache whose attention is written out (products summed, a masked
softmax) rather than an SDPA call or batched matmuls, to the LM wrapper contract of ``aot.hf.causal_lm`` (as ``tiny_lm.py``): keyword
inputs ``input_ids`` [batch, seq], ``position_ids`` [batch, seq], ``cache_position`` [seq],
``attention_mask`` [batch, max_context], state ``key_cache`` / ``value_cache`` [batch, heads,
max_context, head_dim]; it returns the logits of the last position, [batch, vocab]. Every step of
it has a Triton form, so it builds ``--library-free`` and runs on ``aotpack-rt``."""

import torch
from torch import nn

from aot import Dim, EntryPoint, Input, ModelSpec

VOCAB, D_MODEL, HEADS = 61, 32, 2
HEAD_DIM = D_MODEL // HEADS
MAX_BATCH, MAX_CONTEXT = 4, 32


class TinyStateLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(MAX_CONTEXT, D_MODEL)
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.q = nn.Linear(D_MODEL, D_MODEL)
        self.k = nn.Linear(D_MODEL, D_MODEL)
        self.v = nn.Linear(D_MODEL, D_MODEL)
        self.o = nn.Linear(D_MODEL, D_MODEL)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids, position_ids, cache_position, attention_mask, key_cache, value_cache):
        b, t = input_ids.shape
        x = self.tok(input_ids) + self.pos(position_ids)  # [B, T, C]
        h = self.norm1(x)
        q = self.q(h).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)  # [B, H, T, D]
        key_cache.index_copy_(2, cache_position, self.k(h).view(b, t, HEADS, HEAD_DIM).transpose(1, 2))
        value_cache.index_copy_(2, cache_position, self.v(h).view(b, t, HEADS, HEAD_DIM).transpose(1, 2))
        slots = torch.arange(MAX_CONTEXT, device=input_ids.device)
        causal = slots[None, :] <= cache_position[:, None]  # [T, S]
        keep = ((attention_mask[:, None, None, :] != 0) & causal[None, None]) | (
            slots[None, :] == cache_position[:, None]
        )[None, None]  # [B, 1, T, S]: a query always sees its own slot
        # products summed, not matmuls: pointwise and reductions, which the fuser makes kernels of
        scores = (q[:, :, :, None, :] * key_cache[:, :, None]).sum(-1) * HEAD_DIM**-0.5  # [B, H, T, S]
        weights = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        y = (weights[..., None] * value_cache[:, :, None]).sum(-2)  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(b, t, D_MODEL)
        x = x + self.o(y)
        return self.head(self.norm2(x[:, -1]))  # [B, vocab]


batch = Dim("batch", 1, MAX_BATCH)
seq = Dim("seq", 1, MAX_CONTEXT)
cache_shape = (batch, HEADS, MAX_CONTEXT, HEAD_DIM)


def _examples(sizes):
    t = sizes["seq"]
    return {
        "cache_position": torch.arange(t, dtype=torch.int64),
        "position_ids": torch.arange(t, dtype=torch.int64).expand(sizes["batch"], t).contiguous(),
    }


spec = ModelSpec(
    module=TinyStateLM,
    inputs=[
        Input("input_ids", (batch, seq), dtype="int64", low=0, high=VOCAB),
        Input("position_ids", (batch, seq), dtype="int64", low=0, high=MAX_CONTEXT),
        Input("cache_position", (seq,), dtype="int64", low=0, high=MAX_CONTEXT),
        Input("attention_mask", (batch, MAX_CONTEXT), dtype="int64", low=1, high=2),
        Input("key_cache", cache_shape, state=True),
        Input("value_cache", cache_shape, state=True),
    ],
    entry_points=(EntryPoint("prefill"), EntryPoint("decode", {"seq": 1})),
    example_inputs=_examples,
)
