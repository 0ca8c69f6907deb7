"""The argument contract of every allowlisted op: what its arguments must satisfy before its ATen
kernel sees them.

ATen validates most arguments itself (shapes that broadcast, dims in range, indices within their
tensor on the CPU), but some kernels trust theirs: batch norm reads ``weight``, ``bias`` and the
running statistics at every channel of its input whatever their length; ``grid_sampler_2d`` with
an interpolation or padding mode outside 0..2 hands back its output unwritten (freed memory of
earlier calls); attention's CPU kernel reads the value at every key position whatever its length;
``col2im`` with a padding of 2**31 never returns; integer ``trunc`` division of ``INT_MIN`` by
``-1`` is a hardware trap (SIGFPE) on the CPU. A bundle's program chooses every argument, so each
allowlisted op has a ``Contract`` here (``aot.aten.resolve_op`` refuses an op without one), and
``tests/aot/test_op_contracts.py`` drives every allowlisted op with hostile arguments under guard
bytes and heap canaries.

A contract is a tuple of checks, each over named arguments of the op's schema. ``aot.aten.AtenCall``
(through ``ContractChecker``, the one checker) evaluates a check at load when every argument it reads is known there (a
constant, a weight, or a tensor of static declared shape) and raises ``BundleError`` naming the
step, the op and the argument; the others run on every call, on the values the step is about to
get: a few comparisons, or one reduction for integer division (``GuardError``: the caller's values
trap, not the bundle). ``validated`` says in words what ATen checks itself, confirmed by the fuzz.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# A size or count argument beyond this is no model's (``aot.spec.MAX_DIM``); ATen's kernels compute
# some of them in 32 bits (col2im with a padding of 2**31 loops for ever).
MAX_SIZE = (1 << 31) - 1
# Kernel sizes, strides, dilations and paddings of convolutions, pools and folds: far above any
# model's (a 1-D audio convolution's padding is in the hundreds).
MAX_WINDOW = 1 << 20
UNKNOWN = object()  # an argument whose value is known only per call


@dataclass(frozen=True)
class Check:
    """``test(*values)`` over the arguments ``args`` (schema names) gives a problem text or None.
    ``caller``: a failure comes from the call's values (``GuardError``), not from the program."""

    args: tuple[str, ...]
    test: Callable[..., str | None]
    caller: bool = False
    # The op's kernel trusts what this checks (ATen does not): checked on every call whenever it
    # reads a tensor a call computes, even where the program's declared shapes passed at load.
    always: bool = False


@dataclass(frozen=True)
class Contract:
    checks: tuple[Check, ...] = ()
    validated: str = "shapes and dtypes (ATen)"


def _ints(value: Any) -> list[int] | None:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value) if all(type(v) is int for v in value) else None
    return [value] if type(value) is int else None


def sizes(arg: str, infer: bool = False, high: int = MAX_SIZE, keep: bool = False) -> Check:
    """A size list: every entry 0..high; ``-1`` once where ``infer`` (view, reshape: the size
    inferred), anywhere where ``keep`` (expand: that dim keeps its size)."""
    low = -1 if infer or keep else 0

    def test(value: Any) -> str | None:
        values = _ints(value)
        if values is None:
            return f"expected a list of ints, got {str(value)[:40]}"
        bad = [v for v in values if not low <= v <= high]
        if bad:
            return f"expected sizes in {low}..{high}, got {bad[0]}"
        if infer and values.count(-1) > 1:
            return "expected at most one -1 (inferred size)"
        return None

    return Check((arg,), test)


def positive(arg: str, high: int = MAX_WINDOW) -> Check:
    """An int or int list whose entries are 1..high (kernel sizes, strides, dilations, groups)."""

    def test(value: Any) -> str | None:
        values = _ints(value)
        if values is None or value is None:
            return f"expected a positive int or list of them, got {str(value)[:40]}"
        bad = [v for v in values if not 1 <= v <= high]
        return f"expected values in 1..{high}, got {bad[0]}" if bad else None

    return Check((arg,), test)


def bounded(arg: str, low: int = -MAX_SIZE, high: int = MAX_SIZE) -> Check:
    """An int or int list (paddings, offsets, starts) within ``low..high``."""

    def test(value: Any) -> str | None:
        values = _ints(value)
        if values is None:
            return f"expected an int or a list of ints, got {str(value)[:40]}"
        bad = [v for v in values if not low <= v <= high]
        return f"expected values in {low}..{high}, got {bad[0]}" if bad else None

    return Check((arg,), test)


def choice(arg: str, low: int, high: int) -> Check:
    """An enum passed as an int: ``low..high``."""

    def test(value: Any) -> str | None:
        if type(value) is not int or not low <= value <= high:
            return f"expected one of {low}..{high}, got {str(value)[:40]}"
        return None

    return Check((arg,), test)


def one_of(arg: str, values: tuple) -> Check:
    def test(value: Any) -> str | None:
        return None if value in values else f"expected one of {list(values)}, got {str(value)[:40]}"

    return Check((arg,), test)


def dims(arg: str, of: str = "self", optional: bool = False) -> Check:
    """A dim (or list of distinct dims) in ``-rank..rank-1`` of tensor ``of`` (rank 0 counts as 1)."""

    def test(value: Any, tensor: Any) -> str | None:
        if value is None and optional:
            return None
        values = _ints(value)
        if values is None or value is None:
            return f"expected a dim or a list of dims, got {str(value)[:40]}"
        if isinstance(tensor, (list, tuple)) and tensor:
            tensor = tensor[0]
        if not isinstance(tensor, torch.Tensor):
            return None
        rank = max(tensor.dim(), 1)
        bad = [d for d in values if not -rank <= d < rank]
        if bad:
            return f"expected dims in {-rank}..{rank - 1} of {of} (rank {tensor.dim()}), got {bad[0]}"
        if len({d % rank for d in values}) != len(values):
            return f"expected distinct dims, got {values[:8]}"
        return None

    return Check((arg, of), test)


def per_channel(args: tuple[str, ...], of: str, dim: int) -> tuple[Check, ...]:
    """Each tensor of ``args`` (optional) holds exactly one value per channel of ``of``'s dim
    ``dim``: batch norm's kernel reads them at every channel, whatever their length."""

    def check(arg: str) -> Check:
        def test(value: Any, tensor: Any) -> str | None:
            if value is None or not isinstance(tensor, torch.Tensor):
                return None
            if not isinstance(value, torch.Tensor):
                return f"expected a tensor or None, got {type(value).__name__}"
            if tensor.dim() <= dim:
                return f"expected {of} of rank > {dim}, got rank {tensor.dim()}"
            channels = tensor.shape[dim]
            if value.dim() != 1 or value.shape[0] != channels:
                return (
                    f"expected a vector of {channels} values (one per channel of {of} dim {dim}), "
                    f"got shape {list(value.shape)}"
                )
            return None

        return Check((arg, of), test, always=True)

    return tuple(check(a) for a in args)


def _integral(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and not t.dtype.is_complex


def integer_division(rounding: str | None = None) -> Check:
    """Integer division on the CPU: by zero ATen refuses (an error the call's values cause, not the
    bundle), and ``trunc`` division of the dtype's minimum by -1 is a hardware trap (SIGFPE: the
    process dies; floor division, ``remainder`` and ``fmod`` define it: the minimum, 0, 0). A
    ``GuardError``, not a defined result: the CUDA kernels wrap to the minimum instead, and a
    bundle must not answer differently on the two devices, so the caller learns it passed values
    the model's integer arithmetic cannot take. Checked per call for integer tensors on the CPU
    (one or two reductions); float division is untouched."""
    names = ("self", "other") + ((rounding,) if rounding else ())

    def test(a: Any, b: Any, mode: Any = None) -> str | None:
        if (
            not isinstance(a, torch.Tensor)
            or a.device.type != "cpu"
            or not _integral(a)
            or a.dtype == torch.bool
        ):
            return None
        if isinstance(b, torch.Tensor):
            if not _integral(b) or b.dtype == torch.bool:
                return None
        elif type(b) is not int:
            return None
        if rounding and mode is None:
            return None  # true division: a float result
        divisor = b if isinstance(b, torch.Tensor) else torch.tensor(b)
        if bool((divisor == 0).any()):
            return "integer division by zero"
        if mode != "trunc" or a.dtype == torch.uint8 or not bool((divisor == -1).any()):
            return None
        lowest = torch.iinfo(torch.promote_types(a.dtype, divisor.dtype)).min
        if bool(((a == lowest) & (divisor == -1)).any()):
            return f"integer division of {lowest} (the minimum of {str(a.dtype).removeprefix('torch.')}) by -1 overflows"
        return None

    return Check(names, test, caller=True, always=True)


def attention_shapes() -> Check:
    """Query [..., L, E], key [..., S, E], value [..., S, Ev] (the same leading dims, or query's
    and key's broadcasting against each other, as a multi-query model's one KV head against its
    query heads: ATen takes its math path for those; with ``enable_gqa``, query's heads a multiple
    of key's), the mask broadcasting to [..., L, S]: the CPU kernel reads the value at every key
    position whatever its length."""

    def test(q: Any, k: Any, v: Any, mask: Any, gqa: Any) -> str | None:
        if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
            return None
        qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
        if len(qs) < 2 or len(ks) != len(qs) or len(vs) != len(qs):
            return f"expected query, key and value of one rank >= 2, got {len(qs)}, {len(ks)}, {len(vs)}"
        if ks[:-1] != vs[:-1]:
            return f"expected key {list(ks)} and value {list(vs)} of the same positions"
        if qs[-1] != ks[-1]:
            return f"expected query {list(qs)} and key {list(ks)} of the same last dim"
        lead = qs[:-2]
        if qs[:-2] != ks[:-2]:
            if gqa is True:
                if not (len(qs) >= 3 and qs[:-3] == ks[:-3] and ks[-3] > 0 and qs[-3] % ks[-3] == 0):
                    return f"expected query {list(qs)}'s heads a multiple of key {list(ks)}'s, the rest alike"
            # (an empty side broadcasts in ATen to a result of the other's size, never written)
            elif all((a == b or 1 in (a, b)) and a > 0 and b > 0 for a, b in zip(qs[:-2], ks[:-2])):
                lead = tuple(max(a, b) for a, b in zip(qs[:-2], ks[:-2]))
            else:
                return (
                    f"expected query {list(qs)} and key {list(ks)} of the same leading dims, or "
                    "non-empty ones broadcasting"
                )
        if type(mask) is torch.Tensor:
            full = (*lead, qs[-2], ks[-2])
            ms = tuple(mask.shape)
            if len(ms) > len(full) or any(m not in (1, f) for m, f in zip(reversed(ms), reversed(full))):
                return f"expected a mask that broadcasts to {list(full)}, got {list(ms)}"
        return None

    return Check(("query", "key", "value", "attn_mask", "enable_gqa"), test, always=True)


def grouped_mm_operands() -> Check:
    """Rows [S, K] grouped by expert, stacked weights [E, K, N] and ``offs``: E int32 ends of the
    groups, non-decreasing, the last S; no bias, the rows' dtype out. What a Mixture-of-Experts
    layer calls (``aot.experts``). The ends are values a call computes: on the CPU they are
    checked per call (E values), since the kernel takes its row ranges from them and leaves the
    rows past the last end unwritten."""

    def test(rows: Any, weights: Any, offs: Any, bias: Any, out_dtype: Any) -> str | None:
        if not (type(rows) is torch.Tensor and type(weights) is torch.Tensor):
            return None
        if rows.dim() != 2 or weights.dim() != 3:
            return (
                f"expected rows of rank 2 and weights of rank 3, got ranks {rows.dim()} and {weights.dim()}"
            )
        if rows.shape[1] != weights.shape[1]:
            return f"expected rows [S, {weights.shape[1]}] for weights {list(weights.shape)}, got {list(rows.shape)}"
        if bias is not None or out_dtype is not None:
            return "expected no bias and no out_dtype"
        if type(offs) is not torch.Tensor:
            return f"expected offs as a tensor, got {type(offs).__name__}"
        if offs.dtype != torch.int32 or tuple(offs.shape) != (weights.shape[0],):
            return f"expected offs int32[{weights.shape[0]}], got {str(offs.dtype).removeprefix('torch.')}{list(offs.shape)}"
        if offs.device.type != "cpu" or offs.numel() == 0:
            return None
        ends = offs.to(torch.int64)
        if bool((ends < 0).any()) or int(ends[-1]) != rows.shape[0] or bool((ends[1:] < ends[:-1]).any()):
            return f"expected offs non-decreasing from 0 to {rows.shape[0]} (every row in a group), got {ends[:8].tolist()}"
        return None

    return Check(("self", "mat2", "offs", "bias", "out_dtype"), test, always=True)


def _index_dims(dim_arg: str = "dim") -> Contract:
    return Contract((dims(dim_arg),), "index values against the indexed dim (ATen, CPU)")


_NONE = Contract()
_DIM = Contract((dims("dim"),))
_DIM_LIST = Contract((dims("dim", optional=True),))
_SOFTMAX = Contract((dims("dim"), one_of("half_to_float", (False,))))
_DIV_MODE = Contract((integer_division("rounding_mode"),))
_INT_DIV = Contract((integer_division(),))
_POOL = (positive("kernel_size"), sizes("stride", high=MAX_WINDOW), sizes("padding", high=MAX_WINDOW))

# Elementwise ops, whole-tensor reductions and views without arguments: tensors that broadcast
# (or match) and numbers, all checked by ATen.
ELEMENTWISE = (
    "aten.abs.default",
    "aten.acos.default",
    "aten.acosh.default",
    "aten.add.Scalar",
    "aten.add.Tensor",
    "aten.alias.default",
    "aten.any.default",
    "aten.asin.default",
    "aten.asinh.default",
    "aten.atan.default",
    "aten.atan2.default",
    "aten.atanh.default",
    "aten.bitwise_and.Scalar",
    "aten.bitwise_and.Tensor",
    "aten.bitwise_not.default",
    "aten.bitwise_or.Scalar",
    "aten.bitwise_or.Tensor",
    "aten.bitwise_xor.Scalar",
    "aten.bitwise_xor.Tensor",
    "aten.ceil.default",
    "aten.clamp.Tensor",
    "aten.clamp.default",
    "aten.clamp_max.default",
    "aten.clamp_min.default",
    "aten.clone.default",
    "aten.copy.default",
    "aten.cos.default",
    "aten.cosh.default",
    "aten.detach.default",
    "aten.div.Scalar",
    "aten.div.Tensor",
    "aten.elu.default",
    "aten.eq.Scalar",
    "aten.eq.Tensor",
    "aten.erf.default",
    "aten.exp.default",
    "aten.exp2.default",
    "aten.expm1.default",
    "aten.fill.Scalar",
    "aten.floor.default",
    "aten.ge.Scalar",
    "aten.ge.Tensor",
    "aten.gelu.default",
    "aten.gt.Scalar",
    "aten.gt.Tensor",
    "aten.hardsigmoid.default",
    "aten.hardswish.default",
    "aten.hardtanh.default",
    "aten.isinf.default",
    "aten.isnan.default",
    "aten.le.Scalar",
    "aten.le.Tensor",
    "aten.leaky_relu.default",
    "aten.lift_fresh_copy.default",
    "aten.log.default",
    "aten.log10.default",
    "aten.log1p.default",
    "aten.log2.default",
    "aten.logical_and.default",
    "aten.logical_not.default",
    "aten.logical_or.default",
    "aten.logical_xor.default",
    "aten.lt.Scalar",
    "aten.lt.Tensor",
    "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor",
    "aten.masked_scatter.default",
    "aten.maximum.default",
    "aten.mean.default",
    "aten.minimum.default",
    "aten.mish.default",
    "aten.mul.Scalar",
    "aten.mul.Tensor",
    "aten.ne.Scalar",
    "aten.ne.Tensor",
    "aten.neg.default",
    "aten.ones_like.default",
    "aten.pow.Scalar",
    "aten.pow.Tensor_Scalar",
    "aten.pow.Tensor_Tensor",
    "aten.prod.default",
    "aten.reciprocal.default",
    "aten.relu.default",
    "aten.relu6.default",
    "aten.round.default",
    "aten.rsqrt.default",
    "aten.rsub.Scalar",
    "aten.rsub.Tensor",
    "aten.sigmoid.default",
    "aten.sign.default",
    "aten.silu.default",
    "aten.sin.default",
    "aten.sinh.default",
    "aten.softplus.default",
    "aten.sqrt.default",
    "aten.squeeze.default",
    "aten.sub.Scalar",
    "aten.sub.Tensor",
    "aten.sum.default",
    "aten.sym_numel.default",
    "aten.sym_storage_offset.default",
    "aten.t.default",
    "aten.tan.default",
    "aten.tanh.default",
    "aten.trunc.default",
    "aten.where.self",
    "aten.zeros_like.default",
)
MATMULS = (
    "aten._addmm_activation.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.mm.default",
)

CONTRACTS: dict[str, Contract] = {
    **dict.fromkeys(ELEMENTWISE, _NONE),
    **dict.fromkeys(MATMULS, Contract(validated="ranks and inner sizes that agree (ATen)")),
    "aten._adaptive_avg_pool2d.default": Contract((sizes("output_size"),)),
    "aten._adaptive_avg_pool3d.default": Contract((sizes("output_size"),)),
    "aten._local_scalar_dense.default": Contract(validated="a one-element tensor (ATen)"),
    "aten._log_softmax.default": _SOFTMAX,
    "aten._native_batch_norm_legit_no_training.default": Contract(
        per_channel(("weight", "bias", "running_mean", "running_var"), of="input", dim=1),
        "the input's rank (ATen); per-channel lengths are not checked by its kernel",
    ),
    "aten._softmax.default": _SOFTMAX,
    "aten._to_copy.default": Contract(validated="dtype and memory format (ATen)"),
    "aten.amax.default": _DIM_LIST,
    "aten.amin.default": _DIM_LIST,
    "aten.any.dim": _DIM,
    "aten.any.dims": _DIM_LIST,
    "aten.arange.default": Contract(validated="a finite end (ATen); its size: the memory bound"),
    "aten.arange.start": Contract(validated="finite bounds in order (ATen); its size: the memory bound"),
    "aten.arange.start_step": Contract(validated="a non-zero step whose sign fits the bounds (ATen)"),
    "aten.argmax.default": _DIM_LIST,
    "aten.argmin.default": _DIM_LIST,
    "aten.as_strided.default": Contract(
        (sizes("size"), sizes("stride"), bounded("storage_offset", 0)),
        "the view within its storage (aot.aten.check_in_storage)",
    ),
    "aten.avg_pool2d.default": Contract((*_POOL, bounded("divisor_override", 1))),
    "aten.avg_pool3d.default": Contract((*_POOL, bounded("divisor_override", 1))),
    "aten.cat.default": Contract((dims("dim", of="tensors"),), "same ranks and sizes off the dim (ATen)"),
    "aten.col2im.default": Contract(
        (
            sizes("output_size"),
            positive("kernel_size"),
            positive("dilation"),
            sizes("padding"),
            positive("stride"),
        ),
        "the input's blocks against the output size (ATen)",
    ),
    "aten.constant_pad_nd.default": Contract(
        (bounded("pad", -MAX_SIZE, MAX_WINDOW),), "no negative size after padding (ATen)"
    ),
    "aten.convolution.default": Contract(
        (
            positive("stride"),
            sizes("padding"),
            positive("dilation"),
            sizes("output_padding"),
            positive("groups"),
        ),
        "weight and bias against the input's channels and groups (ATen)",
    ),
    "aten.cumsum.default": _DIM,
    "aten.cumprod.default": _DIM,
    "aten.linalg_vector_norm.default": Contract((dims("dim", optional=True),), "ord and dtype (ATen)"),
    "aten.histc.default": Contract(
        (positive("bins", MAX_SIZE),), "a finite range, max above min (ATen); its size: the memory bound"
    ),
    "aten.erfinv.default": _NONE,
    "aten._grouped_mm.default": Contract(
        (grouped_mm_operands(),), "dtypes alike, strides of 16 bytes (ATen)"
    ),
    "aten._cdist_forward.default": Contract(
        (one_of("compute_mode", (None, 0, 1, 2)),), "p >= 0 and the inputs' widths (ATen)"
    ),
    "aten.diagonal.default": Contract((dims("dim1"), dims("dim2"), bounded("offset"))),
    "aten.div.Tensor_mode": _DIV_MODE,
    "aten.div.Scalar_mode": _DIV_MODE,
    "aten.embedding.default": Contract(
        validated="indices within the table (ATen on the CPU; see aot.loader.values)"
    ),
    "aten.expand.default": Contract((sizes("size", keep=True),)),
    "aten.flip.default": Contract((dims("dims"),)),
    "aten.fmod.Scalar": _INT_DIV,
    "aten.fmod.Tensor": _INT_DIV,
    "aten.full.default": Contract((sizes("size"),)),
    "aten.gather.default": _index_dims(),
    "aten.grid_sampler_2d.default": Contract(
        (choice("interpolation_mode", 0, 2), choice("padding_mode", 0, 2)),
        "input and grid shapes (ATen); its kernel leaves the output unwritten for other modes",
    ),
    "aten.index.Tensor": Contract(validated="index values and counts (ATen, CPU)"),
    "aten.index_put.default": Contract(validated="index values and counts (ATen, CPU)"),
    "aten.index_select.default": _index_dims(),
    "aten.logsumexp.default": _DIM_LIST,
    "aten.max.dim": _DIM,
    "aten.max_pool2d_with_indices.default": Contract((*_POOL, positive("dilation"))),
    "aten.max_pool3d_with_indices.default": Contract((*_POOL, positive("dilation"))),
    "aten.mean.dim": _DIM_LIST,
    "aten.min.dim": _DIM,
    "aten.narrow.default": Contract((dims("dim"), bounded("start"), sizes("length"))),
    "aten.native_group_norm.default": Contract(
        (sizes("N"), sizes("C"), sizes("HxW"), positive("group", MAX_SIZE)),
        "weight, bias and N*C*HxW against the input (ATen)",
    ),
    "aten.native_layer_norm.default": Contract((sizes("normalized_shape"),), "weight and bias shapes (ATen)"),
    "aten.new_full.default": Contract((sizes("size"),)),
    "aten.new_ones.default": Contract((sizes("size"),)),
    "aten.new_zeros.default": Contract((sizes("size"),)),
    "aten.nonzero.default": Contract(validated="none needed: its size is what it finds"),
    "aten.ones.default": Contract((sizes("size"),)),
    "aten.permute.default": Contract((dims("dims"),)),
    "aten.prod.dim_int": _DIM,
    "aten.reflection_pad1d.default": Contract(
        (bounded("padding", -MAX_SIZE, MAX_WINDOW),), "padding below the input's size (ATen)"
    ),
    "aten.reflection_pad2d.default": Contract(
        (bounded("padding", -MAX_SIZE, MAX_WINDOW),), "padding below the input's size (ATen)"
    ),
    "aten.reflection_pad3d.default": Contract(
        (bounded("padding", -MAX_SIZE, MAX_WINDOW),), "padding below the input's size (ATen)"
    ),
    "aten.remainder.Scalar": _INT_DIV,
    "aten.remainder.Tensor": _INT_DIV,
    "aten.repeat.default": Contract((sizes("repeats"),)),
    "aten.replication_pad2d.default": Contract((bounded("padding", -MAX_SIZE, MAX_WINDOW),)),
    "aten.replication_pad3d.default": Contract((bounded("padding", -MAX_SIZE, MAX_WINDOW),)),
    "aten.reshape.default": Contract((sizes("shape", infer=True),)),
    "aten._unsafe_view.default": Contract((sizes("size", infer=True),), "run as reshape (aot.aten)"),
    "aten.view.default": Contract((sizes("size", infer=True),), "run as reshape (aot.aten)"),
    "aten.scaled_dot_product_attention.default": Contract(
        (one_of("dropout_p", (0, 0.0)), attention_shapes()), "dtypes (ATen); its kernel trusts the shapes"
    ),
    "aten.scatter.src": _index_dims(),
    "aten.scatter.value": _index_dims(),
    "aten.scatter_add.default": _index_dims(),
    "aten.scatter_reduce.two": Contract(
        (dims("dim"), one_of("reduce", ("sum", "prod", "mean", "amax", "amin"))),
        "index values against the dim (ATen, CPU)",
    ),
    "aten.select.int": Contract((dims("dim"), bounded("index"))),
    "aten.select_scatter.default": Contract((dims("dim"), bounded("index"))),
    "aten.slice.Tensor": Contract((dims("dim"), positive("step", MAX_SIZE))),
    "aten.slice_scatter.default": Contract((dims("dim"), positive("step", MAX_SIZE))),
    "aten.sort.default": _DIM,
    "aten.split.Tensor": Contract((positive("split_size", MAX_SIZE), dims("dim"))),
    "aten.split_with_sizes.default": Contract((sizes("split_sizes"), dims("dim"))),
    "aten.squeeze.dim": _DIM,
    "aten.squeeze.dims": _DIM,
    "aten.sum.dim_IntList": _DIM_LIST,
    "aten.sym_size.int": _DIM,
    "aten.sym_stride.int": _DIM,
    "aten.topk.default": Contract((sizes("k"), dims("dim")), "k within the dim (ATen)"),
    "aten.transpose.int": Contract((dims("dim0"), dims("dim1"))),
    "aten.unbind.int": _DIM,
    "aten.unsqueeze.default": Contract(validated="the dim within rank + 1 (ATen)"),
    "aten.upsample_bilinear2d.vec": Contract((sizes("output_size"),), "scale factors (ATen)"),
    "aten._upsample_bicubic2d_aa.default": Contract((sizes("output_size"),), "scale factors (ATen)"),
    "aten._upsample_bilinear2d_aa.default": Contract((sizes("output_size"),), "scale factors (ATen)"),
    "aten.upsample_nearest2d.vec": Contract((sizes("output_size"),), "scale factors (ATen)"),
    "aten.var.correction": _DIM_LIST,
    "aten.var.dim": _DIM_LIST,
    "aten.var_mean.correction": _DIM_LIST,
    "aten.full_like.default": _NONE,
    "aten.scalar_tensor.default": _NONE,
    "aten.zeros.default": Contract((sizes("size"),)),
}
