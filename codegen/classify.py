"""Which ATen ops the fuser knows, and the entry point that lowers one step into a kernel's value
graph.

Every step of the program is one of:

- ``view``: a reshape/permute/expand/slice/select/split…; never materialized inside a kernel,
  folded into index arithmetic (``lower_views``);
- ``generator``: values that depend only on the index (``arange``, ``full``…), recomputed
  wherever they are used (``lower_views``);
- ``pointwise``: one value per output element from inputs at broadcast positions
  (``lower_pointwise``);
- ``reduction``: reduces trailing dims (sum, mean, amax, var, softmax, layer norm…)
  (``lower_reduction``);
- ``library``: everything else (matmul, convolution, attention, embedding, pooling, and every op
  the codegen does not know). A library step stays an ATen call, so an unknown op never fails a
  build.

The partitioner reads ``classify``; ``render`` calls ``lower`` for every step of a group.
"""

from __future__ import annotations

from aot.codegen import index as ix
from aot.codegen.lower_gather import INDEX, adjacent_indices, lower_index
from aot.codegen.lower_pointwise import POINTWISE
from aot.codegen.lower_reduction import lower_reduction
from aot.codegen.lower_views import FOLDED_VIEWS, lower_generator, lower_view
from aot.codegen.triton_types import COMPUTE
from aot.codegen.valuegraph import Builder, Unsupported
from aot.program import VIEW_OPS as PROGRAM_VIEW_OPS
from aot.schema import Step, StepKind, TensorSpec

# The program's views (``aot.program.VIEW_OPS``) that a kernel folds into its index arithmetic;
# ``as_strided`` addresses storage directly and stays a library call.
UNFOLDABLE_VIEWS = frozenset({"aten.as_strided.default"})
VIEW_OPS = PROGRAM_VIEW_OPS - UNFOLDABLE_VIEWS
assert VIEW_OPS == FOLDED_VIEWS, sorted(VIEW_OPS ^ FOLDED_VIEWS)

GENERATOR_OPS = frozenset(
    {
        "aten.arange.default",
        "aten.arange.start",
        "aten.arange.start_step",
        "aten.full.default",
        "aten.full_like.default",
        "aten.scalar_tensor.default",
        "aten.fill.Scalar",
        "aten.zeros_like.default",
        "aten.ones_like.default",
        "aten.zeros.default",
        "aten.ones.default",
        "aten.new_zeros.default",
        "aten.new_ones.default",
        "aten.new_full.default",
    }
)
REDUCTION_OPS = frozenset(
    {
        "aten.native_layer_norm.default",
        "aten.native_group_norm.default",
        "aten._softmax.default",
        "aten._log_softmax.default",
        "aten.sum.dim_IntList",
        "aten.sum.default",
        "aten.mean.dim",
        "aten.mean.default",
        "aten.amax.default",
        "aten.amin.default",
        "aten.var.correction",
        "aten.var_mean.correction",
        "aten.logsumexp.default",
        "aten.linalg_vector_norm.default",
    }
)


def returns_view(target: str) -> bool:
    """Whether an ATen op returns a view of an input (its schema's first return aliases)."""
    import torch

    try:
        _, name, overload = target.split(".")
        schema = getattr(getattr(torch.ops.aten, name), overload)._schema
    except (AttributeError, ValueError, RuntimeError):
        return False
    return bool(schema.returns) and schema.returns[0].alias_info is not None


def classify(step: Step, buffers: dict[str, TensorSpec]) -> str:
    """``view`` | ``generator`` | ``pointwise`` | ``reduction`` | ``library`` (see module doc)."""
    name = step.target
    if step.kind != StepKind.ATEN:
        return "library"
    specs = [buffers.get(o) for o in step.outputs if o is not None]
    if not specs or any(s is None or s.dtype not in COMPUTE for s in specs):
        return "library"
    if name in VIEW_OPS:
        return "view"
    if name in GENERATOR_OPS:
        return "generator"
    if name in POINTWISE:
        return "pointwise"
    if name == INDEX and adjacent_indices(step) is not None:  # x[:, i, j]: a gather node
        return "pointwise"
    if name in REDUCTION_OPS:
        return "reduction"
    return "library"


def lower(b: Builder, step: Step) -> None:
    """Add the nodes of ``step`` to ``b``; ``Unsupported`` when it cannot be fused."""
    kind = classify(step, b.buffers)
    try:
        if kind == "view":
            lower_view(b, step)
        elif kind == "generator":
            lower_generator(b, step)
        elif kind == "pointwise":
            (lower_index if step.target == INDEX else POINTWISE[step.target])(b, step)
        elif kind == "reduction":
            lower_reduction(b, step)
        else:
            raise Unsupported(f"{step.target} is a library call")
    except (IndexError, KeyError, TypeError, ValueError, ix.InexpressibleIndex) as e:
        raise Unsupported(f"{step.target}: {type(e).__name__}: {e}") from None
