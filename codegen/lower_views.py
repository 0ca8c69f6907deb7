"""Lowering of the steps a kernel never materializes: views, folded into index arithmetic as
``remap`` nodes (output index → input index), and generators (``arange``, ``full``…), recomputed
from the index wherever they are read.

The partitioner calls these steps *virtual*: every kernel that reads one folds it in.
"""

from __future__ import annotations

from aot.codegen import index as ix
from aot.codegen.index import Lin, Size
from aot.codegen.step_args import arg, is_tensor, literal, norm_dim
from aot.codegen.triton_types import COMPUTE, TL_TYPE
from aot.codegen.valuegraph import Builder, Node, Unsupported, same_index
from aot.program import RESHAPE_VIEWS
from aot.schema import Step

# views that keep the flat index: the output's element i is the input's element i
SAME_INDEX_VIEWS = RESHAPE_VIEWS | frozenset(
    {
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.alias.default",
        "aten.detach.default",
    }
)
PERMUTE_VIEWS = frozenset({"aten.permute.default", "aten.transpose.int", "aten.t.default"})
SLICE_VIEWS = frozenset({"aten.slice.Tensor", "aten.narrow.default"})
SPLIT_VIEWS = frozenset({"aten.split_with_sizes.default", "aten.split.Tensor", "aten.unbind.int"})
# every view this module folds (``classify`` checks it against ``aot.program.VIEW_OPS``)
FOLDED_VIEWS = (
    SAME_INDEX_VIEWS | PERMUTE_VIEWS | SLICE_VIEWS | SPLIT_VIEWS | {"aten.expand.default", "aten.select.int"}
)


def lower_generator(b: Builder, step: Step) -> None:
    name, shape, dtype = b.out(step)
    ty = COMPUTE[dtype]
    t = step.target
    if t.startswith("aten.arange."):
        args = list(step.args)
        if t == "aten.arange.default":
            start, step_size = 0, 1
        elif t == "aten.arange.start":
            start, step_size = args[0], 1
        else:
            start, step_size = args[0], arg(step, 2, "step", 1)
        idx_ty = "fp32" if ty in ("fp32", "fp64") else ty
        fmt = f"($idx).to({TL_TYPE[idx_ty]})"
        if step_size != 1:
            fmt = f"({fmt} * {literal(step_size, idx_ty)})"
        if start != 0:
            fmt = f"({literal(start, idx_ty)} + {fmt})"
        node = Node("op", shape, dtype, (), f"{fmt}.to({TL_TYPE[ty]})")
    else:
        if t in ("aten.full.default", "aten.new_full.default"):
            value = step.args[1] if t == "aten.full.default" else step.args[2]
        elif t in ("aten.full_like.default", "aten.fill.Scalar"):
            value = step.args[1]
        elif t == "aten.scalar_tensor.default":
            value = step.args[0]
        elif "zeros" in t:
            value = 0
        else:
            value = 1
        if is_tensor(value):
            raise Unsupported(f"{t} with a tensor value")
        node = Node("op", shape, dtype, (), f"tl.full([], {literal(value, ty)}, {TL_TYPE[ty]})")
    b.set(name, node)


def lower_view(b: Builder, step: Step) -> None:
    t = step.target
    x = b.tensor(step.args[0])
    if t in SPLIT_VIEWS:
        _lower_split(b, step, x)
        return
    name, shape, dtype = b.out(step)
    if t in SAME_INDEX_VIEWS:
        node = Node("remap", shape, dtype, (x,), remap=same_index)
    elif t in PERMUTE_VIEWS:
        node = Node("remap", shape, dtype, (x,), remap=_permute_remap(step, x.shape, shape))
    elif t == "aten.expand.default":

        def expand(lin: Lin, shape=shape, in_shape=x.shape) -> Lin:
            return ix.broadcast_in(lin, shape, in_shape)

        node = Node("remap", shape, dtype, (x,), remap=expand)
    elif t == "aten.select.int":
        dim = norm_dim(step.args[1], len(x.shape))
        index = step.args[2]
        idx = ix.size_of(index) if not (isinstance(index, int) and index < 0) else x.shape[dim] + index
        node = slice_node(x, shape, dim, idx, 1, squeeze=True)
    elif t in SLICE_VIEWS:
        node = _slice_view(step, x, shape)
    else:
        raise Unsupported(f"view {t}")
    b.set(name, node)


def _lower_split(b: Builder, step: Step, x: Node) -> None:
    """``split``, ``split_with_sizes``, ``unbind``: one slice (or select) of ``x`` per output."""
    t = step.target
    if t == "aten.unbind.int":
        dim = arg(step, 1, "dim", 0)
    else:
        dim = arg(step, 2, "dim", 0)
    dim = norm_dim(dim, len(x.shape))
    if t == "aten.split.Tensor":
        piece = ix.size_of(step.args[1])
        starts = [piece * i for i in range(len(step.outputs))]
    elif t == "aten.split_with_sizes.default":
        starts, acc = [], ix.ZERO
        for size in step.args[1]:
            starts.append(acc)
            acc = acc + ix.size_of(size)
    else:
        starts = [ix.sympy.Integer(i) for i in range(len(step.outputs))]
    for out, start in zip(step.outputs, starts):
        if out is not None:
            b.set(out, slice_node(x, b.shape(out), dim, start, 1, squeeze=t == "aten.unbind.int"))


def _permute_remap(step: Step, in_shape: tuple[Size, ...], shape: tuple[Size, ...]):
    """Output index → input index of ``permute``, ``transpose`` or ``t``."""
    t = step.target
    n = len(in_shape)
    if t == "aten.permute.default":
        perm = [norm_dim(d, n) for d in step.args[1]]
    else:
        perm = list(range(n))
        if n >= 2:
            d0, d1 = (
                (norm_dim(step.args[1], n), norm_dim(step.args[2], n))
                if t == "aten.transpose.int"
                else (0, 1)
            )
            perm[d0], perm[d1] = perm[d1], perm[d0]

    def permute(lin: Lin, perm=perm, shape=shape, in_shape=in_shape) -> Lin:
        return ix.through_permute(lin, in_shape, perm, shape)

    return permute


def _slice_view(step: Step, x: Node, shape: tuple[Size, ...]) -> Node:
    """``slice`` or ``narrow`` of ``x`` (a negative start counts from the end, clamped at 0)."""
    t = step.target
    in_shape = x.shape
    args = list(step.args) + [None] * 5
    dim = norm_dim(args[1] if args[1] is not None else step.kwargs.get("dim", 0), len(in_shape))
    start = (
        args[2]
        if t == "aten.narrow.default"
        else (args[2] if args[2] is not None else step.kwargs.get("start"))
    )
    stride = (
        1 if t == "aten.narrow.default" else (args[4] if args[4] is not None else step.kwargs.get("step", 1))
    )
    if start is None:
        start = 0
    if not isinstance(stride, int) or stride < 1:
        raise Unsupported(f"slice step {stride!r}")
    if isinstance(start, int) and start < 0:
        start_size = in_shape[dim] + start
        if not start_size.is_Integer and not isinstance(start_size, ix.sympy.Symbol):
            start_size = ix.sympy.Max(start_size, 0)
        elif start_size.is_Integer and start_size < 0:
            start_size = ix.ZERO
    else:
        start_size = ix.size_of(start)
    return slice_node(x, shape, dim, start_size, stride)


def slice_node(x: Node, out_shape, dim: int, start: Size, stride: int, squeeze: bool = False) -> Node:
    """Output index → input index for ``x[..., start::stride (dim), ...]`` (``squeeze``: select)."""
    in_shape = x.shape

    def slice_(lin: Lin) -> Lin:
        per = ix.unflatten(lin, out_shape)
        if squeeze:
            per = per[:dim] + [ix.const_lin(ix.ZERO)] + per[dim:]
        d = per[dim]
        moved = ix.make_lin([(c * stride, f) for c, f in d.terms], d.const * stride + start)
        per[dim] = ix.derived(moved, in_shape[dim]) if moved.const != ix.ZERO or stride != 1 else moved
        return ix.flatten(per, in_shape)

    return Node("remap", out_shape, x.dtype, (x,), remap=slice_)
