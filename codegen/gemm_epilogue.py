"""GEMM epilogues: an absorbed pointwise kernel's reference steps as fp32 tile arithmetic over
the accumulators ``acc{g}``, with the tensors it loads and the outputs it stores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.gemm_forms import ROUND
from aot.codegen.triton_types import FLOAT_DTYPES
from aot.program import RESHAPE_VIEWS
from aot.schema import Buf, DType, Step, StepKind, TensorSpec


class NoSite(Exception):
    """A GEMM (or its epilogue) this module cannot express; it stays as it is."""


def spec_of(buffers: dict[str, TensorSpec], known: dict[str, TensorSpec], name: str) -> TensorSpec | None:
    return buffers.get(name) or known.get(name)


def float_cast(s: Step) -> DType:
    """The float dtype the ``_to_copy`` step ``s`` casts to; ``NoSite`` where it takes more than
    its input and the dtype, layout, device and memory format keywords, or casts to no float."""
    if set(s.kwargs) - {"dtype", "layout", "device", "memory_format"} or len(s.args) != 1:
        raise NoSite(s.target)
    dt = s.kwargs.get("dtype")
    if not isinstance(dt, DType) or dt.name not in FLOAT_DTYPES:
        raise NoSite(f"{s.target} to {dt}")
    return dt


_VIEWS = RESHAPE_VIEWS | {"aten.clone.default"}
_UNARY = {
    "aten.relu.default": "tl.maximum({0}, 0.0)",
    "aten.sigmoid.default": "tl.sigmoid({0})",
    "aten.silu.default": "({0} * tl.sigmoid({0}))",
    "aten.tanh.default": "(1.0 - 2.0 / (tl.exp(2.0 * {0}) + 1.0))",  # no libdevice in the interpreter
    "aten.neg.default": "(-{0})",
}
# the binary ops a GEMM's epilogue or prologue computes, as Triton expressions
BINARY = {
    "aten.add.Tensor": "({0} + {1})",
    "aten.sub.Tensor": "({0} - {1})",
    "aten.mul.Tensor": "({0} * {1})",
    "aten.div.Tensor": "({0} / {1})",
}
MAX_POWER = 4  # a power of the epilogue is written as this many products at most
GELU = "(0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476)))"
GELU_TANH = "(0.5 * {0} * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * (0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0}))) + 1.0))))"


@dataclass
class Load:
    param: str
    layout: str  # "full" ([M, N] row-major), "row" ([N], broadcast over rows), "scalar"
    dtype: str


class Epilogue:
    """Lowers an epilogue's steps to lines of fp32 tile arithmetic (``lines``), the tensors it
    loads (``loads``: buffer → ``Load``) and its outputs (``stores``: buffer, value, dtype).
    Raises ``NoSite`` for anything it cannot express."""

    def __init__(self, gemm_outputs: list[str], m: str, n: int, buffers, known):
        self.buffers, self.known = buffers, known
        self.M, self.N = ix.parse_size(m), sympy.Integer(n)
        self.vals: dict[str, str] = {o: f"acc{i}" for i, o in enumerate(gemm_outputs)}
        self.alias: dict[str, tuple[str, tuple[str, ...]]] = {}  # external view -> (root, shape)
        self.loads: dict[str, Load] = {}
        self.lines: list[str] = []
        self.stores: list[tuple[str, str, str]] = []

    def spec(self, name: str) -> TensorSpec:
        spec = spec_of(self.buffers, self.known, name)
        if spec is None:
            raise NoSite(f"no spec for {name}")
        return spec

    def layout(self, shape: tuple[str, ...]) -> str:
        dims = [ix.parse_size(s) for s in shape]
        numel = ix.numel(tuple(dims))
        if ix.same(numel, sympy.Integer(1)):
            return "scalar"
        if not dims or not ix.same(dims[-1], self.N):
            raise NoSite(f"shape {shape} does not end in N")
        if ix.same(numel, self.N):
            return "row"
        if ix.same(numel, self.M * self.N):
            return "full"
        raise NoSite(f"shape {shape} is neither [M, N] nor [N]")

    def value(self, arg: Any) -> str:
        if isinstance(arg, Buf):
            if arg.name in self.vals:
                return self.vals[arg.name]
            root, shape = self.alias.get(arg.name, (arg.name, self.spec(arg.name).shape))
            spec = self.spec(root)
            if spec.dtype not in FLOAT_DTYPES:
                raise NoSite(f"{root} is {spec.dtype}")
            layout = self.layout(shape)
            if root not in self.loads:
                self.loads[root] = Load(f"e{len(self.loads)}", layout, spec.dtype)
            elif self.loads[root].layout != layout:
                raise NoSite(f"{root} read in two layouts")
            return f"{self.loads[root].param}_v"
        if isinstance(arg, bool) or not isinstance(arg, (int, float)):
            raise NoSite(f"argument {str(arg)[:40]}")
        return repr(float(arg))

    def lower(self, steps: tuple[Step, ...], outputs: tuple[str | None, ...]) -> None:
        n = 0
        for s in steps:
            if s.kind != StepKind.ATEN or len(s.outputs) != 1 or s.outputs[0] is None:
                raise NoSite(f"{s.target}")
            out = s.outputs[0]
            ospec = self.spec(out)
            t = s.target
            if t in _VIEWS:
                src = s.args[0]
                if not isinstance(src, Buf):
                    raise NoSite(t)
                if t == "aten.clone.default" and set(s.kwargs) - {"memory_format"}:
                    raise NoSite(t)
                if src.name in self.vals:
                    if self.layout(ospec.shape) != "full":
                        raise NoSite(f"{t} of the GEMM result to {ospec.shape}")
                    self.vals[out] = self.vals[src.name]
                else:
                    root, _ = self.alias.get(src.name, (src.name, ()))
                    self.alias[out] = (root, ospec.shape)
                continue
            if t == "aten._to_copy.default":
                dt = float_cast(s)
                x = self.value(s.args[0])
                # values are fp32 in registers; the reference rounds a half value when it is
                # made, so round it here: to the narrower of its own dtype and the target
                src = self.spec(self.alias.get(s.args[0].name, (s.args[0].name,))[0]).dtype
                narrow = dt.name if dt.name in ROUND else src if src in ROUND else None
                if narrow is None:
                    if self.layout(ospec.shape) != "full":
                        raise NoSite(f"{t} result {ospec.shape} is not [M, N]")
                    self.vals[out] = x
                    continue
                expr = f"{x}.to({ROUND[narrow]}).to(tl.float32)"
            elif t in _UNARY and len(s.args) == 1 and not s.kwargs:
                expr = _UNARY[t].format(self.value(s.args[0]))
            elif t == "aten.gelu.default":
                approx = s.kwargs.get("approximate", s.args[1] if len(s.args) > 1 else "none")
                if approx not in ("none", "tanh"):
                    raise NoSite(f"gelu approximate={approx!r}")
                expr = (GELU if approx == "none" else GELU_TANH).format(self.value(s.args[0]))
            elif t == "aten.pow.Tensor_Scalar" and len(s.args) == 2 and not s.kwargs:
                # x ** 2 .. x ** MAX_POWER as products (GPT-2's GELU writes x ** 3)
                p = s.args[1]
                if isinstance(p, bool) or not isinstance(p, (int, float)) or p not in range(1, MAX_POWER + 1):
                    raise NoSite(f"{t} to {p!r}")
                x = self.value(s.args[0])
                expr = "(" + " * ".join([x] * int(p)) + ")"
            elif t in BINARY and len(s.args) == 2:
                if set(s.kwargs) - {"alpha"}:
                    raise NoSite(t)
                a, b = self.value(s.args[0]), self.value(s.args[1])
                alpha = s.kwargs.get("alpha", 1)
                if alpha != 1:
                    if t not in ("aten.add.Tensor", "aten.sub.Tensor"):
                        raise NoSite(t)
                    b = f"({self.value(alpha)} * {b})"
                expr = BINARY[t].format(a, b)
            else:
                raise NoSite(f"{t} in the epilogue")
            if ospec.dtype not in FLOAT_DTYPES:
                raise NoSite(f"{t} makes {ospec.dtype}")
            if self.layout(ospec.shape) != "full":
                raise NoSite(f"{t} result {ospec.shape} is not [M, N]")
            var = f"v{n}"
            n += 1
            self.lines.append(f"{var} = {expr}")
            self.vals[out] = var
        for o in outputs:
            if o is None:
                continue
            if o not in self.vals or self.layout(self.spec(o).shape) != "full":
                raise NoSite(f"output {o} is not an [M, N] value of the epilogue")
            self.stores.append((o, self.vals[o], self.spec(o).dtype))
