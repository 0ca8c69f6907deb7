"""The greedy step's kernel on a GPU (``aot.codegen.greedy``, launched by the loader's decode
blocks): tiny Llamas of wide vocabularies (50,257 and 128,256 logits: 25 and 63 chunks a row) in
float16 generate, in blocks of steps captured as CUDA graphs, the tokens of the ATen steps
(``AOTPACK_GREEDY_KERNEL=off``, the same bundle and GPU), with and without end tokens,
at batch 1 and 4 with left padding, graph captured then replayed; the kernel ran, and its
counters are zero after.

    pytest -m gpu tests/gpu/test_greedy_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[50257, 128256])
def bundle(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.realmodels.conftest import require

    require("transformers")
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import tiny_llama

    major, minor = torch.cuda.get_device_capability()
    factory = tiny_llama(num_hidden_layers=2, vocab_size=request.param, max_position_embeddings=64)
    spec = causal_lm(factory, max_batch=4, max_context=64, dtype="float16", name="wide")
    path = tmp_path_factory.mktemp("greedy") / f"wide-{request.param}.tpk"
    pack(generate(trace(spec), (f"sm_{major}{minor}",)), path)
    return path


def test_the_greedy_kernel_gives_the_aten_steps_tokens(bundle, monkeypatch):
    import aot.loader
    from aot.loader import decode_blocks

    launched = []
    launch = decode_blocks._Greedy.launch

    def counted(self, args, rows):
        launched.append(rows)
        launch(self, args, rows)

    monkeypatch.setattr(decode_blocks._Greedy, "launch", counted)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [4], [7, 7, 7, 7, 7, 7, 7]]
    n = 40
    gpu = aot.loader.load(bundle, device="cuda")
    monkeypatch.setenv(decode_blocks.GREEDY_ENV, "off")
    aten = aot.loader.load(bundle, device="cuda")
    want = aten.generate(prompts, n)
    assert not launched
    monkeypatch.delenv(decode_blocks.GREEDY_ENV)
    for _ in range(2):  # captured, then replayed
        assert gpu.generate(prompts, n) == want
    assert launched and set(launched) == {4}
    eos = [want[0][9], want[2][20]]
    assert gpu.generate(prompts, n, eos_token_id=eos) == aten.generate(prompts, n, eos_token_id=eos)
    assert gpu.generate(prompts[3], n) == aten.generate(prompts[3], n)
    assert 1 in launched
    blocks = [b for b in gpu._decode_blocks.values() if b.greedy is not None]
    assert blocks and all(not b.counts.any().item() for b in blocks)
