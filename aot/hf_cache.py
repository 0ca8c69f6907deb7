"""What ``aot.hf.causal_lm`` and ``aot.hf.seq2seq`` share: the transformers ``Cache`` classes over
a runner's state tensors (``StateCache``: a layer's keys and values written at ``cache_position``
in place; ``RecordingCache``: what each attention layer writes, for reading a cache's layout),
the model made on the meta device to read its layout (``probe``), and the attention
implementation set to one that takes the additive 4-D masks the wrappers build.

transformers is imported inside functions only: a serving host that loads a bundle never needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from aot.errors import SpecError, TraceError

# Attention implementations that take the 4-D additive float mask built here and read the cache
# through ``past_key_values.update``. "sdpa" exports as one scaled_dot_product_attention call
# (a library call in the bundle); "eager" is the fallback for models without SDPA support.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def probe(factory: Callable[[], Any], seed: int, who: str = "causal_lm") -> Any:
    """The model as ``factory`` builds it, on the meta device when it can be (no weights are
    initialized or read), else for real; the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with torch.device("meta"):
                return factory()
        except Exception:
            pass
        torch.manual_seed(seed)
        try:
            return factory()
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:200]
            raise SpecError(f"{who}: the factory failed: {type(e).__name__}: {first}") from None


def set_attention(model: Any, attn_implementation: str | None, model_class: str, who: str) -> None:
    """Set ``model``'s attention implementation to one that takes the additive 4-D masks built
    here: ``attn_implementation``, else the model's own when it is one of them, else "sdpa" where
    the model supports it, else "eager"; a SpecError when the model cannot use it."""
    current = getattr(model.config, "_attn_implementation", None)
    implementation = attn_implementation or (
        current
        if current in ATTENTION_IMPLEMENTATIONS
        else ("sdpa" if getattr(model, "_supports_sdpa", False) else "eager")
    )
    if current == implementation:
        return
    why = "transformers kept " + repr(current)
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, ImportError) as e:
        why = (str(e).splitlines() or [""])[0][:200]
    if getattr(model.config, "_attn_implementation", None) != implementation:
        raise SpecError(
            f"{who}: {model_class} cannot use attn_implementation {implementation!r}: {why}; leave "
            f"attn_implementation unset to use what the model supports"
        )


@functools.cache
def state_cache_classes() -> tuple[type, type, type]:
    """``StateCache``, its layer and ``RecordingCache``, defined on first use (transformers is
    imported lazily)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class StateLayer(CacheLayerMixin):
        """One layer's keys and values: the runner's state tensors, written at ``cache_position``."""

        is_compileable = True
        is_sliding = False

        def __init__(
            self,
            keys: torch.Tensor,
            values: torch.Tensor,
            cache_position: torch.Tensor,
            owner: str,
            context: Any = None,
            own: bool = True,
            length: int | None = None,
        ):
            super().__init__()
            self.keys, self.values = keys, values
            # False: a layer that reads an earlier layer's cache (these are that layer's tensors,
            # for the sizes transformers asks of every layer) and must write none
            self.own = own
            self.cache_position = cache_position
            self.owner = owner
            # the slots attention reads: 0..context-1 (the attention mask's length), or all (None)
            self.context = context
            # what get_seq_length answers: None, the tensor of the slots before this call's first
            # one; a number for a model that reads it as one (``aot.hf._alibi_by_cache_length``)
            self.length = length
            self.writes = 0
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.own:
                raise TraceError(
                    f"{self.owner}'s attention wrote keys and values through past_key_values.update in a layer "
                    f"that reads an earlier layer's (is_kv_shared_layer); causal_lm cannot serve this model"
                )
            # key_states: [B, kv_heads, S, head_dim] → slots cache_position of [B, kv_heads, C, head_dim]
            for new, cache, what in ((key_states, self.keys, "keys"), (value_states, self.values, "values")):
                expected = (*cache.shape[:2], self.cache_position.shape[0], cache.shape[3])
                if tuple(new.shape) != expected:
                    raise TraceError(
                        f"{self.owner}'s attention wrote {what} of shape {tuple(new.shape)} into a cache laid out "
                        f"for {expected} ([batch, kv_heads, seq, head_dim] as the spec declared it); causal_lm cannot "
                        f"serve this model"
                    )
            self.keys.index_copy_(2, self.cache_position, key_states.to(self.keys.dtype))
            self.values.index_copy_(2, self.cache_position, value_states.to(self.values.dtype))
            self.writes += 1
            if self.context is None:
                return self.keys, self.values
            # narrow, not a slice: its length is exactly ``context`` (a slice's is min(C, context))
            return self.keys.narrow(2, 0, self.context), self.values.narrow(2, 0, self.context)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[2] if self.context is None else self.context, 0

        def get_seq_length(self) -> int:
            # The slots before this call's first one (callers pass positions, so it is only a hint).
            return self.cache_position[0] if self.length is None else self.length

        def get_max_length(self) -> int:
            return self.keys.shape[2] if self.context is None else self.context

    class StateCache(Cache):
        """``past_key_values`` over the runner's cache tensors: each layer's ``update`` writes
        the call's keys and values into their slots in place and returns the whole cache. A layer
        given None keeps no cache of its own (it reads an earlier layer's, which it stands for)."""

        def __init__(
            self,
            keys: list[torch.Tensor | None],
            values: list[torch.Tensor | None],
            cache_position: torch.Tensor,
            owner: str,
            context: Any = None,
            length: int | None = None,
        ):
            layers, last = [], None
            for k, v in zip(keys, values):
                own = k is not None
                if own:
                    last = (k, v)
                layers.append(StateLayer(*last, cache_position, owner, context, own, length))
            super().__init__(layers=layers)

    class RecordingLayer(CacheLayerMixin):
        """Records the ``(heads, head_dim)`` of what the attention writes; holds nothing."""

        is_compileable = False
        is_sliding = False

        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[tuple[int, int], tuple[int, int]]] = []
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # [B, heads, S, head_dim]: a call of one token attends to itself alone
            self.shapes.append(
                ((key_states.shape[1], key_states.shape[3]), (value_states.shape[1], value_states.shape[3]))
            )
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return query_length, 0

        def get_seq_length(self) -> int:
            return 0

        def get_max_length(self) -> int:
            return -1

    class RecordingCache(Cache):
        """``past_key_values`` that records each layer's key and value shapes (``cache_layout``)."""

        def __init__(self, num_layers: int):
            super().__init__(layers=[RecordingLayer() for _ in range(num_layers)])

    return StateCache, StateLayer, RecordingCache
