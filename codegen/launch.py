"""How a group's kernel is launched: the shape of the kernel (pointwise or reduction, single
block or looped), its block sizes, warps and grid, the index width, and its parameters.

- **pointwise**: one flat index ``x`` over the outputs' elements, ``BLOCK`` per program;
- **tiled pointwise**: rows ``r`` × columns ``c`` of the output, a 2-D grid of ``ROWS`` ×
  ``BLOCK_R`` tiles, for a group that reads some input transposed (``plan_tiled``);
- **reduction**: rows ``r`` × reduced elements ``c`` (the reduced dims are the trailing ones);
  ``ROWS`` rows per program. When the reduced extent can exceed ``SINGLE_BLOCK_MAX`` the kernel
  loops over ``c`` in ``BLOCK_R`` chunks; otherwise a row sits in registers.

No autotuning yet: the heuristics below choose every config, and the choice is recorded per
kernel (``config``). ``plan_launch`` hands ``render`` a ``Launch``; ``kernel_params`` the
kernel's signature and runtime arguments.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aot.codegen import index as ix
from aot.codegen.index import Lin, Size
from aot.codegen.triton_types import STORAGE
from aot.codegen.valuegraph import Node, NotFusible
from aot.schema import Buf, KernelParam, ParamKind, Sym

HEURISTIC = "aotpack-v1"
POINTWISE_BLOCK = 1024  # elements per program of a pointwise kernel (8 per thread at 4 warps)
POINTWISE_MIN_BLOCK = 128
SINGLE_BLOCK_MAX = 8192  # largest reduced extent kept in registers (single-block reduction)
REDUCTION_TILE = 1024  # target ROWS * BLOCK_R of a single-block reduction (small rows share a program)
STRIDED_TILE = 8192  # the same when a load walks the reduced dim with a stride and the rows contiguously
MAX_ROWS = 64
TILE = 64  # rows and columns of a tiled pointwise program (a transposing copy: 64 x 64 elements)
TILE_MIN = 16  # tile only when both the rows and the columns reach this
LOOP_BLOCK = 2048  # reduced elements per iteration of a looped reduction
LOOP_WARPS = 8
NUM_STAGES = 1  # no software pipelining: the kernels do no dot products
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes (the first: 2**31 - 1)
INT32_LIMIT = 2**31 - 1


def pointwise_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def reduction_warps(tile: int) -> int:
    return max(1, min(8, tile // 256))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _at_corners(expr: Size, ranges: dict[str, tuple[int, int]]) -> list[int]:
    """A size expression's values at the corners of the declared dim ranges (sizes grow with
    their dims: the corners bound them)."""
    syms = sorted(expr.free_symbols, key=lambda s: s.name)
    if not syms:
        return [int(expr)]
    corners = itertools.product(*[ranges.get(s.name, (1, 1)) for s in syms])
    return [int(expr.subs(dict(zip(syms, corner)))) for corner in corners]


def max_value(expr: Size, ranges: dict[str, tuple[int, int]]) -> int:
    """Largest value of a size expression over the declared dim ranges (0 at the least where it
    has symbols)."""
    values = _at_corners(expr, ranges)
    return max(0, *values) if expr.free_symbols else values[0]


def min_value(expr: Size, ranges: dict[str, tuple[int, int]]) -> int:
    """Smallest value of a size expression over the declared dim ranges."""
    return min(_at_corners(expr, ranges))


def cdiv_text(n: Size, block: int) -> str:
    """The grid's count of ``block``-sized blocks over ``n``, as text (a size expression's where
    ``n`` is symbolic)."""
    if n.is_Integer:
        return str(-(-int(n) // block))
    if block == 1:
        return ix.size_text(n)
    return f"({ix.size_text(n)} + {block - 1})//{block}"


@dataclass(frozen=True)
class Launch:
    mode: str  # "pointwise" | "tiled" | "single" | "loop"
    levels: tuple[str, ...]  # per output: "full" (every element) or "row" (one per reduced row)
    masks: dict[str, bool]  # atom ("x", "r", "c") -> needs a bounds mask
    row_lin: Lin | None  # index of a row value (reductions)
    full_lin: Lin  # index of a full value
    rows: Size | None  # rows and reduced extent (reductions)
    width: Size | None
    domain_max: int  # largest number of elements the grid covers
    grid: tuple[str, ...]
    num_warps: int
    config: dict[str, Any]


def plan_launch(
    reduces: list[Node], out_numels: list[Size], maxv: Callable[[Size], int], strided: bool = False
) -> Launch:
    """The launch of a group whose value graph has ``reduces`` and outputs of ``out_numels``
    elements; ``maxv`` bounds a size over the declared dim ranges. ``strided``: some load reads the
    reduced dim with a stride and consecutive rows at consecutive addresses (a LayerNorm over the
    channels of an NCHW tensor): a program then takes up to ``MAX_ROWS`` rows, so that each
    channel's load is one contiguous run of rows (eight rows read 16 bytes per channel)."""
    if reduces:
        return _plan_reduction(reduces, out_numels, maxv, strided)
    numel0 = out_numels[0]
    if any(not ix.same(n, numel0) for n in out_numels):
        raise NotFusible("outputs of different sizes")
    n_max = maxv(numel0)
    block = (
        POINTWISE_BLOCK if n_max >= POINTWISE_BLOCK else max(POINTWISE_MIN_BLOCK, next_pow2(max(n_max, 1)))
    )
    return Launch(
        mode="pointwise",
        levels=("full",) * len(out_numels),
        masks={"x": not (numel0.is_Integer and int(numel0) % block == 0)},
        row_lin=None,
        full_lin=ix.atom("x", numel0),
        rows=None,
        width=None,
        domain_max=n_max,
        grid=(cdiv_text(numel0, block),),
        num_warps=pointwise_warps(block),
        config={"kind": "pointwise", "BLOCK": block},
    )


def plan_tiled(numel: Size, width: Size, n_outputs: int, maxv: Callable[[Size], int]) -> Launch | None:
    """A pointwise group seen as ``numel / width`` rows of ``width`` contiguous output elements,
    in ``TILE`` x ``TILE`` tiles on a 2-D grid: for a group that reads an input transposed (its
    consecutive elements a row apart, ``kernel_source.transposed_width``), whose flat loads would
    touch a sector per element; in a tile both that load (down the rows) and the store (along the
    columns) are runs of adjacent elements. None when the rows or columns are too few to tile."""
    rows = ix.quotient(numel, width)
    if not ix.same(rows * width, numel) or rows.free_symbols - numel.free_symbols:
        return None
    rows_max, width_max = maxv(rows), maxv(width)
    if rows_max < TILE_MIN or width_max < TILE_MIN:
        return None
    n_rows, block_c = min(TILE, next_pow2(rows_max)), min(TILE, next_pow2(width_max))
    return Launch(
        mode="tiled",
        levels=("full",) * n_outputs,
        masks={
            "r": not (rows.is_Integer and int(rows) % n_rows == 0),
            "c": not (width.is_Integer and int(width) % block_c == 0),
        },
        row_lin=ix.atom("r", rows),
        full_lin=ix.make_lin([(width, ix.Frag("r", rows)), (ix.ONE, ix.Frag("c", width))]),
        rows=rows,
        width=width,
        domain_max=rows_max * width_max,
        grid=(cdiv_text(rows, n_rows), cdiv_text(width, block_c)),
        num_warps=pointwise_warps(n_rows * block_c),
        config={"kind": "pointwise-tiled", "ROWS": n_rows, "BLOCK_R": block_c},
    )


def _plan_reduction(
    reduces: list[Node], out_numels: list[Size], maxv: Callable[[Size], int], strided: bool = False
) -> Launch:
    first = reduces[0]
    width = first.width
    rows = ix.quotient(ix.numel(first.inputs[0].shape), width)
    for red in reduces:
        if not ix.same(red.width, width) or not ix.same(ix.numel(red.inputs[0].shape), rows * width):
            raise NotFusible("reductions of different extents")
    levels = []
    for n in out_numels:
        if ix.same(n, rows * width):
            levels.append("full")
        elif ix.same(n, rows):
            levels.append("row")
        else:
            raise NotFusible("an output is neither a full nor a row value of the reduction")
    width_max, rows_max = maxv(width), maxv(rows)
    if width_max <= SINGLE_BLOCK_MAX:
        mode = "single"
        block_r = next_pow2(max(width_max, 1))
        tile = STRIDED_TILE if strided else REDUCTION_TILE
        n_rows = max(1, min(MAX_ROWS, tile // block_r, next_pow2(max(rows_max, 1))))
        warps = reduction_warps(n_rows * block_r)
    else:
        mode = "loop"
        block_r, n_rows, warps = LOOP_BLOCK, 1, LOOP_WARPS
    masks = {
        "r": not (rows.is_Integer and int(rows) % n_rows == 0),
        "c": not (
            width.is_Integer and (int(width) == block_r if mode == "single" else int(width) % block_r == 0)
        ),
    }
    return Launch(
        mode=mode,
        levels=tuple(levels),
        masks=masks,
        row_lin=ix.atom("r", rows),
        full_lin=ix.make_lin([(width, ix.Frag("r", rows)), (ix.ONE, ix.Frag("c", width))]),
        rows=rows,
        width=width,
        domain_max=rows_max * width_max,
        grid=(cdiv_text(rows, n_rows),),
        num_warps=warps,
        config={"kind": f"reduction-{mode}", "ROWS": n_rows, "BLOCK_R": block_r},
    )


def index_type(biggest: int, config: dict[str, Any]) -> str:
    """``i32`` unless an index can reach 2**31 (``biggest`` elements plus a block's overshoot)."""
    block_elems = config.get("BLOCK", 0) + config.get("ROWS", 0) * config.get("BLOCK_R", 0)
    return "i32" if biggest + 2 * block_elems <= INT32_LIMIT else "i64"


def kernel_params(
    ptrs: dict[str, str],
    ptr_dtypes: dict[str, str],
    outputs: list[tuple[str, str]],
    sizes: list[str],
    index_ty: str,
) -> tuple[list[KernelParam], dict[str, str], list[Any]]:
    """(parameters, Triton signature, step arguments): input pointers (``ptrs``: root buffer →
    parameter name), output pointers (``outputs``: buffer, dtype), then one size per symbol."""
    params: list[KernelParam] = []
    signature: dict[str, str] = {}
    args: list[Any] = []
    for buf, pname in ptrs.items():
        dt = ptr_dtypes[buf]
        params.append(KernelParam(pname, ParamKind.PTR, dt))
        signature[pname] = "*" + STORAGE[dt]
        args.append(Buf(buf))
    for i, (o, dt) in enumerate(outputs):
        params.append(KernelParam(f"out{i}", ParamKind.PTR, dt))
        signature[f"out{i}"] = "*" + STORAGE[dt]
        args.append(Buf(o))
    for s in sizes:
        params.append(KernelParam(f"s_{s}", ParamKind(index_ty), ""))
        signature[f"s_{s}"] = index_ty
        args.append(Sym(s))
    return params, signature, args
