"""Token generation with a stateful LM bundle: one prefill call, then one decode call per token.

The bundle follows the LM wrapper contract of ``aot.hf.causal_lm``: entry points ``prefill``
(any prompt length) and ``decode`` (one token), keyword inputs ``input_ids`` [batch, seq],
``position_ids`` [batch, seq], ``cache_position`` [seq] (the cache slots this call writes, the
same for every row) and ``attention_mask`` [batch, max_context] (1 = a valid slot), a KV cache as
state, and the logits of each row's last position as output, [batch, vocab].

Several prompts of different lengths are left-padded to the longest: each row's padding slots
stay 0 in the attention mask, and its positions count its own tokens only, as transformers'
``generate`` does, so the tokens of each row are those it would get alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from aot.errors import GuardError
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
    batch = symbols.get(guards["input_ids"].shape[0])
    if context is None or batch is None:
        raise GuardError(
            f"generate needs attention_mask of shape [batch, max_context] or [batch, context] and a "
            f"dynamic batch, the bundle declares input_ids {list(guards['input_ids'].shape)}, "
            f"attention_mask {list(mask)}"
        )
    return batch.max, context


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
) -> list[list[int]] | list[int]:
    """Generate up to ``max_new_tokens`` tokens after each prompt; see ``Runner.generate``."""
    flat = not isinstance(prompt_ids, torch.Tensor) and bool(prompt_ids) and isinstance(prompt_ids[0], int)
    prompts = _prompts([prompt_ids] if flat else prompt_ids, attention_mask)
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise GuardError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise GuardError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k is not None and (type(top_k) is not int or top_k < 1):
        raise GuardError(f"top_k must be a positive int, got {top_k!r}")
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
    eos_ids = torch.tensor(sorted(eos), dtype=torch.int64, device=device) if eos else None
    padding = torch.full((batch,), pad, dtype=torch.int64, device=device)

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
    logits = _logits(
        prefill(
            input_ids=ids,
            position_ids=positions,
            cache_position=slots[:longest],
            attention_mask=visible(longest),
        )
    )
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    done = [False] * batch
    new: list[list[int]] = [[] for _ in prompts]
    # On a GPU, greedy decoding launches step t+1 before the host reads step t's tokens: the next
    # step needs only tensors already on the device, so the GPU runs it while the host copies,
    # records and checks the tokens (a finished generation then has launched one step too many,
    # whose results nobody reads). Sampling draws on the host, so it cannot run ahead.
    ahead = _runs_ahead(device, do_sample)
    host = _HostCopy(batch, device)

    def advance(step: int) -> torch.Tensor:
        """Launch the decode step that feeds this step's ``token`` back."""
        nonlocal last
        slot = longest + step
        mask[:, slot] = 1
        last = last + 1
        return _logits(
            decode(
                input_ids=token[:, None],
                position_ids=last,
                cache_position=slots[slot : slot + 1],
                attention_mask=visible(slot + 1),
            )
        )

    for step in range(max_new_tokens):
        token = _choose(logits, do_sample, temperature, top_k, generator).to(device)  # [B]
        if eos_ids is not None:
            token = torch.where(finished, padding, token)
            finished |= torch.isin(token, eos_ids)
        more = step + 1 < max_new_tokens and not all(done)
        host.start(token)
        if ahead and more:
            logits = advance(step)
        values = host.values()  # the one host sync of a step: the copy only, not a step after it
        for i, t in enumerate(values):
            if not done[i]:
                new[i].append(t)
                done[i] = t in eos
        if on_token is not None:
            on_token(step, values)
        if not more or all(done):
            break
        if not ahead:
            logits = advance(step)
    return new[0] if flat else new


def _runs_ahead(device: torch.device, do_sample: bool) -> bool:
    return device.type == "cuda" and not do_sample


class _HostCopy:
    """The tokens of a step copied to the host without waiting for work queued after them: on a
    GPU into pinned memory, with an event recorded after the copy."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty(batch, dtype=torch.int64, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def start(self, token: torch.Tensor) -> None:  # token: [B] int64 on the device
        self.buffer.copy_(token, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def values(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.buffer.tolist()


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


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
