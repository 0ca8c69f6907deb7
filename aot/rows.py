"""Row independence: whether a program keeps the rows along a dynamic dim apart.

A server may join several clients' requests along a dim (Triton's dynamic batcher, Ray's
``@serve.batch``) only when row ``b`` of every output depends on row ``b`` of the inputs alone: no
step reduces, scans, sorts, flips, indexes, gathers or reshapes across the dim. ``row_mixing``
proves that from a program's steps, each op by its known semantics (library calls too: a matmul
keeps the rows of its first operand, attention the rows of its batch dims, a norm those of the dims
it does not normalize); an op it does not know mixes the rows, so the answer errs towards not
joining. The tracer confirms a proof numerically on the eager model before it records it
(``SymbolGuard.rows_independent``).

A buffer's rows are tracked as ``(dim, inner)``: along ``dim`` its size is ``rows * inner`` with the
row outermost (``[batch * seq, 16]`` after a linear layer flattened ``[batch, seq, 16]``), so a view
that merges or splits dims keeps track of them. Sizes are evaluated with the dim at ``PROBE_ROWS``
(a prime no static size is a multiple of) and the other symbols at sizes the guards admit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from aot.errors import AotError
from aot.schema import Buf, Program, Step, StepKind, Sym
from aot.symexpr import compile_expr

PROBE_ROWS = 10007


class Mixed(Exception):
    """A step mixes rows; the message says which and how."""


Rows = tuple[int, int]  # (dim, inner): dim's size is rows * inner, row outermost


def _strip(target: str) -> str:
    return target.removeprefix("aten.")


# Elementwise ops (broadcasting over all their tensor arguments): row b of the result reads row b of
# each argument. Scalars and dtype/memory-format arguments aside, none has other semantics.
POINTWISE = frozenset(
    f"aten.{n}"
    for n in (
        "abs.default acos.default acosh.default add.Scalar add.Tensor alias.default asin.default "
        "asinh.default atan.default atan2.default atanh.default bitwise_and.Scalar bitwise_and.Tensor "
        "bitwise_not.default bitwise_or.Scalar bitwise_or.Tensor bitwise_xor.Scalar bitwise_xor.Tensor "
        "ceil.default clamp.Tensor clamp.default clamp_max.default clamp_min.default clone.default "
        "copy.default cos.default cosh.default detach.default div.Scalar div.Scalar_mode div.Tensor "
        "div.Tensor_mode elu.default eq.Scalar eq.Tensor erf.default exp.default exp2.default expm1.default "
        "floor.default fmod.Scalar fmod.Tensor ge.Scalar ge.Tensor gelu.default gt.Scalar gt.Tensor "
        "hardsigmoid.default hardswish.default hardtanh.default isinf.default isnan.default le.Scalar "
        "le.Tensor leaky_relu.default lift_fresh_copy.default log.default log10.default log1p.default "
        "log2.default logical_and.default logical_not.default logical_or.default logical_xor.default "
        "lt.Scalar lt.Tensor masked_fill.Scalar masked_fill.Tensor maximum.default minimum.default "
        "mish.default mul.Scalar mul.Tensor ne.Scalar ne.Tensor neg.default pow.Scalar pow.Tensor_Scalar "
        "pow.Tensor_Tensor reciprocal.default relu.default relu6.default remainder.Scalar "
        "remainder.Tensor round.default rsqrt.default rsub.Scalar rsub.Tensor sigmoid.default "
        "sign.default silu.default sin.default sinh.default softplus.default sqrt.default sub.Scalar "
        "sub.Tensor tan.default tanh.default trunc.default where.self _to_copy.default"
    ).split()
)
# Results that are filled with one value (or copy a shape only): row-local whatever their shape.
FILLS = frozenset(
    f"aten.{n}"
    for n in (
        "full.default zeros.default ones.default scalar_tensor.default new_full.default "
        "new_zeros.default new_ones.default"
    ).split()
)
FILLS_LIKE = frozenset(
    f"aten.{n}" for n in "full_like.default zeros_like.default ones_like.default fill.Scalar".split()
)
# Reductions and scans over the dims named by argument 1 (an int or a list; None or absent: all).
REDUCE_DIMS = frozenset(
    f"aten.{n}"
    for n in (
        "sum.dim_IntList mean.dim amax.default amin.default any.dim any.dims prod.dim_int var.correction "
        "var.dim var_mean.correction logsumexp.default argmax.default argmin.default max.dim min.dim "
        "cumsum.default _softmax.default _log_softmax.default sort.default"
    ).split()
)
REDUCE_ALL = frozenset(f"aten.{n}" for n in "sum.default mean.default prod.default any.default".split())
# Reductions that keep the reduced dims (scans, softmax, sort): the result has the input's rank.
KEEPS_RANK = frozenset(
    f"aten.{n}" for n in "cumsum.default _softmax.default _log_softmax.default sort.default".split()
)
# Ops over the trailing spatial dims of an [N, C, *spatial] input: rows along N or C stay apart.
SPATIAL = {
    "aten.avg_pool2d.default": 2,
    "aten.avg_pool3d.default": 3,
    "aten.max_pool2d_with_indices.default": 2,
    "aten.max_pool3d_with_indices.default": 3,
    "aten._adaptive_avg_pool2d.default": 2,
    "aten._adaptive_avg_pool3d.default": 3,
    "aten.upsample_bilinear2d.vec": 2,
    "aten.upsample_nearest2d.vec": 2,
    "aten.reflection_pad1d.default": 1,
    "aten.reflection_pad2d.default": 2,
    "aten.reflection_pad3d.default": 3,
    "aten.replication_pad2d.default": 2,
    "aten.replication_pad3d.default": 3,
}
# Ops that produce sizes, not data.
SIZES = frozenset(
    f"aten.{n}" for n in "sym_size.int sym_numel.default sym_stride.int sym_storage_offset.default".split()
)


@dataclass
class _Walk:
    """One pass over a program: which buffers carry rows, and where."""

    program: Program
    symbol: str
    sizes: dict[str, int]
    rows: dict[str, Rows]

    def shape(self, name: str) -> tuple[int, ...]:
        spec = self.specs.get(name)
        if spec is None:
            raise Mixed(f"buffer {name!r} has no shape in the program")
        return tuple(compile_expr(str(s))(self.sizes) for s in spec.shape)

    def __post_init__(self) -> None:
        p = self.program
        self.specs = {
            **{w.name: w.spec for w in p.weights},
            **{i.name: i.spec for i in p.inputs},
            **p.buffers,
        }

    def of(self, arg: Any) -> Rows | None:
        return self.rows.get(arg.name) if isinstance(arg, Buf) else None

    def mentions(self, value: Any) -> bool:
        """Whether a size argument depends on the row count."""
        if isinstance(value, Sym):
            return self.symbol in compile_expr(value.text).symbols
        if isinstance(value, (list, tuple)):
            return any(self.mentions(v) for v in value)
        return False

    def carried(self, step: Step) -> list[Any]:
        return [a for a in _tensors(step) if self.of(a) is not None]


def _tensors(step: Step) -> list[Buf]:
    out: list[Buf] = []

    def visit(v: Any) -> None:
        if isinstance(v, Buf):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    visit(step.args)
    visit(tuple(step.kwargs.values()))
    return out


def _arg(step: Step, index: int, name: str, default: Any = None) -> Any:
    if len(step.args) > index:
        return step.args[index]
    return step.kwargs.get(name, default)


def _dims(value: Any, rank: int) -> list[int] | None:
    """A dim argument (int or list) as non-negative dims; None: all of them."""
    if value is None or value == []:
        return None
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) % rank if rank else 0 for v in values]


def row_mixing(program: Program, symbol: str, sizes: Mapping[str, int]) -> str | None:
    """None when ``program`` keeps the rows along ``symbol`` independent and every output that has
    rows has them along a dim of size ``symbol`` exactly; else the reason it does not, naming the
    step. ``sizes``: a value for every other symbol, admitted by the guards."""
    walk = _Walk(program, symbol, {**sizes, symbol: PROBE_ROWS}, {})
    state = set(program.state)
    try:
        for inp in program.inputs:
            at = [d for d, s in enumerate(inp.spec.shape) if str(s) == symbol]
            other = [d for d, s in enumerate(inp.spec.shape) if walk.mentions(Sym(str(s))) and d not in at]
            if inp.name in state and (at or other):
                return f"state input {inp.name!r} holds rows along {symbol} across calls"
            if other or len(at) > 1:
                return f"input {inp.name!r} has {symbol} in dims {sorted(at + other)}, not in one dim alone"
            if at:
                walk.rows[inp.name] = (at[0], 1)
        for index, step in enumerate(program.steps):
            for s in step.reference if step.kind == StepKind.KERNEL else (step,):
                try:
                    _step(walk, s)
                except Mixed as e:
                    return f"step {index} ({_strip(s.target)}) {e}"
        for name in program.outputs:
            where = walk.rows.get(name)
            shape = walk.specs[name].shape if name in walk.specs else ()
            if where is None:
                if any(walk.mentions(Sym(str(s))) for s in shape):
                    return f"output {name!r} has a {symbol}-sized dim its rows do not follow"
                continue
            dim, inner = where
            if inner != 1 or str(shape[dim]) != symbol:
                return (
                    f"output {name!r} holds the rows along dim {dim} of size {shape[dim]}, not {symbol} alone"
                )
    except (AotError, KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        return f"the analysis could not follow the program ({type(e).__name__}: {e})"
    return None


def _set(walk: _Walk, step: Step, rows: Rows | None, outputs: Sequence[int] | None = None) -> None:
    for i, out in enumerate(step.outputs):
        if out is None or (outputs is not None and i not in outputs):
            continue
        if rows is None:
            walk.rows.pop(out, None)
        else:
            walk.rows[out] = rows


def _step(walk: _Walk, step: Step) -> None:
    target = step.target
    carried = walk.carried(step)
    if target in SIZES:
        return _set(walk, step, None)
    if target in FILLS:
        return _set(walk, step, _fill_rows(walk, step))
    if target in FILLS_LIKE:
        return _set(walk, step, walk.of(step.args[0]))
    if target.startswith("aten.arange"):
        if walk.mentions(list(step.args)):
            raise Mixed(f"numbers positions along {walk.symbol}: a row's value depends on where it sits")
        return _set(walk, step, None)
    if not carried:
        if walk.mentions([*step.args, *step.kwargs.values()]) and target not in _SHAPE_OPS:
            raise Mixed(f"takes a {walk.symbol}-dependent size it does not apply to rows")
        if target in ("aten.expand.default",) and step.outputs[0] is not None:
            return _set(walk, step, _expanded_rows(walk, step))
        return _set(walk, step, None)
    if target in POINTWISE:
        return _set(walk, step, _broadcast(walk, step))
    handler = _HANDLERS.get(target)
    if handler is None:
        raise Mixed(f"is not known to keep rows along {walk.symbol} apart")
    handler(walk, step)


_SHAPE_OPS = frozenset(
    f"aten.{n}" for n in "view.default _unsafe_view.default reshape.default expand.default".split()
)


def _fill_rows(walk: _Walk, step: Step) -> Rows | None:
    """A filled tensor is row-local: its rows (if its shape has them) along the first dim whose
    size depends on the row count."""
    out = step.outputs[0]
    if out is None:
        return None
    for d, s in enumerate(walk.specs[out].shape if out in walk.specs else ()):
        if walk.mentions(Sym(str(s))):
            size = walk.shape(out)[d]
            if size % PROBE_ROWS:
                raise Mixed(f"fills a dim of size {s}, not a multiple of {walk.symbol}")
            return (d, size // PROBE_ROWS)
    return None


def _expanded_rows(walk: _Walk, step: Step) -> Rows | None:
    """``expand`` of a row-free tensor to a row-sized dim: the same values in every row."""
    return _fill_rows(walk, step)


def _broadcast(walk: _Walk, step: Step) -> Rows | None:
    out = step.outputs[0]
    rank = len(walk.shape(out))
    found: Rows | None = None
    for arg in _tensors(step):
        shape = walk.shape(arg.name)
        where = walk.of(arg)
        if where is None:
            continue
        dim = where[0] + rank - len(shape)
        if found is not None and found != (dim, where[1]):
            raise Mixed(f"combines rows along {walk.symbol} held in different dims")
        found = (dim, where[1])
    assert found is not None
    out_size = walk.shape(out)[found[0]]
    for arg in _tensors(step):
        shape = walk.shape(arg.name)
        d = found[0] - (rank - len(shape))
        if walk.of(arg) is None and d >= 0 and shape[d] != 1:
            raise Mixed(f"broadcasts {arg.name!r}, which has no rows, along the rows of {walk.symbol}")
        if walk.of(arg) is not None and shape[d] != out_size:
            raise Mixed(f"broadcasts the rows of {arg.name!r} along {walk.symbol}")
    return found


def _reduce(walk: _Walk, step: Step) -> None:
    (x,) = step.args[:1]
    where = walk.of(x)
    if len(walk.carried(step)) != 1 or where is None:
        raise Mixed(f"reads rows along {walk.symbol} from more than its input")
    rank = len(walk.shape(x.name))
    dim, inner = where
    dims = _dims(_arg(step, 1, "dim"), rank)
    if dims is None or dim in dims:
        raise Mixed(f"reduces, scans or sorts across {walk.symbol}")
    keepdim = step.target in KEEPS_RANK or bool(
        _arg(step, 3 if "var" in step.target else 2, "keepdim", False)
    )
    if step.target == "aten.var.correction" or step.target == "aten.var_mean.correction":
        keepdim = bool(step.kwargs.get("keepdim", False))
    new = dim if keepdim else dim - sum(d < dim for d in dims)
    _set(walk, step, (new, inner))


def _view(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    before = walk.shape(x.name)
    outer, block = prod(before[:dim]), inner * prod(before[dim + 1 :])
    after = walk.shape(step.outputs[0])
    for d, size in enumerate(after):
        rest = prod(after[d + 1 :])
        if prod(after[:d]) == outer and size % PROBE_ROWS == 0 and (size // PROBE_ROWS) * rest == block:
            return _set(walk, step, (d, size // PROBE_ROWS))
    text = [", ".join(map(str, walk.specs[b].shape)) for b in (x.name, step.outputs[0])]
    raise Mixed(f"reshapes across {walk.symbol} ([{text[0]}] to [{text[1]}])")


def _permute(walk: _Walk, step: Step) -> None:
    dim, inner = walk.of(step.args[0])
    order = [int(d) % len(step.args[1]) for d in step.args[1]]
    _set(walk, step, (order.index(dim), inner))


def _transpose(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    rank = len(walk.shape(x.name))
    a, b = (0, 1) if step.target == "aten.t.default" else (int(step.args[1]) % rank, int(step.args[2]) % rank)
    _set(walk, step, ({a: b, b: a}.get(dim, dim), inner))


def _unsqueeze(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    at = int(step.args[1]) % (len(walk.shape(x.name)) + 1)
    _set(walk, step, (dim + (at <= dim), inner))


def _squeeze(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    before = walk.shape(x.name)
    if step.target == "aten.squeeze.default":
        gone = [d for d, s in enumerate(before) if s == 1]
    else:
        gone = [d for d in (_dims(step.args[1], len(before)) or []) if before[d] == 1]
    _set(walk, step, (dim - sum(d < dim for d in gone), inner))


def _expand(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    shift = len(walk.shape(step.outputs[0])) - len(walk.shape(x.name))
    if walk.shape(step.outputs[0])[dim + shift] != walk.shape(x.name)[dim]:
        raise Mixed(f"expands across {walk.symbol}")
    _set(walk, step, (dim + shift, inner))


def _along(walk: _Walk, step: Step, dim_arg: int, what: str, full_ok: bool = False) -> int:
    """The row dim of argument 0, refusing a step that works along it."""
    x = step.args[0]
    dim, _ = walk.of(x)
    rank = len(walk.shape(x.name))
    along = int(_arg(step, dim_arg, "dim", 0)) % rank
    if along == dim and not (full_ok and walk.shape(step.outputs[0]) == walk.shape(x.name)):
        raise Mixed(f"{what} across {walk.symbol}")
    return along


def _slice(walk: _Walk, step: Step) -> None:
    _along(walk, step, 1, "slices", full_ok=True)
    _set(walk, step, walk.of(step.args[0]))


def _select(walk: _Walk, step: Step) -> None:
    along = _along(walk, step, 1, "selects")
    dim, inner = walk.of(step.args[0])
    _set(walk, step, (dim - (along < dim), inner))


def _split(walk: _Walk, step: Step) -> None:
    along = _along(walk, step, 1 if step.target == "aten.unbind.int" else 2, "splits")
    dim, inner = walk.of(step.args[0])
    if step.target == "aten.unbind.int":
        return _set(walk, step, (dim - (along < dim), inner))
    _set(walk, step, (dim, inner))


def _cat(walk: _Walk, step: Step) -> None:
    tensors = step.args[0]
    first = walk.shape(tensors[0].name)
    along = int(_arg(step, 1, "dim", 0)) % len(first)
    found = {walk.of(t) for t in tensors}
    if None in found or len(found) != 1:
        raise Mixed(f"concatenates tensors with and without rows along {walk.symbol}")
    (where,) = found
    if where[0] == along:
        raise Mixed(f"concatenates along {walk.symbol}")
    _set(walk, step, where)


def _pad(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, _ = walk.of(x)
    rank = len(walk.shape(x.name))
    pads = list(step.args[1])
    for i in range(0, len(pads), 2):
        if rank - 1 - i // 2 == dim and (pads[i] or pads[i + 1]):
            raise Mixed(f"pads across {walk.symbol}")
    _set(walk, step, walk.of(x))


def _repeat(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    repeats = list(step.args[1])
    new = dim + len(repeats) - len(walk.shape(x.name))
    if repeats[new] != 1:
        raise Mixed(f"repeats across {walk.symbol}")
    _set(walk, step, (new, inner))


def _flip(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, _ = walk.of(x)
    if dim in (_dims(step.args[1], len(walk.shape(x.name))) or []):
        raise Mixed(f"flips across {walk.symbol}")
    _set(walk, step, walk.of(x))


def _spatial(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    if len(walk.carried(step)) != 1 or dim >= len(walk.shape(x.name)) - SPATIAL[step.target]:
        raise Mixed(f"works across {walk.symbol} (a spatial dim)")
    _set(walk, step, (dim, inner))


def _leading(walk: _Walk, step: Step, operands: Sequence[int], batch_dims: int, dim: int = 0) -> Rows:
    """Rows along ``dim`` < ``batch_dims`` of every row-carrying operand among ``operands`` (and
    of no other argument): a library call over independent leading dims."""
    found = set()
    for i, arg in enumerate(_tensors(step)):
        where = walk.of(arg)
        if where is None:
            continue
        if i not in operands or where[0] >= batch_dims:
            raise Mixed(f"contracts or mixes rows along {walk.symbol}")
        found.add(where)
    if len(found) != 1:
        raise Mixed(f"combines rows along {walk.symbol} held in different dims")
    return found.pop()


def _mm(walk: _Walk, step: Step) -> None:
    if step.target == "aten.mm.default":
        return _set(walk, step, _leading(walk, step, (0,), 1))
    # addmm(bias, a, b): the bias broadcasts over a's rows, or holds the same rows
    bias, a, b = step.args[0], step.args[1], step.args[2]
    rows, bias_rows = walk.of(a), walk.of(bias)
    if rows is None or rows[0] != 0 or walk.of(b) is not None:
        raise Mixed(f"contracts or mixes rows along {walk.symbol}")
    shape = walk.shape(bias.name)
    if bias_rows is None and len(shape) == 2 and shape[0] != 1:
        raise Mixed(f"adds a bias that varies along {walk.symbol} but has no rows")
    if bias_rows is not None and (bias_rows != rows or len(shape) != 2):
        raise Mixed(f"adds a bias whose rows along {walk.symbol} sit elsewhere")
    _set(walk, step, rows)


def _bmm(walk: _Walk, step: Step) -> None:
    a, b = step.args[0], step.args[1]
    ra, rb = walk.of(a), walk.of(b)
    if ra is not None and rb is not None and ra == rb and ra[0] == 0:
        return _set(walk, step, ra)
    if rb is None and ra is not None and ra[0] == 1:  # rows of a's M dim against a shared b
        return _set(walk, step, ra)
    if ra is None and rb is not None and rb[0] == 2:
        return _set(walk, step, rb)
    raise Mixed(f"contracts or mixes rows along {walk.symbol}")


def _attention(walk: _Walk, step: Step) -> None:
    q = step.args[0]
    rank = len(walk.shape(q.name))
    try:
        rows = _leading(walk, step, (0, 1, 2, 3), rank - 2)
    except Mixed:
        raise Mixed(f"attends across {walk.symbol}") from None
    q_rows = walk.of(q)
    for arg in step.args[:3]:
        if walk.of(arg) != q_rows:
            raise Mixed(f"attends across {walk.symbol}: query, key and value do not share its rows")
    mask = _arg(step, 3, "attn_mask")
    if isinstance(mask, Buf) and walk.of(mask) is None:
        shape = walk.shape(mask.name)
        d = rows[0] - (rank - len(shape))
        if d >= 0 and shape[d] != 1:
            raise Mixed(f"applies a mask without rows along {walk.symbol}")
    _set(walk, step, rows)


def _convolution(walk: _Walk, step: Step) -> None:
    if walk.of(step.args[0]) is None or len(walk.carried(step)) != 1 or walk.of(step.args[0])[0] != 0:
        raise Mixed(f"convolves across {walk.symbol}")
    _set(walk, step, walk.of(step.args[0]))


def _layer_norm(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    rank = len(walk.shape(x.name))
    rows = _leading(walk, step, (0,), rank - len(step.args[1]))
    _set(walk, step, rows)


def _group_norm(walk: _Walk, step: Step) -> None:
    rows = _leading(walk, step, (0,), 1)
    _set(walk, step, rows)


def _batch_norm(walk: _Walk, step: Step) -> None:
    rows = _leading(walk, step, (0,), 1)  # per channel (dim 1) constants: only N keeps rows apart
    _set(walk, step, rows, outputs=(0,))
    _set(walk, step, None, outputs=(1, 2))


def _embedding(walk: _Walk, step: Step) -> None:
    weight, indices = step.args[0], step.args[1]
    if walk.of(weight) is not None:
        raise Mixed(f"looks up a table that has rows along {walk.symbol}")
    _set(walk, step, walk.of(indices))


def _index_select(walk: _Walk, step: Step) -> None:
    x, along, index = step.args[0], int(step.args[1]), step.args[2]
    rank = len(walk.shape(x.name))
    along %= rank
    if walk.of(index) is not None:
        if walk.of(x) is not None:
            raise Mixed(f"indexes rows along {walk.symbol} by rows")
        return _set(walk, step, (along, walk.of(index)[1]))
    dim, inner = walk.of(x)
    if along == dim:
        raise Mixed(f"indexes across {walk.symbol}")
    _set(walk, step, (dim, inner))


def _gather(walk: _Walk, step: Step) -> None:
    x, along, index = step.args[0], int(step.args[1]), step.args[2]
    along %= len(walk.shape(index.name))
    rx, ri = walk.of(x), walk.of(index)
    if ri is None or (rx is not None and (rx != ri or along == rx[0])):
        raise Mixed(f"gathers across {walk.symbol}")
    _set(walk, step, ri)


def _index(walk: _Walk, step: Step) -> None:
    x, indices = step.args[0], list(step.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used or used != list(range(used[0], used[-1] + 1)):
        raise Mixed(f"indexes non-adjacent dims of a tensor with rows along {walk.symbol}")
    shapes = [walk.shape(indices[i].name) for i in used]
    width = max(len(s) for s in shapes)
    found = {walk.of(indices[i]) for i in used}
    if found != {None}:  # row-local indices into a tensor without rows: rows of the result
        if walk.of(x) is not None or len(found) != 1 or any(len(s) != width for s in shapes):
            raise Mixed(f"indexes with tensors that do not share the rows of {walk.symbol}")
        dim, inner = found.pop()
        return _set(walk, step, (used[0] + dim, inner))
    dim, inner = walk.of(x)
    if dim in used:
        raise Mixed(f"indexes across {walk.symbol}")
    _set(walk, step, (dim if dim < used[0] else dim - len(used) + width, inner))


def _topk(walk: _Walk, step: Step) -> None:
    x = step.args[0]
    dim, inner = walk.of(x)
    if int(_arg(step, 2, "dim", -1)) % len(walk.shape(x.name)) == dim:
        raise Mixed(f"sorts across {walk.symbol}")
    _set(walk, step, (dim, inner))


def _grid_sample(walk: _Walk, step: Step) -> None:
    rows = _leading(walk, step, (0, 1), 1)
    if walk.of(step.args[0]) != walk.of(step.args[1]):
        raise Mixed(f"samples a grid across {walk.symbol}")
    _set(walk, step, rows)


_HANDLERS = {
    **dict.fromkeys(REDUCE_DIMS, _reduce),
    **dict.fromkeys(SPATIAL, _spatial),
    "aten.view.default": _view,
    "aten._unsafe_view.default": _view,
    "aten.reshape.default": _view,
    "aten.permute.default": _permute,
    "aten.transpose.int": _transpose,
    "aten.t.default": _transpose,
    "aten.unsqueeze.default": _unsqueeze,
    "aten.squeeze.dim": _squeeze,
    "aten.squeeze.dims": _squeeze,
    "aten.squeeze.default": _squeeze,
    "aten.expand.default": _expand,
    "aten.slice.Tensor": _slice,
    "aten.narrow.default": _slice,
    "aten.select.int": _select,
    "aten.split.Tensor": _split,
    "aten.split_with_sizes.default": _split,
    "aten.unbind.int": _split,
    "aten.cat.default": _cat,
    "aten.constant_pad_nd.default": _pad,
    "aten.repeat.default": _repeat,
    "aten.flip.default": _flip,
    "aten.mm.default": _mm,
    "aten.addmm.default": _mm,
    "aten._addmm_activation.default": _mm,
    "aten.bmm.default": _bmm,
    "aten.scaled_dot_product_attention.default": _attention,
    "aten.convolution.default": _convolution,
    "aten.native_layer_norm.default": _layer_norm,
    "aten.native_group_norm.default": _group_norm,
    "aten._native_batch_norm_legit_no_training.default": _batch_norm,
    "aten.embedding.default": _embedding,
    "aten.index_select.default": _index_select,
    "aten.gather.default": _gather,
    "aten.index.Tensor": _index,
    "aten.grid_sampler_2d.default": _grid_sample,
    "aten.topk.default": _topk,
}
