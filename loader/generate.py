"""Token generation with a stateful LM bundle: one prefill call, then one decode call per token.

The bundle follows the LM wrapper contract of ``aot.hf.causal_lm``: entry points ``prefill``
(any prompt length) and ``decode`` (one token), keyword inputs ``input_ids`` [batch, seq],
``position_ids`` [batch, seq], ``cache_position`` [seq] (the cache slots this call writes, the
same for every row) and ``attention_mask`` [batch, max_context] (1 = a valid slot), a KV cache as
state, and the logits of each row's last position as output, [batch, vocab].

Several prompts of different lengths are left-padded to the longest: each row's padding slots
stay 0 in the attention mask, and its positions count its own tokens only, as transformers'
``generate`` does, so the tokens of each row are those it would get alone.

Encoder-decoder bundles (``aot.hf.seq2seq``: entry points ``encode``, ``prefill``, ``decode``)
generate through ``seq2seq_generate``: the prompts (right-padded) or log-mel features feed one
``encode`` call, which also runs the decoder's step on its start token; then one ``decode`` call
per token. Both share the token loop, ``decode_loop``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from aot.aten import DTYPES
from aot.errors import GuardError
from aot.loader.decode_blocks import GPU_BLOCK_STEPS, DecodeBlocks, logits_of
from aot.manifest_text import static_size

LM_INPUTS = ("input_ids", "position_ids", "cache_position", "attention_mask")
ENTRY_POINTS = ("prefill", "decode")


def lm_contract(runner: Any) -> tuple[int, int]:
    """(max batch, max context) of a runner that follows the LM contract; ``GuardError`` if not."""
    missing = [e for e in ENTRY_POINTS if e not in runner.entry_points]
    if missing or set(runner.input_names) != set(LM_INPUTS):
        raise GuardError(
            f"generate needs a bundle with entry points {list(ENTRY_POINTS)} and inputs {list(LM_INPUTS)} "
            f"(as aot.hf.causal_lm builds), this one has entry points {list(runner.entry_points)} and "
            f"inputs {list(runner.input_names)}"
        )
    guards = {i.name: i for i in runner.manifest.guards.inputs}
    mask = guards["attention_mask"].shape
    symbols = runner.guards.symbols
    context = None
    if len(mask) == 2:
        context = static_size(mask[1])
        if context is None and mask[1] in symbols:  # context buckets: [batch, context]
            context = symbols[mask[1]].max
    rows = guards["input_ids"].shape[0]
    # a batch of one size (``max_batch=1``) is that size in the guards, not a symbol
    batch = symbols[rows].max if rows in symbols else static_size(rows)
    if context is None or batch is None:
        raise GuardError(
            f"generate needs attention_mask of shape [batch, max_context] or [batch, context] and a "
            f"batch dim, the bundle declares input_ids {list(guards['input_ids'].shape)}, "
            f"attention_mask {list(mask)}"
        )
    return batch, context


def context_sizes(runner: Any) -> tuple[int, ...]:
    """The attention-mask lengths a decode call may take, smallest first: the decode programs'
    buckets of the ``context`` size of a bundle built with context buckets, else () (every call
    passes the whole mask)."""
    mask = next(i for i in runner.manifest.guards.inputs if i.name == "attention_mask").shape
    if len(mask) != 2 or static_size(mask[1]) is not None:
        return ()
    sizes: set[int] = set()
    programs = [p for p in runner.manifest.programs if p.entry == "decode"] or [runner.manifest]
    for program in programs:
        sizes.update(s for b in program.buckets if b.symbol == mask[1] for s in b.sizes)
    return tuple(sorted(sizes | {runner.guards.symbols[mask[1]].max}))


def _prompts(prompt_ids: Any, attention_mask: Any) -> list[list[int]]:
    """The prompts as lists of token ids, left padding (attention_mask 0) removed."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.dim() != 2 or prompt_ids.dtype.is_floating_point:
            raise GuardError(
                f"prompt_ids: expected integer token ids [batch, seq], got {prompt_ids.dtype} {list(prompt_ids.shape)}"
            )
        rows = prompt_ids.tolist()
    else:
        rows = [list(r) for r in prompt_ids]
    if attention_mask is None:
        return [[int(t) for t in r] for r in rows]
    mask = (
        attention_mask.tolist()
        if isinstance(attention_mask, torch.Tensor)
        else [list(m) for m in attention_mask]
    )
    if len(mask) != len(rows) or any(len(m) != len(r) for m, r in zip(mask, rows)):
        raise GuardError("attention_mask must have the shape of prompt_ids")
    out = []
    for i, (r, m) in enumerate(zip(rows, mask)):
        first = next((k for k, v in enumerate(m) if v), len(m))
        if any(not v for v in m[first:]):
            raise GuardError(
                f"prompt {i}: attention_mask {m} is not left padding (0s then 1s); generate pads on the left"
            )
        out.append([int(t) for t in r[first:]])
    return out


def generate(
    runner: Any,
    prompt_ids: Any,
    max_new_tokens: int,
    attention_mask: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    on_token: Callable[[int, list[int]], None] | None = None,
    steps_per_launch: int | None = None,
) -> list[list[int]] | list[int]:
    """Generate up to ``max_new_tokens`` tokens after each prompt; see ``Runner.generate``."""
    if prompt_ids is None:
        raise GuardError("generate needs prompt_ids: token ids, a list of them per prompt, or a tensor")
    flat = not isinstance(prompt_ids, torch.Tensor) and bool(prompt_ids) and isinstance(prompt_ids[0], int)
    prompts = _prompts([prompt_ids] if flat else prompt_ids, attention_mask)
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise GuardError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise GuardError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and (type(top_k) is not int or top_k < 1):
        raise GuardError(f"top_k must be a positive int, got {top_k!r}")
    if steps_per_launch is not None and (type(steps_per_launch) is not int or steps_per_launch < 1):
        raise GuardError(f"steps_per_launch must be a positive int, got {steps_per_launch!r}")
    max_batch, context = lm_contract(runner)
    if not prompts or any(not p for p in prompts):
        raise GuardError("every prompt needs at least one token")
    if len(prompts) > max_batch:
        raise GuardError(f"{len(prompts)} prompts, the bundle's batch admits at most {max_batch}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise GuardError(
            f"a prompt of {longest} tokens plus {max_new_tokens} new tokens needs {longest + max_new_tokens} "
            f"cache slots, the bundle's context holds {context}; shorten the prompt or max_new_tokens"
        )
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    device = runner.device
    batch = len(prompts)

    ids = torch.full((batch, longest), pad, dtype=torch.int64)
    mask = torch.zeros((batch, context), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p, dtype=torch.int64)
        mask[i, longest - len(p) : longest] = 1
    # positions count each row's own tokens (padding slots get 1, as transformers does; masked anyway)
    positions = (mask[:, :longest].cumsum(-1) - 1).masked_fill(mask[:, :longest] == 0, 1)
    mask, ids, positions = mask.to(device), ids.to(device), positions.to(device)
    last = positions[:, -1:].clone()  # [B, 1]
    slots = torch.arange(context, dtype=torch.int64, device=device)  # cache_position: a slice of it
    generator = torch.Generator().manual_seed(seed) if seed is not None else None

    runner.reset(range(batch))
    contexts = context_sizes(runner)

    def visible(slots_used: int) -> torch.Tensor:
        """The mask a call passes: all of it, or (context buckets) the smallest bucket's length
        that covers the slots used so far, so that attention reads no slot past it."""
        if not contexts:
            return mask
        return mask[:, : next(c for c in contexts if c >= slots_used)]

    prefill, decode = runner.entry("prefill"), runner.entry("decode")
    # every slot written below is < longest + max_new_tokens <= context (checked above): no call
    # needs its cache_position checked, which on a GPU would wait for the step before it
    prefill.check_indices = decode.check_indices = False
    logits = logits_of(
        prefill(
            input_ids=ids,
            position_ids=positions,
            cache_position=slots[:longest],
            attention_mask=visible(longest),
        )
    )

    def advance(step: int, token: torch.Tensor) -> torch.Tensor:
        """Launch the decode step that feeds this step's ``token`` [B] back."""
        nonlocal last
        slot = longest + step
        mask[:, slot] = 1
        last = last + 1
        return logits_of(
            decode(
                input_ids=token[:, None],
                position_ids=last,
                cache_position=slots[slot : slot + 1],
                attention_mask=visible(slot + 1),
            )
        )

    block_steps = steps_per_launch or (GPU_BLOCK_STEPS if device.type == "cuda" and not do_sample else 1)

    def blocks(step: int, logits: torch.Tensor, loop: _Loop) -> tuple[int, torch.Tensor]:
        """Blocks of ``block_steps`` greedy steps from ``step`` (``aot.loader.decode_blocks``) while
        they fit before the last step and their bucket's graph is captured; (the step where the
        step-by-step loop goes on, its logits)."""
        nonlocal last
        if loop.blocks is None:
            loop.blocks = DecodeBlocks(
                runner, decode, batch, block_steps, mask, loop.finished, loop.padding, loop.eos_ids, argmax
            )
        start = step
        while step + block_steps <= max_new_tokens - 1 and not loop.stopped:
            slot = longest + step  # the first slot the block writes
            inputs = {
                "input_ids": loop.padding[:, None],
                "position_ids": last,
                "cache_position": slots[slot - 1 : slot],
                "attention_mask": visible(slot + block_steps),
            }
            block = loop.blocks.block_for(inputs)
            if block is None:
                break
            loop.blocks.run(block, logits, inputs)
            mask[:, slot : slot + block_steps] = 1
            loop.pending(step, block.tokens)
            step += block_steps
        loop.drain()
        if step > start:
            logits, last = loop.blocks.handoff()
        return step, logits

    new = decode_loop(
        logits,
        advance,
        batch,
        max_new_tokens,
        eos,
        pad,
        (do_sample, temperature, top_k, generator),
        on_token,
        blocks if block_steps > 1 and not do_sample else None,
    )
    return new[0] if flat else new


def decode_loop(
    logits: torch.Tensor,
    advance: Callable[[int, torch.Tensor], torch.Tensor],
    batch: int,
    max_new_tokens: int,
    eos: set[int],
    pad: int,
    sampling: tuple,
    on_token: Callable[[int, list[int]], None] | None,
    blocks: Callable[[int, torch.Tensor, _Loop], tuple[int, torch.Tensor]] | None = None,
) -> list[list[int]]:
    """Up to ``max_new_tokens`` tokens per row from the first step's ``logits`` [B, vocab]:
    each step picks a token per row and ``advance(step, token)`` feeds it back, returning the
    next logits. A row that produced an ``eos`` token keeps it and is fed ``pad`` afterwards;
    the loop ends when every row has. ``sampling``: (do_sample, temperature, top_k, generator).
    ``blocks(step, logits, loop)``: greedy steps run several per launch from ``step`` where it
    can (``aot.loader.decode_blocks``), their tokens recorded through ``loop``; it returns the
    step where this loop goes on and that step's logits."""
    do_sample, temperature, top_k, generator = sampling
    device = logits.device
    loop = _Loop(batch, device, eos, pad, on_token)
    # On a GPU, greedy decoding launches step t+1 before the host reads step t's tokens: the next
    # step needs only tensors already on the device, so the GPU runs it while the host copies,
    # records and checks the tokens (a finished generation then has launched one step too many,
    # whose results nobody reads). Sampling draws on the host, so it cannot run ahead.
    ahead = _runs_ahead(device, do_sample)
    host = _HostCopy(batch, device)
    step = 0
    while step < max_new_tokens:
        if blocks is not None and step > 0:
            step, logits = blocks(step, logits, loop)
            if loop.stopped or step >= max_new_tokens:
                break
        token = _choose(logits, do_sample, temperature, top_k, generator).to(device)  # [B]
        if loop.eos_ids is not None:
            token = torch.where(loop.finished, loop.padding, token)
            loop.finished |= torch.isin(token, loop.eos_ids)
        more = step + 1 < max_new_tokens and not loop.stopped
        host.start(token)
        if ahead and more:
            logits = advance(step, token)
        loop.record(step, host.values())  # the one host sync of a step: the copy only, not a step after it
        if not more or loop.stopped:
            break
        if not ahead:
            logits = advance(step, token)
        step += 1
    return loop.new


class _Loop:
    """The token loop's state: each row's new tokens, which rows are done (on the host, and on
    the device as ``finished``, with the ``padding`` they are fed after), and the blocks' tokens
    on their way to the host (two blocks in flight: the host reads a block's tokens while the
    GPU runs the next)."""

    def __init__(self, batch: int, device: torch.device, eos: set[int], pad: int, on_token: Any):
        self.eos, self.on_token = eos, on_token
        self.eos_ids = torch.tensor(sorted(eos), dtype=torch.int64, device=device) if eos else None
        self.padding = torch.full((batch,), pad, dtype=torch.int64, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.done = [False] * batch
        self.new: list[list[int]] = [[] for _ in range(batch)]
        self.stopped = False
        self.blocks: Any = None
        self.batch, self.device = batch, device
        self._copies: list[tuple[int, _HostCopy]] = []
        self._free: list[_HostCopy] = []

    def record(self, step: int, values: list[int]) -> None:
        for i, t in enumerate(values):
            if not self.done[i]:
                self.new[i].append(t)
                self.done[i] = t in self.eos
        if self.on_token is not None:
            self.on_token(step, values)
        self.stopped = all(self.done)

    def pending(self, step: int, tokens: torch.Tensor) -> None:
        """A block's ``tokens`` [B, n] (steps ``step``..): copied to the host now, recorded when
        the block after it has been launched (or at ``drain``)."""
        if len(self._copies) == 2:
            self._record_oldest()
        copy = self._free.pop() if self._free else _HostCopy(tokens.shape, self.device)
        copy.start(tokens)
        self._copies.append((step, copy))

    def drain(self) -> None:
        while self._copies:
            self._record_oldest()

    def _record_oldest(self) -> None:
        step, copy = self._copies.pop(0)
        rows = copy.values()  # [B][n]
        for j in range(len(rows[0])):
            if not self.stopped:
                self.record(step + j, [r[j] for r in rows])
        self._free.append(copy)


def _runs_ahead(device: torch.device, do_sample: bool) -> bool:
    return device.type == "cuda" and not do_sample


class _HostCopy:
    """The tokens of a step (``shape`` [B]) or of a block of steps ([B, n]) copied to the host
    without waiting for work queued after them: on a GPU into pinned memory, with an event
    recorded after the copy."""

    def __init__(self, shape: int | tuple[int, ...], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty(shape, dtype=torch.int64, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def start(self, token: torch.Tensor) -> None:  # token: [B] or [B, n] int64 on the device
        self.buffer.copy_(token, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.buffer.tolist()


# On an H200 (bench/argmax_sweep.py, bfloat16, µs per call in a CUDA graph, bench/results/decode/
# argmax-h200-2026-11-28.json): vocab 128,256 argmax 26.3, two stages of 256 chunks 10.4 (128: 11.9,
# 64: 15.3); vocab 32,000 argmax 8.7, two stages 9.3 at best: below about 64K one block is as fast.
TWO_STAGE_MIN_VOCAB = 65536
TWO_STAGE_CHUNKS = (256, 128, 64, 32, 16, 8)


def argmax(logits: torch.Tensor, two_stage: bool | None = None) -> torch.Tensor:
    """Each row's first index of its largest logit, as ``logits.argmax(-1)``. On a GPU (or with
    ``two_stage=True``) a wide row whose length some chunk count of ``TWO_STAGE_CHUNKS`` divides is
    reduced in two stages: each chunk's maximum and its first index (many blocks at once), then
    the first chunk holding the row's maximum. ATen's argmax reduces a row in one block: 29 us
    per step for Llama-3's 128,256 logits on an H200, where the two stages take four launches
    of ~1-2 us. The first chunk with the maximum holds its first index, so ties resolve as
    ``argmax`` does."""
    if two_stage is None:
        two_stage = logits.device.type == "cuda"
    rows, vocab = logits.shape
    chunks = next((c for c in TWO_STAGE_CHUNKS if vocab % c == 0), None)
    if not two_stage or vocab < TWO_STAGE_MIN_VOCAB or chunks is None or not logits.is_contiguous():
        return logits.argmax(-1)
    values, index = logits.view(rows, chunks, vocab // chunks).max(-1)  # [rows, chunks]
    best = values.argmax(-1, keepdim=True)  # [rows, 1]
    return torch.add(index.gather(-1, best), best, alpha=vocab // chunks)[:, 0]


def _choose(
    logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, generator: Any
) -> torch.Tensor:
    """The next token of each row: the most likely (greedy), or a sample of the softmax of
    ``logits / temperature`` over the ``top_k`` most likely, drawn with ``generator`` on the CPU
    (so a seed gives the same tokens on every device)."""
    if not do_sample:
        return argmax(logits)  # on the logits' device
    logits = logits.float().cpu() / temperature  # [B, vocab]; drawn on the CPU, whatever the device
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# The entry points of an encoder-decoder bundle (``aot.hf.seq2seq``) and its decoder inputs.
SEQ2SEQ_ENTRY_POINTS = ("prefill", "encode", "decode")
SEQ2SEQ_INPUTS = ("decoder_input_ids", "cache_position")
SOURCE_INPUTS = {"tokens": ("input_ids", "attention_mask"), "audio": ("input_features",)}


def is_seq2seq(runner: Any) -> bool:
    """Whether ``runner`` is an encoder-decoder bundle (it has an ``encode`` entry point)."""
    return "encode" in runner.entry_points


def seq2seq_contract(runner: Any) -> dict[str, Any]:
    """What generate needs of an encoder-decoder bundle: its kind of source ("tokens" or "audio"),
    max batch, source length (tokens, or the audio encoder's frames), mel bins, decoder slots and
    the dtype of its features; ``GuardError`` for a bundle that is not one."""
    names = set(runner.input_names)
    kind = next((k for k, v in SOURCE_INPUTS.items() if names == {*v, *SEQ2SEQ_INPUTS}), None)
    missing = [e for e in SEQ2SEQ_ENTRY_POINTS if e not in runner.entry_points]
    if kind is None or missing or "key_cache_0" not in runner.state_names:
        raise GuardError(
            f"generate needs an encoder-decoder bundle with entry points {list(SEQ2SEQ_ENTRY_POINTS)}, inputs "
            f"input_ids and attention_mask (or input_features), {', '.join(SEQ2SEQ_INPUTS)}, and a key_cache_0 "
            f"state (as aot.hf.seq2seq builds); this one has entry points {list(runner.entry_points)} and inputs "
            f"{list(runner.input_names)}"
        )
    guards = {i.name: i for i in runner.manifest.guards.inputs}
    symbols = runner.guards.symbols
    main = guards[SOURCE_INPUTS[kind][0]]
    rows = main.shape[0]
    batch = symbols[rows].max if rows in symbols else static_size(rows)  # one size: max_batch=1
    source = symbols.get(main.shape[-1])
    if batch is None or source is None:
        raise GuardError(
            f"generate needs a batch dim and a dynamic source length, the bundle declares {main.name} "
            f"{list(main.shape)}"
        )
    return {
        "kind": kind,
        "max_batch": batch,
        "max_source": source.max,
        "mel_bins": static_size(main.shape[1]) if kind == "audio" else None,
        "max_target": runner.state.tensors["key_cache_0"].shape[2],
        "dtype": main.dtype,
    }


def _source(contract: dict[str, Any], prompt_ids: Any, attention_mask: Any, input_features: Any, pad: int):
    """The encoder's inputs for the ``encode`` call and the one-position ones the decoder's calls
    pass (they read none), as CPU tensors."""
    if contract["kind"] == "audio":
        if prompt_ids is not None or attention_mask is not None:
            raise GuardError(
                "this bundle's encoder takes log-mel features, not token ids: pass input_features [batch, "
                "mel_bins, frames] to runner.generate (the Python API; aotpack generate feeds token ids only)"
            )
        bins, frames = contract["mel_bins"], contract["max_source"]
        features = input_features
        if (
            not isinstance(features, torch.Tensor)
            or not features.is_floating_point()
            or features.dim() not in (2, 3)
        ):
            got = (
                f"{features.dtype} {list(features.shape)}"
                if isinstance(features, torch.Tensor)
                else repr(features)[:80]
            )
            raise GuardError(
                f"input_features: expected float log-mel features [batch, {bins}, {frames}], got {got}"
            )
        features = features[None] if features.dim() == 2 else features
        if tuple(features.shape[1:]) != (bins, frames):
            raise GuardError(
                f"input_features: expected [batch, {bins}, {frames}] (mel bins, frames: the encoder takes exactly "
                f"{frames}; pad or cut the audio's features to it), got {list(features.shape)}"
            )
        features = features.to(DTYPES[contract["dtype"]])
        return {"input_features": features}, {"input_features": features[:, :, :1]}
    if input_features is not None:
        raise GuardError(
            "this bundle's encoder takes token ids: pass prompt_ids (and attention_mask), not input_features"
        )
    if isinstance(prompt_ids, torch.Tensor):
        ids = prompt_ids[None] if prompt_ids.dim() == 1 else prompt_ids
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise GuardError(
                f"prompt_ids: expected integer token ids [batch, seq], got {ids.dtype} {list(ids.shape)}"
            )
        ids = ids.to(torch.int64).cpu()
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            mask = torch.as_tensor(attention_mask).to(torch.int64).cpu()
            mask = mask[None] if mask.dim() == 1 else mask
            if mask.shape != ids.shape:
                raise GuardError(
                    f"attention_mask must have the shape of prompt_ids {list(ids.shape)}, got {list(mask.shape)}"
                )
    else:
        flat = bool(prompt_ids) and isinstance(prompt_ids[0], int)
        rows = [list(prompt_ids)] if flat else [list(r) for r in prompt_ids or ()]
        if attention_mask is not None:
            raise GuardError("attention_mask goes with a prompt_ids tensor; lists of prompts are padded here")
        if not rows or any(not r for r in rows):
            raise GuardError("every prompt needs at least one token")
        longest = max(len(r) for r in rows)
        # padded on the right, as tokenizers pad encoder inputs: each row's positions are its own
        ids = torch.full((len(rows), longest), pad, dtype=torch.int64)
        mask = torch.zeros((len(rows), longest), dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor([int(t) for t in r], dtype=torch.int64)
            mask[i, : len(r)] = 1
    if ids.shape[0] == 0 or ids.shape[1] == 0 or bool((mask.sum(-1) == 0).any()):
        raise GuardError("every prompt needs at least one token (a row of attention_mask holds no 1)")
    if ids.shape[1] > contract["max_source"]:
        raise GuardError(
            f"a prompt of {ids.shape[1]} tokens, the bundle's encoder takes at most {contract['max_source']} "
            f"(max_source); shorten the prompt or build with a larger max_source"
        )
    return {"input_ids": ids, "attention_mask": mask}, {
        "input_ids": ids[:, :1],
        "attention_mask": mask[:, :1],
    }


def seq2seq_generate(
    runner: Any,
    prompt_ids: Any,
    max_new_tokens: int,
    attention_mask: Any = None,
    input_features: Any = None,
    decoder_prompt_ids: Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    on_token: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]] | list[int]:
    """Generate with an encoder-decoder bundle: one ``encode`` call (the encoder, the cross caches,
    and the decoder's step on its start token), one ``prefill`` of ``decoder_prompt_ids`` when
    given (tokens after the start token, the same for every row), then one ``decode`` call per
    token; see ``Runner.generate``."""
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise GuardError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise GuardError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and (type(top_k) is not int or top_k < 1):
        raise GuardError(f"top_k must be a positive int, got {top_k!r}")
    contract = seq2seq_contract(runner)
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    flat = (
        contract["kind"] == "tokens"
        and not isinstance(prompt_ids, torch.Tensor)
        and bool(prompt_ids)
        and isinstance(prompt_ids[0], int)
    ) or (
        contract["kind"] == "audio" and isinstance(input_features, torch.Tensor) and input_features.dim() == 2
    )
    source, unread = _source(contract, prompt_ids, attention_mask, input_features, pad)
    batch = next(iter(source.values())).shape[0]
    if batch > contract["max_batch"]:
        raise GuardError(f"{batch} prompts, the bundle's batch admits at most {contract['max_batch']}")
    prompt = [int(t) for t in (decoder_prompt_ids or ())]
    # the decoder is fed its start token, the prompt and every new token but the last
    needed = 1 + len(prompt) + max_new_tokens - 1
    if needed > contract["max_target"]:
        raise GuardError(
            f"the start token, {len(prompt)} decoder prompt tokens and {max_new_tokens} new tokens need {needed} "
            f"decoder cache slots, the bundle holds {contract['max_target']} (max_target); lower max_new_tokens to "
            f"at most {contract['max_target'] - len(prompt)} or build with a larger max_target"
        )
    device = runner.device
    source = {k: v.to(device) for k, v in source.items()}
    unread = {k: v.to(device) for k, v in unread.items()}
    slots = torch.arange(contract["max_target"], dtype=torch.int64, device=device)
    nothing = torch.zeros((batch, 1), dtype=torch.int64, device=device)  # decoder inputs encode reads not
    generator = torch.Generator().manual_seed(seed) if seed is not None else None

    runner.reset(range(batch))
    encode, prefill, decode = runner.entry("encode"), runner.entry("prefill"), runner.entry("decode")
    # every slot written below is < max_target (checked above)
    encode.check_indices = prefill.check_indices = decode.check_indices = False
    logits = logits_of(encode(**source, decoder_input_ids=nothing, cache_position=slots[:1]))
    if prompt:
        ids = torch.tensor(prompt, dtype=torch.int64, device=device).expand(batch, -1)
        logits = logits_of(
            prefill(**unread, decoder_input_ids=ids, cache_position=slots[1 : 1 + len(prompt)])
        )
    first = 1 + len(prompt)  # the slot of the first new token

    def advance(step: int, token: torch.Tensor) -> torch.Tensor:
        slot = first + step
        return logits_of(
            decode(**unread, decoder_input_ids=token[:, None], cache_position=slots[slot : slot + 1])
        )

    new = decode_loop(
        logits, advance, batch, max_new_tokens, eos, pad, (do_sample, temperature, top_k, generator), on_token
    )
    return new[0] if flat else new
