"""Decode attention: one query token per row against a KV cache, as one Triton kernel.

A decode step's SDPA call (``aot.hf.causal_lm``'s ``decode`` entry: one new token per row)
reads a query of one position per head and the whole static cache of its layer, under the
mask the wrapper builds. The library runs it as a flash kernel tiled for long queries
(cuDNN's took ~10 us per layer on an H200 for a 512-slot cache, work that moves ~1 MB). This
pass finds such calls by their shapes and operands, not by model, and replaces each with one
kernel step of its own (the SDPA step its reference, what the CPU runs):

- a *site* is ``scaled_dot_product_attention(q, k, v, mask)`` without dropout, not causal, whose
  query ``q`` is ``[B, H, 1, D]`` (a buffer a kernel wrote, or a head view of a projection's rows
  as ``aot.codegen.flash`` reads them) or, grouped-query heads folded into rows
  (``aot.codegen.attention.fold_gqa_repeats``), ``[B, KV, G, D]`` viewing such a query; whose
  ``k`` and ``v`` are ``[B, H, C, D]`` views of a row-major ``[B, KV, C, D]`` cache (full slices;
  grouped-query heads by ``unsqueeze`` / ``expand`` / ``view``, ``H = KV * G``) with a static
  ``C`` of at most ``MAX_CONTEXT``; and whose mask (or none) is a ``[B or 1, 1, 1, C]`` view of a
  row-major buffer, additive or boolean (True: attend);
- the kernel runs one program per (row, KV head): the ``G`` query heads sharing that KV head are
  the rows of one tile (padded to 16 for the tensor cores), so every cache element is read once;
  keys and values stream in blocks of up to 256 slots with the softmax computed online in fp32.
  The running maximum starts at a finite floor, so a block whose slots are all masked (left
  padding) adds nothing rather than NaN;
- where the cache a site reads is the result of this step's ``index_put_`` of one slot into the
  program's state (``cache[:, :, pos] = new``, ``pos`` a one-element input, the new keys and
  values a buffer a kernel wrote or a head view of a projection's rows), and nothing reads that
  state in between, the kernel also does the write (``Append``): each program stores its row's
  and KV head's new key and value at slot ``pos`` and uses them from registers at that slot, so
  the two ``index_put_`` launches of a layer go. The kernel step writes the state in place
  (``Step.in_place``); its reference holds the writes, the views between and the SDPA step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.cache_writes import INDEX_PUT, write_args
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.render import Rendered, compile_site_kernels
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import VIEW_OPS, readers_of, step_reads, step_writes, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym

SDPA = "aten.scaled_dot_product_attention.default"
HEURISTIC = "decode-attention-v1"
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
MAX_BLOCK_N = 256  # cache slots per step of the loop
# One program per row and KV head walks the whole cache: measured at 160 and 512 slots (H200). A
# longer cache at batch 1 would leave a few programs looping long where the library splits the
# keys across blocks; until a split-KV form is measured, longer caches keep SDPA.
MAX_CONTEXT = 1024
WIDE_TILE = 128 * 64  # key tile (slots x head dim) from which a program gets 8 warps, else 4
NUM_STAGES = 2  # the next block's keys and values load while this one's softmax runs
FULL_END = 2**62  # a slice's end at or past this is "to the end"
LOG2E = 1.4426950408889634


POSITION_DTYPES = ("int64", "int32")


@dataclass(frozen=True)
class NewRows:
    """Where a step's new keys or values are: row b's KV head h at ``b * batch_stride + column +
    h * head_dim`` of ``base`` (a ``[B, KV, 1, D]`` buffer, or a projection's rows)."""

    base: str
    batch_stride: int
    column: int


@dataclass(frozen=True)
class Append:
    """A site's cache writes folded into its kernel: ``index_put_(state, [None, None, pos], new)``
    for the keys and the values, steps ``k_write`` and ``v_write``, whose results the SDPA call
    reads (through views)."""

    k_state: str
    v_state: str
    pos: str  # one element: the slot written
    pos_dtype: str
    k_new: NewRows
    v_new: NewRows
    k_write: int
    v_write: int
    k_result: str
    v_result: str


@dataclass(frozen=True)
class DecodeSite:
    """One SDPA call of a decode step: its step, operands (base buffers), sizes and layout."""

    step: int
    q: str
    q_batch_stride: int  # elements between rows' queries; head h's at h * D (+ q_column)
    q_column: int
    k: str  # [B, KV, C, D] row-major
    v: str
    mask: str | None  # [B or 1, C] row-major: additive (mask_dtype the operands'), or bool (True: attend)
    mask_batch_stride: int  # C, or 0 for one mask row shared by every row
    out: str  # [B, H, 1, D] row-major
    batch: str  # size text
    heads: int
    kv_heads: int
    context: int
    head_dim: int
    scale: float
    dtype: str
    mask_dtype: str = ""  # the operands' dtype when empty
    append: Append | None = None


class _Program:
    def __init__(self, program: Program):
        self.steps = program.steps
        self.specs = tensor_specs(program)
        self.producer: dict[str, int] = {}
        for i, s in enumerate(program.steps):
            for o in s.outputs:
                if o is not None:
                    self.producer[o] = i

    def shape(self, name: str) -> tuple[str, ...] | None:
        spec = self.specs.get(name)
        return None if spec is None else spec.shape

    def view_step(self, name: str) -> Step | None:
        i = self.producer.get(name)
        if i is None:
            return None
        s = self.steps[i]
        return s if s.kind == StepKind.ATEN and s.target in VIEW_OPS else None

    def materialized(self, name: str) -> bool:
        """``name`` is memory of its own, row-major: an input, or what a computing step wrote
        (a state write's result is its state, which is row-major)."""
        spec = self.specs.get(name)
        return spec is not None and not spec.order and self.view_step(name) is None

    def through_full_slices(self, name: str) -> str:
        """Back through ``slice(x, dim, 0, end-or-more)`` steps, which view all of ``x``."""
        while (s := self.view_step(name)) is not None and s.target == "aten.slice.Tensor":
            args = list(s.args) + [None] * 5
            src, dim, start, end, step = args[:5]
            shape = self.shape(src.name) if isinstance(src, Buf) else None
            size = (
                shape[dim]
                if shape is not None and type(dim) is int and -len(shape) <= dim < len(shape)
                else None
            )
            if s.kwargs or start not in (0, None) or step not in (1, None) or size is None:
                break
            if not (end is None or (type(end) is int and (end >= FULL_END or str(end) == size))):
                break
            name = src.name
        return name

    def cache(self, name: str, batch: str, heads: int, head_dim: int) -> tuple[str, int, str] | None:
        """(the [B, KV, C, D] row-major buffer ``name`` views, KV, C) where ``name`` is
        ``[B, H, C, D]`` whose head h reads KV head ``h // (H // KV)``."""
        shape = self.shape(name)
        if shape is None or len(shape) != 4:
            return None
        context = shape[2]
        name = self.through_full_slices(name)
        s = self.view_step(name)
        if s is not None and s.target in (
            "aten.view.default",
            "aten.reshape.default",
            "aten._unsafe_view.default",
        ):
            # grouped-query: view(expand(unsqueeze(cache, 2), [B, KV, G, C, D]), [B, KV*G, C, D])
            expanded = s.args[0].name if isinstance(s.args[0], Buf) else None
            copied = self.producer.get(expanded) if expanded else None
            if copied is not None and self.steps[copied].target == "aten.clone.default":  # repeat_kv's copy
                src = self.steps[copied].args[0] if self.steps[copied].args else None
                expanded = (
                    src.name if isinstance(src, Buf) and self.steps[copied].kind == StepKind.ATEN else None
                )
            e = self.view_step(expanded) if expanded else None
            if e is None or e.target != "aten.expand.default":
                return None
            u = self.view_step(e.args[0].name) if isinstance(e.args[0], Buf) else None
            if u is None or u.target != "aten.unsqueeze.default" or u.args[1] != 2:
                return None
            name = self.through_full_slices(u.args[0].name)
        base = self.shape(name)
        if base is None or len(base) != 4 or not self.materialized(name):
            return None
        kv = int(base[1]) if base[1].isdigit() else 0
        if (
            not kv
            or heads % kv
            or base[2] != context
            or base[3] != str(head_dim)
            or not ix.same(ix.parse_size(base[0]), ix.parse_size(batch))
        ):
            return None
        return name, kv, context

    def write_of(self, name: str, batch: str, kv: int, head_dim: int, dtype: str, rows: Any) -> tuple | None:
        """(step, state, pos, new rows) where ``name`` is the result of ``index_put_(state, [None,
        None, pos], new)`` or ``index_copy_(state, 2, pos, new)``: one slot of a ``[B, KV, C, D]`` state, ``new`` of ``[B, KV, 1, D]``
        (``rows``: an ``aot.codegen.flash`` finder of head views of a projection's rows)."""
        i = self.producer.get(name)
        s = self.steps[i] if i is not None else None
        parsed = write_args(s) if s is not None and s.kind == StepKind.ATEN else None
        if parsed is None or parsed[1] % 4 != 2:  # one slot index along the cache's slot dim
            return None
        state, _, slot, new = parsed
        pos = slot.name
        pos_spec = self.specs.get(pos)
        if pos_spec is None or pos_spec.shape != ("1",) or pos_spec.dtype not in POSITION_DTYPES:
            return None
        if self.shape(state.name) != self.shape(name) or self.specs[state.name].dtype != dtype:
            return None
        new_spec = self.specs.get(new.name)
        if (
            new_spec is None
            or new_spec.dtype != dtype
            or self.shape(new.name) != (batch, str(kv), "1", str(head_dim))
        ):
            return None
        if self.materialized(new.name):
            at = NewRows(new.name, kv * head_dim, 0)
        else:
            found = rows.operand(new.name, dtype)
            if found is None or found[2] != "1" or found[3] != kv or found[4] != head_dim:
                return None
            at = NewRows(found[0].base, found[0].width, found[0].column)
        return i, state.name, pos, pos_spec.dtype, at

    def mask(self, name: str, batch: str, context: int) -> tuple[str, int] | None:
        """(the row-major buffer an additive ``[B or 1, 1, 1, C]`` mask views, its batch stride)."""
        while (s := self.view_step(name)) is not None and s.target in (
            "aten.unsqueeze.default",
            "aten.slice.Tensor",
        ):
            if s.target == "aten.slice.Tensor" and self.through_full_slices(name) == name:
                return None
            if s.target == "aten.unsqueeze.default" and s.args[1] not in (1, 2, -3):
                return None
            name = s.args[0].name
        shape = self.shape(name)
        if shape is None or not self.materialized(name):
            return None
        numel = ix.numel(tuple(ix.parse_size(d) for d in shape))
        if ix.same(numel, ix.parse_size(batch) * context):
            return name, context
        if ix.same(numel, sympy.Integer(context)):
            return name, 0
        return None


def _sdpa_args(step: Step):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    given = dict(zip(names, step.args))
    if len(step.args) > len(names) or set(step.kwargs) & set(given):
        return None
    given.update(step.kwargs)
    if set(given) - {*names, "scale", "enable_gqa"}:
        return None
    if given.get("dropout_p", 0.0) != 0 or given.get("is_causal", False) is not False:
        return None
    scale = given.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        return None
    q, k, v, m = (given.get(n) for n in names[:4])
    return q, k, v, m, scale, given.get("enable_gqa", False) is not False


def find_decode_sites(program: Program, fold_writes: bool = True) -> list[DecodeSite]:
    """The SDPA calls of ``program`` the decode kernel can stand for (see the module docstring);
    ``fold_writes``: with the cache writes each could fold in (``DecodeSite.append``)."""
    from aot.codegen.flash import _Finder

    p = _Program(program)
    flash = None
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != SDPA or len(step.outputs) != 1:
            continue
        parsed = _sdpa_args(step)
        if parsed is None:
            continue
        q, k, v, m, scale, enable_gqa = parsed
        if not all(isinstance(x, Buf) for x in (q, k, v)) or not (m is None or isinstance(m, Buf)):
            continue
        qs, out, spec = p.shape(q.name), step.outputs[0], p.specs.get(q.name)
        if qs is None or len(qs) != 4 or not all(d.isdigit() for d in qs[1:]) or enable_gqa:
            continue
        # [B, Hq, L, D]: one query per head (L == 1), or the L query heads sharing a KV head as
        # rows (a grouped-query fold, aot.codegen.attention.fold_gqa_repeats)
        batch, q_heads, rows, head_dim, dtype = qs[0], int(qs[1]), int(qs[2]), int(qs[3]), spec.dtype
        heads = q_heads * rows
        if dtype not in FLOAT_DTYPES or head_dim > MAX_HEAD_DIM or p.shape(out) != qs:
            continue
        if any(x.name not in p.specs or len(p.shape(x.name)) != 4 for x in (k, v)) or out not in p.specs:
            continue
        if any(p.specs[x.name].dtype != dtype or p.shape(x.name)[1] != qs[1] for x in (k, v)):
            continue  # SDPA pairs query head i with key head i
        if p.specs[out].dtype != dtype or p.specs[out].order:
            continue
        if p.materialized(q.name):
            q_base, q_stride, q_column = q.name, heads * head_dim, 0
        elif rows > 1:  # the fold: a view of the [B, H, 1, D] queries a kernel wrote
            viewed = p.view_step(q.name)
            if viewed is None or viewed.target != "aten.view.default" or not isinstance(viewed.args[0], Buf):
                continue
            src = viewed.args[0]
            if p.shape(src.name) != (batch, str(heads), "1", str(head_dim)):
                continue
            if p.materialized(src.name):
                q_base, q_stride, q_column = src.name, heads * head_dim, 0
            else:  # the fold over a head view of a projection's rows
                flash = flash or _Finder(program)
                found = flash.operand(src.name, dtype)
                if found is None or found[2] != "1" or found[3] != heads or found[4] != head_dim:
                    continue
                q_base, q_stride, q_column = found[0].base, found[0].width, found[0].column
        else:  # a head view of a projection's rows (GPT-2's fused QKV)
            flash = flash or _Finder(program)
            found = flash.operand(q.name, dtype)
            if found is None or found[2] != "1" or found[3] != heads or found[4] != head_dim:
                continue
            q_base, q_stride, q_column = found[0].base, found[0].width, found[0].column
        kc, vc = p.cache(k.name, batch, heads, head_dim), p.cache(v.name, batch, heads, head_dim)
        if kc is None or vc is None or kc[1:] != vc[1:] or not kc[2].isdigit():
            continue
        context = int(kc[2])
        if context > MAX_CONTEXT:
            continue
        mask, mask_stride, mask_dtype = None, 0, dtype
        if m is not None:
            ms = p.shape(m.name)
            if (
                ms is None
                or p.specs[m.name].dtype not in (dtype, "bool")
                or ms[1:] != ("1", "1", str(context))
            ):
                continue  # one mask row per batch row (additive, or True = attend), for every head and query row
            found_mask = p.mask(m.name, batch, context)
            if found_mask is None:
                continue
            mask, mask_stride = found_mask
            mask_dtype = p.specs[m.name].dtype
        append = None
        if fold_writes:
            flash = flash or _Finder(program)
            kw = p.write_of(kc[0], batch, kc[1], head_dim, dtype, flash)
            vw = p.write_of(vc[0], batch, kc[1], head_dim, dtype, flash)
            if kw is not None and vw is not None and kw[2] == vw[2] and kw[1] != vw[1]:
                append = Append(
                    k_state=kw[1],
                    v_state=vw[1],
                    pos=kw[2],
                    pos_dtype=kw[3],
                    k_new=kw[4],
                    v_new=vw[4],
                    k_write=kw[0],
                    v_write=vw[0],
                    k_result=kc[0],
                    v_result=vc[0],
                )
        sites.append(
            DecodeSite(
                step=i,
                q=q_base,
                q_batch_stride=q_stride,
                q_column=q_column,
                k=kc[0],
                v=vc[0],
                mask=mask,
                mask_batch_stride=mask_stride,
                mask_dtype=mask_dtype,
                out=out,
                batch=batch,
                heads=heads,
                kv_heads=kc[1],
                context=context,
                head_dim=head_dim,
                scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
                dtype=dtype,
                append=append,
            )
        )
    return sites


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def render_decode_attention(site: DecodeSite) -> Rendered:
    """The kernel of one site: grid (B * KV,), one program per row and KV head."""
    d, groups = site.head_dim, site.heads // site.kv_heads
    bd, bg = max(16, _pow2(d)), max(16, _pow2(groups))
    bn = min(MAX_BLOCK_N, max(16, _pow2(site.context)))
    num_warps = 8 if bn * bd >= WIDE_TILE else 4
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    a = site.append
    name = f"decode_attention{'_append' if a else ''}_g{groups}_d{d}"
    mask_d = "" if bd == d else " & (rd < HEAD_DIM)[None, :]"
    mask_dk = "" if bd == d else " & (rd < HEAD_DIM)[:, None]"
    head_mask = "" if bd == d else ", mask=rd < HEAD_DIM, other=0.0"
    body = [
        "pid = tl.program_id(0).to(tl.int64)",
        "b = pid // KV_HEADS",
        "kh = pid % KV_HEADS",
        "rg = tl.arange(0, BLOCK_G)  # the query heads kh * GROUPS + rg sharing this KV head",
        "rd = tl.arange(0, BLOCK_D)",
        "valid_g = rg < GROUPS",
        "h = kh * GROUPS + rg",
        f"q = tl.load(q_ptr + b * Q_BATCH + Q_COLUMN + h[:, None] * HEAD_DIM + rd[None, :], mask=valid_g[:, None]{mask_d}, other=0.0)",
        "cache = (b * KV_HEADS + kh) * CONTEXT * HEAD_DIM",
        "m_i = tl.full((BLOCK_G,), -1.0e30, dtype=tl.float32)  # finite: an all-masked block adds 0",
        "l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)",
        "acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)",
    ]
    if a:  # this step's key and value into slot pos; the loop takes them from registers there
        body += [
            "pos = tl.load(pos_ptr).to(tl.int64)",
            "pos = tl.where(pos < 0, pos + CONTEXT, pos)  # as index_put_ counts a negative slot",
            f"kn = tl.load(kn_ptr + b * KN_BATCH + KN_COLUMN + kh * HEAD_DIM + rd{head_mask})",
            f"vn = tl.load(vn_ptr + b * VN_BATCH + VN_COLUMN + kh * HEAD_DIM + rd{head_mask})",
            "slot = rd * 0 + pos  # the position per lane: a mask of the block's shape",
            "put = (rd < HEAD_DIM) & (slot >= 0) & (slot < CONTEXT)  # the loader checks pos; never out of the cache",
            "tl.store(k_ptr + cache + pos * HEAD_DIM + rd, kn, mask=put)",
            "tl.store(v_ptr + cache + pos * HEAD_DIM + rd, vn, mask=put)",
        ]
    body += [
        "for start in range(0, CONTEXT, BLOCK_N):",
        "    rn = start + tl.arange(0, BLOCK_N)",
        "    valid_n = rn < CONTEXT",
        f"    k = tl.load(k_ptr + cache + rn[None, :] * HEAD_DIM + rd[:, None], mask=valid_n[None, :]{mask_dk}, other=0.0)",
        f"    v = tl.load(v_ptr + cache + rn[:, None] * HEAD_DIM + rd[None, :], mask=valid_n[:, None]{mask_d}, other=0.0)",
    ]
    if a:
        body += [
            "    k = tl.where((rn == pos)[None, :], kn[:, None], k)",
            "    v = tl.where((rn == pos)[:, None], vn[None, :], v)",
        ]
    body += [
        f"    s = tl.dot(q, k{precision}) * SCALE_LOG2E  # scores in log2 units",
    ]
    bool_mask = site.mask is not None and site.mask_dtype == "bool"
    if bool_mask:
        body.append(
            "    keep = valid_n & (tl.load(mask_ptr + b * MASK_BATCH + rn, mask=valid_n, other=0) != 0)"
        )
    else:
        body.append("    keep = valid_n")
        if site.mask is not None:
            body.append(
                "    s = s + tl.load(mask_ptr + b * MASK_BATCH + rn, mask=valid_n, other=0.0).to(tl.float32)[None, :] * LOG2E"
            )
    body += [
        "    s = tl.where(keep[None, :], s, float('-inf'))",
        "    m_new = tl.maximum(m_i, tl.max(s, 1))",
        "    alpha = tl.exp2(m_i - m_new)",
        "    p = tl.exp2(s - m_new[:, None])",
        "    l_i = l_i * alpha + tl.sum(p, 1)",
        f"    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v{precision})",
        "    m_i = m_new",
        "acc = acc / l_i[:, None]",
        f"tl.store(out_ptr + (b * HEADS + h[:, None]) * HEAD_DIM + rd[None, :], acc.to({tl_dtype}), mask=valid_g[:, None]{mask_d})",
    ]
    params = [
        KernelParam("q_ptr", ParamKind.PTR, site.dtype),
        KernelParam("k_ptr", ParamKind.PTR, site.dtype),
        KernelParam("v_ptr", ParamKind.PTR, site.dtype),
        *(
            [
                KernelParam("kn_ptr", ParamKind.PTR, site.dtype),
                KernelParam("vn_ptr", ParamKind.PTR, site.dtype),
                KernelParam("pos_ptr", ParamKind.PTR, a.pos_dtype),
            ]
            if a
            else []
        ),
        *(
            [KernelParam("mask_ptr", ParamKind.PTR, site.mask_dtype or site.dtype)]
            if site.mask is not None
            else []
        ),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        KernelParam("B", ParamKind("i32"), ""),
    ]
    batch = ix.size_text(ix.parse_size(site.batch))
    args = (
        Buf(site.q),
        *(
            (Buf(a.k_state), Buf(a.v_state), Buf(a.k_new.base), Buf(a.v_new.base), Buf(a.pos))
            if a
            else (Buf(site.k), Buf(site.v))
        ),
        *([Buf(site.mask)] if site.mask is not None else []),
        Buf(site.out),
        Sym(batch),
    )
    signature = signature_of(params, "i32")
    consts = {
        "BLOCK_G": bg,
        "BLOCK_N": bn,
        "BLOCK_D": bd,
        "GROUPS": groups,
        "HEADS": site.heads,
        "KV_HEADS": site.kv_heads,
        "HEAD_DIM": d,
        "CONTEXT": site.context,
        "Q_BATCH": site.q_batch_stride,
        "Q_COLUMN": site.q_column,
        "MASK_BATCH": site.mask_batch_stride,
        "SCALE_LOG2E": repr(site.scale * LOG2E),
        "LOG2E": repr(LOG2E),
    }
    if a:
        consts.update(
            KN_BATCH=a.k_new.batch_stride,
            KN_COLUMN=a.k_new.column,
            VN_BATCH=a.v_new.batch_stride,
            VN_COLUMN=a.v_new.column,
        )
    grid = (ix.size_text(ix.parse_size(site.batch) * site.kv_heads),)
    mask_doc = ""
    if site.mask is not None:
        mask_doc = f"mask: {'bool (True: attend)' if bool_mask else 'additive'} [B or 1, C] rows; "
    doc = [
        f"Decode attention: softmax(q k^T * {site.scale!r} + mask) v for one query per row, online, fp32 accumulation.",
        "",
        f"q: [B, {site.heads}, 1, {d}] (row b at b * {site.q_batch_stride} + {site.q_column}); k, v: the cache,",
        f"[B, {site.kv_heads}, {site.context}, {d}] row-major, {groups} query heads per KV head; "
        + mask_doc
        + f"B = {batch}, {site.dtype}.",
        f"grid: ({', '.join(grid)},)",
    ]
    if a:
        doc[-1:-1] = [
            f"First writes this step's keys and values (rows at b * {a.k_new.batch_stride} + {a.k_new.column} and "
            f"b * {a.v_new.batch_stride} + {a.v_new.column}) into slot pos of the cache, in place.",
        ]
    source = kernel_module(doc, consts, name, signature, body)
    elem = ITEMSIZE[site.dtype]
    rows = ix.parse_size(site.batch)
    traffic = rows * (2 * site.kv_heads * site.context * d + 2 * site.heads * d + site.context) * elem
    if a:
        traffic += rows * 4 * site.kv_heads * d * elem  # the new keys and values, read and written
    config = {
        "kind": "decode_attention",
        "BLOCK_G": bg,
        "BLOCK_N": bn,
        "BLOCK_D": bd,
        "heuristic": HEURISTIC,
        "num_warps": num_warps,
        "num_stages": NUM_STAGES,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=args,
        outputs=(site.out, *((a.k_result, a.v_result) if a else ())),
        grid=grid,
        num_warps=num_warps,
        num_stages=NUM_STAGES,
        config=config,
        ops=(*((INDEX_PUT,) if a else ()), SDPA),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def folded_steps(program: Program, site: DecodeSite) -> tuple[int, ...] | None:
    """The steps the kernel of ``site`` stands for beside the SDPA step, where it folds in the
    cache writes (``site.append``): the two writes and the views of their results that only lead
    to the SDPA call; None where another step between the writes and the SDPA step reads the
    state or what was written (moving the writes to the SDPA step would change what it reads)."""
    a = site.append
    if a is None:
        return None
    folded = {a.k_write, a.v_write}
    written = {a.k_result, a.v_result}
    for i in range(min(folded), site.step):
        if i in folded:
            continue
        step = program.steps[i]
        reads = set(step_reads(step))
        if reads & {a.k_state, a.v_state}:
            return None
        if reads & written:
            if step.kind != StepKind.ATEN or step.target not in VIEW_OPS:
                return None
            folded.add(i)
            written.update(step_writes(step))
    readers = readers_of(program.steps)
    for name in written - {a.k_result, a.v_result}:  # the folded views: read by nothing else
        if name in program.outputs or any(r not in folded and r != site.step for r in readers.get(name, ())):
            return None
    return tuple(sorted(folded))


def decode_attention_kernels(
    program: Program,
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each decode SDPA site run by its kernel (the SDPA step its reference);
    a site whose kernel fails to compile stays the library call."""
    sites = find_decode_sites(program)
    if not sites:
        return program, {}
    folds = [folded_steps(program, site) for site in sites]
    sites = [site if fold is not None else replace(site, append=None) for site, fold in zip(sites, folds)]
    rendered = [render_decode_attention(s) for s in sites]
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, "decode attention", "SDPA stays"
    )
    ids, failed = built.ids, built.failed
    at = {
        s.step: (s, fold, kid, r) for s, fold, kid, r in zip(sites, folds, ids, rendered) if kid not in failed
    }
    steps: list[Step | None] = list(program.steps)
    appended = 0
    for i, (site, fold, kid, r) in at.items():
        a = site.append
        reference = (program.steps[i],)
        if a is not None:
            reference = (*(program.steps[j] for j in fold), program.steps[i])
            for j in fold:
                steps[j] = None
            appended += 1
        steps[i] = Step(
            kind=StepKind.KERNEL,
            target=kid,
            args=r.args,
            kwargs={},
            outputs=r.outputs,
            grid=r.grid,
            reference=reference,
            in_place={a.k_result: a.k_state, a.v_result: a.v_state} if a is not None else {},
        )
    if at:
        also = (
            f", {appended} of them writing the step's keys and values into the cache too" if appended else ""
        )
        say(f"  {len(at)} one-token SDPA calls over a KV cache run as decode attention kernels{also}")
    return built.program_with(program, steps), built.cubins
