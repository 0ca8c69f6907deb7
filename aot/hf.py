"""Causal language models from transformers, as stateful bundles for token-by-token decoding.

``causal_lm(factory, max_batch=..., max_context=...)`` returns the ``ModelSpec`` of an unmodified
transformers causal LM (GPT-2, Llama, Qwen2, Mistral, ...) wrapped in a ``Decoder``: one forward
that serves both prefill and decode over a static KV cache held by the runner as state::

    logits = decoder(
        input_ids=...,        # int64 [batch, seq]
        position_ids=...,     # int64 [batch, seq]   (RoPE / absolute position of each token)
        cache_position=...,   # int64 [seq]          (the cache slots this call writes, every row alike)
        attention_mask=...,   # int64 [batch, max_context]  (1 = a slot holding a real token;
                              #   [batch, context] with context_buckets: attention reads slots < context)
        key_cache_0=..., value_cache_0=..., ...,  # [batch, kv_heads, max_context, head_dim], written in place
    )                         # -> [batch, vocab]: the logits of each row's last position

The cache tensors are passed to the model as its ``past_key_values`` through ``StateCache``, whose
``update`` (the one call every transformers attention layer makes) copies the new keys and values
into their slots in place and hands the whole cache back. The attention mask is built here as a
4-D additive float mask (a slot is visible when its ``attention_mask`` bit is set and it is not
after the query's slot, nor outside a sliding window); transformers passes a 4-D mask through its
mask code unchanged, so no version-specific mask logic is involved. The cache's shape per layer
is read from the model itself: one token through it on the meta device, with a ``past_key_values``
that records what each attention layer writes. A model whose ALiBi biases come from the 2-D mask
(Bloom) takes no ``position_ids``: it gets the 4-D mask too, and its ``build_alibi_tensor`` reads
the call's 2-D ``attention_mask`` (``_alibi_over``). One whose ALiBi biases follow the slot index
(MPT) takes none either: the cache tells it a length of 0 (``_alibi_by_cache_length``).

transformers is imported inside functions only: a serving host that loads a bundle never needs it.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from aot.errors import SpecError, TraceError
from aot.hf_cache import ATTENTION_IMPLEMENTATIONS, probe, set_attention, state_cache_classes
from aot.spec import Dim, EntryPoint, Input, ModelSpec

# The forward parameters a causal LM must take for the wrapper to drive it.
REQUIRED_PARAMETERS = ("input_ids", "attention_mask", "position_ids", "past_key_values")


@dataclass(frozen=True)
class CacheLayout:
    """What the spec needs to know about a model: its KV cache's shape and its vocabulary.

    ``key_shapes``/``value_shapes``: each layer's ``(kv_heads, head_dim)`` as its attention
    hands keys and values to the cache; None for a layer that keeps no cache of its own, whose
    attention reads an earlier layer's (Gemma 3n's KV-shared layers: ``cached`` lists the
    others, each a ``key_cache_{i}``/``value_cache_{i}`` state pair). ``window``: the
    sliding-window length when it is shorter than the context, else None; ``chunk``: the same of attention chunks (Llama 4). They apply to
    every layer (Mistral's window), or, with ``mixed``, to the "sliding_attention" and
    "chunked_attention" layers of ``config.layer_types`` alone, the "full_attention" ones seeing
    the whole context (Gemma 2 and 3, GPT-OSS, Cohere 2, Qwen2 with ``max_window_layers``, Llama
    4): the wrapper then hands the model a mask per kind of layer, as transformers' own
    ``causal_mask_mapping``."""

    model_class: str
    key_shapes: tuple[tuple[int, int] | None, ...]
    value_shapes: tuple[tuple[int, int] | None, ...]
    vocab_size: int
    window: int | None
    chunk: int | None = None
    mixed: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.key_shapes)

    @property
    def cached(self) -> tuple[int, ...]:
        """The layers that keep a cache of their own."""
        return tuple(i for i, shape in enumerate(self.key_shapes) if shape is not None)


def causal_lm(
    factory: Callable[[], Any],
    *,
    max_batch: int,
    max_context: int,
    dtype: str = "float32",
    seed: int = 0,
    name: str | None = None,
    batch_buckets: tuple[int, ...] | None = None,
    seq_buckets: tuple[int, ...] | None = None,
    attn_implementation: str | None = None,
    context_buckets: tuple[int, ...] | None = None,
) -> ModelSpec:
    """The spec of a transformers causal LM with a static KV cache of ``max_batch`` rows and
    ``max_context`` slots, and two entry points: ``prefill`` (any ``seq``) and ``decode``
    (``seq == 1``).

    ``factory``: a zero-argument callable returning the model (``lambda:
    LlamaForCausalLM(config)``, ``lambda: AutoModelForCausalLM.from_pretrained(path)``); it is
    called as ModelSpec does (``torch.manual_seed(seed); factory()``), once here on the meta
    device to read the cache layout, and again by the build. Trained weights come with the
    model (``from_pretrained`` in the factory): the module the bundle is built from holds the
    transformers model under ``model.``, so its state dict is not a transformers checkpoint's.
    ``batch_buckets``/``seq_buckets``: CUDA-graph sizes (default: powers of two up to the
    maximum). ``attn_implementation``: "sdpa" (default where the model supports it) or "eager".

    ``context_buckets``: attend over the filled part of the cache only. ``attention_mask`` is then
    [batch, context] with ``context`` a size of its own (these buckets, ``max_context`` among
    them), and attention reads cache slots ``0..context-1`` alone; ``generate`` passes the
    smallest bucket that covers every slot written so far, so a short conversation in a long
    context reads a short cache. Without them, every call attends over all ``max_context``
    slots (one graph per batch bucket instead of one per batch and context bucket).
    """
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SpecError(f"causal_lm: max_batch must be an int >= 1, got {max_batch!r}")
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
        raise SpecError(f"causal_lm: max_context must be an int >= 2, got {max_context!r}")
    if attn_implementation is not None and attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise SpecError(
            f"causal_lm: attn_implementation {attn_implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}"
        )
    if not callable(factory):
        raise SpecError(f"causal_lm: factory must be a zero-argument callable, got {type(factory).__name__}")
    # the wrapper the build will make, made here on the meta device: a model it cannot serve
    # is refused now, and its cache layout read
    layout = Decoder(probe(factory, seed), max_context, attn_implementation).layout

    def make_module() -> torch.nn.Module:
        return Decoder(factory(), max_context, attn_implementation, sized_context=context_buckets is not None)

    batch = Dim("batch", 1, max_batch, buckets=batch_buckets, example=min(2, max_batch))
    seq = Dim("seq", 1, max_context, buckets=seq_buckets, example=min(4, max_context - 1))
    context: Dim | int = max_context
    if context_buckets is not None:
        buckets = tuple(sorted(set(context_buckets) | {max_context}))
        if any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= max_context for b in buckets):
            raise SpecError(
                f"causal_lm: context_buckets must be ints in 1..max_context ({max_context}), got {context_buckets!r}"
            )
        # An example below max_context: a slice of the cache is contiguous only at max_context, a
        # case export then guards out and the build traces as a program of its own (the whole
        # cache). The example holds the example's seq tokens after some filled slots.
        example = min(max_context - 1, max(seq.example + 1, max_context // 2))
        context = Dim("context", 1, max_context, buckets=buckets, example=max(example, 1))
    inputs = [
        Input("input_ids", (batch, seq), dtype="int64", low=0, high=layout.vocab_size),
        Input("position_ids", (batch, seq), dtype="int64", low=0, high=max_context),
        Input("cache_position", (seq,), dtype="int64", low=0, high=max_context),
        Input("attention_mask", (batch, context), dtype="int64", low=0, high=2),
    ]
    for i in layout.cached:
        (k_heads, k_dim), (v_heads, v_dim) = layout.key_shapes[i], layout.value_shapes[i]
        inputs.append(Input(f"key_cache_{i}", (batch, k_heads, max_context, k_dim), state=True))
        inputs.append(Input(f"value_cache_{i}", (batch, v_heads, max_context, v_dim), state=True))
    return ModelSpec(
        module=make_module,
        inputs=inputs,
        dtype=dtype,
        name=name or layout.model_class,
        seed=seed,
        example_inputs=functools.partial(example_inputs, max_context=max_context),
        entry_points=(EntryPoint("prefill", {}), EntryPoint("decode", {"seq": 1})),
    )


def example_inputs(sizes: dict[str, int], *, max_context: int) -> dict[str, torch.Tensor]:
    """Inputs that make a valid call at ``sizes``: ``seq`` tokens written at consecutive slots
    after some already-filled ones (slot k holds position k), every earlier slot valid. The
    token ids and the cache contents are left to the spec's random examples."""
    batch, seq = sizes["batch"], sizes["seq"]
    context = sizes.get("context", max_context)  # [batch, context] masks (context buckets)
    start = max(0, (context - seq) // 2)
    cache_position = torch.arange(start, start + seq, dtype=torch.int64)
    attention_mask = torch.zeros(batch, context, dtype=torch.int64)
    attention_mask[:, : start + seq] = 1
    return {
        "position_ids": cache_position.expand(batch, seq).clone(),
        "cache_position": cache_position,
        "attention_mask": attention_mask,
    }


def cache_layout(model: Any, max_context: int) -> CacheLayout:
    """Check that ``model`` is a decoder-only transformers causal LM this wrapper can drive, and
    read its cache layout; a SpecError naming the model class says why not."""
    from transformers import PreTrainedModel

    cls = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise SpecError(
            f"causal_lm needs a transformers causal LM (a PreTrainedModel such as LlamaForCausalLM); "
            f"the factory returned a {cls}"
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise SpecError(
            f"causal_lm supports decoder-only models; {cls} ({config.model_type}) is an encoder-decoder "
            f"or has cross-attention (encoder-decoders: aot.hf.seq2seq)"
        )
    if not _is_causal_lm(model):
        raise SpecError(
            f"causal_lm supports decoder-only causal LMs (AutoModelForCausalLM classes and other ...ForCausalLM "
            f"classes that generate: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, ...); {cls} "
            f"({config.model_type}) is not one"
        )
    params = inspect.signature(model.forward).parameters
    missing = [p for p in REQUIRED_PARAMETERS if p not in params]
    if missing == ["position_ids"] and (_alibi_from_mask(model) or _alibi_by_cache_length(model)):
        missing = []  # Bloom, MPT: ALiBi, no positions of their own
    if missing:
        raise SpecError(
            f"causal_lm cannot drive {cls}: its forward takes no {', '.join(missing)} "
            f"(a static cache needs explicit positions and a past_key_values cache)"
        )
    limit, limit_name = getattr(config, "max_position_embeddings", None), "max_position_embeddings"
    if limit is None and _alibi_by_cache_length(model):  # MPT's biases span max_seq_len slots
        limit, limit_name = getattr(config, "max_seq_len", None), "max_seq_len"
    if isinstance(limit, int) and max_context > limit:
        raise SpecError(
            f"causal_lm: max_context {max_context} exceeds {cls}'s {limit_name} {limit}; "
            f"use max_context <= {limit}"
        )
    num_layers = config.num_hidden_layers
    output = model.get_output_embeddings()
    vocab = output.weight.shape[0] if output is not None else config.vocab_size
    keys, values = _measured_shapes(model, cls, num_layers) or _config_shapes(config, num_layers)
    window, chunk, mixed = _window(config, cls, num_layers, max_context, model)
    return CacheLayout(
        model_class=cls,
        key_shapes=keys,
        value_shapes=values,
        vocab_size=vocab,
        window=window,
        chunk=chunk,
        mixed=mixed,
    )


# each layer's (kv_heads, head_dim) of keys, then of values; None: no cache of its own
Shapes = tuple[tuple[tuple[int, int] | None, ...], tuple[tuple[int, int] | None, ...]]


def _measured_shapes(model: Any, cls: str, num_layers: int) -> Shapes | None:
    """Each layer's ``(kv_heads, head_dim)`` of keys and of values, as its attention hands them
    to ``past_key_values.update`` for one token (on the meta device, nothing is computed), or
    None when the meta device cannot run the model (a kernel without a meta form, a value read
    from a tensor: the config's figures are used then). Read from the model rather than its
    config, whose names for them vary (Falcon's multi-query ``num_kv_heads``, per-layer head
    counts). A model that refuses the cache itself (a layer asking it for convolution, SSM or
    linear-attention state; a cache class of its own) is refused here: its build would fail
    the same way."""
    _, _, RecordingCache = state_cache_classes()

    def record(model: Any) -> Any:
        weight = next(model.parameters())
        recorder = RecordingCache(num_layers)
        # a model still in training mode draws for dropout: leave the caller's random state alone
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(
                input_ids=torch.zeros(1, 1, dtype=torch.int64, device=weight.device),
                attention_mask=torch.ones(1, 1, dtype=torch.int64, device=weight.device)
                if _alibi_from_mask(model)
                else torch.zeros(1, 1, 1, 1, dtype=weight.dtype, device=weight.device),
                position_ids=torch.zeros(1, 1, dtype=torch.int64, device=weight.device),
                past_key_values=recorder,
                use_cache=True,
            )
        return recorder

    recorder, failure = None, None
    try:
        recorder = record(model)
    except Exception as e:
        failure = e
    if recorder is None and next(model.parameters()).device.type == "meta":
        # on the meta device some kernels take bfloat16 alone (grouped_mm: the experts of a
        # mixture-of-experts model, DeepSeek-V3's); shapes do not depend on the dtype, so a
        # bfloat16 copy (nothing to copy on the meta device) is measured instead
        try:
            recorder = record(copy.deepcopy(model).to(torch.bfloat16))
        except Exception as e:
            failure = e
    if recorder is None:
        # RuntimeError (NotImplementedError among them): what the meta device cannot run
        if not isinstance(failure, RuntimeError) or _other_state_kinds(model.config, num_layers):
            raise SpecError(_no_key_value_cache(cls, model.config, num_layers, failure))
        return None
    seen = [layer.shapes for layer in recorder.layers]
    shared = _kv_shared_layers(model)
    if any(len(s) != (0 if i in shared else 1) for i, s in enumerate(seen)):
        if _other_state_kinds(model.config, num_layers):  # RecurrentGemma's recurrent blocks: say so
            raise SpecError(_no_key_value_cache(cls, model.config, num_layers, None))
        calls = [len(s) for s in seen]
        reused = f" (layers {sorted(shared)} read an earlier layer's and write none)" if shared else ""
        raise SpecError(
            f"causal_lm cannot serve {cls}: its layers must each write their keys and values once through "
            f"past_key_values.update per call{reused}; the {num_layers} layers wrote {calls} times"
        )
    if shared and min(shared) == 0:
        raise SpecError(
            f"causal_lm cannot serve {cls}: its first layer reads an earlier layer's keys and values "
            f"(is_kv_shared_layer), and there is none"
        )
    return tuple(s[0][0] if s else None for s in seen), tuple(s[0][1] if s else None for s in seen)


def _first_line(failure: BaseException) -> str:
    return f"{type(failure).__name__}: {(str(failure).splitlines() or [''])[0][:200]}"


def _kv_shared_layers(model: Any) -> frozenset[int]:
    """The layers whose attention reuses an earlier layer's keys and values and writes no cache of
    its own (transformers marks them ``is_kv_shared_layer``: Gemma 3n's last layers)."""
    return frozenset(
        m.layer_idx
        for m in model.modules()
        if getattr(m, "is_kv_shared_layer", False) is True and isinstance(getattr(m, "layer_idx", None), int)
    )


# Words in a kind of layer (``config.layer_types``; Jamba's and Bamba's ``layers_block_type``)
# that name a state other than keys and values: state-space (Mamba), convolution (LFM2),
# linear-attention (Qwen3-Next, MiniMax; RecurrentGemma's recurrent blocks) and hybrid layers
# (Falcon-H1: attention and a Mamba mixer side by side in every layer).
OTHER_STATE_WORDS = ("mamba", "ssm", "conv", "linear", "recurrent", "rwkv", "hybrid")


def _other_state_kinds(config: Any, num_layers: int) -> list[str]:
    """The kinds of ``config``'s first ``num_layers`` layers that keep a state other than a
    key/value cache, sorted (none where the config lists no kinds)."""
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if not isinstance(kinds, (list, tuple)):
        return []
    found = {
        k for k in kinds[:num_layers] if isinstance(k, str) and any(w in k.lower() for w in OTHER_STATE_WORDS)
    }
    return sorted(found)


def _no_key_value_cache(cls: str, config: Any, num_layers: int, failure: BaseException | None) -> str:
    """Why ``causal_lm`` cannot serve ``cls``: one token through it with a key/value cache as
    ``past_key_values`` failed (``failure``), or its config lists layers of other state."""
    kinds = _other_state_kinds(config, num_layers)
    why = f"its layers of kind {', '.join(map(repr, kinds))} keep a state other than keys and values"
    serves = (
        "causal_lm serves models whose every layer keeps keys and values alone, written through "
        "past_key_values.update (state-space, convolution and linear-attention layers keep other state)"
    )
    if failure is not None:
        ran = f"one token through it with a key/value cache as past_key_values fails ({_first_line(failure)})"
        if not kinds:  # no layer kind says why: the model itself, or a state its config does not list
            return (
                f"causal_lm cannot serve {cls}: {ran}. Either the model fails as configured (run one token "
                f"through it to see), or a layer keeps a state other than keys and values: {serves}"
            )
        why = f"{ran}; {why}"
    return f"causal_lm cannot serve {cls}: {why}. {serves}"


def _config_shapes(config: Any, num_layers: int) -> Shapes:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    every = tuple((kv_heads, head_dim) for _ in range(num_layers))
    return every, every


def _alibi_from_mask(model: Any) -> bool:
    """Whether ``model``'s base builds its ALiBi biases from the 2-D attention mask through a method
    ``build_alibi_tensor(attention_mask, num_heads, dtype)`` (Bloom): each key's position is its count
    of attended slots, so the model takes no ``position_ids``. ``Decoder`` hands such a model a 4-D
    mask and has that method read the call's 2-D mask instead (``_alibi_over``)."""
    return callable(getattr(getattr(model, "base_model", None), "build_alibi_tensor", None))


def _alibi_by_cache_length(model: Any) -> bool:
    """Whether ``model``'s base builds one row of ALiBi biases over ``max_seq_len`` slots
    (``build_mpt_alibi_tensor``: MPT), each slot's bias by its index, which its attention cuts to
    the keys it is handed and to the query length it reads from ``past_key_values.get_seq_length()``
    as a Python number. Over a static cache of C slots a key's bias is (slot - C + 1) × slope, a
    shift of the dynamic cache's (slot - length + 1) × slope by the same amount for every key of
    a query, which softmax does not see; and the query cut is 0 for any length, so the cache
    answers 0 (``Decoder``) rather than the tensor of its slots, which export cannot compare."""
    return callable(getattr(getattr(model, "base_model", None), "build_mpt_alibi_tensor", None))


@contextmanager
def _alibi_over(model: Any, attention_mask: torch.Tensor) -> Iterator[None]:
    """While the call runs, ``model``'s ``build_alibi_tensor`` builds from ``attention_mask`` ([B, C],
    1 where a slot is attended) whatever mask the model passes it; the model is left as it was."""
    base = model.base_model
    own = vars(base).get("build_alibi_tensor")  # an attribute of the instance's own, where one was set
    build = base.build_alibi_tensor
    base.build_alibi_tensor = lambda _mask, num_heads, dtype: build(attention_mask, num_heads, dtype)
    try:
        yield
    finally:
        if own is None:
            del base.build_alibi_tensor  # the class's method again
        else:
            base.build_alibi_tensor = own


def _is_causal_lm(model: Any) -> bool:
    """An ``AutoModelForCausalLM`` class, or a ``...ForCausalLM`` class the auto mapping does not
    list (Mistral 4's text model in transformers 5.23), that generates; what it cannot run with
    a static cache is refused by the checks after this one."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    mro = type(model).__mro__
    named = any(c.__name__ in names or c.__name__.endswith("ForCausalLM") for c in mro)
    return named and model.can_generate()


# The kinds of layer a mask mapping serves (transformers' ``causal_mask_mapping`` keys)
MASK_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def _window(
    config: Any, cls: str, num_layers: int, max_context: int, model: Any
) -> tuple[int | None, int | None, bool]:
    """The sliding window and the attention chunk the mask must apply (None where they hide
    nothing at ``max_context``), and whether they apply to their kinds of layer alone
    (``CacheLayout.mixed``).

    Layers list their kind in ``config.layer_types``: "sliding_attention" layers use
    ``config.sliding_window``, "chunked_attention" ones ``config.attention_chunk_size`` (Llama
    4), "full_attention" ones neither; a config without it (Mistral) slides every layer when it
    sets a window. A window of W slots hides slot k from query slot q when q - k >= W, a chunk of
    N slots when they fall in different chunks, counted from the row's first real token; each
    matters only below ``max_context``. Where kinds that need different masks mix, the model must
    take a mask per kind of layer (a dict for ``attention_mask``, as transformers' models with
    ``layer_types`` do); one that does not is refused, as is a kind of layer that needs a mask
    this wrapper does not make.

    GPT-Neo's "local" layers (``config.attention_layers``, ``config.window_size``) slide by a
    mask of their own that they place by the cache's length, not by the query's slot: over a
    static cache that hides the wrong slots, so any such layer needs a window of the whole
    context (``max_context`` at most ``window_size``), where it hides nothing."""
    layers, local = getattr(config, "attention_layers", None), getattr(config, "window_size", None)
    if isinstance(layers, (list, tuple)) and "local" in layers[:num_layers] and isinstance(local, int):
        if local < max_context:
            raise SpecError(
                f"causal_lm: {cls}'s local attention layers (window {local}) place their window by "
                f"the cache's length, not the query's slot, which a static cache of {max_context} "
                f"slots breaks; use max_context <= {local}"
            )

    def below_context(value: Any) -> int | None:
        return (
            value if isinstance(value, int) and not isinstance(value, bool) and value < max_context else None
        )

    window = below_context(getattr(config, "sliding_window", None))
    chunk = below_context(getattr(config, "attention_chunk_size", None))
    kinds = getattr(config, "layer_types", None)
    if kinds is None:  # every layer slides alike (Mistral), or none does
        return window, None, False
    used = set(kinds[:num_layers])
    masked = {k for k, v in (("sliding_attention", window), ("chunked_attention", chunk)) if v is not None}
    if not used & masked:
        return None, None, False
    if len(used) == 1:  # one kind of layer: one mask
        return window, chunk, False
    if used <= set(MASK_KINDS) and _takes_mask_mapping(model):
        return window, chunk, True
    limits = [f"window {window}"] * (window is not None) + [f"chunk {chunk}"] * (chunk is not None)
    raise SpecError(
        f"causal_lm: {cls} mixes kinds of attention layer ({', '.join(sorted(used))}; {', '.join(limits)}) and "
        f"takes no mask per kind of layer; use max_context <= {min(v for v in (window, chunk) if v is not None)}"
    )


def _takes_mask_mapping(model: Any) -> bool:
    """Whether the model's decoder takes ``attention_mask`` as a dict of masks per kind of layer
    (transformers' ``causal_mask_mapping``, passed through where it is a dict already)."""
    base = getattr(model, "model", None) or getattr(model, "get_decoder", lambda: None)()
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in source


class Decoder(torch.nn.Module):
    """A transformers causal LM as one forward over a static cache (the contract in the module
    docstring). ``model`` is kept unmodified, except that its attention implementation is set
    to one that takes an additive 4-D mask ("sdpa" where supported, else "eager"), and a RoPE
    that would update its frequencies in the forward but cannot within ``max_context``
    (``fix_rope``) is marked as one that keeps them."""

    def __init__(
        self,
        model: Any,
        max_context: int,
        attn_implementation: str | None = None,
        sized_context: bool = False,
    ):
        super().__init__()
        fix_rope(model, max_context)
        self.layout = cache_layout(model, max_context)
        self.max_context = max_context
        self.sized_context = sized_context  # attention_mask [batch, context]: read slots < context only
        self.model = model
        set_attention(model, attn_implementation, self.layout.model_class, "causal_lm")
        params = inspect.signature(model.forward).parameters
        self._keep_last = "logits_to_keep" in params
        # transformers 5 takes no cache_position (the cache knows its slots here); a model that
        # still does gets it, so it never derives one from the cache's length.
        self._takes_cache_position = "cache_position" in params
        self._takes_positions = "position_ids" in params  # not Bloom's (``_alibi_from_mask``)
        self._alibi = _alibi_from_mask(model)
        self._cache_length = 0 if _alibi_by_cache_length(model) else None  # MPT's

        self.__class__ = _decoder_class(self.layout.cached)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        attention_mask: torch.Tensor,
        **state: torch.Tensor,
    ) -> torch.Tensor:
        cached = self.layout.cached
        names = [f"{kind}_cache_{i}" for i in cached for kind in ("key", "value")]
        if sorted(state) != sorted(names):
            raise SpecError(
                f"Decoder({self.layout.model_class}) takes the state inputs {names}; got {sorted(state)}"
            )
        # a layer without a cache of its own (it reads an earlier layer's) holds None
        keys = [state.get(f"key_cache_{i}") for i in range(self.layout.num_layers)]
        values = [state.get(f"value_cache_{i}") for i in range(self.layout.num_layers)]
        StateCache, _, _ = state_cache_classes()
        # context buckets: the mask's length says which slots attention reads (0..context-1)
        context = attention_mask.shape[1] if self.sized_context else None
        cache = StateCache(keys, values, cache_position, self.layout.model_class, context, self._cache_length)
        window, chunk, dtype = self.layout.window, self.layout.chunk, keys[cached[0]].dtype
        if self.layout.mixed:  # a mask per kind of layer: the full layers see the whole context
            full = additive_mask(attention_mask, cache_position, dtype)
            # a kind whose window or chunk hides nothing at this context reads the full mask
            mask = {
                "full_attention": full,
                "sliding_attention": full
                if window is None
                else additive_mask(attention_mask, cache_position, dtype, window=window),
                "chunked_attention": full
                if chunk is None
                else additive_mask(attention_mask, cache_position, dtype, chunk=chunk),
            }
        else:
            mask = additive_mask(attention_mask, cache_position, dtype, window, chunk)
        # Only the last position's logits. Where seq is a symbol (prefill), an index tensor rather
        # than the int 1, whose slice of the hidden states is contiguous only when batch or seq is
        # 1 (a batch != 1 guard in export); where it is 1 as traced (decode), the int: a slice of
        # all of the hidden states, a view, where the index is a gather and an arange per step.
        seq = input_ids.shape[1]
        last = 1 if isinstance(seq, int) and seq == 1 else torch.arange(seq, device=input_ids.device)[-1:]
        extra = {"logits_to_keep": last} if self._keep_last else {}
        if self._takes_cache_position:
            extra["cache_position"] = cache_position
        if self._takes_positions:
            extra["position_ids"] = position_ids
        with _alibi_over(self.model, attention_mask) if self._alibi else nullcontext():
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
                **extra,
            )
        unwritten = [i for i in cached if cache.layers[i].writes != 1]
        if unwritten:
            raise TraceError(
                f"{self.layout.model_class}'s attention layers {unwritten} did not write the cache once through "
                f"past_key_values.update; causal_lm cannot serve this model"
            )
        # logits: [B, S or 1, V] → the last position's, [B, V]
        return out.logits[:, -1].to(dtype)


# RoPE kinds whose forward may recompute the frequencies (transformers' ``dynamic_rope_update``)
UPDATING_ROPE = ("dynamic", "longrope")


def fix_rope(model: Any, max_context: int) -> None:
    """Mark ``model``'s rotary embeddings whose frequencies update in the forward, when no
    position below ``max_context`` updates them, as keeping their frequencies ("default"), so
    the forward exports without the update's data-dependent branch or its in-place write to the
    ``inv_freq`` buffer. Dynamic NTK scaling grows its base only past the cached length (the
    config's ``max_position_embeddings``, which ``max_context`` may not pass); longrope switches
    to its long factors only past ``original_max_position_embeddings`` (where transformers'
    Phi-3 runs the whole sequence again): a longer ``max_context`` is refused, naming the limit."""
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if not hasattr(module, "inv_freq") or not isinstance(kinds, (str, dict)):
            continue
        per_layer = isinstance(kinds, dict)
        fixed = {}
        for layer_type, kind in kinds.items() if per_layer else [(None, kinds)]:
            if not isinstance(kind, str) or not any(u in kind for u in UPDATING_ROPE):
                continue
            prefix = f"{layer_type}_" if per_layer else ""
            if "dynamic" in kind:
                cached = getattr(
                    module, f"{prefix}max_seq_len_cached", getattr(module, "max_seq_len_cached", None)
                )
                original = getattr(module, "original_max_seq_len", cached)
                if not isinstance(cached, int) or max_context > cached or cached > original:
                    continue  # left as it is: the export says what it cannot trace
            else:
                parameters = getattr(model.config, "rope_parameters", None) or {}
                if per_layer:
                    parameters = parameters.get(layer_type) or {}
                original = parameters.get("original_max_position_embeddings") or getattr(
                    model.config, "original_max_position_embeddings", None
                )
                if not isinstance(original, int):
                    continue
                if max_context > original:
                    raise SpecError(
                        f"causal_lm: {type(model).__name__}'s longrope RoPE switches to its long factors past "
                        f"{original} positions, a switch by the sequence's length that a bundle does not make "
                        f"(transformers' Phi-3 runs the whole sequence again there); use max_context <= {original}"
                    )
            fixed[layer_type] = "default"
        if fixed:
            module.rope_type = {**kinds, **fixed} if per_layer else "default"


@functools.cache
def _decoder_class(cached: tuple[int, ...]) -> type[Decoder]:
    """``Decoder`` with a ``forward`` whose signature names each state input (``key_cache_0``,
    ...), so that callers, the tracer and ``torch.export`` bind them by keyword like any other
    parameter. A class of its own (not an attribute of the instance), so that a copy of the
    module (``copy.deepcopy``, as the tracer makes of half-precision models) runs itself."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = ["input_ids", "position_ids", "cache_position", "attention_mask"]
    names += [f"{k}_cache_{i}" for i in cached for k in ("key", "value")]
    parameters = [inspect.Parameter("self", kind)]
    parameters += [inspect.Parameter(n, kind, annotation=torch.Tensor) for n in names]

    def forward(self: Decoder, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = forward.__signature__.bind(self, *args, **kwargs)
        return Decoder.forward(**bound.arguments)

    forward.__signature__ = inspect.Signature(parameters, return_annotation=torch.Tensor)  # type: ignore[attr-defined]
    return type(
        "Decoder", (Decoder,), {"forward": forward, "__module__": __name__, "__qualname__": "Decoder"}
    )


def additive_mask(
    attention_mask: torch.Tensor,
    cache_position: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The 4-D additive mask [B, 1, S, C]: 0 where query s may attend slot c, the dtype's most
    negative value elsewhere. A slot is visible when it holds a real token (``attention_mask``
    [B, C] is 1), is not after the query's slot ``cache_position[s]``, with a sliding ``window``
    is fewer than ``window`` slots before it, and with a ``chunk`` falls in the query's chunk of
    that many slots, counted from the row's first real token (transformers' chunked mask). The
    query's own slot is always visible: a left-padding query would otherwise see no slot at all,
    and a fully masked row is NaN in some attention kernels (half precision, -inf masks), which
    would then reach the cache. Real tokens never see padding slots, so what padding queries
    compute stays there."""
    slots = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    query = cache_position[:, None]  # [S, 1]
    visible = slots[None, :] <= query  # [S, C]
    if window is not None:
        visible = visible & (slots[None, :] > query - window)
    visible = visible[None] & attention_mask[:, None, :].bool()  # [B, S, C]
    if chunk is not None:
        pad = (attention_mask.cumsum(-1) == 0).sum(-1)[:, None, None]  # [B, 1, 1]: left padding
        visible = visible & ((slots[None, None, :] - pad) // chunk == (query[None] - pad) // chunk)
    visible = visible | (slots[None, :] == query)[None]  # [B, S, C]
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    lowest = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
    return torch.where(visible, zero, lowest)[:, None]


# encoder-decoders (BART, T5, Whisper): their own module, offered here beside causal_lm
from aot.seq2seq import Seq2Seq, seq2seq  # noqa: E402, F401
