"""Lower a decomposed ExportedProgram to an ``aot.schema.Program`` of ATen steps.

The result is device-neutral: ``device=`` arguments become ``{"device": "runtime"}`` and metadata
asserts (which name the tracing device) are dropped, so a graph traced on CPU runs on CUDA.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, TensorArgument

from aot.allowed_ops import ALLOWED_OPS
from aot.dtypes import name_of as dtype_name
from aot.errors import TraceError
from aot.schema import (
    Buf,
    Device,
    DType,
    Layout,
    MemoryFormat,
    NamedTensor,
    Program,
    SpecialFloat,
    Step,
    StepKind,
    Sym,
    SymbolSource,
    SymBool,
    TensorSpec,
)
from aot.sympy_text import to_text

# Ops that only assert facts about the tracing run; they carry no computation.
DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
    "aten._assert_async.default",
}


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of an eager output tree in the order export flattens it (None skipped)."""
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def op_name(target: Any) -> str:
    """``torch.ops.aten.addmm.default`` → ``aten.addmm.default``."""
    return f"{target.namespace}.{target._schema.name.split('::', 1)[1]}.{target._overloadname}"


def _model_line(node: torch.fx.Node) -> str:
    """``file:line: `` of the model code that made ``node`` (the innermost frame export recorded)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{frames[-1][0]}:{frames[-1][1]}: " if frames else ""


def symbol_sources(inputs) -> tuple[SymbolSource, ...]:
    """Where each symbol is first read: the first input dim whose size is that symbol."""
    symbols, seen = [], set()
    for inp in inputs:
        for d, size in enumerate(inp.spec.shape):
            if size.isidentifier() and size not in seen:
                seen.add(size)
                symbols.append(SymbolSource(symbol=size, input=inp.name, dim=d))
    return tuple(symbols)


class Lowering:
    def __init__(self, ep: ExportedProgram, input_names: list[str], names: Mapping[sympy.Symbol, str]):
        self.ep = ep
        self.names = names
        self.input_names = input_names
        self.value_names: dict[torch.fx.Node, str] = {}
        self.buffers: dict[str, TensorSpec] = {}
        self.steps: list[Step] = []
        self.weights: dict[str, torch.Tensor] = {}

    def sym(self, value: Any) -> Any:
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            if expr.is_Integer:
                return int(expr)
            return Sym(to_text(expr, self.names))
        if isinstance(value, torch.SymBool):  # HF's `is_causal = q_len > 1` under torch 2.11
            expr = value.node.expr
            if expr in (sympy.true, sympy.false):
                return bool(expr)
            return SymBool(to_text(expr, self.names))
        if isinstance(value, torch.SymFloat):
            raise TraceError(f"symbolic {type(value).__name__} values are not supported in bundles: {value}")
        return value

    def spec_of(self, val: Any, what: str) -> TensorSpec:
        if not isinstance(val, torch.Tensor):
            raise TraceError(
                f"{what} is not a tensor ({type(val).__name__}); aotpack lowers tensor programs only"
            )
        shape = []
        for s in val.shape:
            v = self.sym(s)
            shape.append(v.text if isinstance(v, Sym) else str(v))
        return TensorSpec(dtype=dtype_name(val.dtype), shape=tuple(shape))

    def encode(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a in self.value_names:
                return Buf(self.value_names[a])
            val = a.meta.get("val")
            if isinstance(val, (torch.SymInt, torch.SymBool, int, bool)):
                return self.sym(val)
            raise TraceError(f"graph value {a.name} ({a.op} {a.target}) cannot be an argument in a bundle")
        if isinstance(a, (list, tuple)):
            return [self.encode(v) for v in a]
        if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
            return a
        if isinstance(a, float):
            return a if math.isfinite(a) else SpecialFloat(repr(a))
        if isinstance(a, torch.dtype):
            return DType(dtype_name(a))
        if isinstance(a, torch.device):
            return Device()
        if isinstance(a, torch.layout):
            return Layout(str(a).removeprefix("torch."))
        if isinstance(a, torch.memory_format):
            return MemoryFormat(str(a).removeprefix("torch."))
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.sym(a)
        raise TraceError(f"argument {a!r} of type {type(a).__name__} cannot be stored in a bundle")

    def run(self) -> tuple[Program, dict[str, torch.Tensor]]:
        ep = self.ep
        graph = ep.graph_module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        user_inputs: list[NamedTensor] = []
        weights: list[NamedTensor] = []
        state = {**ep.state_dict, **ep.constants}
        user_index = 0
        stored: dict[int, str] = {}
        for node, spec in zip(placeholders, ep.graph_signature.input_specs):
            if spec.kind == InputKind.USER_INPUT and not isinstance(spec.arg, TensorArgument):
                continue  # a constant keyword argument (use_cache=False): fixed in the trace
            if spec.kind == InputKind.USER_INPUT:
                if user_index >= len(self.input_names):
                    raise TraceError("forward takes more inputs than the model file declares")
                name = self.input_names[user_index]
                user_index += 1
                self.value_names[node] = name
                user_inputs.append(NamedTensor(name, self.spec_of(node.meta["val"], f"input {name}")))
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                tensor = state[spec.target]
                name = spec.target
                if id(tensor) in stored:  # tied weights (lm_head = wte) are stored once
                    self.value_names[node] = stored[id(tensor)]
                    continue
                stored[id(tensor)] = name
                self.value_names[node] = name
                self.weights[name] = tensor.detach().contiguous().clone()
                weights.append(NamedTensor(name, self.spec_of(tensor, f"weight {name}")))
            else:
                raise TraceError(f"unsupported graph input kind {spec.kind.name} for {spec.target}")

        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is operator.getitem:
                parent, index = node.args
                self.value_names[node] = node.name
                self.buffers[node.name] = self.spec_of(node.meta["val"], node.name)
                continue
            if not isinstance(node.target, torch._ops.OpOverload):
                val = node.meta.get("val")
                if isinstance(val, (torch.SymInt, torch.SymBool, int, bool)):  # size arithmetic and
                    # comparisons: folded into the expressions of the arguments that use them
                    continue
                raise TraceError(f"graph node {node.name} calls {node.target}, which bundles cannot store")
            name = op_name(node.target)
            if name in DROPPED_OPS:
                continue
            val = node.meta.get("val")
            if name == "aten.sym_size.int" or isinstance(val, (torch.SymInt, torch.SymBool, int, bool)):
                continue
            if name not in ALLOWED_OPS:
                raise TraceError(
                    f"{_model_line(node)}the model calls {name}, which a bundle may not run (only the pure "
                    f"ATen ops of aot/allowed_ops.py: no random numbers, autograd or process state); "
                    f"build the model in eval mode, pass random values in as inputs, or add the op to "
                    f"aot/allowed_ops.py if it is a pure function of its arguments"
                )
            outputs: tuple[str | None, ...]
            if isinstance(val, (tuple, list)):
                by_index = {u.args[1]: u.name for u in node.users if u.target is operator.getitem}
                outputs = tuple(by_index.get(i) for i in range(len(val)))
            else:
                self.value_names[node] = node.name
                self.buffers[node.name] = self.spec_of(val, node.name)
                outputs = (node.name,)
            self.steps.append(
                Step(
                    kind=StepKind.ATEN,
                    target=name,
                    args=tuple(self.encode(a) for a in node.args),
                    kwargs={k: self.encode(v) for k, v in node.kwargs.items()},
                    outputs=outputs,
                )
            )

        out_node = next(n for n in graph.nodes if n.op == "output")
        outputs = []
        self.none_outputs: set[int] = set()  # flat outputs that are None (an optional field)
        for k, o in enumerate(out_node.args[0]):
            if o is None:
                self.none_outputs.add(k)
                continue
            if not isinstance(o, torch.fx.Node) or o not in self.value_names:
                raise TraceError(f"model output {o} is not a tensor; return tensors only")
            outputs.append(self.value_names[o])

        symbols = symbol_sources(user_inputs)
        program = Program(
            inputs=tuple(user_inputs),
            weights=tuple(sorted(weights, key=lambda w: w.name)),
            buffers=self.buffers,
            steps=tuple(self.steps),
            outputs=tuple(outputs),
            symbols=symbols,
        )
        return program, self.weights
