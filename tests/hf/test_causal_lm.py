"""``aot.hf.causal_lm``: an unmodified transformers causal LM as one forward over a static KV cache.

The eager ``Decoder`` driven token by token (prefill, then one-token decode steps) must pick the
tokens transformers' greedy ``generate`` picks, with the same logits at every step (fp32, atol
1e-5), with and without left padding; ``torch.export`` of it must keep the cache writes as
mutations of the state inputs; models it cannot serve are refused with a SpecError naming them.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from aot.errors import SpecError
from aot.hf import Decoder, additive_mask, causal_lm
from tests.conftest import HANG_GUARD_S

MAX_CONTEXT = 16
NEW_TOKENS = 6
ATOL = 1e-5
# Tiny random-weight configs. A wide initializer spreads the logits, so greedy picks are not
# near-ties that rounding could flip; no eos, so generate runs every step.
COMMON = dict(vocab_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.3)
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _config(kind: str):
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **COMMON)
    if kind == "llama":  # grouped-query attention: 4 query heads over 2 KV heads
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            num_key_value_heads=2, max_position_embeddings=64, **DECODER, **COMMON
        )
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            num_key_value_heads=2, max_position_embeddings=64, **DECODER, **COMMON
        )
    if kind == "mistral":  # a sliding window shorter than the context: the mask must slide too
        return tf.MistralForCausalLM, tf.MistralConfig(
            num_key_value_heads=1, sliding_window=5, max_position_embeddings=64, **DECODER, **COMMON
        )
    if kind == "falcon":  # multi-query: one KV head, which its config calls neither num_key_value_heads
        return tf.FalconForCausalLM, tf.FalconConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True, **COMMON
        )
    if kind in MORE:
        name, fields, *config = MORE[kind]  # a third element: the config class, where not <name>Config
        return getattr(tf, f"{name}ForCausalLM"), getattr(tf, *config or [f"{name}Config"])(
            **{**COMMON, **fields}
        )
    raise ValueError(kind)


# Other architectures, checked in the slow run (eager wrapper against generate).
_GQA = dict(num_key_value_heads=2, max_position_embeddings=64, **DECODER)
# DeepSeek's multi-head latent attention and routed experts (the first layer dense)
_MLA = dict(
    _GQA,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
_LONGROPE = dict(
    rope_type="longrope", rope_theta=1e4, short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[2.0, 3.0, 4.0, 5.0]
)
MORE = {
    "phi3": ("Phi3", _GQA),
    "gemma": ("Gemma", dict(_GQA, num_key_value_heads=1, head_dim=8)),
    # attention soft-capping (at 0.5, so that it changes these small scores: the decode kernel's
    # cap is checked against it); sliding and full layers alternate (a window of 4: a mask per
    # kind of layer). Untied: its scaled tied embedding makes every greedy token repeat the last one
    "gemma2": (
        "Gemma2",
        dict(
            _GQA,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=4,
            tie_word_embeddings=False,
            attn_logit_softcapping=0.5,
        ),
    ),
    # two query heads per KV head: repeat_kv copies the cache (a clone the decode kernel folds in
    # with the cache writes)
    "gemma2_gqa": (
        "Gemma2",
        dict(_GQA, head_dim=8, sliding_window=4, tie_word_embeddings=False, attn_logit_softcapping=0.5),
    ),
    "gpt_neox": ("GPTNeoX", dict(max_position_embeddings=64, **DECODER)),
    "opt": (
        "OPT",
        dict(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
    ),
    "gptj": ("GPTJ", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    "qwen3": ("Qwen3", dict(_GQA, head_dim=8)),
    "stablelm": ("StableLm", _GQA),
    "mixtral": ("Mixtral", dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    "gpt_bigcode": ("GPTBigCode", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    # a local layer whose window spans the context (a shorter one is refused: its mask is placed
    # by the cache's length); CodeGen: GPT-J's rotary over interleaved pairs, a fused qkv
    "gpt_neo": (
        "GPTNeo",
        dict(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=16,
            max_position_embeddings=64,
        ),
    ),  # fmt: skip
    "codegen": ("CodeGen", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    # ALiBi from the mask: no position_ids, each key's bias from its count of attended slots (left
    # padding shifts it), the scores through baddbmm
    "bloom": ("Bloom", dict(hidden_size=32, n_layer=2, n_head=4)),
    # ALiBi by the slot index over max_seq_len slots, cut by the cache's length read as a number:
    # no position_ids either; over the static cache a query's biases are generate's, shifted
    "mpt": ("Mpt", dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, expansion_ratio=2)),
    # a parallel block: attention and MLP beside each other, the next LayerNorm over three rows
    "phi": ("Phi", dict(_GQA, head_dim=8)),
    # multi-head latent attention: the cache holds the compressed keys and values (one head of
    # kv_lora_rank, one of the rotary part), each layer's keys built in an empty tensor filled
    # slice by slice (aot.tracer.filled); mixture-of-experts layers after the first
    "deepseek_v3": ("DeepseekV3", _MLA),
    # norms after attention and MLP and on q/k (OLMo-2); scaled embeddings, residuals and logits
    # (Granite); a parallel block under one LayerNorm and scaled logits (Cohere)
    # rotary embeddings in complex numbers (aot.tracer.complex_parts): DeepSeek-V2 (multi-head
    # latent attention, experts) and Llama 4's text model (experts, layers without RoPE)
    "deepseek_v2": ("DeepseekV2", _MLA),
    "llama4": (
        "Llama4",
        dict(
            _GQA,
            head_dim=8,
            num_local_experts=1,
            interleave_moe_layer_step=2,  # a dense layer, then one of experts
            intermediate_size_mlp=64,
            no_rope_layers=[1, 1],
            attention_chunk_size=64,
            tie_word_embeddings=False,
        ),
        "Llama4TextConfig",
    ),
    # sliding-window layers beside full-attention ones, a window shorter than the prompt: a mask
    # per kind of layer (Qwen2's first layer full, the second sliding; Gemma 3 the other way round)
    "qwen2_window": ("Qwen2", dict(_GQA, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "gemma3": (
        "Gemma3",
        dict(
            _GQA,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,  # as Gemma 2's: a scaled tied embedding repeats the last token
        ),
        "Gemma3TextConfig",
    ),
    # GPT-OSS: attention sinks, experts, sliding and full layers; Cohere 2: the same mix
    "gpt_oss": (
        "GptOss",
        dict(
            _GQA,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
    ),
    "cohere2": ("Cohere2", dict(_GQA, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # a ...ForCausalLM class that transformers' auto mapping does not list (5.23): multi-head
    # latent attention as DeepSeek-V3's, without experts
    "mistral4": (
        "Mistral4",
        dict(
            _GQA,
            num_key_value_heads=4,
            head_dim=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
    ),
    # Llama 4's chunked attention (chunks of 4 slots) beside a full-attention layer
    "llama4_chunked": (
        "Llama4",
        dict(
            _GQA,
            head_dim=8,
            num_local_experts=1,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=64,
            no_rope_layers=[1, 0],
            attention_chunk_size=4,
            layer_types=["chunked_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
        "Llama4TextConfig",
    ),
    "olmo2": ("Olmo2", _GQA),
    "granite": ("Granite", _GQA),
    "cohere": ("Cohere", _GQA),
    # Gemma 3n: its last layer reads the keys and values of the last full layer before it
    # (num_kv_shared_layers) and keeps no cache of its own; AltUp, Laurel, per-layer inputs
    "gemma3n_shared": (
        "Gemma3n",
        dict(
            _GQA,
            num_hidden_layers=3,
            head_dim=8,
            vocab_size_per_layer_input=96,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            num_kv_shared_layers=1,
            altup_num_inputs=2,
            activation_sparsity_pattern=[0.0, 0.0, 0.0],
            tie_word_embeddings=False,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
        ),
        "Gemma3nTextConfig",
    ),
    # RoPE that updates its frequencies in the forward, where no position below the context does:
    # dynamic NTK scaling (grows past max_position_embeddings), longrope (long factors past 32)
    "llama_dynamic_rope": (
        "Llama",
        dict(_GQA, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
    ),
    "phi3_longrope": ("Phi3", dict(_GQA, rope_parameters=_LONGROPE, original_max_position_embeddings=32)),
}


# A Llama-3.2-shaped tiny causal LM: grouped-query heads (4 over 2 KV heads), tied embeddings.
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=64,
    tie_word_embeddings=True,
)


def tiny_llama(**overrides):
    """A factory of ``TINY_LLAMA`` (random weights), with ``overrides`` of its config."""
    import transformers

    cfg = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    return lambda: transformers.LlamaForCausalLM(cfg)


def factory(kind: str):
    """``kind``'s model with random weights and trained-looking norms (``trained_norms``: at
    initialization a norm's scale 1 and shift 0 would hide a wrong fold of them into the
    projections after it)."""
    from tests.realmodels.zoo import trained_norms

    cls, config = _config(kind)
    return lambda: trained_norms(cls(config))


def built(kind: str, seed: int = 0):
    """The model as ModelSpec builds it: ``torch.manual_seed(seed); factory()``, eval."""
    torch.manual_seed(seed)
    return factory(kind)().eval()


def prompts(batch: int, length: int = 5, vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch, length] and their mask; row r > 0 is left-padded by r + 1 tokens."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.int64)
    for r in range(1, batch):
        mask[r, : r + 1] = 0
        ids[r, : r + 1] = 0
    return ids, mask


def empty_cache(decoder: Decoder, batch: int) -> dict[str, torch.Tensor]:
    out, context = {}, decoder.max_context
    for i in decoder.layout.cached:  # a layer reading an earlier layer's keys keeps none of its own
        (k_heads, k_dim), (v_heads, v_dim) = decoder.layout.key_shapes[i], decoder.layout.value_shapes[i]
        out[f"key_cache_{i}"] = torch.zeros(batch, k_heads, context, k_dim)
        out[f"value_cache_{i}"] = torch.zeros(batch, v_heads, context, v_dim)
    return out


def eager_greedy(decoder: Decoder, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int):
    """Greedy decoding through the Decoder's contract, as a runner drives it: one prefill of the
    (left-padded) prompt into slots 0..T-1, then one token per call into slot T + i. Positions
    count real tokens only, as transformers' ``generate`` computes them. Returns the new tokens
    [B, new_tokens] and the logits [B, V] that chose each."""
    batch, length = ids.shape
    state = empty_cache(decoder, batch)
    valid = torch.zeros(batch, decoder.max_context, dtype=torch.int64)
    valid[:, :length] = mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    tokens, logits_seen = [], []
    with torch.no_grad():
        logits = decoder(
            input_ids=ids,
            position_ids=positions,
            cache_position=torch.arange(length),
            attention_mask=valid,
            **state,
        )
        last = positions[:, -1:]
        for step in range(new_tokens):
            logits_seen.append(logits)
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
            tokens.append(token)
            slot = length + step
            valid[:, slot] = 1
            last = last + 1
            logits = decoder(
                input_ids=token,
                position_ids=last,
                cache_position=torch.tensor([slot]),
                attention_mask=valid,
                **state,
            )
    return torch.cat(tokens, 1), logits_seen


def hf_greedy(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, ids.shape[1] :], list(out.logits)


FAST = ["gpt2", "llama"]
SLOW = ["qwen2", "mistral"]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    "kind", FAST + [pytest.param(k, marks=pytest.mark.slow) for k in (*SLOW, "falcon", *MORE)]
)
def test_greedy_tokens_and_logits_equal_generate(kind, batch):
    reference = built(kind)
    decoder = Decoder(built(kind), MAX_CONTEXT).eval()
    ids, mask = prompts(batch)
    expected, expected_logits = hf_greedy(reference, ids, mask, NEW_TOKENS)
    got, got_logits = eager_greedy(decoder, ids, mask, NEW_TOKENS)
    assert got.tolist() == expected.tolist()
    assert len(set(got.flatten().tolist())) > 2, "the tokens barely vary; the comparison would prove little"
    for step, (a, b) in enumerate(zip(got_logits, expected_logits)):
        assert a.shape == b.shape == (batch, 96) and a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")


def test_the_mask_sees_valid_slots_up_to_the_query_and_within_the_window():
    # row 1 is left padding up to slot 2: its query at slot 2 sees nothing valid, so only itself
    valid = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0]])
    cache_position = torch.tensor([2, 3])
    lowest = torch.finfo(torch.float32).min
    mask = additive_mask(valid, cache_position, torch.float32)
    assert mask.shape == (2, 1, 2, 6) and mask.dtype == torch.float32
    seen = (mask == 0).int()[:, 0].tolist()
    assert seen == [[[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], [[0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0]]]
    assert set(mask.unique().tolist()) == {0.0, lowest}
    windowed = (additive_mask(valid, cache_position, torch.float32, window=2) == 0).int()[:, 0].tolist()
    assert windowed == [[[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0]], [[0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0]]]
    assert additive_mask(valid, cache_position, torch.float16).dtype == torch.float16
    # chunks of 2 slots counted from each row's first real token: row 0's slots 0-1, 2-3; row 1's
    # (padded by 3) slots 3-4: its query at slot 4 sees slot 3, row 0's at slot 3 sees slot 2
    chunked = (additive_mask(valid, torch.tensor([3, 4]), torch.float32, chunk=2) == 0).int()[:, 0].tolist()
    assert chunked == [[[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0]], [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0]]]


def test_the_spec_declares_the_contract():
    make = factory("llama")
    before = torch.random.get_rng_state()
    spec = causal_lm(make, max_batch=4, max_context=MAX_CONTEXT, name="tiny-llama", seq_buckets=(1, 8, 16))
    assert torch.equal(torch.random.get_rng_state(), before)  # probing the model drew nothing
    by_name = {i.name: i for i in spec.inputs}
    names = [i.name for i in spec.inputs]
    assert names[:4] == ["input_ids", "position_ids", "cache_position", "attention_mask"]
    assert names[4:] == [f"{k}_cache_{i}" for i in range(2) for k in ("key", "value")]
    batch, seq = spec.dims()
    assert (batch.name, batch.min, batch.max, seq.name, seq.min, seq.max) == (
        "batch",
        1,
        4,
        "seq",
        1,
        MAX_CONTEXT,
    )
    assert by_name["input_ids"].shape == (batch, seq) and by_name["input_ids"].dtype == "int64"
    assert (by_name["input_ids"].low, by_name["input_ids"].high) == (0, 96)
    assert by_name["position_ids"].shape == (batch, seq) and by_name["position_ids"].high == MAX_CONTEXT
    assert by_name["cache_position"].shape == (seq,) and by_name["cache_position"].high == MAX_CONTEXT
    assert by_name["attention_mask"].shape == (batch, MAX_CONTEXT)
    assert by_name["key_cache_1"].shape == (batch, 2, MAX_CONTEXT, 8) and by_name["key_cache_1"].dtype is None
    assert by_name["value_cache_1"].shape == (batch, 2, MAX_CONTEXT, 8)
    assert [i.name for i in spec.state_inputs()] == names[4:]
    assert [(e.name, e.sizes) for e in spec.entry_points] == [("prefill", {}), ("decode", {"seq": 1})]
    assert (spec.name, spec.dtype, spec.seed) == ("tiny-llama", "float32", 0)
    assert (batch.buckets, seq.buckets) == (None, (1, 8, 16))
    assert causal_lm(factory("gpt2"), max_batch=1, max_context=MAX_CONTEXT).name == "GPT2LMHeadModel"


def test_a_layer_that_reads_an_earlier_layers_cache_keeps_none_of_its_own():
    """Gemma 3n's KV-shared layers (the last ``num_kv_shared_layers``) read the keys and values of
    the last layer of their kind before them: the spec holds a cache for the others alone, and
    the wrapper runs on it (greedy tokens against generate: the slow run's MORE)."""
    spec = causal_lm(factory("gemma3n_shared"), max_batch=2, max_context=MAX_CONTEXT)
    assert [i.name for i in spec.state_inputs()] == [
        "key_cache_0",
        "value_cache_0",
        "key_cache_1",
        "value_cache_1",
    ]
    decoder = Decoder(built("gemma3n_shared"), MAX_CONTEXT).eval()
    assert decoder.layout.cached == (0, 1) and decoder.layout.key_shapes[2] is None
    ids, mask = prompts(2)
    state = empty_cache(decoder, 2)
    with torch.no_grad():
        logits = decoder(
            input_ids=ids,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            cache_position=torch.arange(ids.shape[1]),
            attention_mask=torch.cat(
                [mask, torch.zeros(2, MAX_CONTEXT - ids.shape[1], dtype=torch.int64)], 1
            ),
            **state,
        )
    assert logits.shape == (2, 96) and torch.isfinite(logits).all()
    assert all(state[f"key_cache_{i}"][:, :, : ids.shape[1]].abs().sum() > 0 for i in (0, 1))


def test_cache_shapes_are_read_from_the_model_not_guessed_from_its_config():
    # Falcon's config has no num_key_value_heads (4 attention heads, multi-query: one KV head)
    spec = causal_lm(factory("falcon"), max_batch=2, max_context=MAX_CONTEXT)
    shapes = {i.name: i.shape[1:] for i in spec.state_inputs()}
    assert shapes == {f"{k}_cache_{i}": (1, MAX_CONTEXT, 8) for i in range(2) for k in ("key", "value")}


def test_the_module_is_built_as_modelspec_builds_it_and_runs_its_examples():
    from aot.tracer.model import example_inputs, instantiate, run_eager

    spec = causal_lm(factory("gpt2"), max_batch=3, max_context=MAX_CONTEXT, seed=5)
    module = instantiate(spec)
    assert isinstance(module, Decoder) and not module.training
    reference = built("gpt2", seed=5)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(module.model.state_dict()[name], tensor), name
    for sizes in ({"batch": 1, "seq": 1}, {"batch": 3, "seq": 7}, {"batch": 2, "seq": MAX_CONTEXT}):
        inputs = example_inputs(spec, sizes)
        slots = inputs["cache_position"]
        assert slots.shape == (sizes["seq"],) and 0 <= slots.min() and slots.max() < MAX_CONTEXT
        assert torch.equal(inputs["position_ids"], slots.expand(sizes["batch"], -1))
        assert inputs["attention_mask"][:, slots].all()
        logits = run_eager(spec, module, inputs)
        assert logits.shape == (sizes["batch"], 96) and torch.isfinite(logits).all()
        # the call wrote its slots of every layer's cache, and nothing else
        written = inputs["key_cache_0"].ne(example_inputs(spec, sizes)["key_cache_0"]).any(-1).any(1)
        assert written.any(0).nonzero().flatten().tolist() == slots.tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_models_keep_their_dtype(dtype):
    from aot.tracer.model import example_inputs, instantiate, run_eager

    spec = causal_lm(factory("llama"), max_batch=2, max_context=MAX_CONTEXT, dtype=dtype)
    module = instantiate(spec)
    inputs = example_inputs(spec, {"batch": 2, "seq": 3})
    assert inputs["key_cache_0"].dtype == getattr(torch, dtype)
    logits = run_eager(spec, module, inputs)
    assert logits.dtype == getattr(torch, dtype) and torch.isfinite(logits).all()
    # a float32 copy (the tracer measures half-precision error against one) runs itself
    import copy

    wide = copy.deepcopy(module).float()
    inputs32 = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        wide_logits = wide(**inputs32)
    assert wide_logits.dtype == torch.float32
    torch.testing.assert_close(wide_logits.to(logits.dtype), logits, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("kind", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_export_keeps_the_cache_writes_as_state_mutations(kind):
    """torch.export of the Decoder (dynamic batch and seq, as the tracer exports it) records the
    cache writes as mutations of the state inputs, and decomposition to core ATen keeps them; the
    exported program run at other sizes gives eager's logits and cache."""
    import torch.fx.experimental._config as fx_config
    from torch.export import Dim, default_decompositions, export

    from aot.tracer.model import example_inputs, instantiate

    spec = causal_lm(factory(kind), max_batch=4, max_context=MAX_CONTEXT)
    module = instantiate(spec)
    dims = {"batch": Dim.DYNAMIC(min=1, max=4), "seq": Dim.DYNAMIC(min=1, max=MAX_CONTEXT)}
    dynamic = {
        i.name: {d: dims[s.name] for d, s in enumerate(i.shape) if hasattr(s, "name")} for i in spec.inputs
    }
    table = default_decompositions()
    table.pop(torch.ops.aten.scaled_dot_product_attention.default)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        ep = export(module, (), example_inputs(spec), dynamic_shapes=dynamic)
        ep = ep.run_decompositions(table)
    state = [i.name for i in spec.state_inputs()]
    assert sorted(ep.graph_signature.user_inputs_to_mutate.values()) == sorted(state)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "aten.index_put.default" in targets and "aten.scaled_dot_product_attention.default" in targets
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    batch = placeholders["input_ids"].meta["val"].shape[0].node.expr
    assert (ep.range_constraints[batch].lower, ep.range_constraints[batch].upper) == (1, 4)
    # batch 1 in the same program: the Decoder adds no batch != 1 guard of its own (GPT-2 adds none;
    # Llama's RoPE matmul does in transformers 5.17, where the tracer exports batch 1 apart)
    sizes_run = [{"batch": 3, "seq": 6}, {"batch": 2, "seq": 2}] + (
        [{"batch": 1, "seq": 3}] if kind == "gpt2" else []
    )
    for sizes in sizes_run:
        inputs = example_inputs(spec, sizes, seed=11)
        mine = {k: v.clone() for k, v in inputs.items()}
        with torch.no_grad():
            expected = module(**inputs)
            got = ep.module()(**mine)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        for name in state:
            torch.testing.assert_close(mine[name], inputs[name], atol=ATOL, rtol=0, msg=name)
        assert not torch.equal(mine["key_cache_0"], example_inputs(spec, sizes, seed=11)["key_cache_0"])


def test_models_it_cannot_serve_are_refused_by_name():
    import transformers as tf

    bert = tf.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    with pytest.raises(SpecError, match=r"decoder-only causal LMs .*; BertForMaskedLM \(bert\) is not one"):
        causal_lm(lambda: tf.BertForMaskedLM(bert), max_batch=2, max_context=MAX_CONTEXT)
    t5 = tf.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    with pytest.raises(
        SpecError, match=r"decoder-only models; T5ForConditionalGeneration \(t5\) is an encoder-decoder"
    ):
        causal_lm(lambda: tf.T5ForConditionalGeneration(t5), max_batch=2, max_context=MAX_CONTEXT)
    # GPT-1 keeps no cache (Bloom and MPT, which take no position_ids, are served: ``MORE``)
    gpt1 = tf.OpenAIGPTConfig(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    with pytest.raises(
        SpecError, match=r"cannot drive OpenAIGPTLMHeadModel: its forward takes no past_key_values"
    ):
        causal_lm(lambda: tf.OpenAIGPTLMHeadModel(gpt1), max_batch=2, max_context=MAX_CONTEXT)
    # MPT's biases span max_seq_len slots, its config's name for the limit
    with pytest.raises(SpecError, match=r"max_context 128 exceeds MptForCausalLM's max_seq_len 64"):
        causal_lm(factory("mpt"), max_batch=2, max_context=128)
    # a causal LM class the auto mapping does not list is served, not refused by name
    assert causal_lm(factory("mistral4"), max_batch=2, max_context=MAX_CONTEXT).name == "Mistral4ForCausalLM"
    with pytest.raises(SpecError, match=r"needs a transformers causal LM .*; the factory returned a Linear"):
        causal_lm(lambda: torch.nn.Linear(2, 2), max_batch=2, max_context=MAX_CONTEXT)
    with pytest.raises(
        SpecError, match=r"max_context 128 exceeds GPT2LMHeadModel's max_position_embeddings 64"
    ):
        causal_lm(factory("gpt2"), max_batch=2, max_context=128)
    # sliding and full layers mixed: served with a mask per kind of layer (qwen2_window, gemma3,
    # llama4_chunked), refused where the model takes no such mapping
    _, mixed = _config("qwen2_window")
    assert causal_lm(lambda: tf.Qwen2ForCausalLM(mixed), max_batch=2, max_context=MAX_CONTEXT).name
    with (
        mock.patch("aot.hf._takes_mask_mapping", return_value=False),
        pytest.raises(
            SpecError,
            match=r"Qwen2ForCausalLM mixes kinds of attention layer \(full_attention, sliding_attention; window 4\) "
            r"and takes no mask per kind of layer; use max_context <= 4",
        ),
    ):
        causal_lm(lambda: tf.Qwen2ForCausalLM(mixed), max_batch=2, max_context=MAX_CONTEXT)

    # GPT-Neo's local layers place their own window by the cache's length: wrong over a static cache
    neo = tf.GPTNeoConfig(
        vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=8, max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(
        SpecError, match=r"GPTNeoForCausalLM's local attention layers \(window 8\) .*; use max_context <= 8"
    ):
        causal_lm(lambda: tf.GPTNeoForCausalLM(neo), max_batch=2, max_context=MAX_CONTEXT)
    assert (
        causal_lm(lambda: tf.GPTNeoForCausalLM(neo), max_batch=2, max_context=8).name == "GPTNeoForCausalLM"
    )

    gptj = tf.GPTJConfig(vocab_size=96, n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=64)
    with pytest.raises(SpecError, match=r"GPTJForCausalLM cannot use attn_implementation 'sdpa': "):
        causal_lm(
            lambda: tf.GPTJForCausalLM(gptj), max_batch=2, max_context=MAX_CONTEXT, attn_implementation="sdpa"
        )

    # longrope's long factors past original_max_position_embeddings: a switch no bundle makes
    longrope = tf.Phi3Config(**COMMON, **_GQA, rope_parameters=_LONGROPE, original_max_position_embeddings=8)
    with pytest.raises(
        SpecError,
        match=r"Phi3ForCausalLM's longrope RoPE switches to its long factors past 8 positions.*; use max_context <= 8",
    ):
        causal_lm(lambda: tf.Phi3ForCausalLM(longrope), max_batch=2, max_context=MAX_CONTEXT)
    assert causal_lm(lambda: tf.Phi3ForCausalLM(longrope), max_batch=2, max_context=8).name

    def broken():
        raise OSError("no such checkpoint: /models/x")

    with pytest.raises(SpecError, match=r"the factory failed: OSError: no such checkpoint: /models/x"):
        causal_lm(broken, max_batch=2, max_context=MAX_CONTEXT)
    with pytest.raises(SpecError, match=r"max_batch must be an int >= 1, got 0"):
        causal_lm(factory("gpt2"), max_batch=0, max_context=MAX_CONTEXT)


# Layers that keep a state other than keys and values: transformers' models of them accept
# past_key_values but ask it for convolution or SSM state (Jamba, LFM2), or for a cache class of
# their own (MiniMax, even with full attention layers alone)
OTHER_STATE = {
    "jamba": (
        "Jamba",
        dict(_GQA, attn_layer_period=2, attn_layer_offset=1, num_experts=2, expert_layer_period=2,
             expert_layer_offset=1, num_experts_per_tok=1, mamba_d_state=8, mamba_dt_rank=4),
        r"JambaForCausalLM: one token through it with a key/value cache as past_key_values fails "
        r"\(ValueError: .*conv state.*\); its layers of kind 'linear_attention' keep a state other than keys and values",
    ),
    "lfm2": ("Lfm2", dict(_GQA, layer_types=["conv", "full_attention"]), r"Lfm2ForCausalLM: .*; its layers of kind 'conv' keep"),
    "minimax": (
        "MiniMax",
        dict(_GQA, head_dim=8, num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"] * 2),
        r"MiniMaxForCausalLM: one token through it .* fails \(ValueError: MiniMax uses cache of its own",
    ),
    # attention and a Mamba mixer side by side in every layer, which its config calls "hybrid"
    "falcon_h1": (
        "FalconH1",
        dict(_GQA, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
             mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16),
        r"FalconH1ForCausalLM: one token through it .* fails \(ValueError: .*conv state.*\); "
        r"its layers of kind 'hybrid' keep a state other than keys and values",
    ),
    # a recurrent block that runs without asking the cache for its state: it writes no keys and
    # values, and the config names its kind
    "recurrent_gemma": (
        "RecurrentGemma",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=8, lru_width=32, attention_window_size=16,
             block_types=["recurrent", "attention"], conv1d_width=4),
        r"RecurrentGemmaForCausalLM: its layers of kind 'linear_attention' keep a state other than keys and values",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", OTHER_STATE)
def test_layers_of_state_other_than_keys_and_values_are_refused(kind):
    """Refused by causal_lm with what the model said and the layer kinds its config lists, not
    accepted with a key/value cache per layer that the build then fails to trace."""
    import transformers as tf

    name, fields, message = OTHER_STATE[kind]
    config = getattr(tf, f"{name}Config")(**{**COMMON, **fields})
    with pytest.raises(SpecError, match=rf"causal_lm cannot serve {message}"):
        causal_lm(lambda: getattr(tf, f"{name}ForCausalLM")(config), max_batch=2, max_context=MAX_CONTEXT)


def test_other_state_kinds_are_read_from_the_config_alone():
    """Where the meta device cannot run the model (its probe says nothing), the config's kinds of
    layer still refuse it; attention kinds of any name pass."""
    from types import SimpleNamespace

    from aot.hf import _other_state_kinds

    hybrid = SimpleNamespace(layer_types=["mamba", "attention", "linear_attention", "conv", "full_attention"])
    assert _other_state_kinds(hybrid, 4) == ["conv", "linear_attention", "mamba"]
    assert _other_state_kinds(hybrid, 2) == ["mamba"]
    blocks = SimpleNamespace(layers_block_type=["attention", "mamba"])
    assert _other_state_kinds(blocks, 2) == ["mamba"]
    kinds = ["full_attention", "sliding_attention", "chunked_attention", "attention"]
    assert _other_state_kinds(SimpleNamespace(layer_types=kinds), 4) == []
    assert _other_state_kinds(SimpleNamespace(), 4) == []
    import transformers as tf

    def meta_cannot_run(num_layers):
        raise RuntimeError("Tensor.item() cannot be called on meta tensors")

    name, fields, _ = OTHER_STATE["lfm2"]
    config = tf.Lfm2Config(**{**COMMON, **fields})
    with (
        mock.patch("aot.hf.state_cache_classes", return_value=(None, None, meta_cannot_run)),
        pytest.raises(
            SpecError,
            match=r"cannot serve Lfm2ForCausalLM: one token .* fails \(RuntimeError: Tensor.item\(\) .*\); "
            r"its layers of kind 'conv'",
        ),
    ):
        causal_lm(lambda: tf.Lfm2ForCausalLM(config), max_batch=2, max_context=MAX_CONTEXT)
    # a model of attention layers alone whose probe the meta device cannot run: the config's shapes
    with mock.patch("aot.hf.state_cache_classes", return_value=(None, None, meta_cannot_run)):
        assert causal_lm(factory("llama"), max_batch=2, max_context=MAX_CONTEXT).name == "LlamaForCausalLM"


def test_the_loader_needs_neither_this_module_nor_transformers():
    import subprocess
    import sys

    code = "import sys, aot.loader; print(sorted(m for m in sys.modules if m.startswith(('aot.hf', 'transformers'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Slow: tests/lm/test_hf_generate.py builds GPT-2 and Llama bundles in the default run (generate,
# eos, sampling, CLI); this one is the tracer-level check, for every kind.
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["llama", "gpt2", *SLOW, "llama_dynamic_rope", "phi3_longrope", "gemma3n_shared", "bloom", "mpt"]
)
def test_a_bundle_writes_the_cache_in_place_and_generates_what_transformers_generates(kind, tmp_path):
    """aotpack's own tracer on the spec: one program per entry point, each writing every layer's
    cache in place (``index_put_`` into the state input, no copy); the bundle's greedy tokens
    equal transformers' ``generate`` (fp32, CPU), left padding included."""
    import aot.loader
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import trace

    spec = causal_lm(factory(kind), max_batch=4, max_context=MAX_CONTEXT)
    traced = trace(spec)
    state = tuple(i.name for i in spec.state_inputs())
    programs = traced.programs or ()
    assert sorted(p.entry for p in programs) == ["decode", "prefill"]
    for p in programs:
        assert p.program.state == state
        writes = [s for s in p.program.steps if s.target.startswith("aten.index_put")]
        assert [s.target for s in writes] == ["aten.index_put_.default"] * len(state)
        assert sorted(s.args[0].name for s in writes) == sorted(state)
        assert not [
            s for s in p.program.steps if s.target in ("aten.copy_.default", "aten.index_put.default")
        ]
    path = tmp_path / f"{kind}.tpk"
    pack(generate(traced, ("sm_90",)), path)
    runner = aot.loader.load(path)
    ids, mask = prompts(3)
    expected, _ = hf_greedy(built(kind), ids, mask, NEW_TOKENS)
    assert runner.generate(ids, NEW_TOKENS, attention_mask=mask) == expected.tolist()
    alone, _ = hf_greedy(built(kind), ids[:1], mask[:1], 10)
    assert runner.generate(ids[0].tolist(), 10) == alone[0].tolist()


def test_trained_weights_come_through_from_pretrained(tmp_path):
    import transformers as tf

    from aot.tracer.model import instantiate

    built("llama", seed=3).save_pretrained(tmp_path)
    spec = causal_lm(
        lambda: tf.AutoModelForCausalLM.from_pretrained(tmp_path), max_batch=2, max_context=MAX_CONTEXT
    )
    module = instantiate(spec)  # seed 0: the weights are the checkpoint's, not the seed's
    ids, mask = prompts(2)
    expected, _ = hf_greedy(built("llama", seed=3), ids, mask, NEW_TOKENS)
    got, _ = eager_greedy(module, ids, mask, NEW_TOKENS)
    assert got.tolist() == expected.tolist()
    assert got.tolist() != hf_greedy(built("llama", seed=0), ids, mask, NEW_TOKENS)[0].tolist()


def test_a_bundle_of_one_batch_row_opens_and_generates_what_transformers_generates(tmp_path):
    """``max_batch=1``: export fixes the batch at its one size in both entry points' programs, so
    the bundle's contract declares it as that size (as a bundle of one program does), and the
    bundle opens; both loaders' ``generate`` read a max batch of 1 from it, and the torch loader's
    greedy tokens equal transformers' ``generate``; two prompts are refused by their count."""
    import aot.loader
    from aot.codegen import generate
    from aot.dtypes import ITEMSIZE
    from aot.errors import GuardError
    from aot.guards import GuardCore
    from aot.packager import pack
    from aot.runtime.generate import lm_contract
    from aot.tracer import trace

    spec = causal_lm(factory("gpt2"), max_batch=1, max_context=MAX_CONTEXT)
    traced = trace(spec)
    contract = {i.name: i.shape for i in traced.guards.inputs}
    assert contract["input_ids"] == ("1", "seq") and contract["key_cache_0"][0] == "1"
    assert "batch" not in {s.name for s in traced.guards.symbols}
    path = tmp_path / "one_row.tpk"
    pack(generate(traced, ("sm_90",), fuse=False), path)
    runner = aot.loader.load(path)
    ids, mask = prompts(1)
    expected, _ = hf_greedy(built("gpt2"), ids, mask, NEW_TOKENS)
    assert runner.generate(ids[0].tolist(), NEW_TOKENS) == expected[0].tolist()
    with pytest.raises(GuardError, match=r"^2 prompts, the bundle's batch admits at most 1$"):
        runner.generate([[5, 6], [7, 8]], 2)
    # the runtime without torch reads the same contract from the same guards
    checked = type(
        "Checked",
        (),
        {
            "entry_points": runner.entry_points,
            "input_names": runner.input_names,
            "guards": GuardCore(runner.manifest.guards, ITEMSIZE),
        },
    )()
    assert lm_contract(checked) == (1, MAX_CONTEXT)


@pytest.mark.slow
def test_a_kv_shared_layer_reads_the_earlier_cache_in_its_decode_kernel(tmp_path):
    """Gemma 3n's decode program: the KV-shared layer's attention is a decode attention kernel
    that reads the earlier layer's cache and appends nothing, beside the appending one of the
    other layers; every kernel of the bundle matches its ATen reference in Triton's
    interpreter (``aot.dtypes.TOLERANCE``) at one step of batch 1 and 3 and a prefill."""
    import aot.loader
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from aot.verify.interpret import interpret_in_subprocess
    from tests.realmodels.conftest import causal_lm_model_file

    model = tmp_path / "gemma3n_model.py"
    model.write_text(
        causal_lm_model_file(
            "tests.hf.test_causal_lm", "gemma3n_shared", max_batch=3, max_context=MAX_CONTEXT, name="gemma3n"
        )
    )
    bundle = tmp_path / "gemma3n.tpk"
    pack(generate(trace(load_model_file(model)), ("sm_90",)), bundle)
    decode = next(e.program for e in aot.loader.load(bundle)._entries if e.name == "seq == 1")
    attention = sorted(k.name for k in decode.kernels if k.config.get("kind") == "decode_attention")
    assert attention == ["decode_attention_append_g2_d8", "decode_attention_g2_d8"], attention
    sizes = [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 1}, {"batch": 2, "seq": 5}]
    (result,) = interpret_in_subprocess([(bundle, model, sizes, None)], timeout=HANG_GUARD_S)
    assert len(result) == len(sizes), sorted(result)
    for key, comparisons in result.items():
        assert comparisons, key
        bad = [c for c in comparisons if not c.ok]
        assert not bad, (key, bad[:3])
