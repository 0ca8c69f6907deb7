"""KV-cache writes as Triton kernels, for library-free programs (``aot.codegen.library_free``).

A stateful LM writes each call's keys and values into its cache with ``index_put_(cache, [None,
None, cache_position], k)`` or ``index_copy_(cache, 2, cache_position, k)``
(``aot.allowed_ops.STATE_WRITE_OPS``): ATen kernels. Here each such write into a program's state
becomes one kernel step: every element of the written values goes to the cache slot its index
names along the written dim (an index outside ``0 <= slot < slots`` writes nothing: the runners
check the slots before a call, ``aot.state.index_bounds``). The values are read where they lie:
usually a head view of the K/V projection's rows (``view``, ``permute``, ``slice``, ``squeeze``
...), resolved here to a base buffer, an offset and strides (``strided_view``), passed as sizes
the call evaluates, so a symbolic sequence length costs nothing.

The kernel step writes the state in place and says so: its result is the write's result, named
as the state it was written into (``Step.in_place``), so the steps after it read the state (the
same memory), both runners (the torch loader and ``aot.runtime``) allocate nothing for it, and
the load checks that only the program's state is written so. The ATen step stays the kernel's
reference, what the CPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from aot.codegen import index as ix
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.render import Rendered, compile_site_kernels
from aot.dtypes import ITEMSIZE
from aot.program import VIEW_OPS, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym

INDEX_PUT, INDEX_COPY = "aten.index_put_.default", "aten.index_copy_.default"
HEURISTIC = "cache-write-v1"
BLOCK = 1024  # elements per program instance
RANK = 4  # the kernel's dims: fewer are padded in front with dims of one element
INDEX_DTYPES = ("int64", "int32")


@dataclass(frozen=True)
class Strided:
    """A tensor as ``base[offset + sum(i_k * strides[k])]`` over ``shape`` (sizes as sympy)."""

    base: str
    offset: sympy.Expr
    shape: tuple
    strides: tuple


def _size(v) -> sympy.Expr:
    if isinstance(v, Sym):
        return ix.parse_size(v.text)
    if type(v) is int:
        return sympy.Integer(v)
    raise ValueError(v)


def _view_strides(shape, strides, new_shape):
    """The strides of ``reshape(x, new_shape)`` as a view of ``x`` (torch's rule: each run of
    dims that are contiguous with one another may be split or merged), or None."""
    if not shape:
        return [sympy.Integer(1)] * len(new_shape)
    out = [None] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk = strides[-1]
    tensor_numel = view_numel = sympy.Integer(1)
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel = tensor_numel * shape[d]
        if d == 0 or (not ix.same(shape[d - 1], 1) and not ix.same(strides[d - 1], tensor_numel * chunk)):
            while view_d >= 0 and (not ix.same(view_numel, tensor_numel) or ix.same(new_shape[view_d], 1)):
                out[view_d] = view_numel * chunk
                view_numel = view_numel * new_shape[view_d]
                view_d -= 1
            if not ix.same(view_numel, tensor_numel):
                return None
            if d > 0:
                chunk = strides[d - 1]
                tensor_numel = view_numel = sympy.Integer(1)
    return out if view_d == -1 else None


def strided_view(name: str, program: Program) -> Strided | None:
    """``name`` as a strided view of a row-major buffer (through ``aot.program.VIEW_OPS`` steps),
    or None where a view is not one this function follows."""
    specs = tensor_specs(program)
    producer = {o: s for s in program.steps for o in s.outputs if o}
    chain: list[tuple[Step, str]] = []
    here = name
    while (s := producer.get(here)) is not None and s.kind == StepKind.ATEN and s.target in VIEW_OPS:
        if not s.args or not isinstance(s.args[0], Buf):
            return None
        chain.append((s, here))
        here = s.args[0].name
    spec = specs.get(here)
    if spec is None or spec.order:
        return None
    shape = [ix.parse_size(d) for d in spec.shape]
    strides = list(ix.strides(tuple(shape)))
    offset = sympy.Integer(0)
    try:
        for step, out in reversed(chain):
            new_shape = [ix.parse_size(d) for d in specs[out].shape]
            t, a = step.target, list(step.args[1:])
            if t in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
                strides = _view_strides(shape, strides, new_shape)
                if strides is None:
                    return None
            elif t == "aten.permute.default":
                strides = [strides[d % len(shape)] for d in a[0]]
            elif t == "aten.transpose.int":
                d0, d1 = a[0] % len(shape), a[1] % len(shape)
                strides[d0], strides[d1] = strides[d1], strides[d0]
            elif t == "aten.t.default":
                strides = strides[::-1]
            elif t == "aten.slice.Tensor":
                dim = (a[0] if a else 0) % len(shape)
                start, step_ = (a[1] if len(a) > 1 else 0) or 0, (a[3] if len(a) > 3 else 1) or 1
                if type(start) is int and start < 0:
                    return None  # from the end, clamped at the front by ATen: no offset says both
                offset = offset + _size(start) * strides[dim]
                strides[dim] = strides[dim] * step_
            elif t == "aten.unsqueeze.default":
                dim = a[0] % (len(shape) + 1)
                strides.insert(dim, sympy.Integer(0))
            elif t in ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"):
                dims = (
                    a[0]
                    if t == "aten.squeeze.dims"
                    else [a[0]]
                    if t == "aten.squeeze.dim"
                    else range(len(shape))
                )
                drop = {d % len(shape) for d in dims if ix.same(shape[d % len(shape)], 1)}
                strides = [s for d, s in enumerate(strides) if d not in drop]
            elif t == "aten.expand.default":
                lead = len(new_shape) - len(shape)
                strides = [sympy.Integer(0)] * lead + [
                    sympy.Integer(0) if ix.same(old, 1) and not ix.same(new, 1) else s
                    for old, new, s in zip(shape, new_shape[lead:], strides)
                ]
            elif t in ("aten.alias.default", "aten.detach.default"):
                pass
            elif t in ("aten.split.Tensor", "aten.split_with_sizes.default"):
                dim = (a[1] if len(a) > 1 else 0) % len(shape)
                k = step.outputs.index(out)
                size = a[0]
                before = sum(_size(x) for x in size[:k]) if isinstance(size, list) else _size(size) * k
                offset = offset + before * strides[dim]
            elif t == "aten.narrow.default":
                dim = a[0] % len(shape)
                offset = offset + _size(a[1]) * strides[dim]
            elif t == "aten.unbind.int":
                dim = (a[0] if a else 0) % len(shape)
                offset = offset + step.outputs.index(out) * strides[dim]
                strides = strides[:dim] + strides[dim + 1 :]
            elif t == "aten.select.int":
                dim = a[0] % len(shape)
                offset = offset + _size(a[1]) * strides[dim]
                strides = strides[:dim] + strides[dim + 1 :]
            else:
                return None
            shape = new_shape
            if len(strides) != len(shape):
                return None
    except (ValueError, TypeError, IndexError):
        return None
    return Strided(here, sympy.expand(offset), tuple(shape), tuple(sympy.expand(s) for s in strides))


@dataclass(frozen=True)
class WriteSite:
    step: int
    target: str  # index_put_ or index_copy_
    state: str
    result: str  # the write's result, which later steps read
    index: str  # 1-D integer buffer of slots
    dim: int  # the written dim (of the kernel's 4)
    src: Strided  # padded to 4 dims
    dst_shape: tuple[int, ...]  # the state's dims but its batch, padded to 4 (the batch: 0)
    slots: int
    dtype: str
    index_dtype: str


def write_args(step: Step) -> tuple[Buf, int, Buf, Buf] | None:
    """(state, dim, index, values) of a state write with one index tensor along one dim."""
    if step.target == INDEX_COPY and len(step.args) == 4 and not step.kwargs:
        state, dim, index, src = step.args
        if isinstance(state, Buf) and type(dim) is int and isinstance(index, Buf) and isinstance(src, Buf):
            return state, dim, index, src
    if step.target == INDEX_PUT and len(step.args) in (3, 4) and not step.kwargs:
        state, indices, src = step.args[:3]
        if len(step.args) == 4 and step.args[3] is not False:
            return None  # accumulate
        given = [(d, i) for d, i in enumerate(indices or ()) if i is not None]
        if (
            isinstance(state, Buf)
            and isinstance(src, Buf)
            and len(given) == 1
            and isinstance(given[0][1], Buf)
        ):
            return state, given[0][0], given[0][1], src
    return None


def find_write_sites(program: Program) -> list[WriteSite]:
    """The state writes a kernel can stand for (module docstring)."""
    specs = tensor_specs(program)
    state = set(program.state)
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target not in (INDEX_PUT, INDEX_COPY):
            continue
        parsed = write_args(step)
        if parsed is None or len(step.outputs) != 1 or step.outputs[0] is None:
            continue
        target, dim, index, src = parsed
        if target.name not in state:
            continue
        t, x, v = specs.get(target.name), specs.get(index.name), specs.get(src.name)
        if t is None or x is None or v is None or not 1 <= len(t.shape) <= RANK or t.order:
            continue
        rank = len(t.shape)
        if not -rank <= dim < rank or len(v.shape) != rank or v.dtype != t.dtype or len(x.shape) != 1:
            continue
        dim %= rank
        if x.dtype not in INDEX_DTYPES or x.order or not all(d.isdigit() for d in t.shape[1:]):
            continue
        if not t.shape[dim].isdigit():
            continue
        same = all(
            ix.same(ix.parse_size(a), ix.parse_size(b))
            for d, (a, b) in enumerate(zip(t.shape, v.shape))
            if d != dim
        )
        if not same or not ix.same(ix.parse_size(v.shape[dim]), ix.parse_size(x.shape[0])):
            continue
        if not (x_view := strided_view(index.name, program)) or x_view.base != index.name:
            continue  # the slots: a buffer of their own
        view = strided_view(src.name, program)
        if view is None:
            continue
        pad = RANK - rank
        zero = sympy.Integer(0)
        padded = Strided(
            view.base, view.offset, (sympy.Integer(1),) * pad + view.shape, (zero,) * pad + view.strides
        )
        dst = (1,) * pad + tuple(0 if d == 0 and not s.isdigit() else int(s) for d, s in enumerate(t.shape))
        sites.append(
            WriteSite(
                i,
                step.target,
                target.name,
                step.outputs[0],
                index.name,
                dim + pad,
                padded,
                dst,
                int(t.shape[dim]),
                t.dtype,
                x.dtype,
            )
        )
    return sites


def render_cache_write(site: WriteSite, index: str) -> Rendered:
    """The kernel of one write: grid (elements / BLOCK,)."""
    shape, strides = site.src.shape, site.src.strides
    numel = sympy.expand(sympy.Mul(*shape))
    dst_dims = list(site.dst_shape)
    # the state's row-major strides (its batch dim's size does not enter them)
    dst_strides, n = [0] * RANK, 1
    for d in range(RANK - 1, -1, -1):
        dst_strides[d] = n
        n *= max(dst_dims[d], 1)
    sizes = [f"S{d}" for d in range(RANK)] + [f"ST{d}" for d in range(RANK)] + ["OFF"]
    values = [*shape, *strides, site.src.offset]
    params = [
        KernelParam("idx_ptr", ParamKind.PTR, site.index_dtype),
        KernelParam("src_ptr", ParamKind.PTR, site.dtype),
        KernelParam("dst_ptr", ParamKind.PTR, site.dtype),
        *(KernelParam(s, ParamKind(index), "") for s in sizes),
    ]
    args = (
        Buf(site.index),
        Buf(site.src.base),
        Buf(site.state),
        *(Sym(ix.size_text(sympy.expand(v))) for v in values),
    )
    signature = signature_of(tuple(params), index)
    cast = ".to(tl.int64)" if index == "i64" else ""
    w = site.dim
    coords = ["i0", "i1", "i2", "i3"]
    dst_coords = [("slot" if d == w else c) for d, c in enumerate(coords)]
    body = [
        f"e = tl.program_id(0){cast} * BLOCK + tl.arange(0, BLOCK)",
        "ok = e < S0 * S1 * S2 * S3",
        "i3 = e % S3",
        "r = e // S3",
        "i2 = r % S2",
        "r = r // S2",
        "i1 = r % S1",
        "i0 = r // S1",
        "v = tl.load(src_ptr + OFF + i0 * ST0 + i1 * ST1 + i2 * ST2 + i3 * ST3, mask=ok)",
        f"slot = tl.load(idx_ptr + i{w}, mask=ok, other=0){cast}",
        "ok = ok & (slot >= 0) & (slot < SLOTS)  # the runners check the slots before a call",
        "tl.store(dst_ptr + " + " + ".join(f"{c} * D{d}" for d, c in enumerate(dst_coords)) + ", v, mask=ok)",
    ]
    consts = {"BLOCK": BLOCK, "SLOTS": site.slots, **{f"D{d}": dst_strides[d] for d in range(RANK)}}
    grid = (f"({ix.size_text(numel)} + {BLOCK - 1})//{BLOCK}",)
    doc = [
        f"State write: {site.state}[..., slot[i], ...] = values[..., i, ...] along dim {w} (of {RANK}), {site.dtype}.",
        "",
        "values: base[OFF + sum(i_k * ST_k)] over [S0, S1, S2, S3] (sizes the call evaluates);",
        f"the state row-major, {site.slots} slots along the written dim; a slot outside them writes nothing.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, consts, "cache_write", signature, body)
    traffic = 2 * numel * ITEMSIZE[site.dtype]
    return Rendered(
        name="cache_write",
        source=source,
        signature=signature,
        params=tuple(params),
        args=args,
        outputs=(),
        grid=grid,
        num_warps=4,
        num_stages=1,
        config={
            "kind": "cache_write",
            "BLOCK": BLOCK,
            "heuristic": HEURISTIC,
            "num_warps": 4,
            "num_stages": 1,
        },
        ops=(site.target,),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def cache_write_kernels(
    program: Program,
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each state write a kernel covers run by it (module docstring); a write
    whose kernel fails to compile stays the ATen step."""
    from aot.codegen.launch import max_value

    sites = find_write_sites(program)
    if not sites:
        return program, {}
    specs = tensor_specs(program)
    rendered = []
    for s in sites:
        biggest = max(
            max_value(sympy.Mul(*s.src.shape), ranges),
            max_value(ix.numel(tuple(ix.parse_size(d) for d in specs[s.src.base].shape)), ranges),
            max_value(ix.numel(tuple(ix.parse_size(d) for d in specs[s.state].shape)), ranges),
        )
        rendered.append(render_cache_write(s, "i64" if biggest >= 2**31 - 1 else "i32"))
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, "cache write", "the ATen write stays"
    )
    ids, failed = built.ids, built.failed
    at = {s.step: (s, kid, r) for s, kid, r in zip(sites, ids, rendered) if kid not in failed}
    steps: list[Step] = []
    for i, step in enumerate(program.steps):
        if i in at:
            site, kid, r = at[i]
            steps.append(
                Step(
                    kind=StepKind.KERNEL,
                    target=kid,
                    args=r.args,
                    kwargs={},
                    outputs=(site.result,),
                    grid=r.grid,
                    reference=(step,),
                    in_place={site.result: site.state},
                )
            )
        else:
            steps.append(step)
    if at:
        say(f"  {len(at)} KV-cache writes run as kernels")
    return built.program_with(program, steps), built.cubins
