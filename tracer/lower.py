"""Lower a decomposed ExportedProgram to an ``aot.schema.Program`` of ATen steps.

The result is device-neutral: ``device=`` arguments become ``{"device": "runtime"}`` and metadata
asserts (which name the tracing device) are dropped, so a graph traced on CPU runs on CUDA.

State (``Input(state=True)``, a KV cache): ``torch.export`` records the model's in-place writes
into its inputs as functional ops (``index_put``) whose results the graph returns as input
mutations. Each becomes an in-place write into the state at run time (``index_put_``), its
result an alias of the state that the later reads take, so nothing is copied; where the old
value is still read after the write, the write stays functional and a trailing ``copy_`` stores
it. A write into a caller's input or a module buffer is a ``TraceError`` naming the model line.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from aot.allowed_ops import ALLOWED_OPS, FUNCTIONAL_OF_STATE_WRITE
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
    SymFloat,
    TensorSpec,
)
from aot.sympy_text import to_float_text, to_text
from aot.tracer.folding import constant_step, evaluate, folded_name, item
from aot.tracer.selections import selection_error
from aot.tracer.sites import float_from_sizes, library_relative, value_dependent_size

# Ops that only assert facts about the tracing run; they carry no computation.
DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
    "aten._assert_async.default",
}
# Ops of aotpack's own that stand for an ATen op during export only (``aot.experts``): the
# program calls the ATen op.
STANDS_FOR = {"aotpack.grouped_mm.default": "aten._grouped_mm.default"}


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
    return f"{library_relative(frames[-1][0])}:{frames[-1][1]}: " if frames else ""


def _user_line(node: torch.fx.Node) -> str:
    """``file:line`` of the innermost frame outside torch that made ``node`` (the model's own code,
    or its model library's: ``transformers/...``), else the innermost; "" when export kept none."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    torch_dir = os.path.dirname(torch.__file__)
    outside = [f for f in frames if not os.path.abspath(f[0]).startswith(torch_dir + os.sep)]
    file, line = (outside or frames or [("", "")])[-1]
    return f"{library_relative(file)}:{line}" if file else ""


def symbol_sources(inputs) -> tuple[SymbolSource, ...]:
    """Where each symbol is first read: the first input dim whose size is that symbol."""
    symbols, seen = [], set()
    for inp in inputs:
        for d, size in enumerate(inp.spec.shape):
            if size.isidentifier() and size not in seen:
                seen.add(size)
                symbols.append(SymbolSource(symbol=size, input=inp.name, dim=d))
    return tuple(symbols)


def _shape_text(node: Any) -> list[str] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return [str(s) for s in val.shape] if isinstance(val, torch.Tensor) else None


def _full_slice(node: Any) -> bool:
    """``x[:, :]``: an ``aten.slice`` that keeps all of its input (``x[:, :, pos] = v`` makes one)."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target is torch.ops.aten.slice.Tensor
        and (len(node.args) < 5 or node.args[4] == 1)
        and _shape_text(node) is not None
        and _shape_text(node) == _shape_text(node.args[0])
    )


def _full_scatter(node: Any) -> bool:
    """``slice_scatter(x, y)`` where ``y`` covers all of ``x``: the value is ``y``."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target is torch.ops.aten.slice_scatter.default
        and (len(node.args) < 6 or node.args[5] == 1)
        and _shape_text(node.args[1]) is not None
        and _shape_text(node.args[1]) == _shape_text(node.args[0])
    )


def _is_size(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, int, bool))


class Lowering:
    def __init__(
        self,
        ep: ExportedProgram,
        input_names: list[str],
        names: Mapping[sympy.Symbol, str],
        state: frozenset[str] = frozenset(),
        constant_suffix: str = "",
    ):
        self.ep = ep
        # tensors the model made in forward (torch.tensor(...)): a program other than the general
        # one stores those it traced differently under names of its own (see ``aot.tracer.trace``)
        self.constant_suffix = constant_suffix
        self.names = names
        self.input_names = input_names
        self.state = state
        self.value_names: dict[torch.fx.Node, str] = {}
        self.node: torch.fx.Node | None = None  # the node being lowered, for errors at its model line
        self.buffers: dict[str, TensorSpec] = {}
        self.steps: list[Step] = []
        self.weights: dict[str, torch.Tensor] = {}
        # weights and the results of steps of weights alone, computed at build time
        # (``aot.tracer.folding``); such a result is stored as a weight where a step reads it
        self.constants: dict[torch.fx.Node, Any] = {}
        self.folded: list[NamedTensor] = []
        self.constant_views: set[str] = set()  # the results of view steps of constants
        # state writes (see the module docstring)
        self.alias: dict[torch.fx.Node, torch.fx.Node] = {}  # a full slice_scatter -> its source
        self.skip: set[torch.fx.Node] = set()  # full slices only an in-place write read
        self.inplace: dict[torch.fx.Node, tuple[str, torch.fx.Node]] = {}  # node -> (op, what it writes)
        self.trailing: list[tuple[str, torch.fx.Node]] = []  # (state input, its new value)
        self.lines: dict[str, str] = {}  # a step's result -> the model line that made it ("model.py:12")

    def plan_state_writes(self, placeholders: list[torch.fx.Node]) -> list[int]:
        """Decide how each input mutation the export recorded is written (in place, or a trailing
        copy); the positions of the graph's outputs that are the model's own outputs."""
        graph_outputs = list(next(n for n in self.ep.graph.nodes if n.op == "output").args[0])
        by_name = {n.name: n for n in placeholders}
        user_outputs = []
        for k, (o, spec) in enumerate(zip(graph_outputs, self.ep.graph_signature.output_specs)):
            if spec.kind == OutputKind.USER_OUTPUT:
                user_outputs.append(k)
                continue
            where = _model_line(o) if isinstance(o, torch.fx.Node) else ""
            if spec.kind == OutputKind.BUFFER_MUTATION:
                raise TraceError(
                    f"{where}the model writes into its buffer {spec.target!r} in place; a bundle's weights "
                    f"and buffers are read-only: pass the tensor in as a state input "
                    f"(Input(..., state=True)), or compute a new tensor instead of writing"
                )
            if spec.kind != OutputKind.USER_INPUT_MUTATION:
                raise TraceError(f"{where}unsupported graph output kind {spec.kind.name} for {spec.target}")
            x = by_name[spec.target]
            name = self.value_names[x]
            if name not in self.state:
                raise TraceError(
                    f"{where}the model writes into its input {name!r} in place, which is not state; declare "
                    f"it Input(..., state=True) (the runner then owns it across calls), or write into a "
                    f"copy (x = x.clone()) if the caller's tensor must stay as it was"
                )
            self._plan_one(x, o)
        return user_outputs

    def _plan_one(self, x: torch.fx.Node, value: torch.fx.Node) -> None:
        while _full_scatter(value):
            self.alias[value] = value.args[1]
            value = value.args[1]

        def readers(n: torch.fx.Node) -> set[torch.fx.Node]:
            return {u for u in n.users if not _is_size(u) and u not in self.alias}

        chain: list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = []  # (write, its arg, base)
        node = value
        while (
            isinstance(node, torch.fx.Node)
            and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and op_name(node.target) in FUNCTIONAL_OF_STATE_WRITE
            and isinstance(node.args[0], torch.fx.Node)
            and len(chain) < 64
        ):
            src = node.args[0]
            base = src.args[0] if _full_slice(src) else src
            chain.append((node, src, base))
            if base is x:
                break
            node = base
        in_place = bool(chain) and chain[-1][2] is x
        for write, src, base in chain if in_place else ():
            # the old value is read by nothing but this write: writing in place loses nothing
            if readers(base) != {src if src is not base else write} or (
                src is not base and readers(src) != {write}
            ):
                in_place = False
        if not in_place:
            self.trailing.append((self.value_names[x], value))
            return
        for write, src, base in chain:
            self.inplace[write] = (FUNCTIONAL_OF_STATE_WRITE[op_name(write.target)], base)
            if src is not base:
                self.skip.add(src)

    def sym(self, value: Any) -> Any:
        if isinstance(value, (torch.SymInt, torch.SymBool)):
            unnamed = sorted(str(s) for s in value.node.expr.free_symbols if s not in self.names)
            if unnamed:  # no input dim gives it: torch.nonzero's size, say
                where = _model_line(self.node) if self.node is not None else ""
                raise value_dependent_size(unnamed[0], where)
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
        if isinstance(value, torch.SymFloat):  # an interpolation's scale, 4 / (h // 7): per call
            expr = value.node.expr
            if expr.is_Number:
                return float(expr)
            try:
                return SymFloat(to_float_text(expr, self.names))
            except TraceError as e:
                where = _model_line(self.node) if self.node is not None else ""
                raise TraceError(float_from_sizes(where, "an argument", str(value), why=str(e))) from None
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
            if a in self.constants and a not in self.value_names:
                self._store_folded(a)
            if a in self.value_names:
                return Buf(self.value_names[a])
            val = a.meta.get("val")
            if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float)):
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
        graph = self.ep.graph_module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        user_inputs, weights = self._lower_inputs(placeholders)
        user_outputs = self.plan_state_writes(placeholders)
        for node in graph.nodes:
            self.node = node
            self._lower_node(node)
        self._write_back_state(user_inputs)
        outputs = self._outputs(graph, user_outputs)
        symbols = symbol_sources(user_inputs)
        self._drop_unread_views(outputs)
        read = _names_read(self.steps) | set(outputs)  # a weight only folded steps read is left out
        program = Program(
            inputs=tuple(user_inputs),
            weights=tuple(
                sorted((w for w in (*weights, *self.folded) if w.name in read), key=lambda w: w.name)
            ),
            buffers=self.buffers,
            steps=tuple(self.steps),
            outputs=tuple(outputs),
            symbols=symbols,
            state=tuple(i.name for i in user_inputs if i.name in self.state),
        )
        return program, self.weights

    def _lower_inputs(self, placeholders: list[torch.fx.Node]) -> tuple[list[NamedTensor], list[NamedTensor]]:
        """The graph's inputs as the program's: the user's, by the model file's names, and its
        weights (tied ones stored once)."""
        ep = self.ep
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
                name = spec.target + (self.constant_suffix if spec.kind == InputKind.CONSTANT_TENSOR else "")
                if id(tensor) in stored:  # tied weights (lm_head = wte) are stored once
                    self.value_names[node] = stored[id(tensor)]
                    self.constants[node] = self.weights[stored[id(tensor)]]
                    continue
                stored[id(tensor)] = name
                self.value_names[node] = name
                self.weights[name] = tensor.detach().contiguous().clone()
                self.constants[node] = self.weights[name]
                weights.append(NamedTensor(name, self.spec_of(tensor, f"weight {name}")))
            else:
                raise TraceError(f"unsupported graph input kind {spec.kind.name} for {spec.target}")
        return user_inputs, weights

    def _lower_node(self, node: torch.fx.Node) -> None:
        """One graph node as a step of the program (or folded away: views of state, size arithmetic)."""
        if node.op != "call_function" or node in self.skip:
            return
        if node in self.alias:
            source = node
            while source in self.alias:
                source = self.alias[source]
            self.value_names[node] = self.value_names[source]
            return
        if (value := item(node, self.constants)) is not None:  # of a folded step's results
            self.constants[node] = value
            return
        if node.target is operator.getitem:
            parent, index = node.args
            self.value_names[node] = node.name
            self.buffers[node.name] = self.spec_of(node.meta["val"], node.name)
            return
        if not isinstance(node.target, torch._ops.OpOverload):
            val = node.meta.get("val")
            if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float)):  # size
                # arithmetic, comparisons and floats of sizes: folded into the arguments that use them
                return
            raise TraceError(f"graph node {node.name} calls {node.target}, which bundles cannot store")
        name = op_name(node.target)
        name = STANDS_FOR.get(name, name)
        if name in DROPPED_OPS:
            return
        val = node.meta.get("val")
        if name == "aten.sym_size.int" or isinstance(val, (torch.SymInt, torch.SymBool, int, bool)):
            return
        unbacked = [str(s) for s in (node.meta.get("unbacked_bindings") or {}) if s not in self.names]
        if unbacked:  # a size that tensor values give (torch.nonzero, x[mask]): named with its bound
            raise selection_error(node, unbacked[0], self.names)
        if name not in ALLOWED_OPS:
            raise TraceError(
                f"{_model_line(node)}the model calls {name}, which a bundle may not run (only the pure "
                f"ATen ops of aot/allowed_ops.py: no random numbers, autograd or process state); "
                f"build the model in eval mode, pass random values in as inputs, or add the op to "
                f"aot/allowed_ops.py if it is a pure function of its arguments"
            )
        how = constant_step(node, self.constants) if node not in self.inplace else None
        if how is not None and (value := evaluate(node, self.constants)) is not None:
            self.constants[node] = value
            if how == "fold":
                return
            self.constant_views.add(node.name)  # a view stays a step, dropped where nothing reads it
        outputs: tuple[str | None, ...]
        if isinstance(val, (tuple, list)):
            by_index = {u.args[1]: u.name for u in node.users if u.target is operator.getitem}
            outputs = tuple(by_index.get(i) for i in range(len(val)))
        else:
            self.value_names[node] = node.name
            self.buffers[node.name] = self.spec_of(val, node.name)
            outputs = (node.name,)
        if node in self.inplace:  # a state write, in place: its result aliases the state
            name, base = self.inplace[node]
            args = (Buf(self.value_names[base]), *(self.encode(a) for a in node.args[1:]))
        else:
            args = tuple(self.encode(a) for a in node.args)
        self.steps.append(
            Step(
                kind=StepKind.ATEN,
                target=name,
                args=args,
                kwargs={k: self.encode(v) for k, v in node.kwargs.items()},
                outputs=outputs,
            )
        )
        line = _user_line(node)
        if line:
            self.lines.update((o, line) for o in outputs if o is not None)

    def _drop_unread_views(self, outputs: list[str]) -> None:
        """Views of constants that only folded steps read (or other such views): no step left."""
        while True:
            read = _names_read(self.steps) | set(outputs)
            kept = [
                s
                for s in self.steps
                if not (s.outputs[0] in self.constant_views and s.outputs[0] not in read)
            ]
            if len(kept) == len(self.steps):
                return
            self.steps = kept

    def _store_folded(self, node: torch.fx.Node) -> None:
        """A folded result that a step (or the program's output) reads, as a weight of its own."""
        tensor = self.constants[node].detach().clone(memory_format=torch.contiguous_format)  # owns its memory
        name = folded_name(tensor)
        if name not in self.weights:
            self.weights[name] = tensor
            self.folded.append(NamedTensor(name, self.spec_of(tensor, f"weight {name}")))
        self.value_names[node] = name

    def _write_back_state(self, user_inputs: list[NamedTensor]) -> None:
        """A state whose old value is read after its in-place write gets the new value copied in
        last."""
        for state_name, value in self.trailing:  # the old value was read after the write
            written = f"{state_name}__written"
            self.buffers[written] = self.buffers.get(self.value_names[value]) or next(
                i.spec for i in user_inputs if i.name == state_name
            )
            self.steps.append(
                Step(
                    kind=StepKind.ATEN,
                    target="aten.copy_.default",
                    args=(Buf(state_name), Buf(self.value_names[value])),
                    kwargs={},
                    outputs=(written,),
                )
            )

    def _outputs(self, graph: torch.fx.Graph, user_outputs: list[int]) -> list[str]:
        """The program's outputs, by buffer name; ``none_outputs``: the flat outputs that are None."""
        out_node = next(n for n in graph.nodes if n.op == "output")
        outputs = []
        self.none_outputs: set[int] = set()  # flat outputs that are None (an optional field)
        for k, position in enumerate(user_outputs):
            o = out_node.args[0][position]
            if o is None:
                self.none_outputs.add(k)
                continue
            if isinstance(o, torch.fx.Node) and o in self.constants and o not in self.value_names:
                self._store_folded(o)
            if not isinstance(o, torch.fx.Node) or o not in self.value_names:
                raise TraceError(f"model output {o} is not a tensor; return tensors only")
            outputs.append(self.value_names[o])
        return outputs


def _names_read(steps: list[Step]) -> set[str]:
    """The buffer and weight names the steps' arguments name."""

    def names(a: Any) -> set[str]:
        if isinstance(a, Buf):
            return {a.name}
        if isinstance(a, (list, tuple)):
            return set().union(*map(names, a)) if a else set()
        if isinstance(a, dict):
            return set().union(*map(names, a.values())) if a else set()
        return set()

    return set().union(*(names(s.args) | names(s.kwargs) for s in steps)) if steps else set()
