"""A tiny attention decoder with a real KV cache, written to the LM wrapper contract of
``aot.hf.causal_lm``: keyword inputs ``input_ids`` [batch, seq], ``position_ids`` [batch, seq],
``cache_position`` [seq] (the cache slots written this call), ``attention_mask`` [batch,
max_context] (1 = a valid slot), then state ``key_cache_{i}`` / ``value_cache_{i}`` of shape
[batch, kv_heads, max_context, head_dim] per layer; it returns the logits of the last position,
[batch, vocab]. Grouped-query attention (4 query heads over 2 KV heads), learned positions."""

import torch
from torch import nn
from torch.nn import functional as F

from aot import Dim, EntryPoint, Input, ModelSpec

VOCAB, D_MODEL, HEADS, KV_HEADS, LAYERS = 97, 32, 4, 2, 2
HEAD_DIM = D_MODEL // HEADS
MAX_BATCH, MAX_CONTEXT = 4, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.q = nn.Linear(D_MODEL, HEADS * HEAD_DIM)
        self.kv = nn.Linear(D_MODEL, 2 * KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, D_MODEL)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, cache_position, mask, k_cache, v_cache):  # x: [B, T, C]
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)  # [B, H, T, D]
        k, v = self.kv(h).view(b, t, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)  # [B, KV, T, D] each
        k_cache.index_copy_(2, cache_position, k)
        v_cache[:, :, cache_position] = v
        groups = HEADS // KV_HEADS
        keys = (
            k_cache[:, :, None]
            .expand(b, KV_HEADS, groups, MAX_CONTEXT, HEAD_DIM)
            .reshape(b, HEADS, -1, HEAD_DIM)
        )
        values = (
            v_cache[:, :, None]
            .expand(b, KV_HEADS, groups, MAX_CONTEXT, HEAD_DIM)
            .reshape(b, HEADS, -1, HEAD_DIM)
        )
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, H, T, D]
        x = x + self.o(y.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(MAX_CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(
        self,
        input_ids,
        position_ids,
        cache_position,
        attention_mask,
        key_cache_0,
        value_cache_0,
        key_cache_1,
        value_cache_1,
    ):
        x = self.tok(input_ids) + self.pos(position_ids)
        slots = torch.arange(MAX_CONTEXT, device=input_ids.device)
        # a query sees the valid slots up to its own, and always itself (no row is fully masked)
        causal = slots[None, :] <= cache_position[:, None]  # [T, S]
        mask = (attention_mask[:, None, None, :] != 0) & causal[None, None]
        mask = mask | (slots[None, :] == cache_position[:, None])[None, None]  # [B, 1, T, S]
        caches = ((key_cache_0, value_cache_0), (key_cache_1, value_cache_1))
        for block, (k_cache, v_cache) in zip(self.blocks, caches):
            x = block(x, cache_position, mask, k_cache, v_cache)
        return self.head(self.norm(x[:, -1]))  # [B, vocab]


batch = Dim("batch", 1, MAX_BATCH)
seq = Dim("seq", 1, MAX_CONTEXT)
cache_shape = (batch, KV_HEADS, MAX_CONTEXT, HEAD_DIM)


def _examples(sizes):
    t = sizes["seq"]
    return {
        "cache_position": torch.arange(t, dtype=torch.int64),
        "position_ids": torch.arange(t, dtype=torch.int64).expand(sizes["batch"], t).contiguous(),
    }


spec = ModelSpec(
    module=TinyLM,
    inputs=[
        Input("input_ids", (batch, seq), dtype="int64", low=0, high=VOCAB),
        Input("position_ids", (batch, seq), dtype="int64", low=0, high=MAX_CONTEXT),
        Input("cache_position", (seq,), dtype="int64", low=0, high=MAX_CONTEXT),
        Input("attention_mask", (batch, MAX_CONTEXT), dtype="int64", low=1, high=2),
        *(
            Input(f"{kind}_cache_{i}", cache_shape, state=True)
            for i in range(LAYERS)
            for kind in ("key", "value")
        ),
    ],
    entry_points=(EntryPoint("prefill"), EntryPoint("decode", {"seq": 1})),
    example_inputs=_examples,
)
