"""``aot.hf.seq2seq``: an unmodified transformers encoder-decoder as one forward in three phases
(encode, decoder prefill, decode) over static self- and cross-attention caches.

The eager ``Seq2Seq`` driven as a runner drives it (one ``encode`` call, then one-token ``decode``
calls) must pick exactly the tokens transformers' greedy ``generate`` picks (fp32), for BART, T5
and Whisper, alone and in a batch of sources of different lengths; models it cannot serve and
sizes they do not have are refused with a SpecError naming them.
"""

from __future__ import annotations

import pytest
import torch

from aot.errors import SpecError
from aot.hf import Seq2Seq, seq2seq
from aot.spec import EntryPoint

VOCAB = 96
NEW_TOKENS = 6
MAX_SOURCE, MAX_TARGET = 8, 12
MEL_BINS, AUDIO_POSITIONS = 16, 12  # Whisper: 24 log-mel frames, 12 encoder positions
# Tiny random-weight configs. A wide initializer spreads the logits, so greedy picks are not
# near-ties that rounding could flip, and the tokens vary; no eos, no forced or suppressed
# tokens: generate's greedy picks are the logits' argmax at every step.
_COMMON = dict(vocab_size=VOCAB, eos_token_id=None)
_BART_LIKE = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
)

# T5 and Switch Transformers (T5 with experts): relative position buckets in self-attention
_T5_LIKE = dict(
    d_model=32,
    d_kv=8,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    pad_token_id=0,
    decoder_start_token_id=0,
)


def _config(kind: str):
    import transformers as tf

    if kind == "bart":
        return tf.BartForConditionalGeneration, tf.BartConfig(
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
            forced_bos_token_id=None,
            init_std=0.3,
            **_BART_LIKE,
            **_COMMON,
        )
    if kind == "t5":  # relative position buckets in self-attention; cross-attention has none
        return tf.T5ForConditionalGeneration, tf.T5Config(
            d_ff=64, initializer_factor=3.0, **_T5_LIKE, **_COMMON
        )
    if kind == "switch":  # T5 with top-1 experts kept as modules of their own, every other layer; a
        # capacity of 3 tokens an expert a row drops some of the 7-token sources' tokens in the
        # encoder, none of a 3-token decoder prompt's (untied embeddings: the tied head's rescaling
        # leaves these tiny models' tokens all alike)
        return tf.SwitchTransformersForConditionalGeneration, tf.SwitchTransformersConfig(
            d_ff=128,
            expert_capacity=3,
            num_experts=4,
            num_decoder_layers=2,
            num_sparse_encoder_layers=1,
            num_sparse_decoder_layers=1,
            tie_word_embeddings=False,
            **_T5_LIKE,
            **_COMMON,
        )
    if kind == "whisper":  # log-mel features in, no source mask
        return tf.WhisperForConditionalGeneration, tf.WhisperConfig(
            num_mel_bins=MEL_BINS,
            max_source_positions=AUDIO_POSITIONS,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            init_std=2.0,
            **_BART_LIKE,
            **_COMMON,
        )
    raise ValueError(kind)


def factory(kind: str):
    cls, config = _config(kind)
    return lambda: cls(config)


def built(kind: str, seed: int = 0):
    """The model as ModelSpec builds it: ``torch.manual_seed(seed); factory()``, eval."""
    torch.manual_seed(seed)
    return factory(kind)().eval()


def max_source(kind: str) -> int:
    return 2 * AUDIO_POSITIONS if kind == "whisper" else MAX_SOURCE


def sources(kind: str, batch: int) -> dict[str, torch.Tensor]:
    """The encoder's inputs: log-mel features [batch, 16, 24] for Whisper, else token ids
    [batch, 7] whose row r > 0 is padded on the right by 2r tokens (its mask 0 there)."""
    gen = torch.Generator().manual_seed(7)
    if kind == "whisper":
        return {"input_features": torch.randn(batch, MEL_BINS, 2 * AUDIO_POSITIONS, generator=gen)}
    ids = torch.randint(3, VOCAB, (batch, 7), generator=gen)
    mask = torch.ones(batch, 7, dtype=torch.int64)
    for r in range(1, batch):
        mask[r, 7 - 2 * r :] = 0
        ids[r, 7 - 2 * r :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def hf_greedy(model, source: dict[str, torch.Tensor], new_tokens: int, decoder_prompt=None) -> torch.Tensor:
    """transformers' greedy tokens [batch, new_tokens], the decoder start token (which Whisper's
    generate leaves out, and BART's and T5's keep) and any decoder prompt left out."""
    extra = {}
    if decoder_prompt is not None:
        start = model.generation_config.decoder_start_token_id
        batch = next(iter(source.values())).shape[0]
        extra["decoder_input_ids"] = torch.tensor([[start, *decoder_prompt]]).expand(batch, -1)
    with torch.no_grad():
        out = model.generate(**source, **extra, max_new_tokens=new_tokens, do_sample=False)
    return out[:, -new_tokens:]


def empty_state(wrapper: Seq2Seq, batch: int) -> dict[str, torch.Tensor]:
    layout, out = wrapper.layout, {}
    for i in range(layout.num_layers):
        for name, (heads, dim), length in (
            (f"key_cache_{i}", layout.self_keys[i], wrapper.max_target),
            (f"value_cache_{i}", layout.self_values[i], wrapper.max_target),
            (f"cross_key_{i}", layout.cross_keys[i], layout.encoded),
            (f"cross_value_{i}", layout.cross_values[i], layout.encoded),
        ):
            out[name] = torch.zeros(batch, heads, length, dim)
    if not layout.audio:
        out["cross_mask"] = torch.zeros(batch, layout.encoded)
    return out


def eager_greedy(wrapper: Seq2Seq, source: dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
    """Greedy decoding through the Seq2Seq contract, as a runner drives it: ``encode`` (the
    encoder, the cross caches and the start token's step at slot 0), then one token per
    ``decode`` call at slot 1 + i, its encoder inputs one position of the source (unread)."""
    batch = next(iter(source.values())).shape[0]
    state = empty_state(wrapper, batch)
    unread = {k: v[..., :1] for k, v in source.items()}
    tokens = []
    with torch.no_grad():
        logits = wrapper(
            **source,
            decoder_input_ids=torch.zeros(batch, 1, dtype=torch.int64),
            cache_position=torch.zeros(1, dtype=torch.int64),
            **state,
            phase="encode",
        )
        for step in range(new_tokens):
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
            tokens.append(token)
            logits = wrapper(
                **unread,
                decoder_input_ids=token,
                cache_position=torch.tensor([1 + step]),
                **state,
                phase="decode",
            )
    return torch.cat(tokens, 1)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "kind",
    [
        "bart",
        "switch",
        pytest.param("t5", marks=pytest.mark.slow),
        pytest.param("whisper", marks=pytest.mark.slow),
    ],
)
def test_greedy_tokens_equal_generate(kind, batch):
    wrapper = Seq2Seq(built(kind), max_source(kind), MAX_TARGET).eval()
    source = sources(kind, batch)
    want = hf_greedy(built(kind), source, NEW_TOKENS)
    got = eager_greedy(wrapper, source, NEW_TOKENS)
    assert got.tolist() == want.tolist()
    assert len(set(got.flatten().tolist())) > 2, "the tokens barely vary; the comparison would prove little"


def test_the_switch_sources_overflow_an_experts_capacity():
    """The Switch config's sources (``sources``) send more tokens of a row to one expert than its
    capacity in the encoder's sparse layer: the dropped tokens' path (a dispatch mask all zero) is
    what the generate tests compare, not only the routed one."""
    model = built("switch")
    dropped = []
    router = next(m for m in model.encoder.modules() if type(m).__name__ == "SwitchTransformersTop1Router")
    router.register_forward_hook(lambda m, args, out: dropped.append(int((out[0].sum(-1) == 0).sum())))
    with torch.no_grad():
        model.encoder(**sources("switch", 3))
    assert dropped and dropped[0] > 0, dropped


def test_the_spec_has_three_entry_points_over_two_caches():
    spec = seq2seq(factory("bart"), max_batch=4, max_source=MAX_SOURCE, max_target=MAX_TARGET)
    assert [(e.name, e.sizes, e.kwargs) for e in spec.entry_points] == [
        ("prefill", {}, {"phase": "decode"}),
        ("encode", {"seq": 1}, {"phase": "encode"}),
        ("decode", {"source": 1, "seq": 1}, {"phase": "decode"}),
    ]
    shapes = {i.name: tuple(getattr(s, "name", s) for s in i.shape) for i in spec.inputs}
    assert shapes["input_ids"] == shapes["attention_mask"] == ("batch", "source")
    assert shapes["decoder_input_ids"] == ("batch", "seq") and shapes["cache_position"] == ("seq",)
    assert shapes["key_cache_1"] == ("batch", 4, MAX_TARGET, 8)
    assert shapes["cross_value_1"] == ("batch", 4, MAX_SOURCE, 8)
    assert shapes["cross_mask"] == ("batch", MAX_SOURCE)
    assert {i.name for i in spec.state_inputs()} == {
        n for n in shapes if "cache" in n[:-2] or "cross" in n
    } - {"cache_position"}
    audio = seq2seq(factory("whisper"), max_batch=2, max_source=24, max_target=MAX_TARGET)
    shapes = {i.name: tuple(getattr(s, "name", s) for s in i.shape) for i in audio.inputs}
    assert shapes["input_features"] == ("batch", MEL_BINS, "frames") and "attention_mask" not in shapes
    assert shapes["cross_key_0"] == ("batch", 4, AUDIO_POSITIONS, 8) and "cross_mask" not in shapes
    assert [e.sizes for e in audio.entry_points] == [{}, {"seq": 1, "frames": 24}, {"frames": 1, "seq": 1}]


def test_models_and_sizes_it_cannot_serve_are_refused():
    import transformers as tf

    with pytest.raises(
        SpecError, match=r"encoder takes exactly 24 log-mel frames .* max_source must be 24, got 30"
    ):
        seq2seq(factory("whisper"), max_batch=2, max_source=30, max_target=MAX_TARGET)
    with pytest.raises(
        SpecError, match="max_target 80 exceeds BartForConditionalGeneration's 64 decoder positions"
    ):
        seq2seq(factory("bart"), max_batch=2, max_source=MAX_SOURCE, max_target=80)
    with pytest.raises(
        SpecError, match="max_source 65 exceeds BartForConditionalGeneration's max_position_embeddings 64"
    ):
        seq2seq(factory("bart"), max_batch=2, max_source=65, max_target=MAX_TARGET)
    config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB)
    with pytest.raises(
        SpecError, match=r"GPT2LMHeadModel \(gpt2\) is not one \(decoder-only causal LMs: aot.hf.causal_lm\)"
    ):
        seq2seq(lambda: tf.GPT2LMHeadModel(config), max_batch=2, max_source=MAX_SOURCE, max_target=MAX_TARGET)
    with pytest.raises(SpecError, match="max_target must be an int >= 2, got 1"):
        seq2seq(factory("t5"), max_batch=2, max_source=MAX_SOURCE, max_target=1)
    with pytest.raises(SpecError, match="factory must be a zero-argument callable"):
        seq2seq(built("t5"), max_batch=2, max_source=MAX_SOURCE, max_target=MAX_TARGET)


def test_entry_point_kwargs_are_plain_constants():
    assert EntryPoint("encode", {"seq": 1}, kwargs={"phase": "encode"}).kwargs == {"phase": "encode"}
    with pytest.raises(SpecError, match=r"entry point 'encode': kwargs\['phase'\] is a Tensor"):
        EntryPoint("encode", kwargs={"phase": torch.zeros(1)})


def test_an_encoder_decoder_of_one_batch_row_opens_and_generates_what_transformers_generates(tmp_path):
    """``max_batch=1``: the batch is a static size of 1 in the contract (as for ``causal_lm``), the
    bundle opens, and its greedy tokens equal transformers' ``generate``."""
    import aot.loader
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import trace

    traced = trace(seq2seq(factory("bart"), max_batch=1, max_source=MAX_SOURCE, max_target=MAX_TARGET))
    assert {i.name: i.shape for i in traced.guards.inputs}["input_ids"] == ("1", "source")
    path = tmp_path / "one_row.tpk"
    pack(generate(traced, ("sm_90",), fuse=False), path)
    runner = aot.loader.load(path)
    source = sources("bart", 1)
    want = hf_greedy(built("bart"), source, 6)[0].tolist()
    assert runner.generate(source["input_ids"][0].tolist(), 6) == want
