"""Library views that are plain views: indexing by whole ``arange``s
(``x[arange(B)[:, None], arange(T)[None, :]]`` is ``x``) and ``as_strided`` of a row-major tensor
at its own row-major strides.

transformers 5 builds an attention mask's padding part by indexing the caller's mask with one
``arange`` per dim, each over the whole dim and laid along its own broadcast axis
(``masking_utils``: ``attention_mask[batch_arange[:, None, None, None], kv_arange[None, None,
None, :]]``, a ``[B, 1, 1, S]`` result). Every element of ``x`` is then read once, in place: the
``index`` is a view of ``x`` with the index tensors' broadcast axes inserted. As an ATen
``aten.index.Tensor`` it is a library call, which a library-free build refuses and a default
build launches as an ATen kernel; as views, the pointwise steps after it fuse it into their
kernel.

``indexes_as_views`` rewrites ``aten.index.Tensor(x, [i_0, ..., i_{n-1}])`` where every ``i_k``
(none left out) is ``arange(0, N_k)`` plus an int that makes it start at 0, through shape-only
views that keep every value (``splice.consecutive_positions``: ``unsqueeze``, a whole-dim
``slice``, ``view`` to the same count), with ``N_k`` the size of dim ``k`` of ``x`` (equal as a
size expression, so at every size the guards allow) and every dim of ``i_k`` one but the one that
holds the ``arange`` (its axis). With the axes distinct, ``out[j_0, ..., j_{R-1}, *rest] = x[j_{a_0},
..., j_{a_{n-1}}, *rest]``: ``x``'s first ``n`` dims permuted into the order of their axes (no
step where the order is already theirs), then a size-one dim unsqueezed at each axis no index
holds. The steps that made the indices go where nothing else reads them. No index can fall
outside its dim, so the rewrite changes no value and no error: it applies to every fused build.

``strides_as_views``: ``torch.export`` writes a view whose strides it had to pin as
``as_strided`` (timm's ConvNeXt head: ``x.mean((2, 3), keepdim=True)`` before its channels-last
LayerNorm, ``as_strided(mean, [B, C, 1, 1], [C, 1, C, C])``). A kernel cannot fold ``as_strided``
(it addresses storage), so the LayerNorm after it stayed a library call. Where the viewed tensor
is a step's fresh result (or an input, or a weight), the ``as_strided`` keeps its shape with offset
0 and gives the row-major strides of that shape (a dim of one element may have any): a restride
that export pins to the strides eager's result has, at which it reads every element where it is;
it is ``alias(x)``. A kernel writes its results row-major, so the kernels read them so too.

``gathers_as_slices``: BERT without ``token_type_ids`` looks up its buffered zeros as
``gather(token_type_ids.expand(1, -1), 1, position_ids[:, :seq])``, where the ``position_ids``
buffer holds ``0, 1, ..., P-1``: a gather along ``d`` by the first ``n`` of those positions, its
index one element along every other dim, is ``x[:1, ..., :n, ...]``: slices of ``x``. The index's
values are read from the weight when the build runs (the weights a bundle ships are the ones read).

``rolls_as_slices``: ``torch.roll`` along a static dim, as export writes it (an ``index_select``
by ``fmod(arange(n) + c, n)``; Swin's cyclic shift), is ``cat(x[c:], x[:c])``: two slices and a
cat, which fuse into the kernel after them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.codegen import index as ix
from aot.codegen.splice import consecutive_positions, spliced
from aot.program import fresh_name, is_view, producer_of, step_reads, tensor_specs
from aot.schema import Buf, Program, Step, StepKind, Sym, TensorSpec

INDEX = "aten.index.Tensor"
AS_STRIDED = "aten.as_strided.default"


def _axis(shape: tuple[str, ...], length) -> int | None:
    """The one dim of ``shape`` that may differ from one (it has ``length`` elements); None when
    another dim is not a static one, or the dim is ambiguous (a static length of one)."""
    wide = [d for d, s in enumerate(shape) if s != "1"]
    if len(wide) != 1 or not ix.same(ix.parse_size(shape[wide[0]]), length) or ix.same(length, ix.ONE):
        return None
    return wide[0]


def _as_views(step: Step, program: Program, producer: dict[str, int], specs) -> tuple[list, list] | None:
    """(the views of ``x`` that stand for the ``index`` step ``step``: (target, args, shape) with
    the last giving the step's result, the steps that made its indices) where every index is a
    whole ``arange`` on its own axis (module docstring); None otherwise."""
    if step.kind != StepKind.ATEN or step.target != INDEX or len(step.args) != 2 or step.kwargs:
        return None
    x, indices = step.args
    if not isinstance(x, Buf) or not isinstance(indices, (list, tuple)) or len(step.outputs) != 1:
        return None
    xs, out = specs.get(x.name), specs.get(step.outputs[0] or "")
    if xs is None or out is None or not indices or len(indices) > len(xs.shape) or out.dtype != xs.dtype:
        return None
    if not all(isinstance(i, Buf) for i in indices):
        return None
    x_shape = tuple(map(ix.parse_size, xs.shape))
    axes, walked = [], []
    ranks = [len(specs[i.name].shape) if i.name in specs else 0 for i in indices]
    rank = max(ranks)
    for k, idx in enumerate(indices):
        found = consecutive_positions(idx.name, program, producer, specs)
        spec = specs.get(idx.name)
        if found is None or spec is None or spec.dtype != "int64":
            return None
        start, end, chain = found
        if start != 0 or not ix.same(ix.parse_size(end), x_shape[k]):
            return None  # not the whole dim from its start: a slice, which stays an index here
        axis = _axis(spec.shape, x_shape[k])
        if axis is None:
            return None
        axes.append(axis + rank - len(spec.shape))  # broadcasting aligns the index shapes' ends
        walked.extend(chain)
    if len(set(axes)) != len(axes):
        return None  # two indices along one axis: a diagonal, no view of x
    n = len(indices)
    rest = list(xs.shape[n:])
    order = sorted(range(n), key=lambda k: axes[k])
    wanted = ["1"] * rank
    for k in range(n):
        wanted[axes[k]] = xs.shape[k]
    wanted += rest
    if len(out.shape) != len(wanted) or not all(
        ix.same(ix.parse_size(a), ix.parse_size(b)) for a, b in zip(out.shape, wanted)
    ):
        return None
    views: list[tuple[str, tuple, tuple[str, ...]]] = []
    shape = list(xs.shape)
    if order != list(range(n)):
        perm = [*order, *range(n, len(xs.shape))]
        shape = [xs.shape[d] for d in perm]
        views.append(("aten.permute.default", (perm,), tuple(shape)))
    for d in range(rank):
        if d not in axes:
            shape.insert(d, "1")
            views.append(("aten.unsqueeze.default", (d,), tuple(shape)))
    if not views:
        views.append(("aten.alias.default", (), tuple(shape)))
    return views, walked


def indexes_as_views(program: Program) -> tuple[Program, int]:
    """``program`` with every ``index`` by whole ``arange``s made views of the indexed tensor
    (module docstring), the index-making steps nothing else reads dropped; how many."""
    specs = tensor_specs(program)
    producer = producer_of(program.steps)
    buffers = dict(program.buffers)
    replaced: dict[int, list[Step]] = {}
    chains: set[int] = set()
    for i, s in enumerate(program.steps):
        found = _as_views(s, program, producer, specs)
        if found is None:
            continue
        views, walked = found
        dtype = specs[s.args[0].name].dtype
        here = s.args[0]
        out = s.outputs[0]
        group = []
        for n, (target, args, shape) in enumerate(views):
            name = out
            if n < len(views) - 1:
                name = fresh_name(f"{out}_view", specs, buffers)
                buffers[name] = TensorSpec(dtype, shape)
            group.append(Step(StepKind.ATEN, target, (here, *args), {}, (name,)))
            here = Buf(name)
        replaced[i] = group
        chains.update(walked)
    if not replaced:
        return program, 0
    return spliced(program, replaced, chains, buffers), len(replaced)


def _row_major(name: str, program: Program, producer: dict[str, int], specs) -> bool:
    """Whether ``name`` is laid out row-major from its start: an input or weight, or the fresh
    result of a step that is not a view (the fused programs' buffers are row-major unless their
    spec says an order)."""
    spec = specs.get(name)
    if spec is None or spec.order:
        return False
    i = producer.get(name)
    return i is None or not is_view(program.steps[i])


def _restride(step: Step, program: Program, producer: dict[str, int], specs) -> bool:
    """``step`` is an ``as_strided`` that is ``alias(x)`` (module docstring)."""
    if step.kind != StepKind.ATEN or step.target != AS_STRIDED or step.kwargs or len(step.outputs) != 1:
        return False
    if not 3 <= len(step.args) <= 4 or not isinstance(step.args[0], Buf):
        return False
    x, size, stride = step.args[:3]
    offset = step.args[3] if len(step.args) == 4 else 0
    if (
        offset not in (0, None)
        or not isinstance(size, (list, tuple))
        or not isinstance(stride, (list, tuple))
    ):
        return False
    if len(size) != len(stride) or not _row_major(x.name, program, producer, specs):
        return False
    try:
        sizes, strides = [ix.size_of(v) for v in size], [ix.size_of(v) for v in stride]
    except ix.InexpressibleIndex:
        return False
    shape = tuple(map(ix.parse_size, specs[x.name].shape))
    if len(shape) != len(sizes) or not all(ix.same(a, b) for a, b in zip(sizes, shape)):
        return False
    return all(
        ix.same(s, w) or ix.same(n, ix.ONE) for n, s, w in zip(sizes, strides, ix.strides(tuple(sizes)))
    )


def strides_as_views(program: Program) -> tuple[Program, int]:
    """``program`` with each ``as_strided`` that restrides a fresh tensor to its row-major strides an
    ``alias`` (module docstring); how many."""
    specs = tensor_specs(program)
    producer = producer_of(program.steps)
    steps, n = [], 0
    for s in program.steps:
        if _restride(s, program, producer, specs):
            s = Step(StepKind.ATEN, "aten.alias.default", (s.args[0],), {}, s.outputs)
            n += 1
        steps.append(s)
    return (replace(program, steps=tuple(steps)), n) if n else (program, 0)


GATHER = "aten.gather.default"
SLICE = "aten.slice.Tensor"


def _leading_positions(name: str, dim: int, program: Program, producer, specs, weights) -> str | None:
    """The end ``n`` (size text) where ``name`` is ``W[..., :n]`` along ``dim`` of an int64 weight
    ``W`` of one element along every other dim that holds ``0, 1, ..., P-1`` along ``dim``; None
    otherwise."""
    import torch

    i = producer.get(name)
    if i is None:
        return None
    step = program.steps[i]
    if step.kind != StepKind.ATEN or step.target != SLICE or step.kwargs or not isinstance(step.args[0], Buf):
        return None
    args = [*step.args[1:], None, None, None, None][:4]
    here, there = specs.get(name), specs.get(step.args[0].name)
    value = weights.get(step.args[0].name)
    if (
        here is None
        or there is None
        or value is None
        or there.dtype != "int64"
        or len(there.shape) != value.dim()
    ):
        return None
    rank = len(there.shape)
    if (
        type(args[0]) is not int
        or args[0] % rank != dim
        or args[1] not in (0, None)
        or args[3] not in (1, None)
    ):
        return None
    if any(d != "1" for k, d in enumerate(there.shape) if k != dim):
        return None
    if not torch.equal(value.reshape(-1), torch.arange(value.numel(), dtype=value.dtype)):
        return None
    return here.shape[dim]


def gathers_as_slices(program: Program, weights) -> tuple[Program, int]:
    """``program`` with each ``gather`` by a weight's leading positions made slices of its input
    (module docstring); how many. ``weights``: name -> tensor, the values the bundle ships."""
    specs = tensor_specs(program)
    producer = producer_of(program.steps)
    buffers = dict(program.buffers)
    steps: list[Step] = []
    n = 0
    for s in program.steps:
        x, dim, idx = ([*s.args, None, None, None])[:3]
        xs = specs.get(x.name) if isinstance(x, Buf) else None
        out = specs.get(s.outputs[0] or "") if s.outputs else None
        if (
            s.kind != StepKind.ATEN
            or s.target != GATHER
            or len(s.args) != 3
            or set(s.kwargs) - {"sparse_grad"}
            or s.kwargs.get("sparse_grad")
            or xs is None
            or out is None
            or type(dim) is not int
            or not isinstance(idx, Buf)
            or len(out.shape) != len(xs.shape)
        ):
            steps.append(s)
            continue
        dim %= len(xs.shape)
        end = _leading_positions(idx.name, dim, program, producer, specs, weights)
        if end is None or not all(d == "1" for k, d in enumerate(out.shape) if k != dim):
            steps.append(s)
            continue
        cuts = [(k, "1") for k, d in enumerate(xs.shape) if k != dim and d != "1"] + [(dim, end)]
        here, shape = x, list(xs.shape)
        for j, (k, stop) in enumerate(cuts):
            shape[k] = stop
            name = s.outputs[0]
            if j < len(cuts) - 1:
                name = fresh_name(f"{s.outputs[0]}_cut", specs, buffers)
                buffers[name] = TensorSpec(xs.dtype, tuple(shape))
            stop_arg = int(stop) if stop.isdigit() else Sym(stop)
            steps.append(Step(StepKind.ATEN, SLICE, (here, k, 0, stop_arg), {}, (name,)))
            here = Buf(name)
        n += 1
    return (replace(program, steps=tuple(steps), buffers=buffers), n) if n else (program, 0)


ROLL_SELECT = "aten.index_select.default"
CAT = "aten.cat.default"
_ROLL_ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


def _roll_shift(idx: str, n: int, program: Program, producer: dict[str, int]) -> int | None:
    """``c`` where ``idx`` is ``fmod(arange(n) + c, n)`` (or ``remainder``) with ``0 <= c``: the
    positions ``torch.roll`` indexes by; None otherwise."""

    def made(name: Any, targets) -> Step | None:
        at = producer.get(name.name) if isinstance(name, Buf) else None
        step = program.steps[at] if at is not None else None
        return step if step is not None and step.kind == StepKind.ATEN and step.target in targets else None

    mod = made(Buf(idx), ("aten.fmod.Scalar", "aten.remainder.Scalar"))
    if mod is None or mod.kwargs or len(mod.args) != 2 or mod.args[1] != n:
        return None
    add = made(mod.args[0], ("aten.add.Scalar", "aten.add.Tensor"))
    if add is None or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1 or type(add.args[1]) is not int:
        return None
    arange = made(add.args[0], _ROLL_ARANGES)
    if arange is None or set(arange.kwargs) - {"dtype", "device", "layout", "pin_memory"}:
        return None
    bounds = list(arange.args) + [1] * (3 - len(arange.args))
    start, end, step = (0, bounds[0], 1) if arange.target == "aten.arange.default" else bounds[:3]
    if (start, end, step) != (0, n, 1) or add.args[1] < 0:
        return None
    return add.args[1] % n


def rolls_as_slices(program: Program) -> tuple[Program, int]:
    """``program`` with each ``torch.roll`` (as export writes it: ``index_select(x, d,
    fmod(arange(n) + c, n))``; Swin's cyclic shift of its windows) made a ``cat`` of two slices of
    ``x`` along ``d``, ``x[c:]`` then ``x[:c]``, which the kernel after it reads in place; how many.
    The index's steps go where nothing else reads them. Every fused build: an index_select is a
    library call, the slices and the cat fuse."""
    specs = tensor_specs(program)
    producer = producer_of(program.steps)
    buffers = dict(program.buffers)
    steps: list[Step] = []
    count = 0
    for s in program.steps:
        x, dim, idx = ([*s.args, None, None, None])[:3]
        xs = specs.get(x.name) if isinstance(x, Buf) else None
        if (
            s.kind != StepKind.ATEN
            or s.target != ROLL_SELECT
            or s.kwargs
            or xs is None
            or type(dim) is not int
            or not isinstance(idx, Buf)
            or not s.outputs
            or not -len(xs.shape) <= dim < len(xs.shape)
            or not xs.shape[dim].isdigit()
        ):
            steps.append(s)
            continue
        dim %= len(xs.shape)
        n = int(xs.shape[dim])
        shift = _roll_shift(idx.name, n, program, producer)
        if shift is None:
            steps.append(s)
            continue
        pieces = []
        for start, end in ((shift, n), (0, shift)):
            if end <= start:
                continue
            name = fresh_name(f"{s.outputs[0]}_roll", specs, buffers)
            buffers[name] = replace(
                xs, shape=tuple(str(end - start) if k == dim else d for k, d in enumerate(xs.shape)), order=()
            )
            steps.append(Step(StepKind.ATEN, SLICE, (x, dim, start, end), {}, (name,)))
            pieces.append(Buf(name))
        steps.append(Step(StepKind.ATEN, CAT, (pieces, dim), {}, s.outputs))
        count += 1
    return (replace(program, steps=tuple(steps), buffers=buffers), count) if count else (program, 0)


EXTREMES = {"aten.max.dim": "aten.amax.default", "aten.min.dim": "aten.amin.default"}


def extremes_as_amax(program: Program) -> tuple[Program, int]:
    """``program`` with each ``max(x, dim)`` or ``min(x, dim)`` whose indices nothing reads
    (Hiera's query pooling, ``x.view(...).max(dim=1).values``) an ``amax``/``amin`` over that dim,
    a reduction the fuser takes (the same values, NaN propagated alike); how many. Every fused
    build: ``max.dim`` is a library call."""
    read = {b for s in program.steps for b in step_reads(s)} | set(program.outputs)
    steps: list[Step] = []
    unread: set[str | None] = set()  # the indices of the steps rewritten: no step makes them now
    count = 0
    for s in program.steps:
        dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
        keep = s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim", False)
        if (
            s.kind == StepKind.ATEN
            and s.target in EXTREMES
            and len(s.outputs) == 2
            and s.outputs[0] is not None
            and (s.outputs[1] is None or s.outputs[1] not in read)
            and isinstance(s.args[0], Buf)
            and type(dim) is int
            and type(keep) is bool
            and not s.kwargs.keys() - {"dim", "keepdim"}
        ):
            steps.append(
                Step(StepKind.ATEN, EXTREMES[s.target], (s.args[0], [dim], keep), {}, (s.outputs[0],))
            )
            unread.add(s.outputs[1])
            count += 1
        else:
            steps.append(s)
    if not count:
        return program, 0
    buffers = {k: v for k, v in program.buffers.items() if k not in unread}
    return replace(program, steps=tuple(steps), buffers=buffers), count
