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
from aot.errors import BundleError, EnvError, GuardError, printable
from aot.op_contracts import CONTRACTS, UNKNOWN, Check
from aot.program import VIEW_OPS
from aot.schema import (
    Buf,
    Device,
    DType,
    Layout,
    MemoryFormat,
    SpecialFloat,
    Step,
    StepKind,
    Sym,
    SymBool,
    SymFloat,
    TensorSpec,
)
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
# Where a call's environment holds the loader's per-call budget (``aot.loader.prerun.Budget``): no
# buffer's name (a program's names are identifiers).
CALL_BUDGET = "\x00budget"

# The program was traced with CPU strides; on another device a library op may return another
# layout (CUDA attention kernels return [B, T, H, D]-major outputs where the CPU's are
# [B, H, T, D]-major), and a ``view`` the trace found valid is not. Programs are functional (no
# step writes into a view), so running views as reshapes (a view where the strides allow, a copy
# otherwise) gives the same values on every device.
RESHAPED_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default"})


def _addmm_activation_as_on_cuda(
    bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1, use_gelu: bool = False
) -> torch.Tensor:
    """``aten._addmm_activation`` as CUDA computes it, off CUDA: its GELU is the tanh
    approximation (cuBLASLt's epilogue, or ``gelu(approximate="tanh")`` where that is not used),
    while the CPU kernel applies the exact GELU. The build folds ``addmm`` + tanh-GELU into it
    (``aot.codegen.activation_folding``), so on the CPU the op must take the tanh form too."""
    out = torch.ops.aten.addmm.default(bias, mat1, mat2, beta=beta, alpha=alpha)
    if use_gelu:
        return torch.ops.aten.gelu.default(out, approximate="tanh")
    return torch.ops.aten.relu.default(out)


# Ops run by a function of their own off CUDA, where ATen's kernel there computes otherwise
OFF_CUDA = {"aten._addmm_activation.default": _addmm_activation_as_on_cuda}


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
    if (
        name not in ALLOWED_OPS
        or name not in CONTRACTS
        or any(a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments)
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
    if isinstance(a, (Sym, SymBool, SymFloat)):
        expr = compile_expr(a.text, floats=isinstance(a, SymFloat))
        convert = bool if isinstance(a, SymBool) else float if isinstance(a, SymFloat) else int
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
        if step.in_place:
            _check_in_place(i, step, aliases, state)
            aliases.update(step.in_place)
            continue
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


def _check_in_place(i: int, step: Step, aliases: set[str], state: tuple[str, ...]) -> None:
    """A kernel step's in-place writes (``Step.in_place``) go into the program's state, through a
    pointer it is given, one output per buffer: else ``BundleError``."""
    given = {a.name for a in step.args if isinstance(a, Buf)}
    targets = list(step.in_place.values())
    for out, target in step.in_place.items():
        if step.kind != StepKind.KERNEL or out not in step.outputs or target not in given:
            raise BundleError(
                f"step {i} ({step.target[:40]}) claims to write {out[:60]!r} in place into {target[:60]!r}: "
                "only a kernel step may, into a buffer among its arguments, as one of its outputs; "
                "rebuild the bundle with a trusted aotpack"
            )
        if target not in aliases or targets.count(target) > 1:
            raise BundleError(
                f"step {i} (kernel {step.target[:40]}) writes in place into {target[:60]!r}, which is not a "
                f"state input of the program (state: {sorted(state)[:8]}), or twice; bundles write only "
                "into their own state: rebuild the bundle with a trusted aotpack"
            )


class ContractChecker:
    """A step's argument contract (``aot.op_contracts``), bound to where each argument comes
    from: checked at load where the values are known there, and the rest on every call
    (``check``), on the values the op is about to get."""

    __slots__ = ("op", "where", "per_call", "slots", "buffers")

    def __init__(
        self,
        step: Step,
        op: Any,
        args: list,
        kwargs: dict,
        weights: dict[str, torch.Tensor],
        specs: dict[str, TensorSpec],
        where: str,
    ):
        self.op, self.where = step.target, where
        params = op._schema.arguments
        # each schema argument: ("arg", position) | ("kwarg", name) | ("default", value)
        self.slots: dict[str, tuple[str, Any]] = {}
        raw: dict[str, Any] = {}
        self.buffers: dict[str, str] = {}  # argument → the buffer it reads, for errors
        for i, p in enumerate(params):
            if i < len(step.args) and not p.kwarg_only:
                self.slots[p.name], raw[p.name] = ("arg", i), step.args[i]
            elif p.name in step.kwargs:
                self.slots[p.name], raw[p.name] = ("kwarg", p.name), step.kwargs[p.name]
            else:
                value = p.default_value if p.has_default_value() else None
                self.slots[p.name] = ("default", value)
        compiled = {
            n: (args[k] if kind == "arg" else kwargs[k])
            for n, (kind, k) in self.slots.items()
            if kind != "default"
        }
        self.per_call: list[Check] = []
        for check in CONTRACTS[step.target].checks:
            values, known, computed = [], True, False
            for name in check.args:
                kind, key = self.slots.get(name, ("default", None))
                if kind == "default":
                    values.append(key)
                    continue
                if isinstance(raw[name], Buf):
                    self.buffers[name] = raw[name].name
                value = _value_at_load(raw[name], compiled[name], weights, specs)
                computed |= _reads_computed(raw[name], weights)
                known &= value is not UNKNOWN
                values.append(value)
            if known:
                self._apply(check, values, at_load=True)
            if not known or (check.always and computed):
                self.per_call.append(check)

    def _apply(self, check: Check, values: list, at_load: bool = False) -> None:
        problem = check.test(*values)
        if problem is None:
            return
        arg = check.args[0]
        if check.caller and not at_load:
            buffer = self.buffers.get(arg)
            what = f"{arg} ({printable(buffer[:60])!r})" if buffer else arg
            raise GuardError(
                f"{self.where}{self.op}: {problem} in argument {what}, computed from this call's "
                f"inputs; pass values the model's integer arithmetic can take"
            )
        raise BundleError(
            f"{self.where}{self.op}: argument {arg}: {problem}; the op would read or return memory "
            f"it does not own: rebuild the bundle with a trusted aotpack"
        )

    def check(self, args: list, kwargs: dict) -> None:
        for check in self.per_call:
            values = []
            for name in check.args:
                kind, key = self.slots.get(name, ("default", None))
                values.append(args[key] if kind == "arg" else kwargs[key] if kind == "kwarg" else key)
            self._apply(check, values)


def _reads_computed(raw: Any, weights: dict[str, torch.Tensor]) -> bool:
    """Whether an argument reads a buffer a call computes (anything but a weight)."""
    if isinstance(raw, Buf):
        return raw.name not in weights
    if isinstance(raw, list):
        return any(_reads_computed(r, weights) for r in raw)
    return False


def _value_at_load(
    raw: Any, compiled: Any, weights: dict[str, torch.Tensor], specs: dict[str, TensorSpec]
) -> Any:
    """An argument's value as far as the load knows it: a constant, a weight, a tensor on the meta
    device of a buffer's static declared shape, a list of those, or ``UNKNOWN``."""
    if isinstance(compiled, _Const):
        return compiled.value
    if isinstance(raw, Buf):
        if raw.name in weights:
            return weights[raw.name]
        spec = specs.get(raw.name)
        if spec is None or spec.dtype not in DTYPES:
            return UNKNOWN
        shape = [compile_expr(s) for s in spec.shape]
        if not all(d.is_constant for d in shape):
            return UNKNOWN
        return torch.empty([d({}) for d in shape], dtype=DTYPES[spec.dtype], device="meta")
    if isinstance(raw, list):
        parts = [_value_at_load(r, compile_arg(r, torch.device("meta")), weights, specs) for r in raw]
        return UNKNOWN if any(p is UNKNOWN for p in parts) else parts
    return UNKNOWN


class AtenCall:
    """One prepared ATen step. ``weights``: the tensors known at load; a view of one with
    constant arguments is made and checked against its storage right away. ``state_aliases``:
    the buffers a state write may write into (``state_writes_checked``); any other write is
    refused."""

    __slots__ = ("op", "args", "kwargs", "outputs", "name", "check_views", "contract", "where")

    def __init__(
        self,
        step: Step,
        device: torch.device,
        weights: dict[str, torch.Tensor] | None = None,
        state_aliases: frozenset[str] = frozenset(),
        specs: dict[str, TensorSpec] | None = None,
        index: int | None = None,
    ):
        if step.kind != StepKind.ATEN:
            raise BundleError(f"expected an ATen step, got kind {str(step.kind)[:20]!r}")
        self.name = step.target
        first = step.args[0] if step.args else None
        writes_state = (
            step.target in STATE_WRITE_OPS and isinstance(first, Buf) and first.name in state_aliases
        )
        op = self.op = resolve_op(step.target, state_write=writes_state)
        check_zero_args(step)
        if step.target in RESHAPED_VIEWS:
            self.op = torch.ops.aten.reshape.default
        _check_devices(self.op, step)
        if device.type != "cuda" and step.target in OFF_CUDA:
            self.op = OFF_CUDA[step.target]
        self.args = [compile_arg(a, device) for a in step.args]
        self.kwargs = {k: compile_arg(v, device) for k, v in step.kwargs.items()}
        self.outputs = step.outputs
        self.contract = None
        self.where = where = f"step {index} " if index is not None else ""
        if step.target in CONTRACTS:  # state writes have none: they write only the state
            checker = ContractChecker(step, op, self.args, self.kwargs, weights or {}, specs or {}, where)
            self.contract = checker if checker.per_call else None
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

    def arguments(self, env: dict, sizes: dict) -> tuple[list, dict]:
        """The step's arguments on ``env`` at ``sizes``."""
        args = [a.value if isinstance(a, _Const) else a(env, sizes) for a in self.args]
        kwargs = {k: a.value if isinstance(a, _Const) else a(env, sizes) for k, a in self.kwargs.items()}
        return args, kwargs

    def run(self, env: dict, sizes: dict) -> Any:
        """The op's result on ``env``, unbound."""
        args = [a.value if isinstance(a, _Const) else a(env, sizes) for a in self.args]
        kwargs = {k: a.value if isinstance(a, _Const) else a(env, sizes) for k, a in self.kwargs.items()}
        if self.contract is not None:
            self.contract.check(args, kwargs)
        budget = env.get(CALL_BUDGET)
        if budget is not None:  # the loader's bounds on what the step makes and computes
            budget.before(self.where, self.name, self.outputs, args, kwargs)
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
