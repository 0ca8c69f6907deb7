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
  (``Step.in_place``); its reference holds the writes, the views between and the SDPA step;
- where the queries, or the new keys it appends, are what a kernel wrote computing rotary position
  embedding (``rotary_of``: ``x * cos + cat(-x2, x1) * sin`` over the first R elements of each head
  of a projection's rows, the rest of the head as it is; ``cos``/``sin`` ``[B or 1, 1, R]``
  buffers of the step's positions), and nothing else reads what that kernel wrote, the attention
  kernel loads the un-rotated rows and the step's cos/sin and rotates them in registers, so the
  two RoPE launches of a layer go too (their steps join the reference). Each product and the sum
  are rounded to the operands' dtype as the library rounds them, so for float16 and bfloat16 the
  keys the cache keeps are eager's own bits (float32: the GPU may fuse a product and the sum into
  one FMA, as every kernel of the build may). The rows may hold each head's q, k and v side by
  side (GPT-NeoX: ``Rotary.head_stride``). Other forms (GPT-J's interleaved pairs, a per-head norm
  fused into the RoPE kernel, as Qwen3's) keep their RoPE kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.cache_writes import INDEX_PUT, Strided, strided_view, write_args
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.render import Rendered, compile_site_kernels
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.errors import counted
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
class Rotary:
    """Rotary position embedding that the kernel applies to rows it loads, as the step
    ``step`` (a kernel, its reference ``x * cos + cat(-x2, x1) * sin`` over the first ``dim``
    elements of each head, ``x1``/``x2`` their halves, the rest of the head as it is) computed
    ``result``: the kernel reads the un-rotated rows at ``rows`` and ``cos``/``sin`` (row b's at
    ``b * batch_stride``) instead, each product and the sum rounded to the operands' dtype as the
    library rounds them."""

    rows: NewRows
    cos: str
    sin: str
    batch_stride: int  # elements between rows' cos (and sin) values; 0: one row shared
    dim: int  # the rotated elements of a head (even, at most the head dim)
    step: int
    result: str
    head_stride: int = 0  # elements between heads of ``rows``; 0: the head dim (heads side by side)


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
    k_rotary: Rotary | None = None  # the new keys: rotated from the projection's rows in the kernel


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
    q_rotary: Rotary | None = None  # the queries: rotated from the projection's rows in the kernel


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


def _last_dim(dim: Any, rank: int) -> bool:
    return type(dim) is int and dim % rank == rank - 1


def _head_rows(view: Strided | None, batch: str, heads: int, width: int) -> tuple[NewRows, int] | None:
    """(where row b's head 0 is, the stride between heads) where ``view`` is a ``[B, heads, 1,
    width]`` view with unit element stride (None otherwise)."""
    if view is None or len(view.shape) != 4 or not all(isinstance(x, sympy.Integer) for x in view.strides):
        return None
    if not isinstance(view.offset, sympy.Integer) or not ix.same(view.shape[0], ix.parse_size(batch)):
        return None
    if not (ix.same(view.shape[1], heads) and ix.same(view.shape[2], 1) and ix.same(view.shape[3], width)):
        return None
    stride_b, stride_h, _, stride_d = (int(x) for x in view.strides)
    if stride_d != 1 or (heads > 1 and stride_h < 1) or stride_b < 0:
        return None
    return NewRows(view.base, stride_b, int(view.offset)), stride_h


def rotary_of(
    program: Program, p: _Program, name: str, batch: str, heads: int, head_dim: int, dtype: str
) -> Rotary | None:
    """The rotary embedding a kernel applies where ``name`` (``[B, heads, 1, head_dim]``, row-major) is
    what a kernel step wrote computing rotary position embedding, Llama's or GPT-NeoX's form:
    ``x * cos + cat(-x[..., R/2:], x[..., :R/2]) * sin`` of a head view ``x`` of a projection's rows,
    ``cos`` and ``sin`` ``[B or 1, 1, 1, R]`` views of buffers of their own, all of ``dtype``; where
    ``R`` is less than the head dim, ``cat(that, the rest of the head)``. None for any other form
    (GPT-J's interleaved pairs among them): the kernel that computes it stays."""
    i = p.producer.get(name)
    if i is None or p.steps[i].kind != StepKind.KERNEL or not p.steps[i].reference:
        return None
    kernel_step = p.steps[i]
    local = {o: r for r in kernel_step.reference for o in r.outputs if o is not None}

    def made(n: Any, target: str) -> Step | None:
        s = local.get(n.name) if isinstance(n, Buf) else None
        return (
            s if s is not None and s.kind == StepKind.ATEN and s.target == target and not s.kwargs else None
        )

    specs = p.specs
    if any(specs.get(o) is None or specs[o].dtype != dtype for o in local):
        return None  # every intermediate in the operands' dtype (no upcast to float32 and back)
    rotated, rest = Buf(name), None
    top = made(rotated, "aten.cat.default")
    if top is not None:  # partial rotary: cat([rotated, rest of the head], -1)
        parts = top.args[0] if top.args else None
        if (
            len(top.args) != 2
            or not _last_dim(top.args[1], 4)
            or not isinstance(parts, list)
            or len(parts) != 2
        ):
            return None
        rotated, rest = parts
        if not isinstance(rest, Buf):
            return None
    add = made(rotated, "aten.add.Tensor")
    if add is None or len(add.args) != 2:
        return None
    muls = [made(a, "aten.mul.Tensor") for a in add.args]
    if any(m is None or len(m.args) != 2 for m in muls):
        return None
    # one product has the rotated halves, cat([-x2, x1], -1), as an operand
    with_cat = [[j for j, a in enumerate(m.args) if made(a, "aten.cat.default") is not None] for m in muls]
    if sorted(len(c) for c in with_cat) != [0, 1]:
        return None
    straight, turned = muls if with_cat[1] else muls[::-1]
    cats = with_cat[1] or with_cat[0]
    cat = made(turned.args[cats[0]], "aten.cat.default")
    sin = turned.args[1 - cats[0]]
    halves = cat.args[0] if cat.args else None
    if (
        len(cat.args) != 2
        or not _last_dim(cat.args[1], 4)
        or not isinstance(halves, list)
        or len(halves) != 2
    ):
        return None
    neg = made(halves[0], "aten.neg.default")
    second, first = (
        (made(neg.args[0], "aten.slice.Tensor") if neg else None),
        made(halves[1], "aten.slice.Tensor"),
    )
    if second is None or first is None or second.args[0] != first.args[0]:
        return None
    x = first.args[0]
    if not isinstance(x, Buf) or x not in straight.args or p.shape(x.name) is None:
        return None
    cos = straight.args[1 - straight.args.index(x)]
    dim = p.shape(x.name)[-1]
    if not dim.isdigit() or int(dim) % 2 or int(dim) > head_dim:
        return None
    dim, half = int(dim), int(dim) // 2
    first_args, second_args = list(first.args) + [None] * 3, list(second.args) + [None] * 3
    if not (_last_dim(first_args[1], 4) and first_args[2] in (0, None) and first_args[3] == half):
        return None
    end = second_args[3]
    if not (_last_dim(second_args[1], 4) and second_args[2] == half and type(end) is int):
        return None
    if not (end >= FULL_END or end == dim) or first_args[4] not in (1, None):
        return None
    if rest is not None and dim == head_dim and p.shape(rest.name) == (batch, str(heads), "1", "0"):
        rest = None  # the rest of the head is empty (Phi-3 slices it off at any rotary dim)
    if second_args[4] not in (1, None) or (rest is None) != (dim == head_dim):
        return None
    both = replace(program, steps=program.steps + kernel_step.reference)  # views inside the kernel too
    found = _head_rows(strided_view(x.name, both), batch, heads, dim)
    if found is None or found[0].base in local or not p.materialized(found[0].base):
        return None
    rows, head_stride = found
    if heads == 1 or head_stride == head_dim:
        head_stride = 0
    elif head_stride < head_dim:
        return None
    if rest is not None:  # the rest of each head: where the rotated part ends
        after = _head_rows(strided_view(rest.name, both), batch, heads, head_dim - dim)
        if (
            after is None
            or after[0] != replace(rows, column=rows.column + dim)
            or (heads > 1 and after[1] != (head_stride or head_dim))
        ):
            return None
    tables = []
    for t in (cos, sin):
        view = strided_view(t.name, both) if isinstance(t, Buf) else None
        if (
            view is None
            or view.base in local
            or not p.materialized(view.base)
            or specs[view.base].dtype != dtype
        ):
            return None
        if (
            len(view.shape) != 4
            or not all(ix.same(d, 1) for d in view.shape[1:3])
            or not ix.same(view.shape[3], dim)
        ):
            return None
        shared = ix.same(view.shape[0], 1) and not ix.same(ix.parse_size(batch), 1)
        if not shared and not ix.same(view.shape[0], ix.parse_size(batch)):
            return None
        if not isinstance(view.offset, sympy.Integer) or view.offset != 0 or not ix.same(view.strides[3], 1):
            return None
        stride_b = 0 if shared or ix.same(view.shape[0], 1) else view.strides[0]
        if not isinstance(stride_b, (int, sympy.Integer)):
            return None
        tables.append((view.base, int(stride_b)))
    if tables[0][1] != tables[1][1]:
        return None
    return Rotary(rows, tables[0][0], tables[1][0], tables[0][1], dim, i, name, head_stride)


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


def find_decode_sites(
    program: Program, fold_writes: bool = True, fold_rotary: bool = True
) -> list[DecodeSite]:
    """The SDPA calls of ``program`` the decode kernel can stand for (see the module docstring);
    ``fold_writes``: with the cache writes each could fold in (``DecodeSite.append``);
    ``fold_rotary``: with the rotary embeddings of its queries and new keys it could compute
    (``DecodeSite.q_rotary``, ``Append.k_rotary``)."""
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
        q_rotary = None
        if fold_rotary and q_column == 0 and q_stride == heads * head_dim and p.materialized(q_base):
            q_rotary = rotary_of(program, p, q_base, batch, heads, head_dim, dtype)
        if (
            fold_rotary
            and append is not None
            and append.k_new == NewRows(append.k_new.base, kc[1] * head_dim, 0)
        ):
            k_rotary = rotary_of(program, p, append.k_new.base, batch, kc[1], head_dim, dtype)
            append = replace(append, k_rotary=k_rotary)
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
                q_rotary=q_rotary,
            )
        )
    return sites


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rotation_lines(
    prefix: str, x: str, partner_load: str, lanes: str, tables: tuple[str, str, str], tl_dtype: str
) -> list[str]:
    """Kernel lines that rotate ``x`` (loaded un-rotated) as the library computes rotary embedding:
    ``x * cos + cat(-x2, x1) * sin`` over the first ``{PREFIX}_ROT`` elements of each head, each
    product and the sum rounded to the operands' dtype (``tl_dtype``), as the library rounds them
    (on an H200 some rotated keys still differed from the library's bits by a rounding: the GPU
    test holds them to the dtype's tolerance). ``partner_load``: the load of element
    ``{prefix}_partner`` of each head, where ``{prefix}_turn``; ``lanes``: the head dim's broadcast
    (``[None, :]`` in a tile of query heads)."""
    rot = f"{prefix.upper()}_ROT"
    cos_ptr, sin_ptr, batch = tables
    half = tl_dtype != "tl.float32"

    def rounded(e: str) -> str:  # the library's rounding of each op's result
        return f"({e}).to({tl_dtype}).to(tl.float32)" if half else f"({e})"

    return [
        f"{prefix}_turn = rd < {rot}  # the rotated elements of each head; the rest as loaded",
        f"{prefix}_partner = tl.where(rd < {rot} // 2, rd + {rot} // 2, rd - {rot} // 2)",
        f"{prefix}_cos = tl.load({cos_ptr} + b * {batch} + rd, mask={prefix}_turn, other=0.0).to(tl.float32)",
        f"{prefix}_sin = tl.load({sin_ptr} + b * {batch} + rd, mask={prefix}_turn, other=0.0).to(tl.float32)",
        f"{prefix}_sin = tl.where(rd < {rot} // 2, -{prefix}_sin, {prefix}_sin)  # cat(-x2, x1) * sin: the sign on sin, exactly",
        f"{prefix}_other = {partner_load}.to(tl.float32)",
        f"{prefix}_turned = "
        + rounded(
            rounded(f"{x}.to(tl.float32) * {prefix}_cos{lanes}")
            + " + "
            + rounded(f"{prefix}_other * {prefix}_sin{lanes}")
        ),
        f"{x} = tl.where({prefix}_turn{lanes}, {prefix}_turned, {x}.to(tl.float32)).to({tl_dtype})",
    ]


def render_decode_attention(site: DecodeSite) -> Rendered:
    """The kernel of one site: grid (B * KV,), one program per row and KV head."""
    d, groups = site.head_dim, site.heads // site.kv_heads
    bd, bg = max(16, _pow2(d)), max(16, _pow2(groups))
    bn = min(MAX_BLOCK_N, max(16, _pow2(site.context)))
    num_warps = 8 if bn * bd >= WIDE_TILE else 4
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    a = site.append
    qr, kr = site.q_rotary, a.k_rotary if a else None
    # the cos and sin tables' pointers: the queries' and the keys' the same where they are
    shared_tables = (
        qr is not None
        and kr is not None
        and (qr.cos, qr.sin, qr.batch_stride) == (kr.cos, kr.sin, kr.batch_stride)
    )
    qr_tables = ("qcos_ptr", "qsin_ptr", "Q_ROT_BATCH")
    kr_tables = qr_tables if shared_tables else ("kcos_ptr", "ksin_ptr", "K_ROT_BATCH")
    name = f"decode_attention{'_append' if a else ''}{'_rope' if qr or kr else ''}_g{groups}_d{d}"
    # elements between the heads of the rows the queries and new keys are read from
    q_head = "Q_HEAD" if qr and qr.head_stride else "HEAD_DIM"
    k_head = "K_HEAD" if kr and kr.head_stride else "HEAD_DIM"
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
        f"q = tl.load(q_ptr + b * Q_BATCH + Q_COLUMN + h[:, None] * {q_head} + rd[None, :], mask=valid_g[:, None]{mask_d}, other=0.0)",
        *(
            _rotation_lines(
                "q",
                "q",
                f"tl.load(q_ptr + b * Q_BATCH + Q_COLUMN + h[:, None] * {q_head} + q_partner[None, :], "
                "mask=valid_g[:, None] & q_turn[None, :], other=0.0)",
                "[None, :]",
                qr_tables,
                tl_dtype,
            )
            if qr
            else ()
        ),
        "cache = (b * KV_HEADS + kh) * CONTEXT * HEAD_DIM",
        "m_i = tl.full((BLOCK_G,), -1.0e30, dtype=tl.float32)  # finite: an all-masked block adds 0",
        "l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)",
        "acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)",
    ]
    if a:  # this step's key and value into slot pos; the loop takes them from registers there
        body += [
            "pos = tl.load(pos_ptr).to(tl.int64)",
            "pos = tl.where(pos < 0, pos + CONTEXT, pos)  # as index_put_ counts a negative slot",
            f"kn = tl.load(kn_ptr + b * KN_BATCH + KN_COLUMN + kh * {k_head} + rd{head_mask})",
            *(
                _rotation_lines(
                    "k",
                    "kn",
                    f"tl.load(kn_ptr + b * KN_BATCH + KN_COLUMN + kh * {k_head} + k_partner, mask=k_turn, other=0.0)",
                    "",
                    kr_tables,
                    tl_dtype,
                )
                if kr
                else ()
            ),
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
            [
                KernelParam("qcos_ptr", ParamKind.PTR, site.dtype),
                KernelParam("qsin_ptr", ParamKind.PTR, site.dtype),
            ]
            if qr
            else []
        ),
        *(
            [
                KernelParam("kcos_ptr", ParamKind.PTR, site.dtype),
                KernelParam("ksin_ptr", ParamKind.PTR, site.dtype),
            ]
            if kr and not shared_tables
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
    q_at = qr.rows if qr else NewRows(site.q, site.q_batch_stride, site.q_column)
    k_new = kr.rows if kr else a.k_new if a else None
    args = (
        Buf(q_at.base),
        *(
            (Buf(a.k_state), Buf(a.v_state), Buf(k_new.base), Buf(a.v_new.base), Buf(a.pos))
            if a
            else (Buf(site.k), Buf(site.v))
        ),
        *((Buf(qr.cos), Buf(qr.sin)) if qr else ()),
        *((Buf(kr.cos), Buf(kr.sin)) if kr and not shared_tables else ()),
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
        "Q_BATCH": q_at.batch_stride,
        "Q_COLUMN": q_at.column,
        "MASK_BATCH": site.mask_batch_stride,
        "SCALE_LOG2E": repr(site.scale * LOG2E),
        "LOG2E": repr(LOG2E),
    }
    if a:
        consts.update(
            KN_BATCH=k_new.batch_stride,
            KN_COLUMN=k_new.column,
            VN_BATCH=a.v_new.batch_stride,
            VN_COLUMN=a.v_new.column,
        )
    if qr:
        consts.update(Q_ROT=qr.dim, Q_ROT_BATCH=qr.batch_stride)
        if qr.head_stride:
            consts.update(Q_HEAD=qr.head_stride)
    if kr:
        consts.update(K_ROT=kr.dim)
        if kr.head_stride:
            consts.update(K_HEAD=kr.head_stride)
        if not shared_tables:
            consts.update(K_ROT_BATCH=kr.batch_stride)
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
    for what, r in (("queries", qr), ("new keys", kr)):
        if r is not None:
            doc[-1:-1] = [
                f"The {what} are rotated here (rotary embedding over the first {r.dim} elements of each head: "
                f"x * cos + cat(-x2, x1) * sin, each product and the sum rounded to {site.dtype}), read un-rotated "
                f"at b * {r.rows.batch_stride} + {r.rows.column}, cos and sin at b * {r.batch_stride}.",
            ]
    source = kernel_module(doc, consts, name, signature, body)
    elem = ITEMSIZE[site.dtype]
    rows = ix.parse_size(site.batch)
    traffic = rows * (2 * site.kv_heads * site.context * d + 2 * site.heads * d + site.context) * elem
    if a:
        traffic += rows * 4 * site.kv_heads * d * elem  # the new keys and values, read and written
    for r in (qr, kr):
        if r is not None:
            traffic += rows * 2 * r.dim * elem  # cos and sin
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


def rotary_steps(
    program: Program, site: DecodeSite, fold: tuple[int, ...] | None
) -> tuple[DecodeSite, tuple[int, ...]]:
    """``site`` with the rotary embeddings its kernel computes (``q_rotary``, ``Append.k_rotary``;
    the new keys' only where the cache writes fold in, ``fold``) kept where the kernels computing
    them can go, and the steps that go with them into its reference: those kernels and the views
    of what they wrote that lead only to the SDPA call. A kernel goes only when nothing else reads
    anything it wrote (a program output, another step), else the attention reads its result."""
    a = site.append if fold is not None else None
    q, k = site.q_rotary, a.k_rotary if a is not None else None
    readers = readers_of(program.steps)
    allowed = {site.step, *(fold or ())}
    while q is not None or k is not None:
        rotaries = [r for r in (q, k) if r is not None]
        results = {r.result for r in rotaries}
        going, kept = set(), set()
        for r in rotaries:
            kernel = program.steps[r.step]
            views, ok = set(), all(o is None or o in results for o in kernel.outputs)
            todo = [o for o in kernel.outputs if o is not None]
            while ok and todo:
                name = todo.pop()
                if name in program.outputs:
                    ok = False
                for j in readers.get(name, ()):
                    step = program.steps[j]
                    if j in allowed:
                        continue
                    if step.kind != StepKind.ATEN or step.target not in VIEW_OPS:
                        ok = False
                    elif j not in views:
                        views.add(j)
                        todo.extend(o for o in step.outputs if o is not None)
            (going if ok else kept).update({r.step, *views} if ok else {r.step})
        if not kept:
            break
        q = q if q is not None and q.step not in kept else None
        k = k if k is not None and k.step not in kept else None
    else:
        going = set()
    if a is not None:
        site = replace(site, append=replace(a, k_rotary=k))
    return replace(site, q_rotary=q), tuple(sorted(going))


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
    rotated = [rotary_steps(program, site, fold) for site, fold in zip(sites, folds)]
    sites = [site for site, _ in rotated]
    references = [
        _reference(program, site, (*(fold or ()), *more))
        for site, fold, (_, more) in zip(sites, folds, rotated)
    ]
    rendered = [render_decode_attention(s) for s in sites]
    rendered = [  # the ops of the rotary kernels folded in, too
        replace(
            r,
            ops=tuple(dict.fromkeys((*(x.target for j in more for x in program.steps[j].reference), *r.ops))),
        )
        for r, (_, more) in zip(rendered, rotated)
    ]
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, "decode attention", "SDPA stays"
    )
    ids, failed = built.ids, built.failed
    at = {
        s.step: (s, fold, more, ref, kid, r)
        for s, fold, (_, more), ref, kid, r in zip(sites, folds, rotated, references, ids, rendered)
        if kid not in failed
    }
    steps: list[Step | None] = list(program.steps)
    appended = rotations = 0
    gone: set[str] = set()  # the rotary kernels folded in
    for i, (site, fold, more, reference, kid, r) in at.items():
        a = site.append
        for j in (*(fold if a is not None else ()), *more):
            if steps[j] is not None and steps[j].kind == StepKind.KERNEL:
                gone.add(steps[j].target)
            steps[j] = None
        appended += a is not None
        rotations += (site.q_rotary is not None) + (a is not None and a.k_rotary is not None)
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
        if rotations:
            also += f", {counted(rotations, 'rotary embedding')} computed in them"
        say(f"  {len(at)} one-token SDPA calls over a KV cache run as decode attention kernels{also}")
    out = built.program_with(program, steps)
    used = {s.target for s in out.steps if s.kind == StepKind.KERNEL}
    return replace(
        out, kernels=tuple(k for k in out.kernels if k.id in used or k.id not in gone)
    ), built.cubins


def _reference(program: Program, site: DecodeSite, folded: tuple[int, ...]) -> tuple[Step, ...]:
    """What the kernel of ``site`` stands for: the ``folded`` steps in program order (a kernel
    among them by its own reference steps), then the SDPA step."""
    steps = []
    for j in sorted(set(folded)):
        s = program.steps[j]
        steps.extend(s.reference if s.kind == StepKind.KERNEL else (s,))
    return (*steps, program.steps[site.step])
