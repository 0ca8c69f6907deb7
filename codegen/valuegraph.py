"""The value graph of a kernel: what lowering builds from a group's steps and the source writer
reads.

A ``Node`` is one value inside a kernel, addressed by its flat index; its Triton expression is a
format string over its inputs' values, computed in fp32 for half types (rounded only where the
program casts). ``Builder`` resolves a step's buffer arguments to nodes (a buffer no step of the
group computes becomes a ``load`` of a root buffer) and records the node of each output buffer.

``Unsupported`` (one step cannot be part of a kernel) and ``NotFusible`` (a group cannot be one
kernel) are how the codegen says "keep these as ATen calls"; neither ever fails a build.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aot.codegen import index as ix
from aot.codegen.index import Lin, Size
from aot.codegen.triton_types import COMPUTE
from aot.layout import is_row_major
from aot.schema import Buf, Step, TensorSpec


class Unsupported(Exception):
    """This step (with these arguments) cannot be part of a kernel; it stays a library call."""


class NotFusible(Exception):
    """The group cannot be one kernel (the partitioner then splits it)."""


@dataclass(eq=False)
class Node:
    """A value inside a kernel.

    kind ``load``: element of root buffer ``buf``; ``op``: ``fmt`` over the inputs' values (each
    cast to ``casts[i]`` first when given; ``"@ty"``: first rounded to the input's own half
    dtype, for ops whose result jumps, like casts to int and comparisons), ``$idx`` in ``fmt`` is
    the node's own flat index;
    ``remap``: the input at ``remap(index)`` (``order``: a permutation back, below); ``reduce``: ``reduce`` ("sum", "max", "min") of the
    input over its last ``width`` elements per row; ``cat``: the inputs laid end to end along
    dim ``cat_dim`` (input i ends at ``cat_ends[i]``), each read only where it is the one chosen;
    ``gather``: advanced indexing (``x[:, i, j]``): input 0 read where its dims ``gather_dim`` on
    hold the values of the index inputs after it, broadcast to ``gather_shape`` (the dims that
    replace them in this node's shape).
    """

    kind: str
    shape: tuple[Size, ...]
    dtype: str
    inputs: tuple[Node, ...] = ()
    fmt: str = ""
    casts: tuple[str | None, ...] = ()
    buf: str = ""
    remap: Callable[[Lin], Lin] | None = None
    reduce: str = ""
    width: Size = ix.ONE
    cat_dim: int = 0
    cat_ends: tuple[Size, ...] = ()
    # a ``remap`` that permutes its input back into this node's dims: the input's dims in the
    # order they lie in this node's row-major memory. An output such as this is stored from its
    # input in that order (``render_kernel``): a softmax over another dim than the last keeps its
    # rows the kernel's.
    order: tuple[int, ...] = ()
    gather_dim: int = 0
    gather_shape: tuple[Size, ...] = ()

    @property
    def ty(self) -> str:
        return COMPUTE[self.dtype]


def same_index(lin: Lin) -> Lin:
    """The remap of a view that keeps the flat index (reshape, squeeze, a statistic's output)."""
    return lin


class Builder:
    """Resolves a step's arguments to nodes; records each output buffer's node."""

    def __init__(
        self,
        buffers: dict[str, TensorSpec],
        inputs: dict[str, TensorSpec],
        not_roots: frozenset[str] = frozenset(),
    ):
        self.buffers = buffers
        self.known = inputs  # specs of program inputs and weights
        self.not_roots = not_roots  # buffers a kernel must not read through a pointer (ATen views)
        self.env: dict[str, Node] = {}
        self.roots: dict[str, Node] = {}

    def spec(self, name: str) -> TensorSpec:
        spec = self.buffers.get(name) or self.known.get(name)
        if spec is None:
            raise Unsupported(f"buffer {name} has no spec")
        return spec

    def shape(self, name: str) -> tuple[Size, ...]:
        return tuple(ix.parse_size(s) for s in self.spec(name).shape)

    def tensor(self, arg: Any) -> Node:
        if not isinstance(arg, Buf):
            raise Unsupported(f"expected a tensor argument, got {str(arg)[:40]}")
        name = arg.name
        if name in self.env:
            return self.env[name]
        if name not in self.roots:
            if name in self.not_roots:
                raise Unsupported(f"{name} is a view made by a library call")
            spec = self.spec(name)
            if spec.dtype not in COMPUTE:
                raise Unsupported(f"dtype {spec.dtype}")
            shape = self.shape(name)
            if is_row_major(spec.order):
                self.roots[name] = Node("load", shape, spec.dtype, buf=name)
            else:  # read through its memory order: a load of the stored dims, permuted back
                stored = Node("load", ix.permuted(shape, spec.order), spec.dtype, buf=name)
                self.roots[name] = Node(
                    "remap",
                    shape,
                    spec.dtype,
                    (stored,),
                    remap=lambda lin: ix.to_memory(lin, shape, spec.order),
                )
        return self.roots[name]

    def out(self, step: Step, i: int = 0) -> tuple[str | None, tuple[Size, ...], str]:
        name = step.outputs[i] if i < len(step.outputs) else None
        if name is None:
            return None, (), ""
        return name, self.shape(name), self.spec(name).dtype

    def set(self, name: str | None, node: Node) -> None:
        if name is not None:
            self.env[name] = node


def pointwise_node(shape, dtype, fmt: str, operands: list[tuple[Node | None, str]], ty: str | None) -> Node:
    """Node computing ``fmt`` over ``operands`` (tensors cast to ``ty``; scalars already literal)."""
    inputs, casts, slots = [], [], []
    for node, lit in operands:
        if node is None:
            slots.append(lit)
        else:
            slots.append(f"${len(inputs)}")
            inputs.append(node)
            casts.append(ty)
    text = re.sub(r"\$(\d+)", lambda m: slots[int(m.group(1))], fmt)
    return Node("op", shape, dtype, tuple(inputs), text, tuple(casts))


def walk(outputs: list[Node]) -> list[Node]:
    """Nodes reachable from ``outputs``, inputs before users, in a deterministic order."""
    seen: set[int] = set()
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(n, False) for n in reversed(outputs)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for inp in reversed(node.inputs):
            if id(inp) not in seen:
                stack.append((inp, False))
    return order
