"""Attention over a KV cache for any number of query tokens (a prefill), as one Triton kernel, for
library-free programs (``aot.codegen.library_free``).

``aot.codegen.decode_attention`` takes the one-token calls of a decode step; a prefill's
``scaled_dot_product_attention(q, k, v, mask)`` reads ``T`` queries per row against the whole
static cache under a ``[B or 1, 1, T, C]`` mask (causal over the cache slots, left padding), which
the flash candidates (no mask) do not cover. A *site* here is such a call without dropout,
whose query is a row-major ``[B, H, T, D]`` buffer or a head view of a projection's rows (as
``aot.codegen.flash`` reads them), whose keys and values are views of ``[B, KV, C, D]`` caches
(grouped-query heads by ``unsqueeze``/``expand``, then maybe ``repeat_kv``'s copy, then ``view``:
the copy is not needed, the kernel reads the cache; or ``enable_gqa``), and whose mask (or none)
broadcasts to ``[B, H, T, C]``, boolean (True: attend) or additive.

The same kernel serves self-attention under a mask (BERT's padding mask: ``[B, 1, 1, S]``,
``expand``-ed over the queries or not), its keys and values head views of projection rows as its
query is (``CacheSite.rows``), and attention whose query, keys and values are buffers of their
own read through any views that keep the head dim contiguous (``CacheSite.strided``,
``CacheSite.q_strided``: a plain Llama's prompt without a cache, its queries and keys as the
RoPE kernels wrote them, the ``repeat_kv`` copy dropped by ``attention.fold_gqa_repeats``),
under a mask or ``is_causal`` (top-left aligned, as SDPA's). Calls without a mask that a flash
candidate takes (``aot.codegen.flash``: GPT-2's) are left to it. A mask is read through its
views from the buffer they view (``cache_writes.strided_view``: an offset and a batch, head,
query and key stride, 0 where it is shared): a ``[B or 1, 1, T or 1, S]`` padding or causal mask,
or T5's position bias per head, ``[B or 1, H, T, S]`` with the padding added in, which T5 passes
with ``scale=1.0``.

Rows masked everywhere come out as SDPA's do: an additive mask is added in natural units and its
dtype-minimum entries clamp to a finite floor, so a row masked by them everywhere averages its
values (SDPA's softmax of equal scores); a row whose every key is -inf or False comes out 0
(SDPA's safe softmax), never NaN.

One program per (row, KV head, block of ``BLOCK_M`` query rows): its rows are the (token, query
head) pairs sharing that KV head, so each block of keys and values serves all of them; keys and
values stream in blocks with the softmax computed online in float32 from a finite floor (a block
whose slots are all masked adds nothing). ``T`` is a call-time size. The SDPA step is the kernel's
reference, what the CPU runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import sympy

from aot.codegen import index as ix
from aot.codegen.attention import SDPA, sdpa_call
from aot.codegen.cache_writes import strided_view
from aot.codegen.decode_attention_render import LOG2E
from aot.codegen.decode_sites import FLOAT_DTYPES, MAX_HEAD_DIM, _Program
from aot.codegen.kernel_source import kernel_module, online_softmax_lines, signature_of
from aot.codegen.render import Rendered, compile_site_kernels, kernel_step
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import RESHAPE_VIEWS, readers_of, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym

HEURISTIC = "cache-attention-v1"
BLOCK_M = 32  # (token, head) rows per program instance
MAX_BLOCK_N = 64  # cache slots per step of the loop
NO_MASK = ("0", "0", "0", "0", "0")
MASK_STRIDES = ("MASK_OFFSET", "MASK_B", "MASK_H", "MASK_T", "MASK_N")


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
    mask: str | None  # the row-major buffer the mask reads through its views
    # element (b, h, t, n) of the mask at OFFSET + b * B + h * H + t * T + n * N: (offset, batch,
    # head, token and key strides), size texts, 0 for a dim the mask broadcasts over
    mask_at: tuple[str, str, str, str, str]
    mask_dtype: str
    out: str
    batch: str
    seq: str
    heads_apart: tuple[int, ...]  # the permute (clone) view steps it takes on: it writes [B, T, H*D] rows
    heads: int
    kv_heads: int
    context: int  # the cache's slots; 0 for keys and values read from projection rows (``rows``)
    head_dim: int
    scale: float
    dtype: str
    rows: tuple[int, int, int, int, str] | None = None  # (k width, k column, v width, v column, key length)
    # keys and values as strided views of buffers of their own: element (b, kv head, n, d) of k at
    # K_OFFSET + b * K_B + kh * K_H + n * K_N + d (size texts), the same for v, and the key length
    strided: KeysValues | None = None
    # the query as a strided view: element (b, h, t, d) of ``q`` at Q_OFFSET + b * Q_B + h * Q_H +
    # t * Q_T + d (size texts); None: the layout above
    q_strided: tuple[str, str, str, str] | None = None
    causal: bool = False  # query t attends keys n <= t (SDPA's is_causal, aligned at the top left)


@dataclass(frozen=True)
class KeysValues:
    """Keys and values read through their views (``cache_writes.strided_view``): size texts."""

    k: str
    k_at: tuple[str, str, str, str]  # offset, batch, head and key strides
    v: str
    v_at: tuple[str, str, str, str]
    keys: str  # the key length


def _strided_query(program: Program, p: _Program, q: str, shape: tuple[str, ...], dtype: str):
    """(base, (offset, b, h, t strides as size texts)) where ``q`` (``shape``: [B, H, T, D]) is a
    view of a row-major buffer of ``dtype`` with its head dim contiguous; None otherwise."""
    view = strided_view(q, program)
    spec = p.specs.get(view.base) if view is not None else None
    if view is None or spec is None or spec.dtype != dtype or len(view.shape) != 4:
        return None
    if not all(ix.same(a, ix.parse_size(b)) for a, b in zip(view.shape, shape)):
        return None
    if not ix.same(view.strides[3], sympy.Integer(1)):
        return None
    return view.base, tuple(ix.size_text(x) for x in (view.offset, *view.strides[:3]))


def _strided_keys_values(
    program: Program, p: _Program, k: str, v: str, batch: str, heads: int, head_dim: int, dtype: str
):
    """(KV, ``KeysValues``) where ``k`` and ``v`` are ``[B, KV, S, D]`` views, their head dim
    contiguous, of row-major buffers of ``dtype`` (a RoPE kernel's result; ``repeat_kv``'s copy
    viewed back to ``[B, H, S, D]``, read as ``H`` heads, where the build kept one: a library-free
    build has SDPA read the copied heads, ``enable_gqa``, ``attention.fold_gqa_repeats``), ``KV``
    dividing ``heads``; None otherwise."""
    found = []
    for name in (k, v):
        view = strided_view(name, program)
        spec = p.specs.get(view.base) if view is not None else None
        if view is None or spec is None or spec.dtype != dtype or len(view.shape) != 4:
            return None
        b, kv, n, d = view.shape
        if not ix.same(b, ix.parse_size(batch)) or not ix.same(d, sympy.Integer(head_dim)):
            return None
        if not isinstance(kv, sympy.Integer) or int(kv) < 1 or heads % int(kv):
            return None
        if not ix.same(view.strides[3], sympy.Integer(1)):
            return None
        texts = tuple(ix.size_text(x) for x in (view.offset, *view.strides[:3]))
        found.append((view.base, texts, int(kv), n))
    (kb, k_at, kv, kn), (vb, v_at, vkv, vn) = found
    if kv != vkv or not ix.same(kn, vn):
        return None
    return kv, KeysValues(kb, k_at, vb, v_at, ix.size_text(kn))


def find_cache_sites(program: Program) -> list[CacheSite]:
    """The SDPA calls over a KV cache the kernel can stand for (module docstring)."""
    from aot.codegen.flash import _Finder, find_attention_sites

    p = _Program(program)
    readers = readers_of(program.steps)
    flash = None
    flash_steps = None  # the SDPA steps a flash candidate stands for: left to it
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != SDPA or len(step.outputs) != 1:
            continue
        call = sdpa_call(step)
        if call is None:
            continue
        q, k, v, m, scale, causal = call.query, call.key, call.value, call.mask, call.scale, call.causal
        if not all(isinstance(x, Buf) for x in (q, k, v)) or not (m is None or isinstance(m, Buf)):
            continue
        if causal and m is not None:
            continue  # SDPA takes one or the other
        if m is None:
            if flash_steps is None:
                flash_steps = {j for a in find_attention_sites(program) for j in a.library}
            if i in flash_steps:
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
            q_base, q_strided = q.name, None
        elif (
            (found := (flash := flash or _Finder(program)).operand(q.name, dtype)) is not None
            and found[2] == seq
            and found[3] == heads
            and found[4] == head_dim
        ):  # a head view of a projection's rows
            layout = (found[0].width, found[0].width, head_dim, 0, found[0].column)
            q_base, q_strided = found[0].base, None
        elif (found := _strided_query(program, p, q.name, qs, dtype)) is not None:
            layout = (0, 0, 0, 0, 0)
            q_base, q_strided = found
        else:
            continue
        kc, vc = p.cache(k.name, batch, heads, head_dim), p.cache(v.name, batch, heads, head_dim)
        rows, strided = None, None
        flash = flash or _Finder(program)
        fk, fv = flash.operand(k.name, dtype), flash.operand(v.name, dtype)
        if kc is not None and vc is not None and kc[1:] == vc[1:] and kc[2].isdigit():
            k_base, v_base, kv_heads, context, keys = kc[0], vc[0], kc[1], int(kc[2]), kc[2]
        elif (
            fk is not None
            and fv is not None
            and all(f[3] == heads and f[4] == head_dim for f in (fk, fv))
            and fk[2] == fv[2]
            and ix.same(ix.parse_size(fk[1]), ix.parse_size(batch))
        ):  # self-attention under a mask (BERT's padding): keys and values in projection rows
            k_base, v_base, kv_heads, context, keys = fk[0].base, fv[0].base, heads, 0, fk[2]
            rows = (fk[0].width, fk[0].column, fv[0].width, fv[0].column, keys)
        elif (
            found := _strided_keys_values(program, p, k.name, v.name, batch, heads, head_dim, dtype)
        ) is not None:
            kv_heads, strided = found  # keys and values of their own (a RoPE kernel's result)
            k_base, v_base, context, keys = strided.k, strided.v, 0, strided.keys
        else:
            continue
        mask, mask_at, mask_dtype = None, NO_MASK, dtype
        if m is not None:
            found_mask = _mask(program, p, m.name, (batch, str(heads), seq, keys), dtype)
            if found_mask is None:
                continue
            mask, mask_at, mask_dtype = found_mask
        out, apart = token_major(program, readers, i, out, batch, seq, heads * head_dim)
        sites.append(
            CacheSite(
                i,
                q_base,
                *layout,
                k=k_base,
                v=v_base,
                mask=mask,
                mask_at=mask_at,
                mask_dtype=mask_dtype,
                out=out,
                batch=batch,
                seq=seq,
                heads_apart=apart,
                heads=heads,
                kv_heads=kv_heads,
                context=context,
                head_dim=head_dim,
                scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
                dtype=dtype,
                rows=rows,
                strided=strided,
                causal=causal,
                q_strided=q_strided,
            )
        )
    return sites


def _mask(program: Program, p: _Program, name: str, full: tuple[str, str, str, str], dtype: str):
    """(buffer, (offset, batch, head, token, key strides) as size texts, dtype) of a mask that
    broadcasts to ``full`` ``[B, H, T, S]`` as SDPA's does (each dim its size or 1, leading dims
    maybe absent), read through its views from a row-major buffer: ``expand`` views of a
    ``[B, 1, 1, S]`` padding mask, T5's ``[B or 1, H, T, S]`` position bias with the padding added
    in; a dim of size 1 reads at stride 0. None for any other."""
    spec = p.specs.get(name)
    view = strided_view(name, program)
    if spec is None or spec.dtype not in (dtype, "bool") or view is None or not 1 <= len(view.shape) <= 4:
        return None
    base = p.specs.get(view.base)
    if base is None or base.order or base.dtype != spec.dtype:
        return None
    one, lead = sympy.Integer(1), 4 - len(view.shape)
    shape = (one,) * lead + tuple(view.shape)
    strides = (sympy.Integer(0),) * lead + tuple(view.strides)
    at = []
    for size, stride, want in zip(shape, strides, full):
        if ix.same(size, one):
            at.append(sympy.Integer(0))
        elif ix.same(size, ix.parse_size(want)):
            at.append(stride)
        else:
            return None
    return view.base, tuple(ix.size_text(x) for x in (view.offset, *at)), spec.dtype


def token_major(program: Program, readers, i: int, out: str, batch: str, seq: str, width: int):
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
    specs = tensor_specs(program)
    # a view to the result's own shape first (transformers' GPT-2 views it to [B, H, T, D] again)
    while (
        s is not None
        and s.target in RESHAPE_VIEWS
        and specs.get(s.outputs[0]) is not None
        and specs[s.outputs[0]].shape == specs[out].shape
    ):
        s = only_reader(s.outputs[0])
    if s is None or s.target != "aten.permute.default" or list(s.args[1]) != [0, 2, 1, 3]:
        return out, ()
    s = only_reader(s.outputs[0])
    if s is not None and s.target == "aten.clone.default":
        s = only_reader(s.outputs[0])
    if s is None or s.target not in RESHAPE_VIEWS:
        return out, ()
    name = s.outputs[0]
    spec = specs.get(name)
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
    cache = site.rows is None and site.strided is None  # keys and values in a [B, KV, C, D] cache
    bn = min(MAX_BLOCK_N, max(16, _pow2(site.context))) if cache else MAX_BLOCK_N
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    if cache:
        name = f"cache_attention_g{groups}_d{d}"
    elif site.rows is not None:
        name = f"masked_attention_d{d}"
    else:
        name = f"attention_g{groups}_d{d}"
    name += "_causal" if site.causal else ""
    keys = "CONTEXT" if cache else "S"
    # strides of keys and values read through their views: constants where they are, else arguments
    # (and of a query and a mask read through their views)
    texts: list[tuple[str, str]] = []
    if site.q_strided is not None:
        texts += zip(("Q_OFFSET", "Q_B", "Q_H", "Q_T"), site.q_strided)
    if site.strided is not None:
        texts += zip(
            ("K_OFFSET", "K_B", "K_H", "K_N", "V_OFFSET", "V_B", "V_H", "V_N"),
            (*site.strided.k_at, *site.strided.v_at),
        )
    if site.mask is not None:
        texts += zip(MASK_STRIDES, site.mask_at)
    stride_consts: dict[str, int] = {}
    stride_params: list[KernelParam] = []
    stride_args: list[Sym] = []
    stride: dict[str, str] = {}
    for const, text in texts:
        if text.lstrip("-").isdigit():
            stride_consts[const] = int(text)
            stride[const] = const
        else:
            stride_params.append(KernelParam(const.lower(), ParamKind("i32"), ""))
            stride_args.append(Sym(text))
            stride[const] = const.lower()
    q_at = (
        "q_at = b * T * Q_BATCH_T + t * Q_TOKEN + h * (Q_HEAD + T * Q_HEAD_T) + Q_COLUMN"
        if site.q_strided is None
        else f"q_at = {stride['Q_OFFSET']} + b * {stride['Q_B']} + h * {stride['Q_H']} + t * {stride['Q_T']}"
    )
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
        q_at,
        f"q = tl.load(q_ptr + q_at[:, None] + rd[None, :], mask=valid_r[:, None]{mask_d}, other=0.0)",
        *(
            ["kv = (b * KV_HEADS + kh) * CONTEXT * HEAD_DIM  # the cache's rows of this KV head"]
            if cache
            else []
        ),
        # a finite floor below every score (a clamped one too): a block whose keys are all masked adds 0
        "m_i = tl.full((BLOCK_M,), -3.0e30, dtype=tl.float32)",
        "l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)",
        "acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)",
        # causal: no key past the block's last query (top-left aligned, as SDPA's is_causal)
        f"hi = tl.minimum({keys}, ((tl.program_id(1).to(tl.int64) + 1) * BLOCK_M - 1) // GROUPS + 1)"
        if site.causal
        else f"hi = {keys}",
        "for start in range(0, hi, BLOCK_N):",
        "    rn = start + tl.arange(0, BLOCK_N)",
        f"    valid_n = rn < {keys}",
    ]
    if cache:
        body += ["    k_at = kv + rn * HEAD_DIM", "    v_at = k_at"]
    elif site.rows is not None:
        body += [
            "    k_at = (b * S + rn) * K_WIDTH + K_COLUMN + kh * HEAD_DIM  # a head view of the projection's rows",
            "    v_at = (b * S + rn) * V_WIDTH + V_COLUMN + kh * HEAD_DIM",
        ]
    else:
        body += [
            f"    k_at = {stride['K_OFFSET']} + b * {stride['K_B']} + kh * {stride['K_H']} + rn * {stride['K_N']}",
            f"    v_at = {stride['V_OFFSET']} + b * {stride['V_B']} + kh * {stride['V_H']} + rn * {stride['V_N']}",
        ]
    body += [
        f"    k = tl.load(k_ptr + k_at[None, :] + rd[:, None], mask=valid_n[None, :]{mask_dk}, other=0.0)",
        f"    v = tl.load(v_ptr + v_at[:, None] + rd[None, :], mask=valid_n[:, None]{mask_d}, other=0.0)",
        "    keep = valid_r[:, None] & valid_n[None, :]",
    ]
    if site.causal:
        body.append("    keep = keep & (rn[None, :] <= t[:, None])")
    bool_mask = site.mask is not None and site.mask_dtype == "bool"
    if site.mask is not None:
        o, mb, mh, mt, mn = (stride[c] for c in MASK_STRIDES)
        body.append(f"    m_at = {o} + b * {mb} + h[:, None] * {mh} + t[:, None] * {mt} + rn[None, :] * {mn}")
    if site.mask is not None and not bool_mask:
        # an additive mask is added in natural units; its most negative values (the dtype's
        # minimum) clamp to a finite floor, so that a row masked so everywhere averages its values
        # as SDPA does, while -inf stays -inf (such a row comes out 0, as SDPA's does)
        body += [
            f"    s = tl.dot(q, k{precision}) * SCALE",
            "    s = s + tl.load(mask_ptr + m_at, mask=keep, other=0.0).to(tl.float32)",
            "    s = tl.where(s == float('-inf'), s, tl.maximum(s, -1.0e30)) * LOG2E  # scores in log2 units",
        ]
    else:
        body.append(f"    s = tl.dot(q, k{precision}) * SCALE_LOG2E  # scores in log2 units")
    if bool_mask:
        body.append("    keep = keep & (tl.load(mask_ptr + m_at, mask=keep, other=0) != 0)")
    body += [
        "    s = tl.where(keep, s, float('-inf'))",
        *online_softmax_lines(precision, "    "),
        "acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no key to attend: 0, as SDPA",
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
        *([KernelParam("S", ParamKind("i32"), "")] if not cache else []),
        *stride_params,
    ]
    seq = ix.size_text(ix.parse_size(site.seq))
    args = (
        Buf(site.q),
        Buf(site.k),
        Buf(site.v),
        *([Buf(site.mask)] if site.mask is not None else []),
        Buf(site.out),
        Sym(seq),
        *([Sym(ix.size_text(ix.parse_size(site.rows[4])))] if site.rows is not None else []),
        *([Sym(ix.size_text(ix.parse_size(site.strided.keys)))] if site.strided is not None else []),
        *stride_args,
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
        **(
            dict(zip(("K_WIDTH", "K_COLUMN", "V_WIDTH", "V_COLUMN"), site.rows[:4]))
            if site.rows is not None
            else {}
        ),
        **stride_consts,
        "SCALE": repr(site.scale),
        "SCALE_LOG2E": repr(site.scale * LOG2E),
        "LOG2E": repr(LOG2E),
    }
    grid = (
        ix.size_text(ix.parse_size(site.batch) * site.kv_heads),
        f"({ix.size_text(ix.parse_size(site.seq) * groups)} + {BLOCK_M - 1})//{BLOCK_M}",
    )
    mask_doc = "no mask"
    if site.mask is not None:
        mask_doc = (
            f"mask {'bool (True: attend)' if bool_mask else 'additive'} broadcast to [B, H, T, S], element "
            f"(b, h, t, n) at offset, b, h, t, n strides {', '.join(site.mask_at)}"
        )
    if cache:
        kv_doc = f"k, v: the cache [B, {site.kv_heads}, {site.context}, {d}] row-major"
    elif site.rows is not None:
        kv_doc = f"k, v: head views of projection rows, S = {site.rows[4]} keys"
    else:
        kv_doc = (
            f"k, v: [B, {site.kv_heads}, S, {d}] views, S = {site.strided.keys}, element (b, kv head, n) at "
            f"offset, b, kv head, n strides {', '.join(site.strided.k_at)} (k) and {', '.join(site.strided.v_at)} (v)"
        )
    kv_doc += f", {groups} query heads per KV head"
    what = "a KV cache" if cache else "keys under a mask" if site.mask is not None else "keys"
    doc = [
        f"Attention over {what}: softmax(q k^T * {site.scale!r} + mask) v for T queries per row, online, fp32 accumulation"
        + (", causal (key n <= query t)." if site.causal else "."),
        "",
        f"q: [B, {site.heads}, T, {d}]; {kv_doc}; {mask_doc}; B = {site.batch}, T = {seq}, {site.dtype}.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, consts, name, signature, body)
    rows, t = ix.parse_size(site.batch), ix.parse_size(site.seq)
    elem = ITEMSIZE[site.dtype]
    n_keys = (
        sympy.Integer(site.context)
        if cache
        else ix.parse_size(site.rows[4] if site.rows is not None else site.strided.keys)
    )
    traffic = rows * (2 * site.kv_heads * n_keys * d + 2 * site.heads * t * d) * elem
    if site.mask is not None:  # each mask element once, over the dims it does not broadcast
        dims = (rows, sympy.Integer(site.heads), t, n_keys)
        read = [n for n, at in zip(dims, site.mask_at[1:]) if at != "0"]
        traffic += sympy.Mul(*read) * ITEMSIZE[site.mask_dtype]
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
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, "cache attention", "SDPA stays"
    )
    ids, failed = built.ids, built.failed
    at = {s.step: (s, kid, r) for s, kid, r in zip(sites, ids, rendered) if kid not in failed}
    steps: list[Step | None] = list(program.steps)
    for i, (site, kid, r) in at.items():
        steps[i] = kernel_step(kid, r, (program.steps[i], *(program.steps[j] for j in site.heads_apart)))
        for j in site.heads_apart:
            steps[j] = None
    if at:
        say(
            f"  {len(at)} SDPA calls (over a KV cache, masked or over strided operands) run as attention kernels"
        )
    return built.program_with(program, steps), built.cubins
