"""Run a program's steps with ATen library calls: the CPU path, and the fallback on any device.

Steps are prepared once at load: each ATen overload resolved (a missing one is an ``EnvError``
naming it), each argument turned into a constant or a small getter. A kernel step runs its
reference decomposition here. Buffers are dropped after their last use.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from aot.errors import AotError, BundleError, EnvError
from aot.schema import Program, Step
from aot.symexpr import compile_expr

_OP_NAME = re.compile(r"^aten\.([a-z_][a-z0-9_]*)\.([a-zA-Z_][a-zA-Z0-9_]*)$")
DTYPES = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                 "complex64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
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
FORBIDDEN_OPS = frozenset({
    "save", "from_file", "_print", "warn", "set_grad_enabled", "manual_seed", "seed", "wait", "to_here",
    "_cufft_set_plan_cache_max_size", "_cufft_clear_plan_cache",
})


def resolve_op(name: str) -> Any:
    """``aten.addmm.default`` → the OpOverload; only the aten namespace is reachable, and only ops
    that compute new tensors from their arguments (no file access, no global state, no writes)."""
    m = _OP_NAME.match(name)
    if not m:
        raise BundleError(f"step calls {name[:80]!r}, which is not an ATen op name")
    try:
        packet = getattr(torch.ops.aten, m.group(1), None)
        overload = getattr(packet, m.group(2), None) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    except Exception:  # torch's lookup of an odd name may raise instead of returning nothing
        packet = overload = None
    if packet is not None and not isinstance(overload, torch._ops.OpOverload):
        raise BundleError(f"step calls {name[:80]!r}, which is not an ATen op overload")
    if overload is not None and (m.group(1) in FORBIDDEN_OPS
                                 or any(a.alias_info is not None and a.alias_info.is_write
                                        for a in overload._schema.arguments)):
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


def compile_arg(a: Any, device: torch.device, reads: set[str]) -> _Const | Getter:
    if isinstance(a, dict):
        if len(a) != 1:
            raise BundleError(f"malformed step argument {str(a)[:60]}")
        (tag, v), = a.items()
        if tag == "buf":
            if not isinstance(v, str):
                raise BundleError("buffer reference must be a string")
            reads.add(v)
            return lambda env, sizes: env[v]
        if tag == "sym":
            expr = compile_expr(v)
            if expr.is_constant:
                return _Const(expr({}))
            return lambda env, sizes: expr(sizes)
        if tag == "symbool":
            cond = compile_expr(v)
            if cond.is_constant:
                return _Const(bool(cond({})))
            return lambda env, sizes: bool(cond(sizes))
        if tag == "dtype" and v in DTYPES:
            return _Const(DTYPES[v])
        if tag == "device":
            return _Const(device)
        if tag == "layout" and v in _LAYOUTS:
            return _Const(_LAYOUTS[v])
        if tag == "memory_format" and v in _MEMORY_FORMATS:
            return _Const(_MEMORY_FORMATS[v])
        if tag == "float" and v in _FLOATS:
            return _Const(_FLOATS[v])
        raise BundleError(f"unknown step argument {str(a)[:60]}")
    if isinstance(a, list):
        parts = [compile_arg(v, device, reads) for v in a]
        if all(isinstance(p, _Const) for p in parts):
            return _Const([p.value for p in parts])
        return lambda env, sizes: [p.value if isinstance(p, _Const) else p(env, sizes) for p in parts]
    if a is None or isinstance(a, (bool, int, float, str)):
        return _Const(a)
    raise BundleError(f"unknown step argument type {type(a).__name__}")


class AtenCall:
    """One prepared ATen step."""

    __slots__ = ("op", "args", "kwargs", "outputs", "reads", "name")

    def __init__(self, step: Step, device: torch.device):
        if step.kind != "aten":
            raise BundleError(f"expected an ATen step, got kind {step.kind[:20]!r}")
        self.name = step.target
        self.op = resolve_op(step.target)
        if step.target in RESHAPED_VIEWS:
            self.op = torch.ops.aten.reshape.default
        self.reads: set[str] = set()
        self.args = [compile_arg(a, device, self.reads) for a in step.args]
        self.kwargs = {k: compile_arg(v, device, self.reads) for k, v in step.kwargs.items()}
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


def flatten_steps(program: Program) -> list[Step]:
    """Kernel steps replaced by their reference decompositions (the CPU path)."""
    out: list[Step] = []
    for step in program.steps:
        if step.kind == "kernel":
            out.extend(step.reference)
        elif step.kind == "aten":
            out.append(step)
        else:
            raise BundleError(f"unknown step kind {step.kind[:20]!r}")
    return out


class AtenProgram:
    """Executes the program with ATen calls only; stateless per call, so thread-safe."""

    def __init__(self, program: Program, weights: dict[str, torch.Tensor], device: torch.device,
                 steps: list[Step] | None = None):
        self.program = program
        self.weights = weights
        self.calls = [AtenCall(s, device) for s in (steps if steps is not None else flatten_steps(program))]
        self.frees = liveness_frees(self.calls, program, weights)

    def __call__(self, inputs: dict[str, torch.Tensor], sizes: dict[str, int]) -> list[torch.Tensor]:
        env: dict[str, Any] = dict(self.weights)
        env.update(inputs)
        try:
            for call, frees in zip(self.calls, self.frees):
                call(env, sizes)
                for name in frees:
                    del env[name]
        except (AotError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # the inputs passed the guards, so the program itself is at fault
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:300]
            raise BundleError(
                f"step {self.calls.index(call)} ({call.name}) failed at sizes {sizes}: {type(e).__name__}: {first}; "
                f"the inputs passed the bundle's guards, so its program or guards are wrong: rebuild the bundle"
            ) from None
        return [env[o] for o in self.program.outputs]


def liveness_frees(calls: list[Any], program: Program, weights: dict) -> list[tuple[str, ...]]:
    """For each prepared call, the buffers to drop after it (their last use), validating on the
    way that every read comes after its write and every output is written."""
    known = set(weights) | {i.name for i in program.inputs}
    last_use: dict[str, int] = {}
    for i, call in enumerate(calls):
        missing = call.reads - known
        if missing:
            raise BundleError(f"step {i} ({call.name}) reads {sorted(missing)[:3]} before they are written")
        for r in call.reads:
            last_use[r] = i
        known.update(o for o in call.outputs if o is not None)
    if set(program.outputs) - known:
        raise BundleError(f"program outputs {sorted(set(program.outputs) - known)[:3]} are never written")
    keep = set(program.outputs) | set(weights) | {i.name for i in program.inputs}
    frees: list[tuple[str, ...]] = [() for _ in calls]
    for name, i in last_use.items():
        if name not in keep:
            frees[i] += (name,)
    # buffers written but never read (unused multi-outputs) die right away
    for i, call in enumerate(calls):
        for o in call.outputs:
            if o is not None and o not in last_use and o not in keep:
                frees[i] += (o,)
    return frees
