"""Tensors made with ``empty`` and then filled slice by slice, as the concatenation of the pieces.

A model may build a tensor by allocating it and copying pieces into its slices (DeepSeek-V3's
multi-head latent attention: ``key = kv.new_empty(...)``, then ``key[..., :d] = k_nope`` and
``key[..., d:] = k_rot``). Exported and functionalized, that is

    e  = empty(shape)
    c0 = copy(slice(e, dim, a0, b0), x0);  s0 = slice_scatter(e,  c0, dim, a0, b0)
    c1 = copy(slice(s0, dim, a1, b1), x1); s1 = slice_scatter(s0, c1, dim, a1, b1) ...

A bundle may not run ``empty`` (its values are whatever the memory held: ``aot.allowed_ops``).
Where the slices of one dim, in whatever order they are written, tile it from 0 to its size
(every element written once), the last ``slice_scatter`` is ``cat`` of the pieces in the dim's
order and this pass makes it so;
the ``empty``, its slices and the copies go. A copy whose source differs from its slice in shape
or dtype (a broadcast, a cast), pieces that leave a gap or overlap, a slice with a step, or any
other use of the uninitialized tensor leave the graph as it is, and the lowering refuses
``empty`` as before.
"""

from __future__ import annotations

import torch

ATEN = torch.ops.aten
END = 2**63 - 1  # ``x[a:]``'s end as export writes it


def cat_filled_empties(graph: torch.fx.Graph) -> int:
    """Rewrite every ``empty`` filled slice by slice (module docstring) in ``graph``; how many."""
    done = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is ATEN.empty.memory_format:
            pieces = _pieces(node)
            if pieces is not None:
                last, dim, sources = pieces
                with graph.inserting_before(last):
                    cat = graph.call_function(ATEN.cat.default, (sources, dim))
                cat.meta = dict(last.meta)
                last.replace_all_uses_with(cat)
                done += 1
    if done:
        graph.eliminate_dead_code()
    return done


def _pieces(empty: torch.fx.Node) -> tuple[torch.fx.Node, int, list[torch.fx.Node]] | None:
    """(the last ``slice_scatter``, the dim, each piece's source in the dim's order) where
    ``empty`` is filled slice by slice, each element of one dim once; else None."""
    val = empty.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    current, dim, pieces = empty, None, []
    while True:
        users = list(current.users)
        scatters = [u for u in users if u.target is ATEN.slice_scatter.default and u.args[0] is current]
        if len(scatters) != 1:
            break
        scatter = scatters[0]
        step = _arg(scatter, 5, "step", 1)
        d, start, end = (
            _arg(scatter, 2, "dim", 0),
            _arg(scatter, 3, "start", None),
            _arg(scatter, 4, "end", None),
        )
        if step != 1 or not isinstance(d, int):
            return None
        d = d % val.dim()
        size = val.shape[d]
        if not isinstance(size, int) or (dim is not None and d != dim):
            return None
        start = 0 if start is None else start
        end = size if end is None or end == END else end
        if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start < end <= size:
            return None
        copy = scatter.args[1]
        piece = _copy_source(copy, current, d, start, end)
        if piece is None:
            return None
        # the uninitialized tensor (or the one partly filled) is read by this piece's slice alone
        if set(users) != {scatter, copy.args[0]}:
            return None
        dim = d
        pieces.append((start, end, piece))
        current = scatter
    if current is empty:
        return None
    pieces.sort(key=lambda p: p[0])  # written in any order: each element once, none left
    ends = [0] + [end for _, end, _ in pieces]
    if [start for start, _, _ in pieces] != ends[:-1] or ends[-1] != val.shape[dim]:
        return None
    return current, dim, [piece for _, _, piece in pieces]


def _copy_source(
    copy: torch.fx.Node, base: torch.fx.Node, dim: int, start: int, end: int
) -> torch.fx.Node | None:
    """``x`` where ``copy`` is ``copy(slice(base, dim, start, end), x)`` with ``x`` of the slice's
    shape and dtype, and the slice has no other use; else None."""
    if not (isinstance(copy, torch.fx.Node) and copy.target is ATEN.copy.default and len(copy.users) == 1):
        return None
    view, source = copy.args[0], copy.args[1]
    if not (
        isinstance(view, torch.fx.Node)
        and view.target is ATEN.slice.Tensor
        and view.args[0] is base
        and len(view.users) == 1
        and isinstance(source, torch.fx.Node)
    ):
        return None
    d = _arg(view, 1, "dim", 0)
    v_start, v_end, v_step = (
        _arg(view, 2, "start", None),
        _arg(view, 3, "end", None),
        _arg(view, 4, "step", 1),
    )
    size = base.meta["val"].shape[dim]
    v_start = 0 if v_start is None else v_start
    v_end = size if v_end is None or v_end == END else v_end
    if (
        not isinstance(d, int)
        or d % base.meta["val"].dim() != dim
        or (v_start, v_end, v_step) != (start, end, 1)
    ):
        return None
    want, got = view.meta.get("val"), source.meta.get("val")
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
        return None
    # sizes as text (symbols by name): comparing them as SymInts would add guards
    if [str(s) for s in want.shape] != [str(s) for s in got.shape] or want.dtype != got.dtype:
        return None
    return source


def _arg(node: torch.fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)
