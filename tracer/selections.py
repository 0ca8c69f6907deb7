"""Why a selection whose size depends on tensor values cannot be built, said at its model line.

``torch.nonzero``, ``masked_select`` and boolean-mask indexing (``x[keep]``) return as many rows
as their mask holds True values: torch.export gives that size an unbacked symbol (``u0``) with no
upper bound of its own. A bundle's programs, memory plans and CUDA graphs are planned from input
sizes alone, so the build refuses such an op where the graph makes it, and says which op, its
bound (the mask's element count, in Dims and at the declared maximum), the model lines that use
its result, and the two ways to build the rest: move the selection out, or keep its size fixed
(a buffer of the N first selected rows and their count: ``tests/tracer/test_selections.py``
builds that form and matches eager).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from aot.errors import TraceError
from aot.tracer.sites import library_relative

# What each data-dependent op is, in words, and which of its arguments bounds its size.
_SELECTIONS = {
    "aten.nonzero.default": "torch.nonzero returns one row per nonzero element",
    "aten.argwhere.default": "torch.argwhere returns one row per nonzero element",
    "aten.masked_select.default": "masked_select returns one element per True value of its mask",
    "aten.index.Tensor": "indexing with a boolean mask returns one row per True value of the mask",
    "aten.unique_dim.default": "torch.unique returns one row per distinct value",
    "aten._unique2.default": "torch.unique returns one element per distinct value",
    "aten.unique_consecutive.default": "torch.unique_consecutive returns one element per run",
    "aten._local_scalar_dense.default": ".item() (or int(t), t.tolist()) turns a tensor value into a number",
}
MAX_LINES_SHOWN = 6


def _frames(node: Any) -> list[tuple[str, str, str]]:
    """(file, line, code) of each frame export recorded for ``node``, innermost last."""
    trace = node.meta.get("stack_trace") or ""
    out = []
    lines = trace.splitlines()
    for k, text in enumerate(lines):
        m = re.search(r'File "([^"]+)", line (\d+)', text)
        if m:
            code = lines[k + 1].strip() if k + 1 < len(lines) and "File " not in lines[k + 1] else ""
            out.append((library_relative(m.group(1)), m.group(2), code))
    return out


def _site(node: Any) -> str:
    frames = _frames(node)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


def _bounding(node: Any) -> Any:
    """The tensor whose element count bounds ``node``'s data-dependent size, or None."""
    name = f"aten.{node.target._schema.name.split('::')[-1]}.{node.target._overloadname}"
    if name in ("aten.nonzero.default", "aten.argwhere.default"):
        return node.args[0]
    if name == "aten.masked_select.default":
        return node.args[1]
    if name == "aten.index.Tensor":
        masks = [
            i
            for i in node.args[1]
            if i is not None and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)
        ]
        return masks[0] if masks else None
    return None


def _bound_text(node: Any, names: dict) -> str:
    """``at most batch*8 (32 at the declared maximum)``, or "" where no input bounds the size."""
    import sympy

    from aot.sympy_text import to_text

    source = _bounding(node)
    val = source.meta.get("val") if source is not None else None
    if val is None:
        return ""
    exprs = [s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s)) for s in val.shape]
    numel = sympy.Mul(*exprs) if exprs else sympy.Integer(1)
    if not numel.free_symbols <= set(names):
        return ""
    try:
        text = to_text(numel, names)
    except TraceError:
        return ""
    if numel.is_Integer:
        return f"at most {text}"
    env = next(s.node.shape_env for s in val.shape if isinstance(s, torch.SymInt))
    try:
        at_max = f", {int(env.bound_sympy(numel).upper)} at the declared maximum"
    except (TypeError, ValueError, AttributeError):
        at_max = ""
    return f"at most {text}{at_max}"


def _downstream(node: Any) -> tuple[list[str], bool]:
    """The model lines that use ``node``'s result (transitively, in graph order) and whether it
    reaches the program's outputs."""
    seen, order, reaches = {node}, [], False
    stack = [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                reaches = True
                continue
            if isinstance(user.meta.get("val"), (torch.SymInt, torch.SymBool)) or user.target in (
                torch.ops.aten._assert_scalar.default,
                torch.ops.aten.sym_constrain_range_for_size.default,
            ):
                continue
            order.append(user)
            stack.append(user)
    position = {n: k for k, n in enumerate(node.graph.nodes)}
    lines = list(dict.fromkeys(s for s in (_site(u) for u in sorted(order, key=position.get)) if s))
    return lines, reaches


def selection_error(node: Any, symbol: str, names: dict) -> TraceError:
    """The build error for ``node``, which gives its result the data-dependent size ``symbol``."""
    name = f"aten.{node.target._schema.name.split('::')[-1]}.{node.target._overloadname}"
    what = _SELECTIONS.get(name, f"{name} returns a result whose size depends on tensor values")
    frames = _frames(node)
    file, line, code = frames[-1] if frames else ("", "", "")
    where = f"{file}:{line}: " if file else ""
    bound = _bound_text(node, names)
    used, reaches = _downstream(node)
    here = f"{file}:{line}"
    later = [s for s in used if s != here]
    uses = ", ".join(later[:MAX_LINES_SHOWN]) + (
        f" and {len(later) - MAX_LINES_SHOWN} more" if len(later) > MAX_LINES_SHOWN else ""
    )
    move = f"this line and what uses its result ({uses})" if later else "this line"
    return TraceError(
        f"{where}{code + ': ' if code else ''}{what}, so its size ({symbol}"
        f"{', ' + bound if bound else ''}) depends on tensor values; a bundle plans its programs, "
        f"memory and CUDA graphs from input sizes alone and cannot hold it. Build the rest: move "
        f"{move} out of the bundle, returning the tensors it selects from and the mask as outputs "
        f"(a detector's boxes and scores before NMS), and run the selection in Python on the runner's "
        f"outputs; or keep the size fixed: torch.where(mask, x, fill) over the whole tensor, or the "
        f"first N selected rows of x in N + 1 rows (pos = mask.cumsum(0) - 1; pos = torch.where(mask & "
        f"(pos < N), pos, N); rows = x.new_zeros(N + 1, *x.shape[1:]).scatter(0, pos[:, None].expand_as(x), "
        f"x)[:N]) with mask.sum() as their count" + ("" if reaches or later else "; its result is not used")
    )
