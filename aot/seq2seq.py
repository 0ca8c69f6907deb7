"""Encoder-decoder models from transformers (BART, T5, Whisper, ...), as stateful bundles for
generation: an encoder entry point, then decoder prefill and decode over two caches.

``seq2seq(factory, max_batch=..., max_source=..., max_target=...)`` returns the ``ModelSpec`` of an
unmodified transformers encoder-decoder wrapped in a ``Seq2Seq``: one forward with three phases,
each an entry point of the bundle (``EntryPoint.kwargs`` picks the phase)::

    logits = seq2seq(
        input_ids=...,          # int64 [batch, source]  the encoder's tokens (Whisper: input_features
        attention_mask=...,     # int64 [batch, source]   float [batch, mel_bins, frames], no mask)
        decoder_input_ids=...,  # int64 [batch, seq]     the decoder's tokens
        cache_position=...,     # int64 [seq]            the self-attention slots they are written to
        key_cache_0=..., value_cache_0=..., ...,   # [batch, heads, max_target, head_dim]  self-attention
        cross_key_0=..., cross_value_0=..., ...,   # [batch, heads, encoded, head_dim]     cross-attention
        cross_mask=...,         # [batch, encoded]       1.0 = an encoder position holding a real token
    )                           # -> [batch, vocab]: the logits of each row's last decoder position

- ``encode`` (``seq == 1``): runs the encoder, writes every decoder layer's cross-attention keys and
  values of the source (and the source's mask) into the cross caches, then runs the decoder's first
  step on the model's decoder start token at self-attention slot 0, and returns that step's logits.
  ``decoder_input_ids`` and ``cache_position`` are not read (a [batch, 1] and a [1] of anything).
- ``prefill`` (no size fixed: the bundle's general program) and ``decode`` (``seq == 1``,
  ``source == 1``): the decoder alone, over ``decoder_input_ids`` written at ``cache_position``;
  cross-attention reads the cross caches. The encoder inputs are not read (``generate`` passes one
  position of the source: [batch, 1]; Whisper: [batch, mel_bins, 1]).

The decoder's self-attention mask is causal over the slots (a decoder prompt is never padded: every
row starts with the same start token); cross-attention sees the source positions marked in
``cross_mask``. Both reach the model as 4-D additive masks, which transformers passes through
unchanged, as it does ``aot.hf.causal_lm``'s. The cache shapes are read from the model (one token on
the meta device), not from its config.

transformers is imported inside functions only: a serving host that loads a bundle never needs it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aot.errors import SpecError, TraceError
from aot.hf_cache import ATTENTION_IMPLEMENTATIONS, probe, set_attention, state_cache_classes
from aot.spec import Dim, EntryPoint, Input, ModelSpec

PHASES = ("encode", "decode")
# The entry points a seq2seq bundle has, in order: the first is the build's general program.
ENTRY_POINTS = ("prefill", "encode", "decode")
# Encoder inputs by the model's ``main_input_name``: token ids with their padding mask, or
# Whisper's log-mel features (a fixed number of frames, no mask).
TOKEN_INPUT, AUDIO_INPUT = "input_ids", "input_features"


@dataclass(frozen=True)
class Seq2SeqLayout:
    """What the spec needs to know about an encoder-decoder: each decoder layer's self-attention
    and cross-attention ``(heads, head_dim)`` for keys and values, its vocabulary, its encoder
    input and the token the decoder starts with.

    ``encoded``: the cross caches' length: ``max_source`` for token inputs, the encoder's output
    length for audio (Whisper's frames / 2). ``mel_bins``: the audio encoder's feature channels."""

    model_class: str
    self_keys: tuple[tuple[int, int], ...]
    self_values: tuple[tuple[int, int], ...]
    cross_keys: tuple[tuple[int, int], ...]
    cross_values: tuple[tuple[int, int], ...]
    vocab_size: int
    source_vocab: int
    decoder_start: int
    hidden_size: int
    main_input: str
    encoded: int
    mel_bins: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.self_keys)

    @property
    def audio(self) -> bool:
        return self.main_input == AUDIO_INPUT


def seq2seq(
    factory: Callable[[], Any],
    *,
    max_batch: int,
    max_source: int,
    max_target: int,
    dtype: str = "float32",
    seed: int = 0,
    name: str | None = None,
    batch_buckets: tuple[int, ...] | None = None,
    attn_implementation: str | None = None,
) -> ModelSpec:
    """The spec of a transformers encoder-decoder (``AutoModelForSeq2SeqLM`` classes such as
    BART and T5, or Whisper's ``WhisperForConditionalGeneration``) with caches for ``max_batch``
    rows, sources of up to ``max_source`` tokens, and ``max_target`` decoder slots (the start
    token, a decoder prompt and the generated tokens but the last); three entry points,
    ``encode``, ``prefill`` and ``decode`` (the module docstring).

    ``factory``: a zero-argument callable returning the model (``lambda:
    BartForConditionalGeneration(config)``, ``lambda: T5ForConditionalGeneration.from_pretrained(path)``),
    called as ModelSpec does. For Whisper, ``max_source`` is the number of log-mel frames the
    encoder takes, which it fixes: ``2 * config.max_source_positions``.
    """
    for what, value, least in (
        ("max_batch", max_batch, 1),
        ("max_source", max_source, 1),
        ("max_target", max_target, 2),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SpecError(f"seq2seq: {what} must be an int >= {least}, got {value!r}")
    if not callable(factory) or isinstance(factory, torch.nn.Module):
        raise SpecError(
            f"seq2seq: factory must be a zero-argument callable that returns the model "
            f"(lambda: BartForConditionalGeneration(config)), got a {type(factory).__name__}"
        )
    if attn_implementation is not None and attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise SpecError(
            f"seq2seq: attn_implementation {attn_implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}"
        )
    # the wrapper the build will make, made here on the meta device: a model it cannot serve is
    # refused now, and its cache layout read
    layout = Seq2Seq(probe(factory, seed, "seq2seq"), max_source, max_target, attn_implementation).layout

    def make_module() -> torch.nn.Module:
        return Seq2Seq(factory(), max_source, max_target, attn_implementation)

    batch = Dim("batch", 1, max_batch, buckets=batch_buckets, example=min(2, max_batch))
    seq = Dim("seq", 1, max_target, buckets=(1,), example=min(3, max_target - 1))
    if layout.audio:
        # Whisper's encoder takes exactly its frames; the decoder's entry points take one frame
        frames = Dim("frames", 1, max_source, buckets=(1, max_source), example=max_source)
        source_inputs = [Input(AUDIO_INPUT, (batch, layout.mel_bins, frames))]
        encode_sizes = {"seq": 1, "frames": max_source}
        decoder_sizes = {"frames": 1}
    else:
        source = Dim("source", 1, max_source, example=max(1, max_source // 2))
        source_inputs = [
            Input(TOKEN_INPUT, (batch, source), dtype="int64", low=0, high=layout.source_vocab),
            Input("attention_mask", (batch, source), dtype="int64", low=0, high=2),
        ]
        encode_sizes = {"seq": 1}
        decoder_sizes = {"source": 1}
    inputs = [
        *source_inputs,
        Input("decoder_input_ids", (batch, seq), dtype="int64", low=0, high=layout.vocab_size),
        Input("cache_position", (seq,), dtype="int64", low=0, high=max_target),
    ]
    for i in range(layout.num_layers):
        (kh, kd), (vh, vd) = layout.self_keys[i], layout.self_values[i]
        inputs.append(Input(f"key_cache_{i}", (batch, kh, max_target, kd), state=True))
        inputs.append(Input(f"value_cache_{i}", (batch, vh, max_target, vd), state=True))
    for i in range(layout.num_layers):
        (kh, kd), (vh, vd) = layout.cross_keys[i], layout.cross_values[i]
        inputs.append(Input(f"cross_key_{i}", (batch, kh, layout.encoded, kd), state=True))
        inputs.append(Input(f"cross_value_{i}", (batch, vh, layout.encoded, vd), state=True))
    if not layout.audio:
        inputs.append(Input("cross_mask", (batch, layout.encoded), state=True))
    return ModelSpec(
        module=make_module,
        inputs=inputs,
        dtype=dtype,
        name=name or layout.model_class,
        seed=seed,
        example_inputs=functools.partial(example_inputs, max_target=max_target, audio=layout.audio),
        # prefill first: the bundle's general program, every Dim dynamic (its encoder inputs unread)
        entry_points=(
            EntryPoint("prefill", {}, kwargs={"phase": "decode"}),
            EntryPoint("encode", encode_sizes, kwargs={"phase": "encode"}),
            EntryPoint("decode", {**decoder_sizes, "seq": 1}, kwargs={"phase": "decode"}),
        ),
    )


def example_inputs(sizes: dict[str, int], *, max_target: int, audio: bool) -> dict[str, torch.Tensor]:
    """Inputs that make a valid call at ``sizes``: a source whose rows after the first are padded
    on the right (one token fewer each, never all of it), and ``seq`` decoder tokens written at
    consecutive slots after the start token's. Token ids and features are left to the spec's
    random examples."""
    batch, seq = sizes["batch"], sizes["seq"]
    start = min(1, max_target - seq)
    out = {"cache_position": torch.arange(start, start + seq, dtype=torch.int64)}
    if not audio:
        source = sizes["source"]
        mask = torch.ones(batch, source, dtype=torch.int64)
        for r in range(1, batch):
            mask[r, max(1, source - r) :] = 0
        out["attention_mask"] = mask
    return out


def seq2seq_layout(model: Any, max_source: int, max_target: int) -> Seq2SeqLayout:
    """Check that ``model`` is a transformers encoder-decoder this wrapper can drive, and read its
    caches' layout; a SpecError naming the model class says why not."""
    from transformers import PreTrainedModel

    cls = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise SpecError(
            f"seq2seq needs a transformers encoder-decoder (a PreTrainedModel such as "
            f"BartForConditionalGeneration); the factory returned a {cls}"
        )
    config = model.config
    if not getattr(config, "is_encoder_decoder", False) or not model.can_generate():
        raise SpecError(
            f"seq2seq supports encoder-decoder models that generate (BartForConditionalGeneration, "
            f"T5ForConditionalGeneration, WhisperForConditionalGeneration, ...); {cls} ({config.model_type}) "
            f"is not one (decoder-only causal LMs: aot.hf.causal_lm)"
        )
    params = inspect.signature(model.forward).parameters
    missing = [
        p
        for p in ("decoder_input_ids", "encoder_outputs", "past_key_values", "decoder_attention_mask")
        if p not in params
    ]
    main_input = getattr(model, "main_input_name", TOKEN_INPUT)
    if missing or main_input not in (TOKEN_INPUT, AUDIO_INPUT) or main_input not in params:
        raise SpecError(
            f"seq2seq cannot drive {cls}: its forward must take {main_input!r} (input_ids or input_features), "
            f"decoder_input_ids, encoder_outputs, past_key_values and decoder_attention_mask"
            + (f"; it takes no {', '.join(missing)}" if missing else "")
        )
    start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "decoder_start_token_id", None)
    if isinstance(start, (list, tuple)) or not isinstance(start, int):
        raise SpecError(
            f"seq2seq: {cls} has no single decoder_start_token_id in its config or generation config "
            f"(got {start!r}); set config.decoder_start_token_id"
        )
    # Whisper's decoder positions, BART's (shared with its encoder); T5's relative ones have none
    limit = getattr(config, "max_target_positions", None)
    if not isinstance(limit, int):
        limit = getattr(config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) else None
    if limit is not None and max_target > limit:
        raise SpecError(
            f"seq2seq: max_target {max_target} exceeds {cls}'s {limit} decoder positions; use max_target <= {limit}"
        )
    mel_bins = 0
    encoded = max_source
    if main_input == AUDIO_INPUT:
        encoder = model.get_encoder()
        strides = encoder.conv1.stride[0] * encoder.conv2.stride[0]
        frames = config.max_source_positions * strides
        if max_source != frames:
            raise SpecError(
                f"seq2seq: {cls}'s encoder takes exactly {frames} log-mel frames (2 x max_source_positions "
                f"{config.max_source_positions}), so max_source must be {frames}, got {max_source}"
            )
        mel_bins, encoded = config.num_mel_bins, config.max_source_positions
    else:
        limit = getattr(config, "max_position_embeddings", None)
        if isinstance(limit, int) and max_source > limit:
            raise SpecError(
                f"seq2seq: max_source {max_source} exceeds {cls}'s max_position_embeddings {limit}; "
                f"use max_source <= {limit}"
            )
    output = model.get_output_embeddings()
    vocab = output.weight.shape[0] if output is not None else config.vocab_size
    source_vocab = model.get_input_embeddings().weight.shape[0] if main_input == TOKEN_INPUT else 0
    shapes = _measured_shapes(model, cls, config)
    return Seq2SeqLayout(
        model_class=cls,
        self_keys=shapes[0],
        self_values=shapes[1],
        cross_keys=shapes[2],
        cross_values=shapes[3],
        vocab_size=vocab,
        source_vocab=source_vocab,
        decoder_start=start,
        hidden_size=config.d_model,
        main_input=main_input,
        encoded=encoded,
        mel_bins=mel_bins,
    )


def encoded(hidden: torch.Tensor) -> Any:
    """The encoder's output as the decoder's forward takes it: ``MoEModelOutput`` has
    ``BaseModelOutput``'s fields and the router's (None here), which Switch Transformers reads from
    it."""
    from transformers.modeling_outputs import MoEModelOutput

    return MoEModelOutput(last_hidden_state=hidden)


def _measured_shapes(model: Any, cls: str, config: Any) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each decoder layer's ``(heads, head_dim)`` of self-attention keys and values and of
    cross-attention keys and values, as its attention hands them to the caches' ``update`` for
    one token over one encoder position (on the meta device, nothing is computed)."""
    from transformers.cache_utils import EncoderDecoderCache

    from aot.experts import grouped_experts  # experts that loop over those hit cannot run on meta

    _, _, RecordingCache = state_cache_classes()
    layers = getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None)
    layers = layers or config.num_hidden_layers
    weight = next(model.parameters())
    own, cross = RecordingCache(layers), RecordingCache(layers)
    cache = EncoderDecoderCache(own, cross)
    cache.is_updated = {i: False for i in range(layers)}
    # 4-D masks, as Seq2Seq passes them: transformers builds none (which would read values)
    mask = torch.zeros(1, 1, 1, 1, dtype=weight.dtype, device=weight.device)
    masks = {"decoder_attention_mask": mask}
    if getattr(model, "main_input_name", TOKEN_INPUT) == TOKEN_INPUT:
        masks["attention_mask"] = mask
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), grouped_experts(model):
            model(
                encoder_outputs=encoded(
                    torch.zeros(1, 1, config.d_model, dtype=weight.dtype, device=weight.device)
                ),
                decoder_input_ids=torch.zeros(1, 1, dtype=torch.int64, device=weight.device),
                past_key_values=cache,
                use_cache=True,
                **masks,
            )
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise SpecError(
            f"seq2seq cannot drive {cls}: one decoder step failed: {type(e).__name__}: {first}"
        ) from None
    out = []
    for recorder, what in ((own, "self-attention"), (cross, "cross-attention")):
        seen = [layer.shapes for layer in recorder.layers]
        if any(len(s) != 1 for s in seen):
            raise SpecError(
                f"seq2seq cannot serve {cls}: each decoder layer must write its {what} keys and values once "
                f"through past_key_values.update per step; the {layers} layers wrote {[len(s) for s in seen]} times"
            )
        out += [tuple(s[0][0] for s in seen), tuple(s[0][1] for s in seen)]
    return tuple(out)


@functools.cache
def _cross_cache_classes() -> tuple[type, type]:
    """``CrossCache`` and its layer, defined on first use (transformers is imported lazily)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class CrossLayer(CacheLayerMixin):
        """One decoder layer's cross-attention keys and values: the runner's state tensors. Its
        ``update`` (called in the encode phase only) writes the source's keys and values into
        slots ``0..source-1`` and hands back the whole cache; in the decoder phases the model reads
        ``keys`` and ``values`` directly (the cache says each layer is updated)."""

        is_compileable = True
        is_sliding = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: str):
            super().__init__()
            self.keys, self.values, self.owner = keys, values, owner
            self.writes = 0
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # key_states: [B, heads, source, head_dim] → slots 0..source-1 of [B, heads, encoded, head_dim]
            for new, cache, what in ((key_states, self.keys, "keys"), (value_states, self.values, "values")):
                if (
                    new.dim() != 4
                    or tuple(new.shape[:2]) != tuple(cache.shape[:2])
                    or new.shape[3] != cache.shape[3]
                ):
                    raise TraceError(
                        f"{self.owner}'s cross-attention wrote {what} of shape {tuple(new.shape)} into a cache laid "
                        f"out as {tuple(cache.shape)} ([batch, heads, source, head_dim]); seq2seq cannot serve this model"
                    )
            slots = torch.arange(key_states.shape[2], device=key_states.device)
            self.keys.index_copy_(2, slots, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, slots, value_states.to(self.values.dtype))
            self.writes += 1
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[2], 0

        def get_seq_length(self) -> int:
            return 0  # EncoderDecoderCache reads it for is_updated, which Seq2Seq sets itself

        def get_max_length(self) -> int:
            return self.keys.shape[2]

    class CrossCache(Cache):
        def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], owner: str):
            super().__init__(layers=[CrossLayer(k, v, owner) for k, v in zip(keys, values)])

    return CrossCache, CrossLayer


class Seq2Seq(torch.nn.Module):
    """A transformers encoder-decoder as one forward over static caches, in three phases (the
    contract in the module docstring). ``model`` is kept unmodified, except that its attention
    implementation is set to one that takes an additive 4-D mask ("sdpa" where supported, else
    "eager")."""

    def __init__(self, model: Any, max_source: int, max_target: int, attn_implementation: str | None = None):
        super().__init__()
        self.layout = seq2seq_layout(model, max_source, max_target)
        self.max_source, self.max_target = max_source, max_target
        self.model = model
        set_attention(model, attn_implementation, self.layout.model_class, "seq2seq")
        self.__class__ = _seq2seq_class(self.layout.num_layers, self.layout.main_input)

    def forward(self, phase: str = "decode", **inputs: torch.Tensor) -> torch.Tensor:
        if phase not in PHASES:
            raise SpecError(
                f"Seq2Seq({self.layout.model_class}): phase must be one of {PHASES}, got {phase!r}"
            )
        from transformers.cache_utils import EncoderDecoderCache

        n, layout = self.layout.num_layers, self.layout
        self_keys = [inputs[f"key_cache_{i}"] for i in range(n)]
        self_values = [inputs[f"value_cache_{i}"] for i in range(n)]
        cross_keys = [inputs[f"cross_key_{i}"] for i in range(n)]
        cross_values = [inputs[f"cross_value_{i}"] for i in range(n)]
        dtype = self_keys[0].dtype
        source = inputs[layout.main_input]
        batch, device = source.shape[0], source.device
        if phase == "encode":
            encoder = self.model.get_encoder()
            if layout.audio:
                hidden = encoder(input_features=source.to(dtype), return_dict=True).last_hidden_state
                visible = None
            else:
                mask = inputs["attention_mask"]  # [B, source]
                hidden = encoder(input_ids=source, attention_mask=mask, return_dict=True).last_hidden_state
                # [B, encoded]: the source's mask, 0 past it (slots a longer source may have left)
                slots = torch.arange(mask.shape[1], device=device)
                visible = torch.zeros(batch, layout.encoded, dtype=dtype, device=device).index_copy(
                    1, slots, mask.to(dtype)
                )
                inputs["cross_mask"].copy_(visible)
            # the decoder's first step: the start token at slot 0
            decoder_ids = torch.full((batch, 1), layout.decoder_start, dtype=torch.int64, device=device)
            cache_position = torch.zeros(1, dtype=torch.int64, device=device)
        else:
            hidden = torch.zeros(batch, 1, layout.hidden_size, dtype=dtype, device=device)  # read by no step
            visible = None if layout.audio else inputs["cross_mask"]
            decoder_ids, cache_position = inputs["decoder_input_ids"], inputs["cache_position"]
        StateCache, _, _ = state_cache_classes()
        CrossCache, _ = _cross_cache_classes()
        own = StateCache(self_keys, self_values, cache_position, layout.model_class)
        cross = CrossCache(cross_keys, cross_values, layout.model_class)
        cache = EncoderDecoderCache(own, cross)
        cache.is_updated = {i: phase == "decode" for i in range(n)}
        lowest = torch.finfo(dtype).min
        # self-attention: causal over the slots, [B, 1, S, max_target]
        slots = torch.arange(self.max_target, device=device)
        causal = torch.where(slots[None, :] <= cache_position[:, None], 0.0, lowest).to(dtype)
        self_mask = causal[None, None].expand(batch, 1, -1, -1)
        extra = {}
        if visible is not None:  # cross-attention: the source's real positions, [B, 1, S, encoded]
            cross_mask = torch.where(visible > 0.5, 0.0, lowest).to(dtype)[:, None, None, :]
            extra["attention_mask"] = cross_mask.expand(-1, -1, decoder_ids.shape[1], -1)
        out = self.model(
            encoder_outputs=encoded(hidden),
            decoder_input_ids=decoder_ids,
            decoder_attention_mask=self_mask,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
            **extra,
        )
        unwritten = [i for i, layer in enumerate(own.layers) if layer.writes != 1]
        if phase == "encode":
            unwritten += [
                i for i, layer in enumerate(cross.layers) if layer.writes != 1 and i not in unwritten
            ]
        if unwritten:
            raise TraceError(
                f"{layout.model_class}'s decoder layers {sorted(unwritten)} did not write their caches once through "
                f"past_key_values.update; seq2seq cannot serve this model"
            )
        # logits: [B, S, V] → the last position's, [B, V]
        return out.logits[:, -1].to(dtype)


@functools.cache
def _seq2seq_class(num_layers: int, main_input: str) -> type[Seq2Seq]:
    """``Seq2Seq`` with a ``forward`` whose signature names each input and state tensor, so that
    callers, the tracer and ``torch.export`` bind them by keyword (as ``aot.hf``'s Decoder)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = [main_input] + (["attention_mask"] if main_input == TOKEN_INPUT else [])
    names += ["decoder_input_ids", "cache_position"]
    names += [f"{k}_cache_{i}" for i in range(num_layers) for k in ("key", "value")]
    names += [f"cross_{k}_{i}" for i in range(num_layers) for k in ("key", "value")]
    names += ["cross_mask"] if main_input == TOKEN_INPUT else []
    parameters = [inspect.Parameter("self", kind)]
    parameters += [inspect.Parameter(n, kind, annotation=torch.Tensor) for n in names]
    parameters.append(
        inspect.Parameter("phase", inspect.Parameter.KEYWORD_ONLY, default="decode", annotation=str)
    )

    def forward(self: Seq2Seq, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = forward.__signature__.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop("self")
        return Seq2Seq.forward(self, **values)

    forward.__signature__ = inspect.Signature(parameters, return_annotation=torch.Tensor)  # type: ignore[attr-defined]
    return type(
        "Seq2Seq", (Seq2Seq,), {"forward": forward, "__module__": __name__, "__qualname__": "Seq2Seq"}
    )
