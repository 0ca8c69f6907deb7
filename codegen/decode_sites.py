"""Decode attention sites: the one-token SDPA calls over a KV cache that
``aot.codegen.decode_attention`` runs as its kernels, found by their shapes and operands (not by
model), with the cache writes (``Append``) and rotary embeddings (``Rotary``) the kernel can take
over; that module says what each form is."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.attention import SDPA, sdpa_call
from aot.codegen.cache_writes import Strided, strided_view, write_args
from aot.codegen.gemm_epilogue import NoSite
from aot.codegen.gemm_prologue import RowNorm, lower_row_norm
from aot.codegen.kernel_source import on_off
from aot.program import VIEW_OPS, tensor_specs
from aot.schema import Buf, Program, Step, StepKind, TensorSpec

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
# The longest cache a site may have. The one-kernel form (one program per row and KV head walks
# the whole cache; measured at 160 and 512 slots, H200) takes caches of up to
# ``decode_attention.ONE_KERNEL_MAX_CONTEXT`` slots (from 512 in splits); longer ones take the split-KV
# form, or keep SDPA where it is off (``decode_attention.decode_splits``).
MAX_CONTEXT = 32768
FULL_END = 2**62  # a slice's end at or past this is "to the end"
POSITION_DTYPES = ("int64", "int32")


# "off": a per-head norm before the rotary stays a kernel of its own (``_head_norm``), for measuring
HEAD_NORM_ENV = "AOTPACK_DECODE_HEAD_NORM"


def head_norms() -> bool:
    """Whether a per-head norm before the rotary folds into the attention kernel
    (``AOTPACK_DECODE_HEAD_NORM``: "on", the default, or "off")."""
    return on_off(HEAD_NORM_ENV, "on")


@dataclass(frozen=True)
class NewRows:
    """Where a step's new keys or values are: row b's KV head h at ``b * batch_stride + column +
    h * head_stride`` of ``base`` (a ``[B, KV, 1, D]`` buffer, or a projection's rows);
    ``head_stride`` 0 is the head dim (heads side by side)."""

    base: str
    batch_stride: int
    column: int
    head_stride: int = 0


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
    # cos and sin of dim / 2 elements, each for both halves (GPT-OSS's ``cat(x1 * cos - x2 * sin,
    # x2 * cos + x1 * sin)``: the same products and sums, the tables not repeated)
    half_tables: bool = False
    # a norm of each head's elements before the rotation, in the same kernel (Qwen3's and Gemma
    # 3's q_norm and k_norm: ``_head_norm``), as a row norm over rows of one head (K the head dim,
    # its one row input ``x0`` the head as loaded, its vectors ``[D]`` weights); None: no norm
    norm: RowNorm | None = None


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
    softcap: float | None = None  # scores capped as c * tanh(s / c) before the mask (Gemma 2's)
    sinks: str | None = None  # [H] logits in each head's softmax denominator (GPT-OSS's sinks)
    # added to the scaled scores: each row's and head's bias row (Bloom's and MPT's ALiBi)
    bias: BiasRows | None = None
    # elements between a row's query heads where they are not side by side (Bloom's fused
    # projection interleaves each head's query, key and value); 0: the head dim
    q_head_stride: int = 0


@dataclass(frozen=True)
class BiasRows:
    """Where a bias per head is: row b's head h's slots at ``offset + b * batch_stride + h *
    head_stride`` of ``base``, one apart, of ``dtype``."""

    base: str
    batch_stride: int
    head_stride: int
    offset: int
    dtype: str


class _Program:
    def __init__(self, program: Program):
        self.program = program
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
        elif (found := rows.operand(new.name, dtype)) is not None:
            if found[2] != "1" or found[3] != kv or found[4] != head_dim:
                return None
            at = NewRows(found[0].base, found[0].width, found[0].column)
        elif kv == 1 and (cols := rows.columns(new.name, [])) is not None:
            # one KV head: its new key (or value) is a run of D columns of each row of what a
            # kernel wrote, reached through views that keep the rows (GPTBigCode's split of its
            # projection's rows)
            base, column = cols
            width = rows.width(base)
            if width is None or column + head_dim > width:
                return None
            if not rows.row_major(base, ix.parse_size(batch), width, dtype):
                return None
            at = NewRows(base, width, column)
        elif (heads := self.head_rows(new.name, batch, kv, head_dim)) is not None:
            # a head view of what a kernel wrote: GPT-J's new keys after its rotary ([B, 1, H, D]
            # permuted heads first), and heads further apart than their size (GPT-NeoX's and
            # CodeGen's projections interleave each head's query, key and value)
            at = heads
        else:
            return None
        return i, state.name, pos, pos_spec.dtype, at

    def head_rows(self, name: str, batch: str, heads: int, head_dim: int) -> NewRows | None:
        """Where ``name``, a ``[B, heads, 1, head_dim]`` head view of what a step wrote, reads its
        rows: heads side by side (``head_stride`` 0) or further apart than their size; None
        otherwise."""
        found = _head_rows(strided_view(name, self.program), batch, heads, head_dim)
        if found is None:
            return None
        at, stride = found
        if not self.materialized(at.base) or (heads > 1 and stride < head_dim):
            return None
        return replace(at, head_stride=0 if heads == 1 or stride == head_dim else stride)

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
    ``R`` is less than the head dim, ``cat(that, the rest of the head)``; or GPT-OSS's, the same
    products and sums over halves ``torch.chunk`` made, its tables of R/2 (``Rotary.half_tables``).
    ``x`` may also be what the same kernel computed as a norm of each head (``_head_norm``: Qwen3's
    and Gemma 3's q_norm and k_norm before the rotary, ``Rotary.norm``). None for any other form
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
    found = _halves_rotary(made, local, Buf(name), p)
    if found is not None:
        x, cos, sin, dim, rest, half_tables = *found, None, True
    else:
        found = _rotate_half_rotary(made, Buf(name), p, batch, heads, head_dim)
        if found is None:
            return None
        x, cos, sin, dim, rest = found
        half_tables = False
    both = replace(program, steps=program.steps + kernel_step.reference)  # views inside the kernel too
    view, norm, normed = strided_view(x.name, both), None, set()
    if view is not None and view.base in local:  # computed in this kernel: a norm of each head?
        if rest is not None or half_tables or not head_norms():
            return None
        headed = _head_norm(
            program, p, local, kernel_step.reference, view, batch, heads, head_dim, dtype, both
        )
        if headed is None:
            return None
        norm, view, normed = headed
    if any(specs.get(o) is None or specs[o].dtype != dtype for o in local if o not in normed):
        return None  # every intermediate in the operands' dtype (no upcast to float32 and back)
    found = _head_rows(view, batch, heads, dim)
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
            or not ix.same(view.shape[3], dim // 2 if half_tables else dim)
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
    return Rotary(
        rows, tables[0][0], tables[1][0], tables[0][1], dim, i, name, head_stride, half_tables, norm
    )


def _head_norm(
    program: Program,
    p: _Program,
    local: dict[str, Step],
    reference: tuple[Step, ...],
    view: Strided,
    batch: str,
    heads: int,
    head_dim: int,
    dtype: str,
    both: Program,
) -> tuple[RowNorm, Strided, set[str]] | None:
    """Where the rotary's input ``view`` (``[B, heads, 1, D]``) is all of a buffer the same
    kernel wrote as a norm of each head of a projection's rows, RMSNorm over the head dim with a
    weight ``[D]`` (Qwen3's ``q_norm(q.view(B, 1, H, D)).transpose(1, 2)``, Gemma 3's
    ``q_norm(q.view(B, 1, H, D).transpose(1, 2))``): (that norm as a row norm over ``B * heads``
    rows of ``D``, a ``[B, heads, 1, D]`` view of the rows it reads, the names its steps wrote).
    None for anything else (``gemm_prologue.lower_row_norm`` decides what a norm is; one row
    input, no second output)."""
    base = view.base
    shape = p.shape(base)
    B = ix.parse_size(batch)
    if shape is None or len(shape) != 4 or len(view.shape) != 4 or p.specs[base].dtype != dtype:
        return None
    dims = [ix.parse_size(d) for d in shape]
    # [B, 1, H, D] (normed, then transposed: Qwen3) or [B, H, 1, D] (transposed first: Gemma 3)
    swapped = ix.same(dims[1], 1) and ix.same(dims[2], heads)
    if not (swapped or (ix.same(dims[1], heads) and ix.same(dims[2], 1))):
        return None
    if not (ix.same(dims[0], B) and ix.same(dims[3], head_dim)):
        return None
    if not (isinstance(view.offset, sympy.Integer) and view.offset == 0):
        return None
    # all of the buffer, row-major, in [B, H, 1, D] order
    st = view.strides
    if not (
        ix.same(st[0], heads * head_dim) and ix.same(st[3], 1) and (heads == 1 or ix.same(st[1], head_dim))
    ):
        return None
    order = {id(s): j for j, s in enumerate(reference)}
    steps, todo, seen = [], [base], set()
    while todo:  # the steps ``base`` is computed from, inside the kernel
        s = local.get(todo.pop())
        if s is None or id(s) in seen:
            continue
        seen.add(id(s))
        steps.append(s)
        todo.extend(a.name for a in s.args if isinstance(a, Buf))
    steps.sort(key=lambda s: order[id(s)])
    computing = [s for s in steps if s.target not in VIEW_OPS]
    viewed = {o for s in steps if s.target in VIEW_OPS for o in s.outputs if o}
    rows_in = {a.name for s in computing for a in s.args if isinstance(a, Buf) and a.name in viewed}
    if len(rows_in) != 1:
        return None
    (x_in,) = rows_in
    rows = strided_view(x_in, both)
    if rows is None or rows.base in local or not p.materialized(rows.base) or len(rows.shape) != 4:
        return None
    if not all(ix.same(a, b) for a, b in zip(rows.shape, dims)):
        return None
    m = ix.size_text(B * heads)
    buffers = {**p.specs, x_in: TensorSpec(p.specs[x_in].dtype, (m, str(head_dim)))}
    known = {w.name: w.spec for w in program.weights}
    try:
        norm = lower_row_norm(tuple(computing), (base,), base, m, head_dim, buffers, known)
    except NoSite:
        return None
    if len(norm.inputs) != 1 or norm.sum_out is not None or norm.more:
        return None
    if swapped:  # the rows as the rotary reads them: [B, H, 1, D]
        rows = Strided(
            rows.base,
            rows.offset,
            (rows.shape[0], rows.shape[2], rows.shape[1], rows.shape[3]),
            (rows.strides[0], rows.strides[2], rows.strides[1], rows.strides[3]),
        )
    return norm, rows, {o for s in steps for o in s.outputs if o}


def _halves_rotary(made, local: dict, rotated: Buf, p: _Program) -> tuple[Buf, Any, Any, int] | None:
    """(x, cos, sin, R) where ``rotated`` is GPT-OSS's ``cat(x1 * cos - x2 * sin, x2 * cos + x1 *
    sin)`` of ``x1, x2 = split(x, [R/2, R/2], -1)`` (``torch.chunk``), cos and sin of R/2 elements."""
    top = made(rotated, "aten.cat.default")
    parts = top.args[0] if top is not None and top.args else None
    if top is None or len(top.args) != 2 or not _last_dim(top.args[1], 4) or not isinstance(parts, list):
        return None
    if len(parts) != 2:
        return None
    sub, add = made(parts[0], "aten.sub.Tensor"), made(parts[1], "aten.add.Tensor")
    if sub is None or add is None or len(sub.args) != 2 or len(add.args) != 2:
        return None
    products = [made(a, "aten.mul.Tensor") for a in (*sub.args, *add.args)]
    if any(m is None or len(m.args) != 2 for m in products):
        return None
    (x1, cos), (x2, sin), (x2b, cos_b), (x1b, sin_b) = (tuple(m.args) for m in products)
    if (x1, x2, cos, sin) != (x1b, x2b, cos_b, sin_b) or not all(
        isinstance(t, Buf) for t in (x1, x2, cos, sin)
    ):
        return None
    split = local.get(x1.name)
    if split is None or split is not local.get(x2.name) or split.target != "aten.split_with_sizes.default":
        return None
    if split.kind != StepKind.ATEN or split.outputs[:2] != (x1.name, x2.name) or split.kwargs:
        return None
    x, sizes = split.args[0], split.args[1] if len(split.args) > 1 else None
    if not isinstance(x, Buf) or not (len(split.args) == 3 and _last_dim(split.args[2], 4)):
        return None
    if not isinstance(sizes, list) or len(sizes) != 2 or sizes[0] != sizes[1] or type(sizes[0]) is not int:
        return None
    shape = p.shape(x.name)
    if shape is None or shape[-1] != str(2 * sizes[0]):
        return None  # the whole head rotated
    return x, cos, sin, 2 * sizes[0]


def _rotate_half_rotary(made, rotated: Buf, p: _Program, batch: str, heads: int, head_dim: int):
    """(x, cos, sin, R, the rest of the head or None) where ``rotated`` is Llama's or GPT-NeoX's
    ``x * cos + cat(-x[..., R/2:], x[..., :R/2]) * sin`` (``cat(that, rest)`` where R is less than
    the head dim); None otherwise."""
    rest = None
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
    return x, cos, sin, dim, rest


def _heads_first(p: _Program, name: str, shape: tuple[str, ...]) -> str | None:
    """The row-major [B, 1, H, D] buffer of ``shape`` that ``name`` permutes to [B, H, 1, D]
    (``permute(0, 2, 1, 3)``: one query, so the same bytes in the same order; GPT-J's queries after
    its rotary), else None."""
    s = p.view_step(name)
    if s is None or s.target != "aten.permute.default" or not isinstance(s.args[0], Buf):
        return None
    src = s.args[0].name
    if list(s.args[1]) != [0, 2, 1, 3] or p.shape(src) != shape or not p.materialized(src):
        return None
    return src


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
        call = sdpa_call(step, extensions=True)
        if call is None or call.causal:
            continue
        q, k, v, m = call.query, call.key, call.value, call.mask
        scale, enable_gqa = call.scale, call.enable_gqa
        if not all(isinstance(x, Buf) for x in (q, k, v)) or not (m is None or isinstance(m, Buf)):
            continue
        qs, out, spec = p.shape(q.name), step.outputs[0], p.specs.get(q.name)
        q_head_stride = 0
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
        # SDPA pairs query head i with key head i, or every query head with one key head it
        # broadcasts (a multi-query model's: Falcon's; KV heads 1 below)
        if any(p.specs[x.name].dtype != dtype or p.shape(x.name)[1] not in (qs[1], "1") for x in (k, v)):
            continue
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
            elif (relabel := _heads_first(p, src.name, (batch, "1", str(heads), str(head_dim)))) is not None:
                # the fold over [B, 1, H, D] queries a kernel wrote, permuted (Llama 4's, after
                # its query norm and temperature)
                q_base, q_stride, q_column = relabel, heads * head_dim, 0
            else:  # the fold over a head view of a projection's rows
                flash = flash or _Finder(program)
                found = flash.operand(src.name, dtype)
                if found is None or found[2] != "1" or found[3] != heads or found[4] != head_dim:
                    continue
                q_base, q_stride, q_column = found[0].base, found[0].width, found[0].column
        elif (relabel := _heads_first(p, q.name, (batch, "1", str(heads), str(head_dim)))) is not None:
            q_base, q_stride, q_column = relabel, heads * head_dim, 0
        elif (
            found := (flash := flash or _Finder(program)).operand(q.name, dtype)
        ) is not None:  # a head view of a projection's rows (GPT-2's fused QKV)
            if found[2] != "1" or found[3] != heads or found[4] != head_dim:
                continue
            q_base, q_stride, q_column = found[0].base, found[0].width, found[0].column
        elif (at := p.head_rows(q.name, batch, heads, head_dim)) is not None:
            # heads further apart than their size (Bloom's projection: each head's q, k and v)
            q_base, q_stride, q_column, q_head_stride = at.base, at.batch_stride, at.column, at.head_stride
        else:
            continue
        sinks = call.sinks.name if call.sinks is not None else None
        if sinks is not None and (p.shape(sinks) != (str(heads),) or p.specs[sinks].dtype != dtype):
            continue
        if call.bias is not None and rows != 1:
            continue  # a bias per query head, the heads folded into rows: not taken
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
        bias = None
        if call.bias is not None:
            bias = _bias_rows(program, p, call.bias.name, batch, heads, context, dtype)
            if bias is None:
                continue
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
                softcap=call.softcap,
                sinks=sinks,
                bias=bias,
                q_head_stride=q_head_stride,
            )
        )
    return sites


def _bias_rows(
    program: Program, p: _Program, name: str, batch: str, heads: int, context: int, dtype: str
) -> BiasRows | None:
    """Where ``name``, a ``[B or 1, H, 1, C]`` bias of float32 or ``dtype``, is: a strided view of
    a row-major buffer of its own, its slots one apart (None otherwise)."""
    spec = p.specs.get(name)
    if spec is None or spec.dtype not in ("float32", dtype) or len(spec.shape) != 4:
        return None
    if spec.shape[1:] != (str(heads), "1", str(context)) or spec.shape[0] not in (batch, "1"):
        return None
    view = strided_view(name, program)
    if view is None or not p.materialized(view.base):
        return None
    if not all(isinstance(x, sympy.Integer) for x in (*view.strides, view.offset)):
        return None
    stride_b, stride_h, _, stride_c = (int(x) for x in view.strides)
    if stride_c != 1 or min(stride_b, stride_h) < 0:
        return None
    batch_stride = 0 if spec.shape[0] == "1" else stride_b
    return BiasRows(view.base, batch_stride, stride_h if heads > 1 else 0, int(view.offset), spec.dtype)
