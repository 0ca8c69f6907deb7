"""Attention masks that only restate causality: call SDPA the way eager does, so flash applies.

Under ``torch.export`` an HF model builds its attention mask explicitly (``masking_utils``: an
``arange`` comparison, ``expand``, ...) and passes it to ``scaled_dot_product_attention``, where
eager passes no mask and ``is_causal=True``. With a mask, the GPU cannot use the flash kernel. A
mask that depends on sizes alone (no user input reaches it) is evaluated here at sample sizes
across the declared ranges; if it is the causal pattern at every one (or all-true), the step
calls SDPA without it (``is_causal=True`` when the pattern is causal and the query is longer than
one token) and the steps that built it are dropped. A mask that reads a user input (BERT's
``attention_mask``) is left alone: only the caller knows its values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from aot.program import step_reads
from aot.schema import Buf, Program, Step

SDPA = "aten.scaled_dot_product_attention.default"
SAMPLE_CAP = 512  # largest size a symbol takes while the mask is evaluated (memory: B*L*S bools)
MASK_ARG = 3  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, ...)
CAUSAL_ARG = 5


def _cone(program: Program, name: str, producer: dict[str, int]) -> list[int] | None:
    """The steps that compute ``name``, in program order; None when a user input reaches it."""
    inputs = {i.name for i in program.inputs}
    seen: set[int] = set()
    todo = [name]
    while todo:
        buf = todo.pop()
        if buf in inputs:
            return None
        i = producer.get(buf)
        if i is None or i in seen:
            continue  # a weight (constant), or already visited
        seen.add(i)
        todo.extend(step_reads(program.steps[i]))
    return sorted(seen)


def _samples(ranges: Mapping[str, tuple[int, int]]) -> list[dict[str, int]]:
    """Sizes to evaluate a mask at: every symbol at its minimum, at its cap, and at odd values."""
    out = []
    for pick in (
        lambda lo, hi: lo,
        lambda lo, hi: hi,
        lambda lo, hi: (lo + hi) // 2 | 1,
        lambda lo, hi: lo + 2,
    ):
        out.append({s: max(lo, min(hi, pick(lo, min(hi, SAMPLE_CAP)))) for s, (lo, hi) in ranges.items()})
    return [dict(t) for t in {tuple(sorted(s.items())) for s in out}]


def _pattern(mask: Any, q_len: int, kv_len: int) -> str | None:
    """What ``mask`` (bool, or additive float) allows over ``[..., q_len, kv_len]``: ``"one"``
    (a 1x1 all-true mask: both patterns), ``"causal"``, ``"all"``, or None for anything else."""
    import torch

    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.dtype.is_floating_point:
        if not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return None
        allowed = mask == 0
    else:
        return None
    if allowed.dim() < 2:
        return None
    allowed = allowed.expand(*allowed.shape[:-2], q_len, kv_len)
    if bool(allowed.all()):
        return "one" if q_len == kv_len == 1 else "all"
    if q_len == kv_len and bool((allowed == torch.ones(q_len, kv_len, dtype=torch.bool).tril()).all()):
        return "causal"
    return None


def simplify_attention_masks(
    program: Program,
    weights: Mapping[str, Any],
    ranges: Mapping[str, tuple[int, int]],
    log: Callable[[str], None] | None = None,
) -> tuple[Program, int]:
    """``program`` with size-only causal / all-true SDPA masks removed; how many were removed."""
    import torch

    from aot.aten import AtenCall
    from aot.symexpr import compile_expr

    producer = {o: i for i, s in enumerate(program.steps) for o in s.outputs if o is not None}
    steps = list(program.steps)
    rewritten = 0
    for i, step in enumerate(program.steps):
        if step.kind != "aten" or step.target != SDPA:
            continue
        mask_ref = step.args[MASK_ARG] if len(step.args) > MASK_ARG else step.kwargs.get("attn_mask")
        if not isinstance(mask_ref, Buf):
            continue
        if (
            len(step.args) > CAUSAL_ARG
            and step.args[CAUSAL_ARG] not in (False, None)
            or step.kwargs.get("is_causal")
        ):
            continue
        cone = _cone(program, mask_ref.name, producer)
        if cone is None:
            continue
        q, k = (program.buffers.get(a.name) if isinstance(a, Buf) else None for a in step.args[:2])
        if q is None or k is None:
            continue
        found = set()
        try:
            calls = [AtenCall(program.steps[j], torch.device("cpu")) for j in cone]
            for sizes in _samples(ranges):
                env = dict(weights)
                for call in calls:
                    call(env, sizes)
                q_len = compile_expr(q.shape[-2])(sizes)
                kv_len = compile_expr(k.shape[-2])(sizes)
                found.add(_pattern(env[mask_ref.name], q_len, kv_len))
        except Exception:  # a mask this pass cannot evaluate stays as it is
            continue
        patterns = found - {"one"}
        if None not in patterns and len(patterns) <= 1:
            # a one-token query attends to everything either way; eager passes is_causal=False there
            causal = patterns == {"causal"}
            args = list(step.args)
            kwargs = dict(step.kwargs)
            if len(args) > MASK_ARG:
                args[MASK_ARG] = None
            else:
                kwargs.pop("attn_mask", None)
            if causal:
                if len(args) > CAUSAL_ARG:
                    args[CAUSAL_ARG] = True
                else:
                    kwargs["is_causal"] = True
            steps[i] = replace(step, args=tuple(args), kwargs=kwargs)
            rewritten += 1
    if not rewritten:
        return program, 0
    program = _drop_dead_steps(replace(program, steps=tuple(steps)))
    if log:
        log(f"  {rewritten} attention masks were causal or all-true: SDPA called without them, as eager does")
    return program, rewritten


def _drop_dead_steps(program: Program) -> Program:
    """Remove steps whose results nothing reads (the mask's construction after its last use)."""
    live = set(program.outputs)
    kept: list[Step] = []
    for step in reversed(program.steps):
        if step.kind == "aten" and not any(o in live for o in step.outputs if o is not None):
            continue
        kept.append(step)
        live.update(step_reads(step))
    kept.reverse()
    used = {o for s in kept for o in s.outputs if o is not None} | live
    buffers = {k: v for k, v in program.buffers.items() if k in used}
    return replace(program, steps=tuple(kept), buffers=buffers)
