"""Stateful bundles on a GPU: bundles of causal LMs built on the CPU box generate on the GPU the
same tokens as on the CPU (fp32), with lazily captured CUDA graphs, all captured at load, and
without graphs; the state stays where the graphs captured it.

    pytest -m gpu tests/gpu/test_generate_gpu.py

Builds its bundles itself (tiny configs, seconds each) for the GPU's arch. Never run in CI (no GPU
there).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

MAX_BATCH, MAX_CONTEXT, NEW_TOKENS = 4, 16, 6


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


# gemma3n_shared: a layer that reads an earlier layer's cache (a decode attention without append)
@pytest.fixture(scope="module", params=["tiny_lm", "gpt2", "llama", "gemma3n_shared", "llama_dynamic_rope"])
def bundle(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from tests.conftest import DATA

    if request.param == "tiny_lm":
        spec = load_model_file(DATA / "tiny_lm.py")
    else:
        from aot.hf import causal_lm
        from tests.hf.test_causal_lm import factory
        from tests.realmodels.conftest import require

        require("transformers")
        spec = causal_lm(
            factory(request.param), max_batch=MAX_BATCH, max_context=MAX_CONTEXT, name=request.param
        )
    path = tmp_path_factory.mktemp("gpu_lm") / f"{request.param}.tpk"
    pack(generate(trace(spec), (_arch(),)), path)
    return path


@pytest.mark.parametrize("capture", ["lazy", "all", "none"])
def test_gpu_generates_the_cpu_tokens(bundle, capture):
    import aot.loader

    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [4]]
    cpu = aot.loader.load(bundle, device="cpu")
    gpu = aot.loader.load(bundle, device="cuda", capture=capture)
    want = cpu.generate(prompts, NEW_TOKENS)
    assert gpu.generate(prompts, NEW_TOKENS) == want
    # again, now replaying the graphs captured by the first run (batch 3 has no bucket: no graph)
    assert gpu.generate(prompts, NEW_TOKENS) == want
    assert gpu.generate(prompts[:2], NEW_TOKENS) == cpu.generate(prompts[:2], NEW_TOKENS)
    assert gpu.generate([1, 2, 3], NEW_TOKENS) == cpu.generate([1, 2, 3], NEW_TOKENS)


def test_graphs_write_the_state_where_it_lives(bundle):
    import aot.loader

    gpu = aot.loader.load(bundle, device="cuda", capture="lazy")
    cpu = aot.loader.load(bundle, device="cpu")
    pointers = {n: t.data_ptr() for n, t in gpu.state.tensors.items()}
    for _ in range(2):  # capture, then replay
        gpu.generate([[3, 4], [5, 6]], NEW_TOKENS)
    cpu.generate([[3, 4], [5, 6]], NEW_TOKENS)
    assert {n: t.data_ptr() for n, t in gpu.state.tensors.items()} == pointers
    for name, t in cpu.state.tensors.items():
        torch.testing.assert_close(gpu.state.tensors[name].cpu(), t, rtol=1e-4, atol=1e-4)
    decode = [e for e in gpu._entries if e.entry == "decode"][0]
    assert decode.graphs is not None and (2,) in decode.graphs.graphs


def test_a_slot_outside_the_cache_is_a_guard_error_and_the_gpu_keeps_working(bundle):
    """Unchecked, an index past the cache is a device-side assert that ends the process."""
    import aot.loader
    from aot.errors import GuardError
    from aot.loader.generate import lm_contract

    gpu = aot.loader.load(bundle, device="cuda", capture="lazy")
    _, context = lm_contract(gpu)
    want = gpu.generate([[1, 2, 3]], NEW_TOKENS)
    for slot in (context, -1):
        with pytest.raises(GuardError, match=f"cache_position holds slot {slot}"):
            gpu.entry("decode")(
                input_ids=torch.tensor([[4]], device="cuda"),
                position_ids=torch.tensor([[3]], device="cuda"),
                cache_position=torch.tensor([slot], device="cuda"),
                attention_mask=torch.ones(1, context, dtype=torch.int64, device="cuda"),
            )
    assert gpu.generate([[1, 2, 3]], NEW_TOKENS) == want


@pytest.mark.parametrize("steps", [3, None])
def test_blocks_of_steps_in_one_graph_give_the_cpu_tokens(bundle, steps):
    """Several greedy steps per CUDA graph launch (``aot.loader.decode_blocks``; None: the GPU
    default): the tokens, end-of-sequence cut-offs and ``on_token`` calls of one step at a time,
    on batches with a graph bucket (2, 4) and without (3: plain steps, no block)."""
    import aot.loader
    from aot.loader import decode_blocks

    launches = []
    launch = decode_blocks._Block.launch
    decode_blocks._Block.launch = lambda block: launches.append(1) or launch(block)
    try:
        cpu = aot.loader.load(bundle, device="cpu")
        gpu = aot.loader.load(bundle, device="cuda", capture="lazy")
        n = MAX_CONTEXT - 5  # the longest prompt has 5 tokens
        for prompts in (
            [[5, 6, 7, 8, 9], [1, 2, 3]],
            [[5, 6, 7, 8, 9], [1, 2, 3], [4], [7, 7]],
            [[1], [2], [3]],
        ):
            want_seen: list = []
            want = cpu.generate(prompts, n, on_token=lambda s, v, out=want_seen: out.append((s, v)))
            for _ in range(2):  # capture, then replay
                seen: list = []
                got = gpu.generate(
                    prompts, n, steps_per_launch=steps, on_token=lambda s, v, out=seen: out.append((s, v))
                )
                assert got == want
                assert seen == want_seen
            eos = want[0][4]
            assert gpu.generate(prompts, n, eos_token_id=eos, steps_per_launch=steps) == cpu.generate(
                prompts, n, eos_token_id=eos
            )
        assert launches, "no block ran"
    finally:
        decode_blocks._Block.launch = launch


@pytest.mark.parametrize("kind", ["gptj", "codegen", "gpt_neox"])
def test_models_the_decode_kernel_newly_takes_give_the_cpu_tokens(kind, tmp_path):
    """GPT-J and CodeGen, whose eager attention of one query the build runs as SDPA
    (``aot.codegen.attention.eager_attention_as_sdpa``; CodeGen's mask passed scaled), and
    GPT-NeoX and CodeGen, whose new keys and values the kernel reads heads 3 * D apart: their
    decode programs run the decode attention kernel, cache writes included, and the GPU's greedy
    tokens (blocks of steps and one step per launch) equal the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    import aot.loader
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory
    from tests.realmodels.conftest import require

    require("transformers")
    spec = causal_lm(factory(kind), max_batch=MAX_BATCH, max_context=32, name=kind)
    compiled = generate(trace(spec), (_arch(),))
    decode = compiled.program.variants[0]
    assert any(k.name.startswith("decode_attention_append") for k in decode.kernels)
    path = tmp_path / f"{kind}.tpk"
    pack(compiled, path)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    want = aot.loader.load(path, device="cpu").generate(prompts, 20)
    gpu = aot.loader.load(path, device="cuda")
    assert gpu.generate(prompts, 20) == want
    assert gpu.generate(prompts, 20, steps_per_launch=1) == want


@pytest.mark.parametrize(
    "kind",
    [
        "deepseek_v3",
        "deepseek_v2",
        "llama4",
        "gemma3",
        "gpt_oss",
        "cohere2",
        "qwen2_window",
        "llama4_chunked",
        "gemma2",
        "gemma2_gqa",
        "qwen3",
        "phi3",
        "olmo2",
        "bloom",
        "mpt",
    ],
)
def test_newer_architectures_give_the_cpu_tokens(kind, tmp_path):
    """DeepSeek-V3 (multi-head latent attention over a compressed cache, experts; its empty-filled
    slices rebuilt by ``tracer.filled``), DeepSeek-V2 and Llama 4 (rotary embeddings in complex
    numbers, run as real pairs by ``tracer.complex_parts``), and models mixing sliding-window
    layers of 4 slots with full-attention ones (Gemma 3, GPT-OSS with its attention sinks,
    Cohere 2, Qwen2 with ``max_window_layers``; Llama 4's chunks of 4 slots: a mask per kind of
    layer), Gemma 2 (its capped eager attention in the decode attention kernel; at two query heads
    per KV head, repeat_kv's copy folded in with the cache writes), Qwen3 (each query and key head
    normed before the rotary, in the decode attention kernel; Gemma 3's queries too), Phi-3 (its
    norms, after a dropout's copy, in the GEMVs' prologues, its split gate/up product in the
    epilogue), OLMo 2 (its post-norms with their adds in the next GEMV's prologue, which also
    stores the sum: the next residual), Bloom and MPT (ALiBi: each head's bias row added to the
    scaled scores in the decode attention kernel; Bloom's from the 2-D mask, its scores through
    ``baddbmm``, its queries interleaved with keys and values in its projection; MPT's a slice of
    a row over ``max_seq_len``, its mask a ``masked_fill``): the GPU's greedy
    tokens, in blocks of steps and one step per launch, equal the CPU's (which equal
    transformers', tests/lm)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    import aot.loader
    from aot.codegen import generate
    from aot.hf import causal_lm
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory
    from tests.realmodels.conftest import require

    require("transformers")
    path = tmp_path / f"{kind}.tpk"
    pack(
        generate(trace(causal_lm(factory(kind), max_batch=MAX_BATCH, max_context=32, name=kind)), (_arch(),)),
        path,
    )
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    want = aot.loader.load(path, device="cpu").generate(prompts, 20)
    gpu = aot.loader.load(path, device="cuda")
    assert gpu.generate(prompts, 20) == want
    assert gpu.generate(prompts, 20, steps_per_launch=1) == want
