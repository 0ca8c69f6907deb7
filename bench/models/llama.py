"""A Llama-style causal LM from transformers, with random weights: ``input_ids [B, S] -> logits``.

The configuration is ``bench/decode.py``'s Llama (d 2048, 10 layers, 32 query heads over 8 KV
heads, vocab 32000: about 0.58B parameters), an unmodified ``LlamaForCausalLM`` built without a
KV cache. With ``AOTPACK_BENCH_SMOKE=1`` (``bench/run.py --smoke``) it is decode.py's tiny config,
for a run on a CPU in seconds.
"""

import os
import sys
from pathlib import Path

from aot import Dim, Input, ModelSpec, SpecError

ROOT = Path(__file__).resolve().parents[2]
SMOKE = os.environ.get("AOTPACK_BENCH_SMOKE") == "1"
VOCAB = 128 if SMOKE else 32000  # decode.py's; checked against its config when the module is built
MAX_SEQ = 16 if SMOKE else 256


def make_llama():
    sys.path.insert(0, str(ROOT))  # bench.decode, and through it tests/realmodels for a CPU torch
    from bench.decode import config

    cls, cfg = config("llama", tiny=SMOKE)
    if cfg.vocab_size != VOCAB:
        raise SpecError(f"bench/decode.py's Llama has vocab {cfg.vocab_size}, this file says {VOCAB}")
    cfg.use_cache = False  # a forward over the whole sequence: no cache to build or return
    cfg.pad_token_id = 0
    return cls(cfg)


batch = Dim("batch", 1, 8, buckets=(1, 8))
seq = Dim("seq", 1, MAX_SEQ, buckets=(1, 8, 16) if SMOKE else (1, 128, 256))
spec = ModelSpec(
    module=make_llama,
    inputs=[Input("input_ids", (batch, seq), dtype="int64", low=0, high=VOCAB)],
    dtype="float16",
    name="llama",
)
