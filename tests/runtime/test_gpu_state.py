"""On a GPU: library-free convolutions and stateful bundles on the runtime without torch, beside the
torch loader on the same bundle. The convolution model of ``tests/codegen/test_convolution.py``
built ``--library-free``: the runtime's outputs equal the torch loader's bit for bit (the same
cubins run) and eager's within float32 tolerance. tests/data/tiny_lm.py built ``--library-free``
(its cache writes and attention over the cache as kernels): greedy ``generate`` tokens of the
runtime equal the torch loader's (one prompt, two of different lengths, with eos), the prefill's
logits and a decode over the cache it wrote are equal bit for bit, and a slot past the cache is
refused before anything runs."""

from __future__ import annotations

import pytest

from aot.errors import GuardError
from tests.codegen.test_convolution import built  # noqa: F401 - the fixture
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


def test_library_free_convolutions_equal_the_torch_loader(built):  # noqa: F811
    import torch

    import aot.runtime
    from aot.loader import load
    from aot.tracer import load_model_file

    compiled, bundle, path = built
    module = load_model_file(path).module()
    module.load_state_dict({k: v for k, v in compiled.traced.weights.items() if k in module.state_dict()})
    module.eval()
    rt, ref = aot.runtime.load(bundle), load(bundle, device="cuda")
    for batch in (1, 3, 4):  # on a bucket (a CUDA graph) and off (launch by launch)
        x = torch.randn(batch, 3, 20, 18, generator=torch.Generator().manual_seed(batch)).cuda()
        want = ref(x)
        got = torch.from_dlpack(rt(x=x))
        assert torch.equal(got, want), batch
        torch.testing.assert_close(got.cpu(), module(x.cpu()), rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def tiny_lm_free(tmp_path_factory):
    """tests/data/tiny_lm.py built ``--library-free`` (prefill and decode over a KV cache)."""
    from aot.codegen import generate as build
    from aot.packager import pack
    from aot.tracer import load_model_file, trace

    out = tmp_path_factory.mktemp("rt_state") / "tiny_lm.tpk"
    traced = trace(load_model_file(ROOT / "tests/data/tiny_lm.py"))
    pack(build(traced, ("sm_90",), gemm_candidates=True, library_free=True), out)
    return out


def test_generate_equals_the_torch_loaders_greedy_tokens(tiny_lm_free):
    import aot.runtime
    from aot.loader import load

    rt, ref = aot.runtime.load(tiny_lm_free), load(tiny_lm_free, device="cuda")
    prompts = [[3, 14, 15, 9, 2], [6, 5]]  # the second left-padded
    want = ref.generate(prompts, 8)
    assert rt.generate(prompts, 8) == want
    assert rt.generate(prompts[0], 8) == ref.generate(prompts[0], 8)
    assert rt.generate(prompts, 8) == want  # the state's rows reset between generations
    for eos in (want[0][2], [want[0][2], want[1][3]]):  # a row stops after eos, which it keeps
        assert rt.generate(prompts, 8, eos_token_id=eos) == ref.generate(prompts, 8, eos_token_id=eos)


def test_blocks_of_decode_calls_equal_the_torch_loaders_greedy_tokens(tiny_lm_free):
    """aotpack-rt's blocks (``aot.runtime.generate.DecodeBlock``): 20 new tokens are 2 blocks of 8
    decode calls, each one CUDA graph at the decode bucket, then a block of 3; with an end token too,
    and the blocks replayed by a second generation: the torch loader's tokens."""
    import aot.runtime
    from aot.loader import load

    rt, ref = aot.runtime.load(tiny_lm_free), load(tiny_lm_free, device="cuda")
    prompts = [[3, 14, 15, 9, 2], [6, 5]]
    want = ref.generate(prompts, 20)
    assert rt.generate(prompts, 20) == want
    assert rt.generate(prompts, 20) == want  # the blocks' graphs replayed
    assert rt.generate(prompts, 20, steps_per_launch=1) == want
    blocks = [b for p in rt._prepared.values() for b in p.blocks.values()]
    assert blocks and all(b.graph is not None for b in blocks)
    eos = want[0][10]  # row 0 ends inside the second block
    assert rt.generate(prompts, 20, eos_token_id=eos) == ref.generate(prompts, 20, eos_token_id=eos)


def test_prefill_logits_and_the_state_equal_the_torch_loaders(tiny_lm_free):
    """One prefill call through the entry point, same inputs: logits bit for bit; then a decode
    call reads the cache the prefill wrote, on both."""
    import torch

    import aot.runtime
    from aot.loader import load

    rt, ref = aot.runtime.load(tiny_lm_free), load(tiny_lm_free, device="cuda")
    ids = torch.tensor([[5, 7, 11, 2], [1, 9, 4, 8]]).cuda()
    mask = torch.zeros(2, 32, dtype=torch.int64).cuda()
    mask[:, :5] = 1
    prefill = dict(
        input_ids=ids,
        position_ids=torch.arange(4).expand(2, 4).contiguous().cuda(),
        cache_position=torch.arange(4).cuda(),
        attention_mask=mask,
    )
    decode = dict(
        input_ids=ids[:, :1].contiguous(),
        position_ids=torch.full((2, 1), 4).cuda(),
        cache_position=torch.tensor([4]).cuda(),
        attention_mask=mask,
    )
    rt.reset()
    ref.reset()
    for entry, inputs in (("prefill", prefill), ("decode", decode)):
        got = torch.from_dlpack(rt.entry(entry)(**inputs))
        assert torch.equal(got, ref.entry(entry)(**inputs)), entry
    with pytest.raises(
        GuardError, match=r"cache_position holds slot 32, the state 'key_cache_0' has 32 slots"
    ):
        rt.entry("decode")(**{**decode, "cache_position": torch.tensor([32]).cuda()})


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "llama-bfloat16"])
def test_hf_causal_lm_library_free_generate_equals_the_torch_loader(kind, tmp_path):
    """A tiny random GPT-2 (fused QKV, learned positions), Llama (RoPE, grouped-query heads),
    Mistral (one KV head, a sliding window in the prefill's mask) and the Llama in bfloat16
    through ``aot.hf.causal_lm``, built ``--library-free`` (the wrapper's last-position pick a
    row gather kernel, ``aot.codegen.index_rows``): the runtime's greedy tokens equal the torch
    loader's on the same bundle, as do the torch loader's on the CPU (in float32, where the
    CPU's rounding cannot pick another token)."""
    from tests.realmodels.conftest import unusable

    why = unusable("transformers")
    if why is not None:
        pytest.skip(why)
    import aot.runtime
    from aot.codegen import generate as build
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import factory

    kind, _, dtype = kind.partition("-")  # llama-bfloat16: the prefill's logits argmaxed on the host
    out = tmp_path / f"{kind}.tpk"
    spec = causal_lm(factory(kind), max_batch=4, max_context=16, name=kind, dtype=dtype or "float32")
    pack(build(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True), out)
    rt, ref = aot.runtime.load(out), load(out, device="cuda")
    prompts = [[5, 17, 42, 8, 3], [11, 9]]
    want = ref.generate(prompts, 6)
    assert rt.generate(prompts, 6) == want
    if not dtype:
        assert load(out).generate(prompts, 6) == want  # the CPU path (reference steps) agrees


def test_the_generate_command_prints_the_torch_loaders_tokens(tiny_lm_free, capsys):
    import json

    from aot.loader import load
    from aot.runtime.cli import main

    argv = ["generate", str(tiny_lm_free), "--prompt-ids", "3,14,15", "--max-new-tokens", "5", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == load(tiny_lm_free, device="cuda").generate([3, 14, 15], 5)


def test_the_split_decode_attention_runs_on_the_runtime(tmp_path):
    """A tiny Llama through ``aot.hf.causal_lm`` at a 1024-slot cache, built ``--library-free``:
    its decode attention is the split-KV form in one kernel, counting arrivals on int32 counters
    the program keeps as scratch (``Program.scratch``). The runtime allocates them and generates
    the torch loader's greedy tokens on the same bundle, generation after generation (the
    counters left zeroed by every launch), as do the torch loader's on the CPU."""
    from tests.realmodels.conftest import require

    require("transformers")
    import aot.runtime
    from aot.codegen import generate as build
    from aot.hf import causal_lm
    from aot.loader import load
    from aot.packager import pack
    from aot.tracer import trace
    from tests.hf.test_causal_lm import tiny_llama

    out = tmp_path / "split.tpk"
    spec = causal_lm(
        tiny_llama(num_hidden_layers=2, max_position_embeddings=1024),
        max_batch=4,
        max_context=1024,
        name="llama",
    )
    compiled = build(trace(spec), ("sm_90",), gemm_candidates=True, library_free=True)
    decode = [p for p in (compiled.program, *compiled.program.variants) if p.scratch]
    assert decode and any(
        k.config.get("kind") == "decode_attention_split_combined" for k in decode[0].kernels
    )
    pack(compiled, out)
    rt, ref = aot.runtime.load(out), load(out, device="cuda")
    prompts = [[5, 17, 42, 8, 3], [11, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    want = ref.generate(prompts, 12)
    for _ in range(3):
        assert rt.generate(prompts, 12) == want
    assert rt.generate(prompts[1], 12) == ref.generate(prompts[1], 12)
    assert load(out).generate(prompts, 12) == want
