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

from aot.allowed_ops import ALLOWED_OPS, STATE_WRITE_OPS, ZERO_ARGS
from aot.dtypes import torch_dtypes
from aot.errors import BundleError, EnvError
from aot.program import VIEW_OPS
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


# Views whose size, stride and storage offset a step chooses freely: each result is checked against
# the storage it views (``check_in_storage``), at load where the base is a weight and the geometry is
# constant, else on every call (ATen checks them too; this holds whatever the op's own checks).
STRIDED_VIEWS = frozenset({"aten.as_strided.default"})


def resolve_op(name: str, state_write: bool = False) -> Any:
    """``aten.addmm.default`` → the OpOverload. Only the ops of ``aot.allowed_ops`` are reachable:
    pure functions of their arguments (no random numbers, autograd, files or process state, no
    writes, no unchecked views). ``EnvError`` for an op this torch lacks (a bundle built against
    another torch), ``BundleError`` for any other op off the list. ``state_write``: also resolve
    the in-place writes of ``STATE_WRITE_OPS``, for a step its caller has checked writes into a
    program's state (``AtenCall``)."""
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
    if overload is None:
        raise EnvError(
            f"this torch ({torch.__version__}) has no ATen op {name}, which the bundle needs; "
            f"use the torch version the bundle was built with or rebuild it against this one"
        )
    if state_write and name in STATE_WRITE_OPS:
        return overload
    if name not in ALLOWED_OPS or any(
        a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments
    ):
        raise BundleError(
            f"step calls {name}, which bundles may not call: aotpack runs only the pure ATen ops "
            f"of its allowlist (no random numbers, autograd, files, process state, writes or unchecked "
            f"views); rebuild the bundle with a trusted aotpack (or load it with the newer aotpack that "
            f"built it)"
        )
    return overload


def check_in_storage(t: torch.Tensor, op: str) -> None:
    """``BundleError`` unless every element of view ``t`` lies inside the storage it views."""
    if t.numel() == 0:
        return
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if (last + 1) * t.element_size() > t.untyped_storage().nbytes():  # ATen refuses negative strides
        raise BundleError(
            f"step {op} makes a view of sizes {list(t.shape)}, strides {list(t.stride())} and offset "
            f"{t.storage_offset()} that reaches outside its {t.untyped_storage().nbytes()}-byte storage; "
            f"rebuild the bundle with a trusted aotpack"
        )


def check_zero_args(step: Step) -> None:
    """Arguments that would draw random numbers (attention's ``dropout_p``) must be zero."""
    for op, name, position in ZERO_ARGS:
        if step.target != op:
            continue
        value = step.kwargs.get(name, step.args[position] if len(step.args) > position else 0)
        if type(value) not in (int, float) or value != 0:
            raise BundleError(
                f"step {op} passes {name}={str(value)[:40]}, which draws random numbers; bundles run "
                f"deterministic programs (0 or nothing): rebuild the bundle with a trusted aotpack"
            )


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


def state_writes_checked(steps: list[Step] | tuple[Step, ...], state: tuple[str, ...]) -> frozenset[str]:
    """The buffers that alias a program's state: the state inputs and the results of the state
    writes into them. ``BundleError`` for a state write (``STATE_WRITE_OPS``) whose first argument
    is anything else (a weight, a caller's input, an intermediate), or that writes a state input
    the program does not declare: a bundle writes nothing but its own state."""
    aliases = set(state)
    for i, step in enumerate(steps):
        if step.kind != StepKind.ATEN or step.target not in STATE_WRITE_OPS:
            continue
        first = step.args[0] if step.args else None
        if not (isinstance(first, Buf) and first.name in aliases):
            got = first.name if isinstance(first, Buf) else str(first)
            raise BundleError(
                f"step {i} ({step.target}) writes into {got[:60]!r}, which is not a state input of the "
                f"program (state: {sorted(state)[:8]}); bundles write only into their own state: "
                f"rebuild the bundle with a trusted aotpack"
            )
        aliases.update(o for o in step.outputs if o is not None)
    return frozenset(aliases)


class AtenCall:
    """One prepared ATen step. ``weights``: the tensors known at load; a view of one with
    constant arguments is made and checked against its storage right away. ``state_aliases``:
    the buffers a state write may write into (``state_writes_checked``); any other write is
    refused."""

    __slots__ = ("op", "args", "kwargs", "outputs", "name", "check_views")

    def __init__(
        self,
        step: Step,
        device: torch.device,
        weights: dict[str, torch.Tensor] | None = None,
        state_aliases: frozenset[str] = frozenset(),
    ):
        if step.kind != StepKind.ATEN:
            raise BundleError(f"expected an ATen step, got kind {str(step.kind)[:20]!r}")
        self.name = step.target
        first = step.args[0] if step.args else None
        writes_state = (
            step.target in STATE_WRITE_OPS and isinstance(first, Buf) and first.name in state_aliases
        )
        self.op = resolve_op(step.target, state_write=writes_state)
        check_zero_args(step)
        if step.target in RESHAPED_VIEWS:
            self.op = torch.ops.aten.reshape.default
        _check_devices(self.op, step)
        self.args = [compile_arg(a, device) for a in step.args]
        self.kwargs = {k: compile_arg(v, device) for k, v in step.kwargs.items()}
        self.outputs = step.outputs
        self.check_views = step.target in STRIDED_VIEWS
        if step.target in VIEW_OPS and self._checked_at_load(step, weights or {}):
            self.check_views = False

    def _checked_at_load(self, step: Step, weights: dict[str, torch.Tensor]) -> bool:
        """A view of a weight with constant arguments: made once now (a view reads no data) and
        checked against the weight's storage, so a bad one is refused before any call; True when
        so checked. Views of what a call computes are checked by ATen, and strided ones here too,
        on every call."""
        base = step.args[0] if step.args else None
        constant = all(isinstance(a, _Const) for a in (*self.args[1:], *self.kwargs.values()))
        if not (isinstance(base, Buf) and base.name in weights and constant):
            return False
        try:
            result = self.run({base.name: weights[base.name]}, {})
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:200]
            raise BundleError(
                f"step {self.name} cannot view weight {base.name!r}: {first}; "
                f"rebuild the bundle with a trusted aotpack"
            ) from None
        for t in result if isinstance(result, (list, tuple)) else [result]:
            check_in_storage(t, self.name)
        return True

    def run(self, env: dict, sizes: dict) -> Any:
        """The op's result on ``env``, unbound."""
        args = [a.value if isinstance(a, _Const) else a(env, sizes) for a in self.args]
        kwargs = {k: a.value if isinstance(a, _Const) else a(env, sizes) for k, a in self.kwargs.items()}
        return self.op(*args, **kwargs)

    def __call__(self, env: dict, sizes: dict) -> None:
        result = self.run(env, sizes)
        if self.check_views:
            check_in_storage(result, self.name)
        if len(self.outputs) == 1:
            env[self.outputs[0]] = result
        else:
            for name, value in zip(self.outputs, result):
                if name is not None:
                    env[name] = value
