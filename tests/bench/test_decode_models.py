"""``bench/decode.py``'s models shaped as published ones (Llama-3.2-1B, Gemma-2-2B, Qwen3-0.6B,
Phi-3-mini-4k-instruct, OLMo-2-0425-1B), without a GPU.

transformers' config classes keep a keyword they have no field for without a word (Phi-3's and
OLMo 2's have no ``head_dim``), so a misnamed field would leave a model at its class's default:
``test_models_build_their_published_shapes`` builds each on the meta device (no memory, well under
a second) and reads its shapes off the modules. ``test_tiny_config_decodes_as_transformers_does``
runs ``bench/decode.py --device cpu --tiny`` on the configs of ``decode.TINY``'s shape (a bundle
built, then it and transformers' ``generate`` each in a fresh process): aotpack's greedy tokens
equal transformers'. Seen on a 2-core CPU: 25-40 s a model, most of it the trace and the two
processes' imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import NamedTuple

import pytest

from tests.conftest import HANG_GUARD_S, ROOT


class Shape(NamedTuple):
    layers: int
    hidden: int
    intermediate: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the head's weight is the embedding's
    billions: float  # parameters, to two places


# as their config.json files and model cards have them
PUBLISHED = {
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 64, 128256, True, 1.24),
    "gemma-2-2b": Shape(26, 2304, 9216, 8, 4, 256, 256000, True, 2.61),
    "qwen3-0.6b": Shape(28, 1024, 3072, 16, 8, 128, 151936, True, 0.60),
    "phi-3-mini": Shape(32, 3072, 8192, 32, 32, 96, 32064, False, 3.82),
    "olmo-2-1b": Shape(16, 2048, 8192, 16, 16, 128, 100352, False, 1.48),
}
# the models whose tiny configs take decode.TINY's shape: layers, hidden, intermediate, query
# heads, head dim, vocabulary (their KV heads and tying as the published model's)
TINY_SHAPED = ("gemma-2-2b", "qwen3-0.6b", "phi-3-mini", "olmo-2-1b")
TINY_SHAPE = (2, 128, 256, 4, 32, 256)


def shapes(model: str, tiny: bool) -> Shape:
    """``model``'s shape as ``bench/decode.py`` builds it, read off its modules."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from decode import config, instantiate

    cls, cfg = config(model, tiny)
    with torch.device("meta"):
        module = instantiate(cls, cfg)
    body, attention = module.model, module.model.layers[0].self_attn
    heads = attention.o_proj.in_features // attention.head_dim
    vocab, hidden = body.embed_tokens.weight.shape
    return Shape(
        len(body.layers),
        hidden,
        body.layers[0].mlp.down_proj.in_features,
        heads,
        heads // attention.num_key_value_groups,
        attention.head_dim,
        vocab,
        module.lm_head.weight is body.embed_tokens.weight,
        round(sum(p.numel() for p in module.parameters()) / 1e9, 2),
    )


@pytest.mark.parametrize("model", list(PUBLISHED))
def test_models_build_their_published_shapes(model):
    from tests.realmodels.conftest import require

    require("transformers")
    sys.path.insert(0, str(ROOT / "bench"))
    from decode import GPU_DTYPE, WORKLOAD

    want = PUBLISHED[model]
    assert shapes(model, tiny=False) == want
    assert (WORKLOAD[model], GPU_DTYPE[model]) == ((32, 128), "bfloat16")  # llama-3.2-1b's anchors
    if model in TINY_SHAPED:
        tiny = shapes(model, tiny=True)
        assert (
            tiny.layers,
            tiny.hidden,
            tiny.intermediate,
            tiny.heads,
            tiny.head_dim,
            tiny.vocab,
        ) == TINY_SHAPE
        assert (tiny.kv_heads == tiny.heads, tiny.tied) == (want.kv_heads == want.heads, want.tied)


def test_bloom_560m_builds_its_published_shape():
    """BLOOM-560m (bigscience/bloom-560m's config.json): 24 layers, hidden 1024, 16 heads of 64, a
    vocabulary of 250880, the head tied to the embedding, 0.56B parameters; float16 at
    llama-3.2-1b's workload."""
    import torch

    from tests.realmodels.conftest import require

    require("transformers")
    sys.path.insert(0, str(ROOT / "bench"))
    from decode import GPU_DTYPE, WORKLOAD, config, instantiate

    cls, cfg = config("bloom-560m", tiny=False)
    with torch.device("meta"):
        module = instantiate(cls, cfg)
    body = module.transformer
    attention = body.h[0].self_attention
    shape = (len(body.h), body.word_embeddings.weight.shape, attention.num_heads, attention.head_dim)
    assert shape == (24, (250880, 1024), 16, 64)
    assert module.lm_head.weight is body.word_embeddings.weight
    assert round(sum(p.numel() for p in module.parameters()) / 1e9, 2) == 0.56
    assert (WORKLOAD["bloom-560m"], GPU_DTYPE["bloom-560m"]) == ((32, 128), "float16")


@pytest.mark.slow  # a trace and a build, then two fresh processes, per model
@pytest.mark.parametrize("model", [*TINY_SHAPED, "bloom-560m"])
def test_tiny_config_decodes_as_transformers_does(model, tmp_path):
    from tests.realmodels.conftest import require

    require("transformers")
    sys.path.insert(0, str(ROOT / "bench"))
    from decode import TINY_NEW_TOKENS

    cmd = [sys.executable, "bench/decode.py", "--device", "cpu", "--tiny", "--models", model]
    done = subprocess.run(
        [*cmd, "--systems", "aotpack,hf_eager", "--batches", "1", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert [(r["system"], r["batch"], r.get("error")) for r in rows] == [
        ("aotpack", 1, None),
        ("hf_eager", 1, None),
    ], rows
    aotpack, eager = rows
    assert len(aotpack["tokens"]) == TINY_NEW_TOKENS and aotpack["tokens"] == eager["tokens"]
