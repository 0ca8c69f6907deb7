"""Advanced indexing inside a kernel: ``aten.index.Tensor`` with two or more index tensors on
adjacent dims (``x[:, :, i, j]``), a ``gather`` node of the value graph.

The bicubic resize as ``torch.export`` decomposes it (DINOv2's, ViT's and CLIP's position
embeddings interpolated to the image's patch grid) reads its input sixteen times so, at rows and
columns it computes from the output's position; one kernel now computes those positions, reads
the sixteen pixels and blends them, where each index read was a library call. An index tensor is
read at the position its broadcast gives it (``i`` of shape ``[H, 1]`` against ``j`` of ``[W]``).
One index tensor stays with the row gathers (``codegen/index_rows.py``) and the index views
(``codegen/index_views.py``); indices apart (``x[i, :, j]``, whose broadcast dims ATen moves to
the front) and boolean masks stay library calls.
"""

from __future__ import annotations

from aot.codegen import index as ix
from aot.codegen.valuegraph import Builder, Node, Unsupported
from aot.schema import Buf, Step

INDEX = "aten.index.Tensor"
INDEX_DTYPES = ("int64", "int32")


def adjacent_indices(step: Step) -> tuple[int, list[Buf]] | None:
    """(the first indexed dim, the index tensors) of an ``index`` step whose two or more index
    tensors lie on adjacent dims; None otherwise."""
    if step.target != INDEX or len(step.args) != 2 or step.kwargs:
        return None
    given = list(step.args[1]) if isinstance(step.args[1], (list, tuple)) else []
    tensors = [k for k, a in enumerate(given) if a is not None]
    if len(tensors) < 2 or tensors != list(range(tensors[0], tensors[-1] + 1)):
        return None
    if not all(isinstance(given[k], Buf) for k in tensors):
        return None
    return tensors[0], [given[k] for k in tensors]


def lower_index(b: Builder, step: Step) -> None:
    found = adjacent_indices(step)
    if found is None:
        raise Unsupported("an index whose tensors are not adjacent")
    d, bufs = found
    name, shape, dtype = b.out(step)
    x = b.tensor(step.args[0])
    if b.spec(step.args[0].name).dtype != dtype:
        raise Unsupported("an index whose result changes the dtype")
    indices = []
    for buf in bufs:
        if b.spec(buf.name).dtype not in INDEX_DTYPES:
            raise Unsupported(f"an index of dtype {b.spec(buf.name).dtype}")
        indices.append(b.tensor(buf))
    rank = max(len(i.shape) for i in indices)
    gather_shape = tuple(shape[d : d + rank])
    expected = (*x.shape[:d], *gather_shape, *x.shape[d + len(indices) :])
    if len(expected) != len(shape) or not all(ix.same(a, c) for a, c in zip(expected, shape)):
        raise Unsupported("an index's result shape is not its input's with the indexed dims replaced")
    b.set(name, Node("gather", shape, dtype, (x, *indices), gather_dim=d, gather_shape=gather_shape))
