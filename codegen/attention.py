"""Attention as the kernels want it: masks that only restate causality dropped, and one-token
attention over a grouped-query KV cache without copying the cache.

Masks that only restate causality: call SDPA the way eager does, so flash applies.

Under ``torch.export`` an HF model builds its attention mask explicitly (``masking_utils``: an
``arange`` comparison, ``expand``, ...) and passes it to ``scaled_dot_product_attention``, where
eager passes no mask and ``is_causal=True``. With a mask, the GPU cannot use the flash kernel. A
mask that depends on sizes alone (no user input reaches it) is evaluated here at sample sizes
across the declared ranges; if it is the causal pattern at every one (or all-true), the step
calls SDPA without it (``is_causal=True`` when the pattern is causal and the query is longer than
one token) and the steps that built it are dropped. A mask that reads a user input (BERT's
``attention_mask``) is left alone: only the caller knows its values.

Grouped-query decode (``fold_gqa_repeats``): transformers' ``repeat_kv`` expands each of the
``KV`` cache heads to the ``G`` query heads that share it and copies the result
(``unsqueeze``/``expand``/``clone``/``view``): for a one-token query that copies the whole cache of
every layer on every step. Instead the ``G`` query heads of each KV head become ``G`` query rows of
one SDPA call on the cache where it lives: ``q [B, KV*G, 1, D]`` viewed as ``[B, KV, G, D]``
against ``k, v [B, KV, S, D]``, the result viewed back. Each query row attends exactly as before
(same keys, same mask row, same scale), so the values are the same. In a library-free build, whose
attention kernels read grouped heads, every other SDPA over such copies (a prompt's) reads the
heads they copy with ``enable_gqa=True`` instead: no step writes the copies.

``sdpa_call`` reads an SDPA step's arguments by name, for every attention kernel's site finder.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from aot.allowed_ops import STATE_WRITE_OPS
from aot.codegen import index as ix
from aot.program import RESHAPE_VIEWS, producer_of, readers_of, step_reads, tensor_specs
from aot.schema import Buf, DType, Program, Step, StepKind, Sym, TensorSpec

SDPA = "aten.scaled_dot_product_attention.default"
FULL_END = 2**62  # a slice's end at or past this is "to the end"
SAMPLE_CAP = 512  # largest size a symbol takes while the mask is evaluated (memory: B*L*S bools)
MASK_ARG = 3  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, ...)
CAUSAL_ARG = 5
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# The keywords an SDPA step carries between ``eager_attention_as_sdpa`` and the decode attention
# kernels where the model's attention is more than SDPA: scores capped (Gemma 2's ``c * tanh(s /
# c)``; the keyword's value c) or a learned logit per head in the softmax's denominator (GPT-OSS's
# attention sinks; the keyword's value the [H] weight) or a bias per head added to the scaled
# scores (Bloom's and MPT's ALiBi; the keyword's value a [B or 1, H, 1, C] tensor, float32 or
# the operands' dtype). No library SDPA takes them, so such a step exists only inside a build;
# ``restore_eager_attention`` puts the model's own steps back wherever no kernel took it.
SOFTCAP, SINKS, BIAS = "softcap", "sinks", "bias"
EXTENSIONS = (SOFTCAP, SINKS, BIAS)


def extended(step: Step) -> bool:
    """``step`` is an SDPA step with a keyword of ``EXTENSIONS``, which no library call computes."""
    return step.target == SDPA and any(k in step.kwargs for k in EXTENSIONS)


@dataclass(frozen=True)
class SdpaCall:
    """The arguments of one ``scaled_dot_product_attention`` step, by name (what every attention
    kernel's site finder reads: ``aot.codegen.flash``, ``decode_sites``, ``cache_attention``)."""

    query: Any
    key: Any
    value: Any
    mask: Any  # a Buf, or None
    causal: bool
    scale: float | None  # None: 1 / sqrt(head dim)
    enable_gqa: bool
    softcap: float | None = None  # scores capped: c * tanh(s / c) before the mask (``SOFTCAP``)
    sinks: Any = None  # a Buf: [H] logits in the softmax's denominator, one per head (``SINKS``)
    bias: Any = None  # a Buf: [B or 1, H, 1, C] added to the scaled scores (``BIAS``)


def sdpa_call(step: Step, extensions: bool = False) -> SdpaCall | None:
    """``step``'s SDPA arguments; None where one is not a plain value (a symbolic scale or flag,
    an unknown keyword) or the call drops out (``dropout_p`` other than 0): no kernel stands for it.
    ``extensions``: the caller's kernel computes ``EXTENSIONS`` too, so their keywords are read
    (for any other caller they are unknown: no kernel of theirs stands for such a call)."""
    given = dict(zip(_SDPA_PARAMS, step.args))
    if len(step.args) > len(_SDPA_PARAMS) or set(step.kwargs) & set(given):
        return None
    given.update(step.kwargs)
    cap = given.pop(SOFTCAP, None) if extensions else None
    sinks = given.pop(SINKS, None) if extensions else None
    bias = given.pop(BIAS, None) if extensions else None
    if set(given) - set(_SDPA_PARAMS) or not (cap is None or (type(cap) is float and cap > 0)):
        return None
    if not all(x is None or isinstance(x, Buf) for x in (sinks, bias)):
        return None
    causal, gqa, scale = given.get("is_causal", False), given.get("enable_gqa", False), given.get("scale")
    if given.get("dropout_p", 0.0) not in (0, 0.0, None) or causal not in (False, True, None):
        return None
    if gqa not in (False, True, None) or not (scale is None or type(scale) in (int, float)):
        return None
    return SdpaCall(
        query=given.get("query"),
        key=given.get("key"),
        value=given.get("value"),
        mask=given.get("attn_mask"),
        causal=bool(causal),
        scale=None if scale is None else float(scale),
        enable_gqa=bool(gqa),
        softcap=cap,
        sinks=sinks,
        bias=bias,
    )


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

    producer = producer_of(program.steps)
    steps = list(program.steps)
    rewritten = 0
    for i, step in enumerate(program.steps):
        if step.kind != "aten" or step.target != SDPA or extended(step):
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
    """Remove steps whose results nothing reads (the mask's construction after its last use);
    state writes stay (their effect is the write)."""
    live = set(program.outputs)
    kept: list[Step] = []
    for step in reversed(program.steps):
        if (
            step.kind == "aten"
            and step.target not in STATE_WRITE_OPS
            and not any(o in live for o in step.outputs if o is not None)
        ):
            continue
        kept.append(step)
        live.update(step_reads(step))
    kept.reverse()
    used = {o for s in kept for o in s.outputs if o is not None} | live
    buffers = {k: v for k, v in program.buffers.items() if k in used}
    return replace(program, steps=tuple(kept), buffers=buffers)


def _repeat_source(program: Program, name: str, producer: dict[str, int]) -> tuple[str, int] | None:
    """``name = view(clone(expand(unsqueeze(src, 2), [B, KV, G, S, D])), [B, KV*G, S, D])`` (the
    shape of ``repeat_kv``): ``(src, G)``; None for anything else."""
    chain = []
    for target in (
        RESHAPE_VIEWS,
        ("aten.clone.default",),
        ("aten.expand.default",),
        ("aten.unsqueeze.default",),
    ):
        i = producer.get(name)
        while i is not None and _whole_slice(program.steps[i]):  # x[:, :, None, :, :] slices it all
            i = producer.get(program.steps[i].args[0].name)
        step = program.steps[i] if i is not None else None
        if step is None or step.kind != "aten" or step.target not in target or not step.args:
            return None
        if not isinstance(step.args[0], Buf):
            return None
        chain.append(step)
        name = step.args[0].name
    while (i := producer.get(name)) is not None and _whole_slice(program.steps[i]):
        name = program.steps[i].args[0].name  # the buffer itself, not a view of all of it
    unsqueeze, expand = chain[3], chain[2]
    if len(unsqueeze.args) < 2 or unsqueeze.args[1] != 2:
        return None
    src = program.buffers.get(name) or next((i.spec for i in program.inputs if i.name == name), None)
    sizes = expand.args[1] if len(expand.args) > 1 else None
    if src is None or len(src.shape) != 4 or not isinstance(sizes, list) or len(sizes) != 5:
        return None
    groups = sizes[2]
    if type(groups) is not int or groups < 1 or not src.shape[1].isdigit():
        return None
    return name, groups


def _whole_slice(step: Step) -> bool:
    """``slice(x, dim, 0 or None, to the end)``: all of ``x``."""
    if step.kind != "aten" or step.target != "aten.slice.Tensor" or step.kwargs or not step.args:
        return False
    start, end, stride = (list(step.args[2:5]) + [None, None, None])[:3]
    return (
        isinstance(step.args[0], Buf)
        and start in (0, None)
        and stride in (1, None)
        and (end is None or (type(end) is int and end >= FULL_END))
    )


def _arg(step: Step, position: int, key: str, default=None):
    return step.args[position] if len(step.args) > position else step.kwargs.get(key, default)


def _size_arg(text: str):
    return int(text) if text.isdigit() else Sym(text)


def _view(src: str, shape: tuple[str, ...], out: str) -> Step:
    """``out = src.view(shape)`` as a program step (sizes as the program writes them)."""
    size = [_size_arg(s) for s in shape]
    return Step(
        kind=StepKind.ATEN, target="aten.view.default", args=(Buf(src), size), kwargs={}, outputs=(out,)
    )


def fold_gqa_repeats(
    program: Program, log: Callable[[str], None] | None = None, any_length: bool = False
) -> tuple[Program, int]:
    """``program`` with each one-token SDPA over a repeated grouped-query cache run on the cache
    itself (see the module docstring); how many were folded. ``any_length`` (library-free builds,
    whose attention kernels read grouped heads): every other SDPA over ``repeat_kv`` copies reads
    the heads they copy, ``enable_gqa=True`` (query head h reads KV head h // G, the copy's
    values), so that no step writes the copies."""
    producer = producer_of(program.steps)
    steps: list[Step] = []
    buffers = dict(program.buffers)
    folded = 0
    for step in program.steps:
        done = None
        if (
            step.kind == "aten"
            and step.target == SDPA
            and not extended(step)
            and len(step.args) >= 3
            and len(step.outputs) == 1
        ):
            done = _fold_one(program, step, producer, buffers)
            if done is None and any_length:
                done = _grouped_call(program, step, producer)
        if done is None:
            steps.append(step)
        else:
            steps.extend(done)
            folded += 1
    if not folded:
        return program, 0
    program = _drop_dead_steps(replace(program, steps=tuple(steps), buffers=buffers))
    if log:
        log(f"  {folded} attention calls read grouped-query keys and values in place (no repeat_kv copy)")
    return program, folded


def _grouped_call(program: Program, step: Step, producer: dict[str, int]) -> list[Step] | None:
    """``[step]`` reading the KV heads that ``repeat_kv`` copied, with ``enable_gqa=True``; None
    where its keys and values are not such copies (of one group size) or it already groups."""
    call = sdpa_call(step)
    if call is None or call.enable_gqa or not all(isinstance(a, Buf) for a in (call.query, call.key)):
        return None
    if not isinstance(call.value, Buf) or len(step.args) < 3:
        return None
    k_src, v_src = (_repeat_source(program, a.name, producer) for a in (call.key, call.value))
    if k_src is None or v_src is None or k_src[1] != v_src[1]:
        return None
    specs = {**{i.name: i.spec for i in program.inputs}, **program.buffers}
    q_spec, k_spec, v_spec = specs.get(call.query.name), specs.get(k_src[0]), specs.get(v_src[0])
    if q_spec is None or k_spec is None or v_spec is None or len(q_spec.shape) != 4:
        return None
    heads = q_spec.shape[1]
    if not heads.isdigit() or int(heads) != int(k_spec.shape[1]) * k_src[1] or k_spec.shape != v_spec.shape:
        return None
    args = (step.args[0], Buf(k_src[0]), Buf(v_src[0]), *step.args[3:])
    return [replace(step, args=args, kwargs={**step.kwargs, "enable_gqa": True})]


def _fold_one(program: Program, step: Step, producer: dict[str, int], buffers: dict[str, TensorSpec]):
    q, k, v = step.args[:3]
    if not all(isinstance(a, Buf) for a in (q, k, v)):
        return None
    if _arg(step, 4, "dropout_p", 0.0) not in (0, 0.0) or _arg(step, 5, "is_causal", False) not in (
        False,
        None,
    ):
        return None
    if _arg(step, 7, "enable_gqa", False) not in (False, None):
        return None
    q_spec = buffers.get(q.name)
    out = step.outputs[0]
    out_spec = buffers.get(out)
    k_src, v_src = _repeat_source(program, k.name, producer), _repeat_source(program, v.name, producer)
    if q_spec is None or out_spec is None or k_src is None or v_src is None or k_src[1] != v_src[1]:
        return None
    (k_name, groups), (v_name, _) = k_src, v_src
    specs = {i.name: i.spec for i in program.inputs}
    k_spec = buffers.get(k_name) or specs.get(k_name)
    v_spec = buffers.get(v_name) or specs.get(v_name)
    if len(q_spec.shape) != 4 or q_spec.shape[2] != "1" or k_spec.shape != v_spec.shape:
        return None
    batch, heads, _, dim = q_spec.shape
    kv_heads = k_spec.shape[1]
    if not heads.isdigit() or int(heads) != int(kv_heads) * groups or k_spec.shape[3] != dim:
        return None
    mask = _arg(step, 3, "attn_mask")
    if mask is not None:
        m = buffers.get(mask.name) or specs.get(mask.name) if isinstance(mask, Buf) else None
        if m is None or len(m.shape) != 4 or m.shape[1] != "1" or m.shape[2] != "1":
            return None  # a per-head or per-query mask does not broadcast over the folded rows
    rows = f"{q.name}__gqa"
    folded = f"{out}__gqa"
    grouped = [_size_arg(batch), int(kv_heads), groups, _size_arg(dim)]
    buffers[rows] = TensorSpec(dtype=q_spec.dtype, shape=(batch, kv_heads, str(groups), dim))
    buffers[folded] = TensorSpec(dtype=out_spec.dtype, shape=(batch, kv_heads, str(groups), dim))
    args = [Buf(rows), Buf(k_name), Buf(v_name), *step.args[3:]]
    return [
        Step(kind=step.kind, target="aten.view.default", args=(q, grouped), kwargs={}, outputs=(rows,)),
        replace(step, args=tuple(args), outputs=(folded,)),
        _view(folded, out_spec.shape, out),
    ]


# Eager attention at one query (``eager_attention_as_sdpa``): the steps an HF model's eager
# attention traces to, by target, from the scores' product to the output's view.
_BMM, _VIEW, _EXPAND, _PERMUTE = (
    "aten.bmm.default",
    "aten.view.default",
    "aten.expand.default",
    "aten.permute.default",
)
_CAST, _CLONE, _SOFTMAX = "aten._to_copy.default", "aten.clone.default", "aten._softmax.default"
_SCALE_OPS = ("aten.div.Tensor", "aten.mul.Tensor")


@dataclass(frozen=True)
class EagerAttention:
    """An eager attention's own steps (``steps``, in program order, from its operands' views
    to its output) and the specs of what they make (``buffers``), as ``eager_attention_as_sdpa``
    found them: what its SDPA step stands for."""

    steps: tuple[Step, ...]
    buffers: dict[str, TensorSpec]


def eager_attention_as_sdpa(
    program: Program,
    log: Callable[[str], None] | None = None,
    originals: dict[str, EagerAttention] | None = None,
) -> tuple[Program, int]:
    """``program`` with each eager attention of one query (GPT-J's: the query and keys cast to
    float32, ``bmm`` over ``expand``/``view``, divided by a constant, plus an additive mask, softmax,
    cast back, ``bmm`` with the values) as one ``scaled_dot_product_attention`` step over the same
    query, keys, values and mask, the constant its ``scale``: the same function (SDPA computes in
    float32 from half-precision operands, the products exact), which the decode attention kernel
    then takes (``aot.codegen.decode_attention``). Only where every step between reads the one
    before alone, the operands are [B, H, 1, D] and [B, H, S, D] of one dtype and the mask [B or 1,
    1, 1, S] of it; elsewhere nothing changes. A mask added before the scale (CodeGen's
    ``(scores + mask) / c``) is passed scaled (one ``mul`` step for the layers sharing the mask
    and scale): SDPA adds its mask after scaling. Scores in float32 of half-precision ones
    (Gemma 2's softmax) are SDPA's own arithmetic. Scores capped as ``tanh(s / c) * c`` between the
    scale and the mask (Gemma 2's), and a learned logit per head joined to the masked scores before
    the softmax and dropped after it (GPT-OSS's sinks: ``cat([s, sinks]) - max``, softmax, ``[...,
    :-1]``), become an SDPA step with a ``SOFTCAP`` or ``SINKS`` keyword, which only the decode
    attention kernel computes, where ``originals`` is given: the attention's own steps go there by
    the step's output, for ``restore_eager_attention``; without it they stay. Returns the program
    and how many were rewritten."""
    steps = list(program.steps)
    producer, readers, specs = producer_of(steps), readers_of(steps), tensor_specs(program)
    buffers = dict(program.buffers)
    out_steps: dict[int, list[Step]] = {}
    scaled_masks: dict[tuple[str, float], str] = {}  # one scaled mask for the layers that share it
    derived: dict[tuple[str, ...], str] = {}  # one negated mask, one bias view, for the layers sharing them

    def derive(before: list[Step], src: str, target: str, args: tuple, shape: tuple[str, ...] | None) -> str:
        """The result of ``target(src, *args)``, of ``shape`` (``src``'s where None), as a step in
        ``before`` (the steps before an SDPA step), or the one an earlier layer's made."""
        key = (src, target, repr(args))
        name = derived.get(key)
        if name is None:
            name = derived[key] = f"{src}_{target.split('.')[1]}_{len(derived)}"
            spec = specs[src]
            buffers[name] = replace(spec, shape=shape or spec.shape)
            before.append(Step(StepKind.ATEN, target, (Buf(src), *args), {}, (name,)))
        return name

    for i, step in enumerate(steps):
        if step.target == _SOFTMAX and step.outputs:
            found = _eager_attention(steps, i, producer, readers, specs)
            if found is None:
                continue
            at, sdpa, mask_scaled, hidden, bias_shape = found
            if extended(sdpa):
                if originals is None:
                    continue
                originals[sdpa.outputs[0]] = _own_steps(program, steps, producer, sdpa)
            before: list[Step] = []
            # MPT's where(hidden, lowest, s): SDPA's bool mask attends where nothing is hidden
            if hidden is not None:
                negated = derive(before, hidden, "aten.bitwise_not.default", (), None)
                sdpa = replace(sdpa, args=(*sdpa.args[:3], Buf(negated), *sdpa.args[4:]))
                if originals is not None and sdpa.outputs[0] in originals:
                    # the model's steps read the negated mask negated back: what the kernel reads
                    # (the hidden mask itself may live only inside the kernel that negates it)
                    own, again = originals[sdpa.outputs[0]], f"{negated}_back"
                    back_step = Step(StepKind.ATEN, "aten.bitwise_not.default", (Buf(negated),), {}, (again,))
                    renamed = tuple(
                        replace(t, args=tuple(Buf(again) if a == Buf(hidden) else a for a in t.args))
                        for t in own.steps
                    )
                    originals[sdpa.outputs[0]] = EagerAttention(
                        (back_step, *renamed), {**own.buffers, again: specs[hidden]}
                    )
            if bias_shape is not None:  # the bias viewed [B or 1, H, 1, C]
                src = sdpa.kwargs[BIAS].name
                if bias_shape[0] == "1":  # [H, 1, C]
                    viewed = derive(before, src, "aten.unsqueeze.default", (0,), bias_shape)
                else:  # [B * H, 1, C], contiguous
                    viewed = derive(before, src, _VIEW, ([_size_arg(d) for d in bias_shape],), bias_shape)
                sdpa = replace(sdpa, kwargs={**sdpa.kwargs, BIAS: Buf(viewed)})
            if mask_scaled:  # (s + m) * c == s * c + m * c: SDPA adds m * c after its scale c
                mask, scale = sdpa.args[3], sdpa.kwargs["scale"]
                name = scaled_masks.get((mask.name, scale))
                if name is None:
                    name = scaled_masks[(mask.name, scale)] = f"{mask.name}_scaled_{len(scaled_masks)}"
                    buffers[name] = specs[mask.name]
                    before.append(Step(StepKind.ATEN, "aten.mul.Tensor", (mask, scale), {}, (name,)))
                sdpa = replace(sdpa, args=(*sdpa.args[:3], Buf(name), *sdpa.args[4:]))
            out_steps[at] = [*before, sdpa]
    if not out_steps:
        return program, 0
    new = [t for i, s in enumerate(steps) for t in out_steps.get(i, [s])]
    if log:
        log(f"  {len(out_steps)} eager attention calls of one query run as scaled_dot_product_attention")
    return _drop_dead_steps(replace(program, steps=tuple(new), buffers=buffers)), len(out_steps)


def _own_steps(program: Program, steps: list[Step], producer: dict[str, int], sdpa: Step) -> EagerAttention:
    """The steps that compute ``sdpa``'s output from its operands (query, keys, values, mask), in
    program order, and the specs of their results."""
    stops = {a.name for a in (*sdpa.args[:4], *sdpa.kwargs.values()) if isinstance(a, Buf)}
    seen: set[int] = set()
    todo = list(sdpa.outputs)
    while todo:
        name = todo.pop()
        i = producer.get(name)
        if name in stops or i is None or i in seen:
            continue
        seen.add(i)
        todo.extend(step_reads(steps[i]))
    own = tuple(steps[i] for i in sorted(seen))
    made = {o for st in own for o in st.outputs if o is not None}
    return EagerAttention(own, {n: program.buffers[n] for n in made if n in program.buffers})


def restore_eager_attention(
    program: Program, originals: Mapping[str, EagerAttention], log: Callable[[str], None] | None = None
) -> Program:
    """``program`` with every extended SDPA step (``EXTENSIONS``) that no kernel took back as the model's
    own steps (``originals``, by the step's output), their buffers with them, and in each kernel's
    reference too, where a decode attention kernel stands for one: what no library SDPA computes
    never reaches a bundle. Raises ``CodegenError`` for an extended step ``originals`` lacks."""
    from aot.errors import CodegenError

    buffers = dict(program.buffers)

    def own(step: Step) -> tuple[Step, ...]:
        """``step``, or the steps an extended one stands for (their results declared: the CPU path
        runs a kernel's reference as steps)."""
        if not extended(step):
            return (step,)
        found = originals.get(step.outputs[0])
        if found is None:
            raise CodegenError(
                f"an attention step beyond SDPA ({step.outputs[0]}) has no steps of its own to restore"
            )
        buffers.update(found.buffers)
        return found.steps

    steps, restored = [], 0
    for step in program.steps:
        if step.kind == StepKind.KERNEL:
            if any(extended(r) for r in step.reference):
                step = replace(step, reference=tuple(r for ref in step.reference for r in own(ref)))
            steps.append(step)
        else:
            restored += extended(step)
            steps.extend(own(step))
    if restored and log:
        log(
            f"  {restored} attention calls beyond SDPA (capped scores, sinks, biases) kept their own steps "
            "(no decode attention kernel took them)"
        )
    return replace(program, steps=tuple(steps), buffers=buffers)


def _only_reader(name: str, readers: dict[str, list[int]], steps: list[Step], target) -> Step | None:
    """The one step that reads ``name``, where it is of ``target`` (a name or a tuple of them)."""
    at = readers.get(name, [])
    if len(at) != 1:
        return None
    step = steps[at[0]]
    targets = (target,) if isinstance(target, str) else target
    return step if step.target in targets and step.outputs else None


def _made_by(name: str, producer: dict[str, int], steps: list[Step], target) -> Step | None:
    at = producer.get(name)
    if at is None:
        return None
    step = steps[at]
    targets = (target,) if isinstance(target, str) else target
    return step if step.target in targets and step.args and isinstance(step.args[0], Buf) else None


def _operand(name: str, producer, steps, transposed: bool) -> str | None:
    """The [B, H, L, D] tensor a ``bmm`` operand views: ``view(expand(x))`` (``view(clone(expand(x)))``
    where the batch is a symbol and ``matmul`` copied the expanded operand to view it), through a
    ``permute(0, 1, 3, 2)`` where ``transposed`` (the keys), and a cast where there is one."""
    view = _made_by(name, producer, steps, _VIEW)
    copied = view and _made_by(view.args[0].name, producer, steps, _CLONE)
    if copied is not None and getattr(copied.kwargs.get("memory_format"), "name", "contiguous_format") != (
        "contiguous_format"
    ):
        return None
    expand = view and _made_by((copied or view).args[0].name, producer, steps, _EXPAND)
    if expand is None:
        return None
    src = expand.args[0].name
    if transposed:
        permute = _made_by(src, producer, steps, _PERMUTE)
        if permute is None or list(permute.args[1]) != [0, 1, 3, 2]:
            return None
        src = permute.args[0].name
    cast = _made_by(src, producer, steps, _CAST)
    return cast.args[0].name if cast is not None and set(cast.kwargs) <= {"dtype"} else src


def _eager_attention(steps, at, producer, readers, specs) -> tuple | None:
    """(the index of the output's view step, the SDPA step in its place, whether the mask was
    added before the scale, the bool mask of what is hidden where the model fills it (MPT's
    ``where(hidden, lowest, s)``: the step's mask until it is negated), the shape the bias must be
    viewed as where it needs one) for the eager attention whose softmax is ``steps[at]``; None
    where it is not one (``eager_attention_as_sdpa``)."""
    softmax = steps[at]
    if not isinstance(softmax.args[0], Buf) or list(softmax.args[1:]) not in ([-1, False], [3, False]):
        return None

    def back(name: str, target) -> Step | None:  # what made ``name``, read by its one reader alone
        step = _made_by(name, producer, steps, target)
        return step if step is not None and len(readers.get(step.outputs[0], [])) == 1 else None

    mask = scale = None
    mask_scaled = False

    def add_mask(score: str) -> str | None:  # the scores under ``score + mask``; None: not that
        nonlocal mask
        add = back(score, "aten.add.Tensor")
        if add is None:
            return score
        if len(add.args) != 2 or not isinstance(add.args[1], Buf) or add.kwargs:
            return None
        shape = specs[add.args[1].name].shape if add.args[1].name in specs else ()
        if len(shape) != 4 or shape[1:3] != ("1", "1"):
            return score  # not a mask's shape: a bias per head, perhaps (``_bias``)
        mask = add.args[1]
        return add.args[0].name

    scores = softmax.args[0].name
    upcast = back(scores, _CAST)  # Gemma 2's softmax in float32 of half-precision scores
    if (
        upcast is not None
        and upcast.kwargs.get("dtype") == DType("float32")
        and set(upcast.kwargs) <= {"dtype", "layout", "device"}  # a dtype change alone
        and getattr(upcast.kwargs.get("layout"), "name", "strided") == "strided"
    ):
        scores = upcast.args[0].name
    sinks = None
    if (found_sinks := _sinks(scores, producer, readers, steps, specs)) is not None:
        scores, sinks = found_sinks
    hidden = _hidden(scores, back, producer, steps, specs)
    if hidden is not None:  # MPT's masked_fill: the mask is that, no mask is added
        hidden, score = hidden
    else:
        score = add_mask(scores)
    cap = None
    if score is not None and (found_cap := _softcap(score, back)) is not None:
        score, cap = found_cap
    bias = viewed = None
    if score is not None and cap is None and sinks is None and (found_bias := _bias(score, back)) is not None:
        score, bias, viewed = found_bias
    scaled = score and back(score, _SCALE_OPS)
    if scaled is not None:
        c = scaled.args[1] if len(scaled.args) == 2 else None
        if type(c) not in (int, float) or not c or scaled.kwargs:
            return None
        scale, score = (1.0 / c if scaled.target == "aten.div.Tensor" else float(c)), scaled.args[0].name
        if mask is None and cap is None and hidden is None and bias is None:
            score = add_mask(score)  # CodeGen's (scores + mask) / c: the mask is scaled too
            mask_scaled = mask is not None
    if score is None:
        return None
    # Bloom's bmm is over [B * H, 1, C] scores viewed back after its bias (``viewed``); the others'
    # are viewed [B, H, 1, C] right after it
    view = None if viewed else back(score, _VIEW)
    bmm = back(score, _BMM) if viewed else view and back(view.args[0].name, _BMM)
    if bmm is None or not all(isinstance(a, Buf) for a in bmm.args[:2]):
        return None
    q = _operand(bmm.args[0].name, producer, steps, transposed=False) or _merged(
        bmm.args[0].name, producer, steps, specs, transposed=False
    )
    k = _operand(bmm.args[1].name, producer, steps, transposed=True) or _merged(
        bmm.args[1].name, producer, steps, specs, transposed=True
    )
    # forward: cast back, dropout's clone (eval), then view(expand(p)) @ view(expand(v)), viewed back
    name = softmax.outputs[0]
    if sinks is not None:  # the sink's column dropped: probs[..., :-1]
        dropped = _only_reader(name, readers, steps, "aten.slice.Tensor")
        if dropped is None or list(dropped.args[1:]) not in ([3, 0, -1], [-1, 0, -1]) or dropped.kwargs:
            return None
        name = dropped.outputs[0]
    for target in (_CAST, _CLONE):
        step = _only_reader(name, readers, steps, target)
        if step is not None:
            name = step.outputs[0]
    expand = _only_reader(name, readers, steps, _EXPAND)  # (Bloom views the probabilities alone)
    pview = _only_reader(expand.outputs[0] if expand else name, readers, steps, _VIEW)
    pv = pview and _only_reader(pview.outputs[0], readers, steps, _BMM)
    if pv is None or not isinstance(pv.args[1], Buf) or pv.args[0] != Buf(pview.outputs[0]):
        return None
    v = _operand(pv.args[1].name, producer, steps, transposed=False) or _merged(
        pv.args[1].name, producer, steps, specs, transposed=False
    )
    out = _only_reader(pv.outputs[0], readers, steps, _VIEW)
    if q is None or k is None or v is None or out is None:
        return None
    qs, ks, vs, os_ = (specs.get(n) for n in (q, k, v, out.outputs[0]))
    if any(s is None or len(s.shape) != 4 for s in (qs, ks, vs, os_)):
        return None
    batch, heads, rows, dim = qs.shape
    if rows != "1" or ks.shape != vs.shape or ks.shape[:2] != (batch, heads) or ks.shape[3] != dim:
        return None
    if tuple(os_.shape) != tuple(qs.shape) or len({qs.dtype, ks.dtype, vs.dtype, os_.dtype}) != 1:
        return None
    if hidden is not None:
        mask = Buf(hidden)
    if mask is not None:
        ms = specs.get(mask.name)
        dtype = "bool" if hidden is not None else qs.dtype
        if ms is None or ms.dtype != dtype or tuple(ms.shape[1:]) != ("1", "1", ks.shape[2]):
            return None
        if ms.shape[0] not in (batch, "1"):
            return None
    bias_shape = None
    if bias is not None:
        bias = _widened(bias, producer, steps, specs)
        bs, context = specs.get(bias), ks.shape[2]
        if bs is None or bs.dtype not in ("float32", qs.dtype):
            return None
        if viewed:  # [B * H, 1, C], the bmm's
            merged = ix.parse_size(batch) * ix.parse_size(heads)
            if len(bs.shape) != 3 or bs.shape[1:] != ("1", context):
                return None
            if not ix.same(ix.parse_size(bs.shape[0]), merged):
                return None
            bias_shape = (batch, heads, "1", context)
        elif tuple(bs.shape) == (heads, "1", context):  # MPT's, one row a head for every batch row
            bias_shape = ("1", heads, "1", context)
        elif len(bs.shape) != 4 or bs.shape[0] not in (batch, "1") or bs.shape[1:] != (heads, "1", context):
            return None
    kwargs: dict[str, Any] = {"scale": 1.0 if scale is None else scale}  # unscaled: not SDPA's 1/sqrt(D)
    if bias is not None:
        kwargs[BIAS] = Buf(bias)
    if cap is not None:
        kwargs[SOFTCAP] = cap
    if sinks is not None:
        sink_spec = specs.get(sinks)
        if sink_spec is None or tuple(sink_spec.shape) != (heads,) or sink_spec.dtype != qs.dtype:
            return None
        kwargs[SINKS] = Buf(sinks)
    sdpa = Step(
        kind=out.kind,
        target=SDPA,
        args=(Buf(q), Buf(k), Buf(v), mask, 0.0, False),
        kwargs=kwargs,
        outputs=out.outputs,
    )
    return producer[out.outputs[0]], sdpa, mask_scaled, hidden, bias_shape


# A fill at or below this hides a score as -inf does: exp(fill - max) is 0 in float32 (MPT's
# masked_fill with the dtype's lowest value)
HIDING_FILL = -1.0e4


def _hidden(name: str, back, producer, steps, specs) -> tuple[str, str] | None:
    """(the bool mask, the scores) where ``name`` is ``where(hidden, fill, scores)`` (MPT's
    ``masked_fill``: True hides a slot), ``fill`` a scalar (or a ``scalar_tensor``) at or below
    ``HIDING_FILL``; None otherwise."""
    where = back(name, "aten.where.self")
    if where is None or len(where.args) != 3 or where.kwargs:
        return None
    hidden, fill, scores = where.args
    if not isinstance(hidden, Buf) or not isinstance(scores, Buf) or hidden.name not in specs:
        return None
    if specs[hidden.name].dtype != "bool":
        return None
    if isinstance(fill, Buf):
        made = producer.get(fill.name)
        step = steps[made] if made is not None else None
        if step is None or step.target != "aten.scalar_tensor.default" or not step.args:
            return None
        fill = step.args[0]
    if type(fill) not in (int, float) or not fill <= HIDING_FILL:
        return None
    return hidden.name, scores.name


def _bias(name: str, back) -> tuple[str, str, bool] | None:
    """(the scaled scores, the bias, whether the scores are viewed after it) where ``name`` is the
    scaled scores plus a bias (MPT's ``s * c + alibi``), or that in a cast and a view (Bloom's
    ``baddbmm(alibi, q, k, alpha=c)`` over [B * H, 1, C], cast to its dtype and viewed [B, H, 1, C]);
    None otherwise (the bias's shape is checked by the caller)."""
    viewed = False
    for _ in range(2):
        view, cast = back(name, _VIEW), back(name, _CAST)
        if view is not None and not viewed:
            name, viewed = view.args[0].name, True
        elif cast is not None and set(cast.kwargs) <= {"dtype"}:
            name = cast.args[0].name
    add = back(name, "aten.add.Tensor")
    if add is None or len(add.args) != 2 or add.kwargs or not all(isinstance(a, Buf) for a in add.args):
        return None
    for scores, bias in (add.args, add.args[::-1]):
        if back(scores.name, _SCALE_OPS) is not None:
            return scores.name, bias.name, viewed
    return None


def _widened(name: str, producer, steps, specs) -> str:
    """``name``, or what it widens where it is a cast of a 16-bit float to float32 (exact: a kernel
    reads the narrower one as it is and widens it itself)."""
    cast = _made_by(name, producer, steps, _CAST)
    if cast is None or set(cast.kwargs) != {"dtype"} or cast.kwargs["dtype"] != DType("float32"):
        return name
    src = specs.get(cast.args[0].name)
    return cast.args[0].name if src is not None and src.dtype in ("float16", "bfloat16") else name


def _merged(name: str, producer, steps, specs, transposed: bool) -> str | None:
    """The [B, H, L, D] tensor a ``bmm`` operand views as [B * H, L, D] (Bloom's: ``view(x)``, the
    keys ``view(x).permute(0, 2, 1)``), through a cast where there is one; None otherwise."""
    cast = _made_by(name, producer, steps, _CAST)
    if cast is not None:
        if set(cast.kwargs) != {"dtype"}:
            return None
        name = cast.args[0].name
    if transposed:
        permute = _made_by(name, producer, steps, _PERMUTE)
        if permute is None or list(permute.args[1]) != [0, 2, 1]:
            return None
        name = permute.args[0].name
    view = _made_by(name, producer, steps, _VIEW)
    if view is None:
        return None
    src, merged = specs.get(view.args[0].name), specs.get(name)
    if src is None or merged is None or len(src.shape) != 4 or len(merged.shape) != 3:
        return None
    both = ix.parse_size(src.shape[0]) * ix.parse_size(src.shape[1])
    if not ix.same(ix.parse_size(merged.shape[0]), both) or tuple(merged.shape[1:]) != tuple(src.shape[2:]):
        return None
    return view.args[0].name


def _sinks(name: str, producer, readers, steps, specs) -> tuple[str, str] | None:
    """(the scores joined, the [H] weight) where ``name`` is GPT-OSS's ``cat([s, sinks]) - max``
    over the last dim: ``c = cat([s, expand(view(w, [1, -1, 1, 1]), ...)], -1)``, ``c - max(c, -1,
    keepdim)`` (which the softmax does not see: it is shift-free), ``w`` a buffer no step makes
    (a weight); None otherwise."""
    at = producer.get(name)
    sub = steps[at] if at is not None else None
    if sub is None or sub.target != "aten.sub.Tensor" or sub.kwargs or len(readers.get(name, [])) != 1:
        return None
    if len(sub.args) != 2 or not all(isinstance(a, Buf) for a in sub.args):
        return None
    joined, top = sub.args[0].name, sub.args[1].name
    most = producer.get(top)
    if most is None or steps[most].target != "aten.max.dim" or steps[most].args[0] != Buf(joined):
        return None
    if list(steps[most].args[1:]) not in ([-1, True], [3, True]) or steps[most].outputs[0] != top:
        return None
    if sorted(readers.get(joined, [])) != sorted([most, at]) or len(readers.get(top, [])) != 1:
        return None
    cat = steps[producer[joined]] if joined in producer else None
    if cat is None or cat.target != "aten.cat.default" or cat.kwargs or len(cat.args) != 2:
        return None
    parts, dim = cat.args
    if dim not in (-1, 3) or not isinstance(parts, list) or len(parts) != 2:
        return None
    if not all(isinstance(x, Buf) for x in parts) or len(readers.get(parts[1].name, [])) != 1:
        return None
    expand = _made_by(parts[1].name, producer, steps, _EXPAND)
    view = expand and _made_by(expand.args[0].name, producer, steps, _VIEW)
    if view is None or list(view.args[1]) != [1, -1, 1, 1] or len(readers.get(view.outputs[0], [])) != 1:
        return None
    weight = view.args[0].name
    spec = specs.get(weight)
    if weight in producer or spec is None or len(spec.shape) != 1:
        return None
    return parts[0].name, weight


def _softcap(name: str, back: Callable[[str, Any], Step | None]) -> tuple[str, float] | None:
    """(the scores under it, c) where ``name`` is ``tanh(s / c) * c`` (Gemma 2's cap on its
    attention scores; ``s * (1 / c)`` too) of a constant c > 0; None otherwise. ``back``: what
    made a name, read by its one reader alone, of the targets given."""
    times = back(name, "aten.mul.Tensor")
    c = times.args[1] if times is not None and len(times.args) == 2 and not times.kwargs else None
    if type(c) not in (int, float) or not c > 0:
        return None
    tanh = back(times.args[0].name, "aten.tanh.default")
    over = tanh and len(tanh.args) == 1 and back(tanh.args[0].name, _SCALE_OPS)
    if not over or len(over.args) != 2 or over.kwargs or type(over.args[1]) not in (int, float):
        return None
    by = over.args[1] if over.target == "aten.div.Tensor" else (1.0 / over.args[1] if over.args[1] else 0.0)
    if not math.isclose(by, c, rel_tol=1e-6):
        return None
    return over.args[0].name, float(c)


def merge_batch_dims(program: Program, log: Callable[[str], None] | None = None) -> tuple[Program, int]:
    """Attention over more than one batch dim (Twins' windows: ``[B, windows, heads, L, D]``)
    as attention over one: ``q``, ``k`` and ``v`` viewed ``[B * windows, heads, L, D]``, the output
    viewed back, so every attention kernel (which takes 4-D operands) can take it. Only where each
    operand's leading dims merge as a view does (each one's stride the next one's size times its
    stride: a copy would be needed otherwise) and no mask is given."""
    from aot.codegen import index as ix
    from aot.codegen.cache_writes import strided_view
    from aot.errors import counted

    buffers = dict(program.buffers)
    specs = tensor_specs(program)
    steps: list[Step] = []
    merged = 0
    for step in program.steps:
        call = sdpa_call(step) if step.kind == StepKind.ATEN and step.target == SDPA else None
        out = step.outputs[0] if step.outputs else None
        operands = [call.query, call.key, call.value] if call is not None else []
        shapes = [specs[a.name].shape if isinstance(a, Buf) and a.name in specs else None for a in operands]
        if (
            call is None
            or call.mask is not None
            or out not in buffers
            or any(s is None or len(s) < 5 or len(s) != len(shapes[0]) for s in shapes)
            or shapes[0][:-3] != shapes[1][:-3]
            or shapes[0][:-3] != shapes[2][:-3]
        ):
            steps.append(step)
            continue
        lead = len(shapes[0]) - 3
        views = [strided_view(a.name, program) for a in operands]
        if not all(
            v is not None
            and all(ix.same(v.strides[i], v.shape[i + 1] * v.strides[i + 1]) for i in range(lead - 1))
            for v in views
        ):
            steps.append(step)
            continue
        rows = ix.size_text(ix.numel(tuple(ix.parse_size(d) for d in shapes[0][:lead])))
        new = []
        for a, shape in zip(operands, shapes):
            flat = f"{a.name}__batch"
            buffers[flat] = TensorSpec(dtype=specs[a.name].dtype, shape=(rows, *shape[lead:]))
            new.append(_view(a.name, buffers[flat].shape, flat))
        o_spec = buffers[out]
        flat_out = f"{out}__batch"
        buffers[flat_out] = TensorSpec(dtype=o_spec.dtype, shape=(rows, *o_spec.shape[lead:]))
        args = (*(Buf(s.outputs[0]) for s in new), *step.args[3:])
        steps += [
            *new,
            replace(step, args=args, outputs=(flat_out, *step.outputs[1:])),
            _view(flat_out, o_spec.shape, out),
        ]
        merged += 1
    if merged and log:
        log(
            f"  {counted(merged, 'attention call')} over several batch dims run over one (their views merged)"
        )
    return (replace(program, steps=tuple(steps), buffers=buffers), merged) if merged else (program, 0)
