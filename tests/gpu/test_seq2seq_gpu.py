"""Encoder-decoder bundles on a GPU: bundles of BART, T5 and Whisper (``aot.hf.seq2seq``) built on
the CPU box generate on the GPU transformers' greedy tokens (fp32), the CPU's, with lazily
captured CUDA graphs, all captured at load, and without graphs.

    pytest -m gpu tests/gpu/test_seq2seq_gpu.py

Builds its bundles itself (tiny configs) for the GPU's arch. Never run in CI (no GPU there).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

MAX_BATCH, NEW_TOKENS = 4, 6


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.fixture(scope="module", params=["bart", "t5", "whisper"])
def bundle(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import seq2seq
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_seq2seq import MAX_TARGET, built, factory, max_source

    kind = request.param
    spec = seq2seq(
        factory(kind), max_batch=MAX_BATCH, max_source=max_source(kind), max_target=MAX_TARGET, name=kind
    )
    path = tmp_path_factory.mktemp("gpu_seq2seq") / f"{kind}.tpk"
    pack(generate(trace(spec), (_arch(),)), path)
    return kind, path, built(kind)


@pytest.mark.parametrize("capture", ["lazy", "all", "none"])
def test_gpu_generates_transformers_greedy_tokens(bundle, capture):
    import aot.loader
    from tests.hf.test_seq2seq import hf_greedy, sources

    kind, path, model = bundle
    source = sources(kind, 3)
    want = hf_greedy(model, source, NEW_TOKENS).tolist()
    cpu = aot.loader.load(path, device="cpu")
    gpu = aot.loader.load(path, device="cuda", capture=capture)
    if kind == "whisper":
        run = {"input_features": source["input_features"]}
    else:
        run = {"prompt_ids": source["input_ids"], "attention_mask": source["attention_mask"]}
    assert cpu.generate(**run, max_new_tokens=NEW_TOKENS) == want
    for _ in range(2):  # capture, then replay
        assert gpu.generate(**run, max_new_tokens=NEW_TOKENS) == want
    one = {k: v[:2] for k, v in run.items()}  # batch 2: a bucket of its own
    assert gpu.generate(**one, max_new_tokens=NEW_TOKENS) == want[:2]
