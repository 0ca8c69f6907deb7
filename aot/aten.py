"""ATen steps made callable: each overload resolved once (only functional ops of the aten
namespace are reachable), each argument turned into a constant or a small getter.

The loader runs programs with these; the build runs a few steps with them too (codegen's
attention-mask analysis), and the verifiers run kernels' reference steps.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from aot.dtypes import torch_dtypes
from aot.errors import BundleError, EnvError
from aot.schema import Buf, Device, DType, Layout, MemoryFormat, SpecialFloat, Step, StepKind, Sym, SymBool
from aot.symexpr import compile_expr

_OP_NAME = re.compile(r"^aten\.([a-z_][a-z0-9_]*)\.([a-zA-Z_][a-zA-Z0-9_]*)$")
DTYPES = torch_dtypes()
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "preserve_format": torch.preserve_format,
    "channels_last": torch.channels_last,
}
_FLOATS = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}

Getter = Callable[[dict, dict], Any]

# The program was traced with CPU strides; on another device a library op may return another
# layout (CUDA attention kernels return [B, T, H, D]-major outputs where the CPU's are
# [B, H, T, D]-major), and a ``view`` the trace found valid is not. Programs are functional (no
# step writes into a view), so running views as reshapes (a view where the strides allow, a copy
# otherwise) gives the same values on every device.
RESHAPED_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default"})


# ATen ops that reach outside the tensors they are given (files, stdout, process-wide state): a
# bundle never needs them, and a hostile one must not call them. Ops that write into an argument
# (in-place, out=) are refused by their schema in ``resolve_op``.
FORBIDDEN_OPS = frozenset(
    {
        "save",
        "from_file",
        "_print",
        "warn",
        "set_grad_enabled",
        "manual_seed",
        "seed",
        "wait",
        "to_here",
        "_cufft_set_plan_cache_max_size",
        "_cufft_clear_plan_cache",
    }
)


def resolve_op(name: str) -> Any:
    """``aten.addmm.default`` → the OpOverload; only the aten namespace is reachable, and only ops
    that compute new tensors from their arguments (no file access, no global state, no writes)."""
    m = _OP_NAME.match(name)
    if not m:
        raise BundleError(f"step calls {name[:80]!r}, which is not an ATen op name")
    try:
        packet = getattr(torch.ops.aten, m.group(1), None)
        overload = (
            getattr(packet, m.group(2), None) if isinstance(packet, torch._ops.OpOverloadPacket) else None
        )
    except Exception:  # torch's lookup of an odd name may raise instead of returning nothing
        packet = overload = None
    if packet is not None and not isinstance(overload, torch._ops.OpOverload):
        raise BundleError(f"step calls {name[:80]!r}, which is not an ATen op overload")
    if overload is not None and (
        m.group(1) in FORBIDDEN_OPS
        or any(a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments)
    ):
        raise BundleError(
            f"step calls {name}, which writes to its arguments or reaches outside its tensors; "
            f"bundles run only functional ATen ops"
        )
    if overload is None:
        raise EnvError(
            f"this torch ({torch.__version__}) has no ATen op {name}, which the bundle needs; "
            f"use the torch version the bundle was built with or rebuild it against this one"
        )
    return overload


class _Const:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def compile_arg(a: Any, device: torch.device) -> _Const | Getter:
    """A step argument → a constant, or a getter of ``(env, sizes)`` for buffers and sizes."""
    if isinstance(a, Buf):
        name = a.name
        return lambda env, sizes: env[name]
    if isinstance(a, (Sym, SymBool)):
        expr = compile_expr(a.text)
        convert = bool if isinstance(a, SymBool) else int
        if expr.is_constant:
            return _Const(convert(expr({})))
        return lambda env, sizes: convert(expr(sizes))
    if isinstance(a, DType) and a.name in DTYPES:
        return _Const(DTYPES[a.name])
    if isinstance(a, Device):
        return _Const(device)
    if isinstance(a, Layout):
        return _Const(_LAYOUTS[a.name])
    if isinstance(a, MemoryFormat):
        return _Const(_MEMORY_FORMATS[a.name])
    if isinstance(a, SpecialFloat):
        return _Const(_FLOATS[a.name])
    if isinstance(a, list):
        parts = [compile_arg(v, device) for v in a]
        if all(isinstance(p, _Const) for p in parts):
            return _Const([p.value for p in parts])
        return lambda env, sizes: [p.value if isinstance(p, _Const) else p(env, sizes) for p in parts]
    if a is None or isinstance(a, (bool, int, float, str)):
        return _Const(a)
    raise BundleError(f"unknown step argument {str(a)[:60]}")


def _is_device_param(t: Any) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.DeviceObjType)


def _check_devices(op: Any, step: Step) -> None:
    """A device parameter takes the runner's device (``{"device": "runtime"}``) or None: a string or
    an index would put results on a device the runner does not own (``"meta"`` ones hold no data)."""
    params = op._schema.arguments
    given = [*zip(params, step.args), *((p, step.kwargs[p.name]) for p in params if p.name in step.kwargs)]
    for p, value in given:
        if _is_device_param(p.type) and not (value is None or isinstance(value, Device)):
            raise BundleError(
                f"step {step.target} passes {p.name}={str(value)[:40]!r}; a bundle's steps run on the "
                "runner's device (the tagged value {'device': 'runtime'}): not a bundle aotpack wrote, rebuild it"
            )


class AtenCall:
    """One prepared ATen step."""

    __slots__ = ("op", "args", "kwargs", "outputs", "name")

    def __init__(self, step: Step, device: torch.device):
        if step.kind != StepKind.ATEN:
            raise BundleError(f"expected an ATen step, got kind {str(step.kind)[:20]!r}")
        self.name = step.target
        self.op = resolve_op(step.target)
        if step.target in RESHAPED_VIEWS:
            self.op = torch.ops.aten.reshape.default
        _check_devices(self.op, step)
        self.args = [compile_arg(a, device) for a in step.args]
        self.kwargs = {k: compile_arg(v, device) for k, v in step.kwargs.items()}
        self.outputs = step.outputs

    def __call__(self, env: dict, sizes: dict) -> None:
        args = [a.value if isinstance(a, _Const) else a(env, sizes) for a in self.args]
        kwargs = {k: a.value if isinstance(a, _Const) else a(env, sizes) for k, a in self.kwargs.items()}
        result = self.op(*args, **kwargs)
        if len(self.outputs) == 1:
            env[self.outputs[0]] = result
        else:
            for name, value in zip(self.outputs, result):
                if name is not None:
                    env[name] = value
