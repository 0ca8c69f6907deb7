"""Attention candidates: a Triton flash-attention forward for SDPA calls that read their query,
key and value as head views of row-major activations, as GPT-style blocks do.

A *site* is an ``aten.scaled_dot_product_attention`` step without a mask or dropout (causal or
not, the default scale or a given one) whose ``q``, ``k`` and ``v`` are each
``permute(view(X, [B, T, H, D]), [0, 2, 1, 3])`` of a piece of one row-major buffer (a slice of
the columns of a fused QKV projection's ``[B*T, 3*H*D]`` result, through ``split``, or a
projection of its own), and whose result goes ``permute([0, 2, 1, 3])`` (then maybe ``clone``)
and ``view([B, T, H*D])`` on to the output projection. The candidate kernel reads the heads where
they lie in the projection's rows and writes the ``[B, T, H*D]`` rows the output projection reads:
the view, split, permute and copy steps go with the library call it replaces.

One program instance per (batch x head, block of queries): the queries' rows stay in registers,
the keys and values stream through in blocks, and the softmax is computed online in fp32 (running
maximum and sum, the accumulator rescaled as the maximum grows). A causal site stops at the
block's last query. For a one-token query (decode without a cache, gpt at ``seq == 1``) that is
one small block per head: the library's flash kernel takes ~6 us there on an H200, for work that
reads 256 bytes per head.

Like the GEMM candidates (``aot.codegen.gemm``), the forms are alternatives recorded in
``Program.alternatives`` (sites ``attn_<n>``); ``aotpack tune`` chooses on the GPU. A default build
runs the forms ``aot.codegen.gemm_defaults`` names at the buckets it names them for (its built-in
table, on sm_90), the library call elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.attention import SDPA, sdpa_call
from aot.codegen.kernel_source import kernel_module, online_softmax_lines, signature_of
from aot.codegen.launch import MAX_GRID_YZ, max_value
from aot.codegen.render import Rendered
from aot.codegen.triton_types import FLOAT_DTYPES, STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import RESHAPE_VIEWS, VIEW_OPS, producer_of, readers_of, tensor_specs
from aot.schema import Buf, KernelParam, ParamKind, Program, Step, StepKind, Sym, TensorSpec
from aot.tuning import ATTENTION_SITE

HEURISTIC = "attention-candidates-v1"
_PERMUTES = ("aten.permute.default", "aten.transpose.int")
_SPLITS = ("aten.split_with_sizes.default", "aten.split.Tensor")
# views that add or drop a unit dim: the rows stay where they were (GPTBigCode unsqueezes its
# projection's rows before splitting q, k and v off them)
_UNIT_DIM_VIEWS = ("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims")
_CLONE = "aten.clone.default"
MAX_HEAD_DIM = 256  # the queries' rows of a block stay in registers
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    """One form: query rows per block, keys per step, warps, stages, and the query lengths ``T``
    it is offered at (inclusive)."""

    name: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_t: int = 1
    max_t: int = 1 << 62


# Performance knobs: the forms compiled for every site. A 16-row block suits short queries (decode
# without a cache: one block per head); longer ones take 64 or 128 rows, so that each key block
# loaded serves more queries.
CONFIGS: tuple[AttnConfig, ...] = (
    AttnConfig("flash_16x32", 16, 32, num_warps=4, num_stages=2, max_t=128),
    AttnConfig("flash_64x64", 64, 64, num_warps=4, num_stages=2, min_t=16),
    AttnConfig("flash_128x64", 128, 64, num_warps=8, num_stages=2, min_t=128),
)


@dataclass(frozen=True)
class Operand:
    """``q``, ``k`` or ``v`` as the kernel reads it: head ``h``'s element ``d`` of token ``t`` of
    batch ``b`` at ``base[(b * T + t) * width + column + h * D + d]``."""

    base: str
    width: int
    column: int


@dataclass(frozen=True)
class AttnSite:
    """One SDPA call the kernel can replace: its operands, sizes, the library steps it stands for
    (``library``, ascending; ``reference`` the same steps) and the buffer it hands on."""

    id: str
    library: tuple[int, ...]
    outputs: tuple[str, ...]
    reference: tuple[Step, ...]
    q: Operand
    k: Operand
    v: Operand
    batch: str  # size text
    seq: str
    heads: int
    head_dim: int
    causal: bool
    scale: float
    dtype: str

    @property
    def m(self) -> str:  # the query length, what a form's buckets are chosen by
        return self.seq

    @property
    def n(self) -> int:  # the output's row width
        return self.heads * self.head_dim


def _size(arg: Any) -> str | None:
    if isinstance(arg, Sym):
        return ix.size_text(ix.parse_size(arg.text))
    if type(arg) is int:
        return str(arg)
    return None


def _is_head_permute(step: Step) -> bool:
    """``permute(x, [0, 2, 1, 3])`` or ``transpose(x, 1, 2)`` of a 4-D tensor."""
    if step.kind != StepKind.ATEN or step.target not in _PERMUTES or step.kwargs or len(step.outputs) != 1:
        return False
    if not isinstance(step.args[0], Buf):
        return False
    if step.target == "aten.permute.default":
        return list(step.args[1:]) == [[0, 2, 1, 3]]
    return sorted(step.args[1:]) in ([1, 2], [-3, -2])


class _Finder:
    def __init__(self, program: Program):
        self.program = program
        self.steps = program.steps
        self.specs = tensor_specs(program)
        self.producer = producer_of(self.steps)
        self.readers = readers_of(self.steps)

    def spec(self, name: str) -> TensorSpec | None:
        return self.specs.get(name)

    def made_by(self, name: str, targets: Collection[str]) -> int | None:
        i = self.producer.get(name)
        if i is None:
            return None
        s = self.steps[i]
        return i if s.kind == StepKind.ATEN and s.target in targets else None

    def row_major(self, name: str, rows: sympy.Expr, width: int, dtype: str) -> bool:
        spec = self.spec(name)
        if spec is None or spec.dtype != dtype or spec.order or not spec.shape:
            return False
        dims = tuple(ix.parse_size(d) for d in spec.shape)
        return ix.same(dims[-1], sympy.Integer(width)) and ix.same(ix.numel(dims), rows * width)

    def width(self, name: str) -> int | None:
        spec = self.spec(name)
        return int(spec.shape[-1]) if spec is not None and spec.shape and spec.shape[-1].isdigit() else None

    def columns(self, name: str, used: list[int]) -> tuple[str, int] | None:
        """The buffer whose rows ``name``'s rows are part of, and the column they start at: back
        through views that keep the last dim (``view``, ``reshape``, ``unsqueeze``, ``squeeze``, a
        head permute of one token's one head) and column slices (``split``, ``slice`` of the last
        dim) to the first buffer a computing step wrote (or an input)."""
        column = 0
        while True:
            i = self.producer.get(name)
            if i is None:
                return name, column
            step = self.steps[i]
            if step.kind != StepKind.ATEN or step.target not in VIEW_OPS:
                return name, column
            src = step.args[0] if step.args else None
            if not isinstance(src, Buf):
                return None
            spec, width = self.spec(src.name), self.width(src.name)
            if spec is None or width is None:
                return None
            last = len(spec.shape) - 1
            if step.target in RESHAPE_VIEWS or step.target in _UNIT_DIM_VIEWS:
                if self.width(name) != width:
                    return None  # the last dim split or merged: columns would move
            elif step.target in _SPLITS:
                dim = step.args[2] if len(step.args) > 2 else step.kwargs.get("dim", 0)
                if dim not in (last, -1) or set(step.kwargs) - {"dim"}:
                    return None
                if step.target == "aten.split.Tensor":
                    chunk = step.args[1]
                    if type(chunk) is not int or chunk <= 0:
                        return None
                    sizes = [min(chunk, width - c) for c in range(0, width, chunk)]
                else:
                    sizes = step.args[1]
                    if not isinstance(sizes, list) or not all(type(x) is int and x >= 0 for x in sizes):
                        return None
                if sum(sizes) != width or len(sizes) != len(step.outputs):
                    return None
                column += sum(sizes[: step.outputs.index(name)])
            elif _is_head_permute(step):  # over unit dims (one token, one head): nothing moves
                swapped = spec.shape[1:3]
                if swapped != ("1", "1"):
                    return None
            elif step.target == "aten.slice.Tensor":
                dim, begin, end = (list(step.args[1:4]) + [None, None, None])[:3]
                stride = step.args[4] if len(step.args) > 4 else 1
                if dim not in (last, -1) or step.kwargs or stride != 1 or type(begin) is not int or begin < 0:
                    return None
                column += begin
            else:
                return None
            used.append(i)
            name = src.name

    def operand(self, name: str, dtype: str) -> tuple[Operand, str, str, int, int, list[int]] | None:
        """``name`` (what SDPA reads) as an operand, with B, T, H, D and the steps that made it."""
        used: list[int] = []
        p = self.producer.get(name)
        if p is None or not _is_head_permute(self.steps[p]):
            return None
        used.append(p)
        viewed = self.steps[p].args[0].name
        v = self.made_by(viewed, RESHAPE_VIEWS)
        if v is None:
            return None
        view = self.steps[v]
        if len(view.args) != 2 or not isinstance(view.args[0], Buf) or not isinstance(view.args[1], list):
            return None
        spec = self.spec(viewed)  # its shape resolved: a view may say -1 for the heads
        shape = list(spec.shape) if spec is not None else []
        if len(shape) != 4 or not shape[2].isdigit() or not shape[3].isdigit():
            return None
        batch, seq, heads, head_dim = shape[0], shape[1], int(shape[2]), int(shape[3])
        piece = view.args[0].name
        if self.width(piece) != heads * head_dim:
            return None
        used.append(v)
        found = self.columns(piece, used)
        if found is None:
            return None
        base, column = found
        width = self.width(base)
        rows = ix.parse_size(batch) * ix.parse_size(seq)
        if width is None or column + heads * head_dim > width or not self.row_major(base, rows, width, dtype):
            return None
        return Operand(base, width, column), batch, seq, heads, head_dim, used

    def _same_shape_view(self, i: int) -> bool:
        step = self.steps[i]
        if step.kind != StepKind.ATEN or step.target not in RESHAPE_VIEWS or len(step.outputs) != 1:
            return False
        src = step.args[0] if step.args else None
        here, there = self.spec(step.outputs[0]), self.spec(src.name) if isinstance(src, Buf) else None
        return here is not None and there is not None and here.shape == there.shape and not there.order

    def output(self, name: str, batch: str, seq: str, width: int, dtype: str) -> tuple[str, list[int]] | None:
        """The ``[B, T, H*D]`` rows SDPA's result ``name`` becomes, and the steps on the way."""
        used: list[int] = []
        readers = self.readers.get(name, [])
        while len(readers) == 1 and self._same_shape_view(readers[0]) and name not in self.program.outputs:
            used.append(readers[0])  # a view to the shape it has (transformers reshapes to [B, H, T, D])
            name = self.steps[readers[0]].outputs[0]
            readers = self.readers.get(name, [])
        if len(readers) != 1 or not _is_head_permute(self.steps[readers[0]]) or name in self.program.outputs:
            return None
        used.append(readers[0])
        name = self.steps[readers[0]].outputs[0]
        readers = self.readers.get(name, [])
        if len(readers) == 1 and self.steps[readers[0]].target == _CLONE and name not in self.program.outputs:
            clone = self.steps[readers[0]]
            if set(clone.kwargs) - {"memory_format"} or len(clone.args) != 1:
                return None
            used.append(readers[0])
            name = clone.outputs[0]
            readers = self.readers.get(name, [])
        if len(readers) != 1 or name in self.program.outputs:
            return None
        view = self.steps[readers[0]]
        if view.kind != StepKind.ATEN or view.target not in RESHAPE_VIEWS or len(view.outputs) != 1:
            return None
        out = view.outputs[0]
        rows = ix.parse_size(batch) * ix.parse_size(seq)
        if not self.row_major(out, rows, width, dtype):
            return None
        used.append(readers[0])
        return out, used


def find_attention_sites(program: Program, first: int = 0) -> list[AttnSite]:
    """The program's SDPA sites, in program order, numbered ``attn_<first>``, ``attn_<first+1>``..."""
    f = _Finder(program)
    sites = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.ATEN or step.target != SDPA or len(step.outputs) < 1:
            continue
        call = sdpa_call(step)
        out_spec = program.buffers.get(step.outputs[0]) if step.outputs[0] else None
        if call is None or out_spec is None or out_spec.dtype not in FLOAT_DTYPES:
            continue
        if call.mask is not None or call.enable_gqa:
            continue  # aot.codegen.cache_attention takes those
        q, k, v, causal, scale = call.query, call.key, call.value, call.causal, call.scale
        if not all(isinstance(x, Buf) for x in (q, k, v)):
            continue
        if any(o is not None for o in step.outputs[1:]):
            continue
        dtype = out_spec.dtype
        found = [f.operand(x.name, dtype) for x in (q, k, v)]
        if None in found:
            continue
        shapes = {tuple(x[1:5]) for x in found}
        if len(shapes) != 1:
            continue  # cross-attention, or heads of different sizes
        batch, seq, heads, head_dim = shapes.pop()
        if head_dim > MAX_HEAD_DIM or head_dim < 1:
            continue
        out = f.output(step.outputs[0], batch, seq, heads * head_dim, dtype)
        if out is None:
            continue
        library = sorted({i, *out[1], *(j for x in found for j in x[5])})
        mine = set(library)
        internal = {o for j in library for o in program.steps[j].outputs if o is not None} - {out[0]}
        if any(set(f.readers.get(b, ())) - mine or b in program.outputs for b in internal):
            continue  # a head view or the split read elsewhere (a KV cache write): leave it
        sites.append(
            AttnSite(
                id=f"{ATTENTION_SITE}{first + len(sites)}",
                library=tuple(library),
                outputs=(out[0],),
                reference=tuple(program.steps[j] for j in library),
                q=found[0][0],
                k=found[1][0],
                v=found[2][0],
                batch=batch,
                seq=seq,
                heads=heads,
                head_dim=head_dim,
                causal=causal,
                scale=(1.0 / math.sqrt(head_dim)) if scale is None else scale,
                dtype=dtype,
            )
        )
    return sites


# ---------------------------------------------------------------------------------------------
# The kernel


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def render_attention(
    site: AttnSite, ranges: dict[str, tuple[int, int]], configs: tuple[AttnConfig, ...] | None = None
) -> list[tuple[AttnConfig, Rendered]]:
    """Per form: its config and kernel."""
    rows_max = max_value(ix.parse_size(site.batch) * ix.parse_size(site.seq), ranges)
    width = max(site.q.width, site.k.width, site.v.width, site.n)
    index = "i64" if rows_max * width >= 2**31 - 1 else "i32"
    t_max = max_value(ix.parse_size(site.seq), ranges)
    return [
        (cfg, _render(site, cfg, index))
        for cfg in (CONFIGS if configs is None else configs)
        if -(-t_max // cfg.block_m) <= MAX_GRID_YZ  # query blocks on the grid's second axis
    ]


def _render(site: AttnSite, cfg: AttnConfig, index: str) -> Rendered:
    d, bd = site.head_dim, _block_d(site.head_dim)
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    cast = ".to(tl.int64)" if index == "i64" else ""
    kind = "causal" if site.causal else "full"
    name = f"attn_{kind}_{cfg.name}"
    t_text = ix.size_text(ix.parse_size(site.seq))
    # batch x heads on the first axis (up to 2**31 - 1 blocks; the others stop at 65535)
    grid = (
        ix.size_text(ix.parse_size(site.batch) * site.heads),
        f"({t_text} + {cfg.block_m - 1})//{cfg.block_m}",
    )
    mask_d = "" if bd == d else " & (rd < HEAD_DIM)[None, :]"
    mask_dk = "" if bd == d else " & (rd < HEAD_DIM)[:, None]"
    body = [
        f"bh = tl.program_id(0){cast}",
        f"pid_m = tl.program_id(1){cast}",
        "b = bh // HEADS",
        "h = bh % HEADS",
        "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "rd = tl.arange(0, BLOCK_D)",
        "rq = b * T + rm  # the queries' rows of the projections",
        f"q = tl.load(q_ptr + rq[:, None] * Q_WIDTH + (Q_COLUMN + h * HEAD_DIM) + rd[None, :], mask=(rm < T)[:, None]{mask_d}, other=0.0)",
        "m_i = tl.full((BLOCK_M,), float('-inf'), dtype=tl.float32)",
        "l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)",
        "acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)",
        # causal: keys up to the block's last query; the first step always holds key 0, which
        # every query sees, so each row's maximum is finite from then on
        "hi = tl.minimum(T, (pid_m + 1) * BLOCK_M)" if site.causal else "hi = T",
        "for start in range(0, hi, BLOCK_N):",
        "    rn = start + tl.arange(0, BLOCK_N)",
        "    rk = b * T + rn",
        "    valid_n = rn < T",
        f"    k = tl.load(k_ptr + rk[None, :] * K_WIDTH + (K_COLUMN + h * HEAD_DIM) + rd[:, None], mask=valid_n[None, :]{mask_dk}, other=0.0)",
        f"    s = tl.dot(q, k{precision}) * SCALE_LOG2E  # scores in log2 units",
        "    keep = (rn[None, :] <= rm[:, None]) & valid_n[None, :]"
        if site.causal
        else "    keep = valid_n[None, :]",
        "    s = tl.where(keep, s, float('-inf'))",
        *online_softmax_lines(
            precision,
            "    ",
            f"v = tl.load(v_ptr + rk[:, None] * V_WIDTH + (V_COLUMN + h * HEAD_DIM) + rd[None, :], mask=valid_n[:, None]{mask_d}, other=0.0)",
        ),
        "acc = acc / l_i[:, None]",
        f"tl.store(out_ptr + rq[:, None] * OUT_WIDTH + h * HEAD_DIM + rd[None, :], acc.to({tl_dtype}), mask=(rm < T)[:, None]{mask_d})",
    ]
    params = [
        KernelParam("q_ptr", ParamKind.PTR, site.dtype),
        KernelParam("k_ptr", ParamKind.PTR, site.dtype),
        KernelParam("v_ptr", ParamKind.PTR, site.dtype),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        KernelParam("T", ParamKind(index), ""),
    ]
    args = (Buf(site.q.base), Buf(site.k.base), Buf(site.v.base), Buf(site.outputs[0]), Sym(t_text))
    signature = signature_of(params, index)
    consts = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_D": bd,
        "HEAD_DIM": d,
        "HEADS": site.heads,
        "Q_WIDTH": site.q.width,
        "Q_COLUMN": site.q.column,
        "K_WIDTH": site.k.width,
        "K_COLUMN": site.k.column,
        "V_WIDTH": site.v.width,
        "V_COLUMN": site.v.column,
        "OUT_WIDTH": site.n,
    }
    doc = [
        f"Attention candidate {cfg.name}: {kind} softmax(q k^T * {site.scale!r}) v, online, fp32 accumulation.",
        "",
        f"q, k, v: [B, H, T, D] head views of row-major projections, B = {site.batch}, T = {t_text},",
        f"H = {site.heads}, D = {d}, {site.dtype}; out: [B, T, H * D] rows.",
        f"grid: ({', '.join(grid)},)",
    ]
    consts["SCALE_LOG2E"] = repr(site.scale * LOG2E)
    source = kernel_module(doc, consts, name, signature, body)
    elem = ITEMSIZE[site.dtype]
    rows = ix.parse_size(site.batch) * ix.parse_size(site.seq)
    traffic = 4 * rows * site.n * elem  # q, k and v read once (from a causal block's view), out written
    config = {
        "kind": "attention",
        "candidate": cfg.name,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_D": bd,
        "heuristic": HEURISTIC,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=args,
        outputs=(site.outputs[0],),
        grid=grid,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        config=config,
        ops=tuple(s.target for s in site.reference),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def attention_buckets(
    site: AttnSite, cfg: AttnConfig, sizes: list[dict[str, int]]
) -> tuple[dict[str, int], ...]:
    from aot.symexpr import compile_expr

    seq = compile_expr(ix.size_text(ix.parse_size(site.seq)))
    return tuple(s for s in sizes if cfg.min_t <= seq(s) <= cfg.max_t)
