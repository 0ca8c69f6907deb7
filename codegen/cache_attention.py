"""Attention over a KV cache for any number of query tokens (a prefill), as one Triton kernel, for
library-free programs (``aot.codegen.library_free``).

``aot.codegen.decode_attention`` takes the one-token calls of a decode step; a prefill's
``scaled_dot_product_attention(q, k, v, mask)`` reads ``T`` queries per row against the whole
static cache under a ``[B or 1, 1, T, C]`` mask (causal over the cache slots, left padding), which
the flash candidates (no mask) do not cover. A *site* here is such a call without dropout, not
causal, whose query is a row-major ``[B, H, T, D]`` buffer or a head view of a projection's rows
(as ``aot.codegen.flash`` reads them), whose keys and values are views of ``[B, KV, C, D]`` caches
(grouped-query heads by ``unsqueeze``/``expand``, then maybe ``repeat_kv``'s copy, then ``view``:
the copy is not needed, the kernel reads the cache), and whose mask (or none) is a row-major
``[B or 1, 1, T, C]`` buffer, boolean (True: attend) or additive.

One program per (row, KV head, block of ``BLOCK_M`` query rows): its rows are the (token, query
head) pairs sharing that KV head, so each block of keys and values serves all of them; keys and
values stream in blocks with the softmax computed online in float32 from a finite floor (a block
whose slots are all masked adds nothing). ``T`` is a call-time size. The SDPA step is the kernel's
reference, what the CPU runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import sympy

from aot.codegen import index as ix
from aot.codegen.decode_attention import FLOAT_DTYPES, LOG2E, MAX_HEAD_DIM, SDPA, _Program, _sdpa_args
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.render import Rendered, kernel_id, kernel_record
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import RESHAPE_VIEWS, readers_of, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym

HEURISTIC = "cache-attention-v1"
BLOCK_M = 32  # (token, head) rows per program instance
MAX_BLOCK_N = 64  # cache slots per step of the loop


@dataclass(frozen=True)
class CacheSite:
    step: int
    q: str
    q_batch_t: int  # row b's query at b * T * q_batch_t
    q_token: int  # token t at t * q_token
    q_head: int  # head h at h * (q_head + T * q_head_t)
    q_head_t: int
    q_column: int
    k: str
    v: str
    mask: str | None
    mask_per_row: bool  # [B, 1, T, C] (else [1, 1, T, C])
    mask_dtype: str
    out: str
    batch: str
    seq: str
    heads_apart: tuple[int, ...]  # the permute (clone) view steps it takes on: it writes [B, T, H*D] rows
    heads: int
    kv_heads: int
    context: int
    head_dim: int
    scale: float
    dtype: str


def find_cache_sites(program: Program) -> list[CacheSite]:
    """The SDPA calls over a KV cache the kernel can stand for (module docstring)."""
    from aot.codegen.flash import _Finder

    p = _Program(program)
    readers = readers_of(program.steps)
    flash = None
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != SDPA or len(step.outputs) != 1:
            continue
        parsed = _sdpa_args(step)
        if parsed is None:
            continue
        q, k, v, m, scale, enable_gqa = parsed
        if (
            not all(isinstance(x, Buf) for x in (q, k, v))
            or not (m is None or isinstance(m, Buf))
            or enable_gqa
        ):
            continue
        qs, out = p.shape(q.name), step.outputs[0]
        if qs is None or len(qs) != 4 or not qs[1].isdigit() or not qs[3].isdigit():
            continue
        batch, heads, seq, head_dim, dtype = qs[0], int(qs[1]), qs[2], int(qs[3]), p.specs[q.name].dtype
        if dtype not in FLOAT_DTYPES or head_dim > MAX_HEAD_DIM or p.shape(out) != qs:
            continue
        if p.specs[out].dtype != dtype or p.specs[out].order:
            continue
        if any(
            x.name not in p.specs or p.specs[x.name].dtype != dtype or len(p.shape(x.name)) != 4
            for x in (k, v)
        ):
            continue
        if p.materialized(q.name):  # [B, H, T, D] row-major
            layout = (heads * head_dim, head_dim, 0, head_dim, 0)
            q_base = q.name
        else:
            flash = flash or _Finder(program)
            found = flash.operand(q.name, dtype)
            if found is None or found[2] != seq or found[3] != heads or found[4] != head_dim:
                continue
            layout = (found[0].width, found[0].width, head_dim, 0, found[0].column)
            q_base = found[0].base
        kc, vc = p.cache(k.name, batch, heads, head_dim), p.cache(v.name, batch, heads, head_dim)
        if kc is None or vc is None or kc[1:] != vc[1:] or not kc[2].isdigit():
            continue
        context = int(kc[2])
        mask, per_row, mask_dtype = None, False, dtype
        if m is not None:
            ms, mspec = p.shape(m.name), p.specs.get(m.name)
            if ms is None or len(ms) != 4 or mspec.dtype not in (dtype, "bool") or not p.materialized(m.name):
                continue
            if ms[1] != "1" or ms[3] != str(context) or not ix.same(ix.parse_size(ms[2]), ix.parse_size(seq)):
                continue
            if ix.same(ix.parse_size(ms[0]), ix.parse_size(batch)):
                per_row = True
            elif ms[0] != "1":
                continue
            mask, mask_dtype = m.name, mspec.dtype
        out, apart = _token_major(program, readers, i, out, batch, seq, heads * head_dim)
        sites.append(
            CacheSite(
                i,
                q_base,
                *layout,
                k=kc[0],
                v=vc[0],
                mask=mask,
                mask_per_row=per_row,
                mask_dtype=mask_dtype,
                out=out,
                batch=batch,
                seq=seq,
                heads_apart=apart,
                heads=heads,
                kv_heads=kc[1],
                context=context,
                head_dim=head_dim,
                scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
                dtype=dtype,
            )
        )
    return sites


def _token_major(program: Program, readers, i: int, out: str, batch: str, seq: str, width: int):
    """(the buffer the kernel writes, the steps it takes on): the ``[B, T, H*D]`` rows the SDPA
    result becomes through ``permute([0, 2, 1, 3])`` (maybe ``clone``) and a ``view`` read by
    nothing else, as an output projection reads them; else the result itself, [B, H, T, D]."""
    steps, taken = program.steps, []

    def only_reader(name: str) -> Step | None:
        users = readers.get(name, [])
        if len(users) != 1 or name in program.outputs:
            return None
        s = steps[users[0]]
        ok = s.kind == StepKind.ATEN and len(s.outputs) == 1 and s.outputs[0] is not None
        if ok:
            taken.append(users[0])
        return s if ok else None

    s = only_reader(out)
    if s is None or s.target != "aten.permute.default" or list(s.args[1]) != [0, 2, 1, 3]:
        return out, ()
    s = only_reader(s.outputs[0])
    if s is not None and s.target == "aten.clone.default":
        s = only_reader(s.outputs[0])
    if s is None or s.target not in RESHAPE_VIEWS:
        return out, ()
    name = s.outputs[0]
    spec = tensor_specs(program).get(name)
    want = (ix.parse_size(batch), ix.parse_size(seq), sympy.Integer(width))
    if spec is None or spec.order or len(spec.shape) != 3:
        return out, ()
    if not all(ix.same(ix.parse_size(a), b) for a, b in zip(spec.shape, want)):
        return out, ()
    return name, tuple(taken)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def render_cache_attention(site: CacheSite) -> Rendered:
    """The kernel of one site: grid (B * KV, query row blocks)."""
    d, groups = site.head_dim, site.heads // site.kv_heads
    bd = max(16, _pow2(d))
    bn = min(MAX_BLOCK_N, max(16, _pow2(site.context)))
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    name = f"cache_attention_g{groups}_d{d}"
    mask_d = "" if bd == d else " & (rd < HEAD_DIM)[None, :]"
    mask_dk = "" if bd == d else " & (rd < HEAD_DIM)[:, None]"
    body = [
        "pid = tl.program_id(0).to(tl.int64)",
        "b = pid // KV_HEADS",
        "kh = pid % KV_HEADS",
        "r = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head) rows",
        "valid_r = r < T * GROUPS",
        "t = r // GROUPS",
        "h = kh * GROUPS + r % GROUPS",
        "rd = tl.arange(0, BLOCK_D)",
        "q_at = b * T * Q_BATCH_T + t * Q_TOKEN + h * (Q_HEAD + T * Q_HEAD_T) + Q_COLUMN",
        f"q = tl.load(q_ptr + q_at[:, None] + rd[None, :], mask=valid_r[:, None]{mask_d}, other=0.0)",
        "cache = (b * KV_HEADS + kh) * CONTEXT * HEAD_DIM",
        "m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: an all-masked block adds 0",
        "l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)",
        "acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)",
        "for start in range(0, CONTEXT, BLOCK_N):",
        "    rn = start + tl.arange(0, BLOCK_N)",
        "    valid_n = rn < CONTEXT",
        f"    k = tl.load(k_ptr + cache + rn[None, :] * HEAD_DIM + rd[:, None], mask=valid_n[None, :]{mask_dk}, other=0.0)",
        f"    v = tl.load(v_ptr + cache + rn[:, None] * HEAD_DIM + rd[None, :], mask=valid_n[:, None]{mask_d}, other=0.0)",
        f"    s = tl.dot(q, k{precision}) * SCALE_LOG2E  # scores in log2 units",
        "    keep = valid_r[:, None] & valid_n[None, :]",
    ]
    bool_mask = site.mask is not None and site.mask_dtype == "bool"
    if site.mask is not None:
        body.append("    m_at = b * T * CONTEXT * MASK_PER_ROW + t[:, None] * CONTEXT + rn[None, :]")
        if bool_mask:
            body.append("    keep = keep & (tl.load(mask_ptr + m_at, mask=keep, other=0) != 0)")
        else:
            body.append("    s = s + tl.load(mask_ptr + m_at, mask=keep, other=0.0).to(tl.float32) * LOG2E")
    body += [
        "    s = tl.where(keep, s, float('-inf'))",
        "    m_new = tl.maximum(m_i, tl.max(s, 1))",
        "    alpha = tl.exp2(m_i - m_new)",
        "    p = tl.exp2(s - m_new[:, None])",
        "    l_i = l_i * alpha + tl.sum(p, 1)",
        f"    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v{precision})",
        "    m_i = m_new",
        "acc = acc / l_i[:, None]",
        "out_at = ((b * HEADS + h) * T + t) * HEAD_DIM"
        if not site.heads_apart
        else "out_at = ((b * T + t) * HEADS + h) * HEAD_DIM  # [B, T, H*D] rows",
        f"tl.store(out_ptr + out_at[:, None] + rd[None, :], acc.to({tl_dtype}), mask=valid_r[:, None]{mask_d})",
    ]
    params = [
        KernelParam("q_ptr", ParamKind.PTR, site.dtype),
        KernelParam("k_ptr", ParamKind.PTR, site.dtype),
        KernelParam("v_ptr", ParamKind.PTR, site.dtype),
        *([KernelParam("mask_ptr", ParamKind.PTR, site.mask_dtype)] if site.mask is not None else []),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        KernelParam("T", ParamKind("i32"), ""),
    ]
    seq = ix.size_text(ix.parse_size(site.seq))
    args = (
        Buf(site.q),
        Buf(site.k),
        Buf(site.v),
        *([Buf(site.mask)] if site.mask is not None else []),
        Buf(site.out),
        Sym(seq),
    )
    signature = signature_of(tuple(params), "i32")
    consts = {
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": bn,
        "BLOCK_D": bd,
        "GROUPS": groups,
        "HEADS": site.heads,
        "KV_HEADS": site.kv_heads,
        "HEAD_DIM": d,
        "CONTEXT": site.context,
        "Q_BATCH_T": site.q_batch_t,
        "Q_TOKEN": site.q_token,
        "Q_HEAD": site.q_head,
        "Q_HEAD_T": site.q_head_t,
        "Q_COLUMN": site.q_column,
        "MASK_PER_ROW": int(site.mask_per_row),
        "SCALE_LOG2E": repr(site.scale * LOG2E),
        "LOG2E": repr(LOG2E),
    }
    grid = (
        ix.size_text(ix.parse_size(site.batch) * site.kv_heads),
        f"({ix.size_text(ix.parse_size(site.seq) * groups)} + {BLOCK_M - 1})//{BLOCK_M}",
    )
    mask_doc = "no mask"
    if site.mask is not None:
        mask_doc = f"mask {'bool (True: attend)' if bool_mask else 'additive'} [{'B' if site.mask_per_row else '1'}, 1, T, C]"
    doc = [
        f"Attention over a KV cache: softmax(q k^T * {site.scale!r} + mask) v for T queries per row, online, fp32 accumulation.",
        "",
        f"q: [B, {site.heads}, T, {d}]; k, v: the cache [B, {site.kv_heads}, {site.context}, {d}] row-major, "
        f"{groups} query heads per KV head; {mask_doc}; B = {site.batch}, T = {seq}, {site.dtype}.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, consts, name, signature, body)
    rows, t = ix.parse_size(site.batch), ix.parse_size(site.seq)
    elem = ITEMSIZE[site.dtype]
    traffic = rows * (2 * site.kv_heads * site.context * d + 2 * site.heads * t * d) * elem
    config = {
        "kind": "cache_attention",
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": bn,
        "BLOCK_D": bd,
        "heuristic": HEURISTIC,
        "num_warps": 4,
        "num_stages": 2,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=args,
        outputs=(site.out,),
        grid=grid,
        num_warps=4,
        num_stages=2,
        config=config,
        ops=(SDPA,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def cache_attention_kernels(
    program: Program,
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each SDPA over a KV cache run by its kernel (the SDPA step its reference);
    a site whose kernel fails to compile stays the library call."""
    sites = find_cache_sites(program)
    if not sites:
        return program, {}
    rendered = [render_cache_attention(s) for s in sites]
    ids = [kernel_id(r.source, r.signature, r.config) for r in rendered]
    todo = dict(zip(ids, rendered))
    results, failed = compile_kernels(list(todo.items()))
    for kid, why in failed.items():
        say(f"  warning: cache attention kernel {todo[kid].name} failed to compile, SDPA stays: {why}")
    existing = {k.id for k in program.kernels}
    records = {
        kid: kernel_record(kid, r, results, archs)
        for kid, r in todo.items()
        if kid not in failed and kid not in existing
    }
    at = {s.step: (s, kid, r) for s, kid, r in zip(sites, ids, rendered) if kid not in failed}
    steps: list[Step | None] = list(program.steps)
    for i, (site, kid, r) in at.items():
        steps[i] = Step(
            kind=StepKind.KERNEL,
            target=kid,
            args=r.args,
            kwargs={},
            outputs=r.outputs,
            grid=r.grid,
            reference=(program.steps[i], *(program.steps[j] for j in site.heads_apart)),
        )
        for j in site.heads_apart:
            steps[j] = None
    if at:
        say(f"  {len(at)} SDPA calls over a KV cache run as cache attention kernels")
    cubins = {(kid, a): results[(kid, a)].cubin for kid in records for a in archs}
    kept = tuple(s for s in steps if s is not None)
    return replace(program, steps=kept, kernels=program.kernels + tuple(records.values())), cubins
