"""Complex tensors as their real and imaginary parts: rotary embeddings in complex numbers.

Some models rotate queries and keys by multiplying complex numbers (Llama 4, DeepSeek-V2:
``freqs = torch.polar(ones, angles)``, ``view_as_complex(q.reshape(..., -1, 2)) * freqs``, then
``view_as_real``). A bundle's tensors are real (``aot.schema``'s dtypes), so this pass rewrites
the exported graph with each complex tensor as two real ones of its shape:

- ``polar(r, a)``: ``r * cos(a)``, ``r * sin(a)``; under export ``torch.polar`` is
  ``torch.complex(r * cos(a), r * sin(a))`` (``polar_from_parts``): the library's own polar
  decomposes through a copy whose meta function guards every dim at 2 or more, which turns a
  batch of at most 2 (Llama 4's rotary angles have the batch dim) into a static 2; ``complex(re,
  im)`` is taken apart as its two operands;
- ``view_as_complex(x)`` (x's last dim of 2): ``x[..., 0]``, ``x[..., 1]``;
- ``mul``: by a real tensor or number, each part; by a complex one,
  ``(ar * br - ai * bi, ar * bi + ai * br)``; ``add``/``sub`` part by part;
- views and copies that move elements without looking at them (``unsqueeze``, ``view``,
  ``expand``, ``permute``, ``slice``, ``select``, ``index``, ``clone``, ...): the same op on each
  part;
- ``view_as_real(z)``: ``cat([re[..., None], im[..., None]], -1)``, real again;
- ``_assert_tensor_metadata`` of a complex tensor goes.

Products round as the library's complex multiply does not promise to (it is free to fuse), so
the parts match eager within float tolerance, not bit for bit. A complex tensor that reaches any
other op (an output, ``abs``, a division) leaves the graph as it is, and the build refuses the
op that made it, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg

ATEN = torch.ops.aten
# ops applied to each part as they are to the complex tensor: they move elements, never read them
SAME_ON_PARTS = frozenset(
    {
        ATEN.unsqueeze.default,
        ATEN.squeeze.dim,
        ATEN.squeeze.dims,
        ATEN.view.default,
        ATEN._unsafe_view.default,
        ATEN.expand.default,
        ATEN.permute.default,
        ATEN.transpose.int,
        ATEN.slice.Tensor,
        ATEN.select.int,
        ATEN.index.Tensor,
        ATEN.index_select.default,
        ATEN.clone.default,
        ATEN.alias.default,
        ATEN.repeat.default,
        ATEN.cat.default,
    }
)


def _polar(r: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    return torch.complex(r * torch.cos(angle), r * torch.sin(angle))


@contextlib.contextmanager
def polar_from_parts() -> Iterator[None]:
    """``torch.polar`` as ``torch.complex`` of its two products while a model is exported (see
    the module docstring): the same values, no guard on the dims."""
    polar = torch.polar
    torch.polar = _polar
    try:
        yield
    finally:
        torch.polar = polar


def split_complex(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``'s complex tensors as real pairs (module docstring), all or nothing: the
    number of complex nodes rewritten, 0 where any of them reaches an op this pass cannot take
    (the graph is then left as it was)."""
    nodes = [n for n in graph.nodes if _is_complex(n)]
    if not nodes:
        return 0
    rewrite = _Rewrite(graph)
    try:
        for node in graph.nodes:
            if node in rewrite.made:
                continue
            if _is_complex(node):
                rewrite.complex_node(node)
            elif any(_is_complex(a) for a in node.all_input_nodes):
                rewrite.real_from_complex(node)
    except _Unsupported:
        rewrite.undo()
        return 0
    for old, new in rewrite.replaced:
        old.replace_all_uses_with(new)
    for node in reversed(list(graph.nodes)):
        if (node in rewrite.dropped or _is_complex(node)) and not node.users:
            graph.erase_node(node)
    if any(_is_complex(n) for n in graph.nodes):  # pragma: no cover - every user was rewritten
        raise AssertionError("a complex node is left after split_complex")
    return len(nodes)


class _Unsupported(Exception):
    pass


def _is_complex(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_complex()


class _Rewrite:
    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.parts: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}
        # new nodes, in order (undone where the pass gives up), and asked after by node
        self.made: dict[torch.fx.Node, None] = {}
        self.replaced: list[tuple[torch.fx.Node, torch.fx.Node]] = []  # (real node, its new form)
        self.dropped: set[torch.fx.Node] = set()
        self.at: torch.fx.Node | None = None
        self.fake = detect_fake_mode(
            [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        )

    def undo(self) -> None:
        for node in reversed(self.made):
            self.graph.erase_node(node)

    def op(self, target: Any, *args: Any) -> torch.fx.Node:
        """A node of ``target(*args)`` before the node being rewritten, its value computed on the
        graph's fake tensors."""
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(target, args)
        with self.fake:
            node.meta["val"] = target(*map_arg(args, lambda a: a.meta["val"]))
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.at.meta:
                node.meta[key] = self.at.meta[key]
        self.made[node] = None
        return node

    def complex_node(self, node: torch.fx.Node) -> None:
        self.at = node
        target, args = node.target, node.args
        if target is ATEN.polar.default:
            r, a = args
            self.parts[node] = (
                self.op(ATEN.mul.Tensor, r, self.op(ATEN.cos.default, a)),
                self.op(ATEN.mul.Tensor, r, self.op(ATEN.sin.default, a)),
            )
        elif target is ATEN.complex.default:
            self.parts[node] = tuple(args)
        elif target is ATEN.view_as_complex.default:
            (x,) = args
            self.parts[node] = (self.op(ATEN.select.int, x, -1, 0), self.op(ATEN.select.int, x, -1, 1))
        elif target in (ATEN.mul.Tensor, ATEN.add.Tensor, ATEN.sub.Tensor) and not node.kwargs:
            self.parts[node] = self._arith(target, *args)
        elif target in SAME_ON_PARTS:
            self.parts[node] = tuple(self.op(target, *self._part_args(args, i)) for i in (0, 1))
        elif (
            target is ATEN._to_copy.default
            and node.kwargs.keys() <= {"dtype"}
            and node.meta["val"].dtype == torch.complex64
            and self._parts_of(args[0])[0].meta["val"].dtype == torch.float32
        ):
            self.parts[node] = self._parts_of(args[0])
        else:
            raise _Unsupported(str(target))

    def real_from_complex(self, node: torch.fx.Node) -> None:
        self.at = node
        if node.target is ATEN._assert_tensor_metadata.default:
            self.dropped.add(node)
            return
        if node.target is ATEN.view_as_real.default:
            re, im = self._parts_of(node.args[0])
            cat = self.op(
                ATEN.cat.default,
                [self.op(ATEN.unsqueeze.default, re, -1), self.op(ATEN.unsqueeze.default, im, -1)],
                -1,
            )
            self.replaced.append((node, cat))
            self.dropped.add(node)
            return
        raise _Unsupported(str(node.target))

    def _parts_of(self, x: Any) -> tuple[torch.fx.Node, torch.fx.Node]:
        if x not in self.parts:
            raise _Unsupported(f"{x} has no parts")
        return self.parts[x]

    def _part_args(self, args: tuple, i: int) -> tuple:
        def one(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and _is_complex(a):
                return self._parts_of(a)[i]
            if isinstance(a, (list, tuple)):
                return type(a)(one(b) for b in a)
            return a

        return tuple(one(a) for a in args)

    def _arith(self, target: Any, x: Any, y: Any) -> tuple[torch.fx.Node, torch.fx.Node]:
        xc, yc = _is_complex(x), _is_complex(y)
        if target is ATEN.mul.Tensor and xc and yc:
            (ar, ai), (br, bi) = self._parts_of(x), self._parts_of(y)
            mul, sub, add = ATEN.mul.Tensor, ATEN.sub.Tensor, ATEN.add.Tensor
            return (
                self.op(sub, self.op(mul, ar, br), self.op(mul, ai, bi)),
                self.op(add, self.op(mul, ar, bi), self.op(mul, ai, br)),
            )
        if target is ATEN.mul.Tensor:  # by a real tensor or number: each part
            z, s = (x, y) if xc else (y, x)
            if isinstance(s, complex):
                raise _Unsupported("a complex number")
            re, im = self._parts_of(z)
            return self.op(target, re, s), self.op(target, im, s)
        if xc and yc:  # add, sub of two complex tensors
            (ar, ai), (br, bi) = self._parts_of(x), self._parts_of(y)
            return self.op(target, ar, br), self.op(target, ai, bi)
        raise _Unsupported(f"{target} of a complex and a real tensor")
