"""Drive allowlisted ops with hostile arguments, the way a bundle's step would call them
(``aot.aten.AtenCall``: contract checks at load, then per call), under heap canaries.

Run as a script (``python -m tests.aot.fuzz_ops_driver OP...``) in a process of its own with its
address space bounded, so that a crash or a runaway allocation ends this process, not pytest's.
For each op: a valid call first (it must run), then every argument replaced in turn by hostile
values (wrong lengths and ranks, enum values out of range, negative and huge sizes, dims and
indices out of range, NaN). Each case prints one JSON line before it runs (so a crash names it)
and one with its outcome: ``refused`` (an ``AotError`` of the contract, or the error ATen raises,
which the loader reports as a ``BundleError``) or ``ran``. A case that ran is run again after the
freed heap is filled with another byte pattern: an op that reads memory it does not own (an
unwritten output, a read past a short tensor) answers differently, and the line says ``leak``.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from typing import Any

import torch

from aot.allowed_ops import ALLOWED_OPS
from aot.aten import AtenCall
from aot.errors import AotError
from aot.schema import Buf, Step, StepKind

ADDRESS_SPACE = 6 << 30  # bytes: a hostile size fails to allocate instead of taking the machine
GUARD = 4096  # bytes of canary around every tensor argument
# Ops whose result depends on where their argument lies in its storage (its offset and size), so
# guard bytes around it change what they legitimately compute; their views are held to their
# storage by ``aot.aten.check_in_storage``.
OWN_STORAGE = ("aten.as_strided.default", "aten.sym_storage_offset.default")
CASE_SECONDS = 60  # a case still running after this ends the process (SIGALRM): a hang, named
HUGE = 1 << 40


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    if dtype.is_floating_point:
        return (torch.arange(n, dtype=torch.float32) / max(n, 1) + 0.25).reshape(shape).to(dtype)
    return (torch.arange(n) % 2).reshape(shape).to(dtype)


X = _t(2, 3, 4)
IMG = _t(1, 2, 4, 4)
VOL = _t(1, 2, 2, 4, 4)
IDX = torch.tensor([[0, 1, 0], [1, 0, 1]])

# Valid calls, where a schema's types alone do not make one (``sample`` makes the others).
SAMPLES: dict[str, tuple[list, dict]] = {
    "aten._adaptive_avg_pool2d.default": ([IMG, [2, 2]], {}),
    "aten._adaptive_avg_pool3d.default": ([VOL, [1, 2, 2]], {}),
    "aten._local_scalar_dense.default": ([_t(1)], {}),
    "aten._native_batch_norm_legit_no_training.default": (
        [IMG, _t(2), _t(2), _t(2), _t(2), 0.1, 1e-5],
        {},
    ),
    "aten._addmm_activation.default": ([_t(3), _t(2, 4), _t(4, 3)], {}),
    "aten.addmm.default": ([_t(3), _t(2, 4), _t(4, 3)], {}),
    "aten.mm.default": ([_t(2, 4), _t(4, 3)], {}),
    "aten.bmm.default": ([_t(2, 2, 4), _t(2, 4, 3)], {}),
    "aten.arange.default": ([5], {}),
    "aten.arange.start": ([1, 5], {}),
    "aten.arange.start_step": ([1, 9, 2], {}),
    "aten.as_strided.default": ([X, [2, 2], [1, 2], 1], {}),
    "aten.avg_pool2d.default": ([IMG, [2, 2], [2, 2], [0, 0], False, True, None], {}),
    "aten.avg_pool3d.default": ([VOL, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, None], {}),
    "aten.cat.default": ([[X, X], 1], {}),
    "aten.col2im.default": ([_t(1, 4, 9), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1]], {}),
    "aten.constant_pad_nd.default": ([X, [1, 1], 0.0], {}),
    "aten.convolution.default": ([IMG, _t(3, 2, 3, 3), _t(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1], {}),
    "aten.diagonal.default": ([X, 0, 1, 2], {}),
    "aten.embedding.default": ([_t(5, 3), torch.tensor([[0, 4], [2, 1]])], {}),
    "aten.expand.default": ([_t(1, 4), [3, 4]], {}),
    "aten.full.default": ([[2, 3], 1.5], {}),
    "aten.gather.default": ([X[:, :, 0], 1, IDX], {}),
    "aten.grid_sampler_2d.default": ([IMG, _t(1, 3, 3, 2) - 0.5, 0, 0, False], {}),
    "aten.index.Tensor": ([X, [None, torch.tensor([0, 2])]], {}),
    "aten.index_put.default": ([X, [torch.tensor([0, 1])], _t(4), False], {}),
    "aten.index_select.default": ([X, 1, torch.tensor([0, 2])], {}),
    "aten.masked_scatter.default": ([X, X > 0.5, _t(24)], {}),
    "aten.max_pool2d_with_indices.default": ([IMG, [2, 2], [2, 2], [0, 0], [1, 1], False], {}),
    "aten.max_pool3d_with_indices.default": ([VOL, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False], {}),
    "aten.narrow.default": ([X, 1, 1, 2], {}),
    "aten.native_group_norm.default": ([IMG, _t(2), _t(2), 1, 2, 16, 2, 1e-5], {}),
    "aten.native_layer_norm.default": ([X, [4], _t(4), _t(4), 1e-5], {}),
    "aten.new_full.default": ([X, [2, 2], 3.0], {}),
    "aten.permute.default": ([X, [2, 0, 1]], {}),
    "aten.reflection_pad1d.default": ([X, [1, 1]], {}),
    "aten.reflection_pad2d.default": ([IMG, [1, 1, 1, 1]], {}),
    "aten.reflection_pad3d.default": ([VOL, [1, 1, 1, 1, 1, 1]], {}),
    "aten.replication_pad2d.default": ([IMG, [1, 1, 1, 1]], {}),
    "aten.replication_pad3d.default": ([VOL, [1, 1, 1, 1, 1, 1]], {}),
    "aten.repeat.default": ([X, [1, 2, 1]], {}),
    "aten.reshape.default": ([X, [6, 4]], {}),
    "aten.view.default": ([X, [6, 4]], {}),
    "aten._unsafe_view.default": ([X, [6, 4]], {}),
    "aten.scaled_dot_product_attention.default": ([_t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4)], {}),
    "aten.scatter.src": ([X[:, :, 0], 1, IDX, _t(2, 3)], {}),
    "aten.scatter.value": ([X[:, :, 0], 1, IDX, 2.0], {}),
    "aten.scatter_add.default": ([X[:, :, 0], 1, IDX, _t(2, 3)], {}),
    "aten.scatter_reduce.two": ([X[:, :, 0], 1, IDX, _t(2, 3), "sum"], {}),
    "aten.select.int": ([X, 1, 2], {}),
    "aten.select_scatter.default": ([X, _t(2, 4), 1, 2], {}),
    "aten.slice.Tensor": ([X, 1, 0, 2, 1], {}),
    "aten.slice_scatter.default": ([X, _t(2, 2, 4), 1, 0, 2, 1], {}),
    "aten.split.Tensor": ([X, 2, 1], {}),
    "aten.split_with_sizes.default": ([X, [1, 2], 1], {}),
    "aten.squeeze.dims": ([_t(2, 1, 3), [1]], {}),
    "aten.topk.default": ([X, 2, 1], {}),
    "aten.upsample_bilinear2d.vec": ([IMG, [8, 8], False, None], {}),
    "aten._upsample_bicubic2d_aa.default": ([IMG, [8, 8], False], {}),
    "aten._upsample_bilinear2d_aa.default": ([IMG, [3, 3], True], {}),
    "aten.upsample_nearest2d.vec": ([IMG, [8, 8], None], {}),
    "aten.where.self": ([X > 0.5, X, X], {}),
    "aten.masked_fill.Tensor": ([X, X > 0.5, torch.tensor(2.0)], {}),
    "aten.masked_fill.Scalar": ([X, X > 0.5, 2.0], {}),
    "aten.div.Tensor_mode": ([X, X + 1], {"rounding_mode": "trunc"}),
    "aten.div.Scalar_mode": ([X, 2], {"rounding_mode": "floor"}),
    "aten.clamp.Tensor": ([X, _t(4), _t(4) + 0.5], {}),
    "aten.clamp.default": ([X, 0.3, 0.6], {}),
    "aten.flip.default": ([X, [0, 2]], {}),
    "aten.logsumexp.default": ([X, [1, 2]], {}),
    "aten.t.default": ([_t(2, 3)], {}),
    "aten.linalg_vector_norm.default": ([X, 2.0, [1, 2], True], {}),
    # rows [6, 8] in three expert groups (2, 0, 4 rows), weights [3, 8, 12], int32 group ends
    "aten._grouped_mm.default": ([_t(6, 8), _t(3, 8, 12), torch.tensor([2, 2, 6], dtype=torch.int32)], {}),
    "aten.histc.default": ([X, 4, 0.0, 1.0], {}),
    "aten._cdist_forward.default": ([_t(2, 3, 4), _t(2, 5, 4), 2.0, None], {}),
    "aten.cumprod.default": ([X, 1], {}),
    "aten.copy.default": ([X, X + 1], {}),
}
BOOL_OPS = ("logical_", "bitwise_")


def sample(name: str, op: Any) -> tuple[list, dict]:
    """A valid call of ``op``: from ``SAMPLES``, else made from its schema's types."""
    if name in SAMPLES:
        return SAMPLES[name]
    dtype = torch.int64 if any(b in name for b in BOOL_OPS) else torch.float32
    args = []
    for a in op._schema.arguments:
        if a.kwarg_only or a.has_default_value():
            break
        t = str(a.type)
        if t.startswith("Tensor"):
            args.append(_t(2, 3, 4, dtype=dtype))
        elif t == "int":
            args.append(1)
        elif t == "List[int]" or t == "SymInt[]":
            args.append([2, 3])
        elif t == "float":
            args.append(0.5)
        elif t == "Scalar" or t == "number":
            args.append(2)
        elif t == "bool":
            args.append(False)
        else:
            args.append(None)
    return args, {}


def hostile_values(value: Any) -> list[Any]:
    """What a hostile program may pass instead of ``value``."""
    if isinstance(value, torch.Tensor):
        out = [_t(16), _t(1), _t(0), torch.tensor(1.0), _t(2, 3, dtype=torch.bool)]
        out.append(torch.tensor([HUGE, -HUGE, -1, 2**31]))
        if value.dim() >= 2:
            shape = list(value.shape)
            for d in range(len(shape)):
                out.append(_t(*(shape[:d] + [max(shape[d] * 64, 64)] + shape[d + 1 :]), dtype=value.dtype))
                out.append(_t(*(shape[:d] + [1] + shape[d + 1 :]), dtype=value.dtype))
        if not value.dtype.is_floating_point:
            dtype = value.dtype if value.dtype != torch.bool else torch.int64
            out.append(torch.full(value.shape, min(HUGE, torch.iinfo(dtype).max), dtype=dtype))  # its largest
            out.append(torch.full(value.shape, -(2**31), dtype=torch.int64))
        return out
    if isinstance(value, bool):
        return [not value, 7]
    if isinstance(value, int):
        return [-1, -(2**31), 2**31, 2**62, 3, 7, 0, -7]
    if isinstance(value, float):
        return [float("nan"), float("inf"), -1.0, 1e308, 7.0]
    if isinstance(value, str):
        return ["bogus", ""]
    if isinstance(value, list):
        if value and all(isinstance(v, torch.Tensor) or v is None for v in value):
            return [[hostile] for hostile in hostile_values(next(v for v in value if v is not None))] + [[]]
        return [
            [-1] * max(len(value), 1),
            [HUGE] * max(len(value), 1),
            [0] * len(value),
            [],
            [1] * 6,
            [2**31, 2**31],
        ]
    if value is None:
        return [_t(16), -1, [HUGE]]
    return []


def as_step(name: str, args: list, kwargs: dict) -> tuple[Step, dict[str, torch.Tensor]]:
    """The values as a step's arguments: tensors become buffers of the call's environment."""
    env: dict[str, torch.Tensor] = {}

    def arg(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            env[f"t{len(env)}"] = v
            return Buf(f"t{len(env) - 1}")
        if isinstance(v, list):
            return [arg(x) for x in v]
        return v

    step = Step(
        StepKind.ATEN, name, tuple(arg(a) for a in args), {k: arg(v) for k, v in kwargs.items()}, ("out",)
    )
    return step, env


def poison(pattern: int) -> None:
    """Fill freed heap with ``pattern``: allocate tensors of many sizes so filled, then free them."""
    keep = [
        torch.full((n,), pattern, dtype=torch.uint8)
        for n in (64, 256, 1024, 4096, 1 << 16, 1 << 20)
        for _ in range(8)
    ]
    del keep


def bits(result: Any) -> list[bytes]:
    parts = result if isinstance(result, (list, tuple)) else [result]
    out = []
    for p in parts:
        if isinstance(p, torch.Tensor):
            out.append(p.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if p.numel() else b"")
        else:
            out.append(repr(p).encode())
    return out


def guarded(t: torch.Tensor, pattern: int) -> torch.Tensor:
    """A copy of ``t`` with ``GUARD`` bytes of ``pattern`` on either side in its storage: a read
    past either end reads the pattern."""
    nbytes = t.numel() * t.element_size()
    buf = torch.full((nbytes + 2 * GUARD,), pattern, dtype=torch.uint8)
    inner = buf[GUARD : GUARD + nbytes].view(t.dtype).view(t.shape)
    inner.copy_(t)
    return inner


def attempt(name: str, args: list, kwargs: dict) -> str:
    step, env = as_step(name, args, kwargs)
    results = []
    for pattern in (0x5A, 0xA5):
        try:
            call = AtenCall(step, torch.device("cpu"), {}, specs={})
            poison(pattern)
            if name not in OWN_STORAGE:
                env = {k: guarded(v, pattern) for k, v in env.items()}
            call(env, {})
        except AotError as e:
            return f"refused: {type(e).__name__}: {str(e)[:200]}"
        except (
            RuntimeError,
            ValueError,
            TypeError,
            IndexError,
            OverflowError,
            NotImplementedError,
            MemoryError,
        ) as e:
            return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        results.append(bits(env.pop("out")))
    return "ran" if results[0] == results[1] else "leak"


def fuzz(name: str) -> None:
    _, packet, overload = name.split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    args, kwargs = sample(name, op)
    print(json.dumps({"op": name, "case": "valid"}), flush=True)
    print(json.dumps({"op": name, "case": "valid", "outcome": attempt(name, args, kwargs)}), flush=True)
    slots = [("arg", i, v) for i, v in enumerate(args)] + [("kwarg", k, v) for k, v in kwargs.items()]
    for kind, key, value in slots:
        for j, hostile in enumerate(hostile_values(value)):
            a, kw = list(args), dict(kwargs)
            if kind == "arg":
                a[key] = hostile
            else:
                kw[key] = hostile
            case = f"{kind} {key} #{j}: {str(hostile)[:60]}"
            print(json.dumps({"op": name, "case": case}), flush=True)
            signal.alarm(CASE_SECONDS)
            print(json.dumps({"op": name, "case": case, "outcome": attempt(name, a, kw)}), flush=True)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    torch.set_num_threads(1)
    for name in sys.argv[1:] or sorted(ALLOWED_OPS):
        fuzz(name)
