"""Render one fusion group as a readable Triton kernel.

A group is a list of ATen steps (the kernel's reference decomposition) and the buffers it must
write. ``render`` lowers the steps to a value graph (``ops.lower``), picks the kernel shape and
block sizes from the heuristics below, and writes the source:

- **pointwise**: one flat index ``x`` over the outputs' elements, ``BLOCK`` per program;
- **reduction**: rows ``r`` × reduced elements ``c`` (the reduced dims are the trailing ones);
  ``ROWS`` rows per program. When the reduced extent can exceed ``SINGLE_BLOCK_MAX`` the kernel
  loops over ``c`` in ``BLOCK_R`` chunks, one pass per dependent reduction (mean before
  variance, max before sum of exponentials) plus one pass for the outputs; otherwise a row sits
  in registers and every value is loaded once.

Every value is read at an index expressed over ``x`` or ``r``/``c`` (``index.Lin``): views and
broadcasts only change that index. A row value (a reduction result) can only be read at its own
row; a group where that fails raises ``NotFusible`` and the partitioner splits it.

Dynamic sizes are kernel parameters (one per dim symbol, ``s_batch``); static sizes are literals;
block sizes are module-level constexprs. Indices are int32 unless a buffer of the group can hold
2**31 or more elements within the declared dim ranges.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen import ops
from aot.codegen.index import Lin, Size
from aot.codegen.ops import STORAGE, TL_TYPE, Node
from aot.schema import Buf, KernelParam, ParamKind, Step, Sym, TensorSpec

# ---------------------------------------------------------------------------------------------
# Heuristics (no autotuning yet: these choose every config; the choice is recorded per kernel)

HEURISTIC = "aotpack-v1"
POINTWISE_BLOCK = 1024  # elements per program of a pointwise kernel (8 per thread at 4 warps)
POINTWISE_MIN_BLOCK = 128
SINGLE_BLOCK_MAX = 8192  # largest reduced extent kept in registers (single-block reduction)
REDUCTION_TILE = 1024  # target ROWS * BLOCK_R of a single-block reduction (small rows share a program)
MAX_ROWS = 64
LOOP_BLOCK = 2048  # reduced elements per iteration of a looped reduction
LOOP_WARPS = 8
NUM_STAGES = 1  # no software pipelining: the kernels do no dot products
INT32_LIMIT = 2**31 - 1


def pointwise_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def reduction_warps(tile: int) -> int:
    return max(1, min(8, tile // 256))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class NotFusible(Exception):
    """The group cannot be one kernel (the partitioner then splits it)."""


@dataclass(frozen=True)
class Rendered:
    name: str  # the @triton.jit function (and PTX entry) name
    source: str
    signature: dict[str, str]  # parameter → Triton type ("*fp16", "i32")
    params: tuple[KernelParam, ...]
    args: tuple[Any, ...]  # step arguments in parameter order
    outputs: tuple[str, ...]
    grid: tuple[str, ...]
    num_warps: int
    num_stages: int
    config: dict[str, Any]
    ops: tuple[str, ...]
    bytes_moved: str


@dataclass(frozen=True)
class Val:
    name: str
    ty: str  # compute type
    in_loop: bool  # depends on the loop index ``c`` (looped reductions only)


def max_value(expr: Size, ranges: dict[str, tuple[int, int]]) -> int:
    """Largest value of a size expression over the corners of the declared dim ranges."""
    syms = sorted(expr.free_symbols, key=lambda s: s.name)
    if not syms:
        return int(expr)
    best = 0
    for corner in itertools.product(*[ranges.get(s.name, (1, 1)) for s in syms]):
        best = max(best, int(expr.subs(dict(zip(syms, corner)))))
    return best


def _cdiv_text(n: Size, block: int) -> str:
    if n.is_Integer:
        return str(-(-int(n) // block))
    if block == 1:
        return ix.size_text(n)
    return f"({ix.size_text(n)} + {block - 1})//{block}"


_SHORT = {
    "_native_batch_norm_legit_no_training": "batch_norm",
    "native_layer_norm": "layer_norm",
    "_to_copy": "cast",
    "_softmax": "softmax",
    "_log_softmax": "log_softmax",
}


def _short(target: str) -> str:
    name = target.split(".")[1]
    return _SHORT.get(name, name.lstrip("_"))


def kernel_name(steps: list[Step]) -> str:
    names: list[str] = []
    for s in steps:
        if s.target in ops.VIEW_OPS:
            continue
        n = _short(s.target)
        if n not in names:
            names.append(n)
    text = "_".join(names[:4]) + ("_etc" if len(names) > 4 else "")
    return ("fused_" + re.sub(r"[^a-z0-9_]", "_", text.lower()))[:60].rstrip("_") or "fused"


class _Writer:
    def __init__(self, mode: str, row_lin: Lin | None, full_lin: Lin, masks: dict[str, bool]):
        self.mode = mode  # "pointwise" | "single" | "loop"
        self.row_lin = row_lin
        self.full_lin = full_lin
        self.masks = masks  # atom -> needs a mask
        self.outer: list[str] = []
        self.body: list[str] | None = None
        self.cache_outer: dict[tuple[int, Lin], Val] = {}
        self.cache_body: dict[tuple[int, Lin], Val] = {}
        self.reduced: dict[int, Val] = {}
        self.ptrs: dict[str, str] = {}  # root buffer -> parameter name
        self.ptr_dtypes: dict[str, str] = {}
        self.n = 0

    # -- emission
    def emit(self, expr: str, ty: str, in_loop: bool) -> Val:
        name = f"v{self.n}"
        self.n += 1
        (self.body if in_loop and self.body is not None else self.outer).append(f"{name} = {expr}")
        return Val(name, ty, in_loop and self.body is not None)

    def mask_for(self, atoms: frozenset[str]) -> str | None:
        need = sorted(a for a in atoms if self.masks.get(a))
        if not need:
            return None
        if need == ["c", "r"]:
            return "rc_mask"
        return f"{need[0]}_mask"

    @staticmethod
    def cast(v: Val, ty: str | None) -> str:
        if ty is None or v.ty == ty:
            return v.name
        return f"{v.name}.to({TL_TYPE[ty]})"

    def operand(self, inp: Node, v: Val, cast: str | None) -> str:
        """``v`` (the value of ``inp``) as an op's operand; ``"@ty"`` rounds a half value first."""
        if cast is None or not cast.startswith("@"):
            return self.cast(v, cast)
        ty = cast[1:] or None
        if inp.dtype not in ("float16", "bfloat16") or v.ty != "fp32":
            return self.cast(v, ty)
        text = f"{v.name}.to({TL_TYPE[STORAGE[inp.dtype]]}).to(tl.float32)"
        return text if ty in (None, "fp32") else f"{text}.to({TL_TYPE[ty]})"

    # -- values
    def value(self, node: Node, lin: Lin) -> Val:
        key = (id(node), lin)
        hit = self.cache_body.get(key) or self.cache_outer.get(key)
        if hit is not None:
            return hit
        if node.kind == "remap":
            val = self.value(node.inputs[0], node.remap(lin))
        elif node.kind == "load":
            val = self._load(node, lin)
        elif node.kind == "op":
            val = self._op(node, lin)
        elif node.kind == "reduce":
            val = self._reduced(node, lin)
        else:
            raise NotFusible(f"unknown node kind {node.kind}")
        (self.cache_body if val.in_loop else self.cache_outer)[key] = val
        return val

    def _load(self, node: Node, lin: Lin) -> Val:
        if node.buf not in self.ptrs:
            self.ptrs[node.buf] = f"in{len(self.ptrs)}"
            self.ptr_dtypes[node.buf] = node.dtype
        ptr = self.ptrs[node.buf]
        atoms = lin.atoms
        mask = self.mask_for(atoms)
        offset = ix.render(lin)
        expr = f"tl.load({ptr} + ({offset})" + (f", mask={mask}, other=0)" if mask else ")")
        if STORAGE[node.dtype] != node.ty:
            expr += f".to({TL_TYPE[node.ty]})"
        return self.emit(expr, node.ty, "c" in atoms)

    def _op(self, node: Node, lin: Lin) -> Val:
        uses_idx = "$idx" in node.fmt
        args, in_loop = [], uses_idx and "c" in lin.atoms
        for inp, cast in zip(node.inputs, node.casts):
            v = self.value(inp, ix.broadcast_in(lin, node.shape, inp.shape))
            in_loop = in_loop or v.in_loop
            args.append(self.operand(inp, v, cast))
        idx = ""
        if uses_idx:  # an index without atoms is a Python int in the source: make it a tensor
            idx = f"({ix.render(lin)})" if lin.atoms else f"tl.full([], {ix.render(lin)}, tl.int32)"
        expr = re.sub(
            r"\$(\d+|idx)", lambda m: idx if m.group(1) == "idx" else args[int(m.group(1))], node.fmt
        )
        if re.fullmatch(r"v\d+", expr):  # a copy or a no-op cast: reuse the value
            return Val(expr, node.ty, in_loop)
        return self.emit(expr, node.ty, in_loop)

    def _reduced(self, node: Node, lin: Lin) -> Val:
        if lin != self.row_lin:
            raise NotFusible("a reduction result is read at another row than its own")
        if id(node) in self.reduced:
            return self.reduced[id(node)]
        if self.mode != "single":
            raise NotFusible("reduction result needed before its pass")
        src = self.value(node.inputs[0], self.full_lin)
        ident = _identity(node.reduce, node.ty)
        fn = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}[node.reduce]
        val = self.emit(
            f"{fn}(tl.where(rc_mask, {self.cast(src, node.ty)}, {ident}), axis=1, keep_dims=True)",
            node.ty,
            False,
        )
        self.reduced[id(node)] = val
        return val


def _identity(kind: str, ty: str) -> str:
    if ty not in ("fp32", "fp64"):
        if kind != "sum":
            raise NotFusible("integer max/min reductions")
        return "0"
    return {"sum": "0.0", "max": '-float("inf")', "min": 'float("inf")'}[kind]


def _walk(outputs: list[Node]) -> list[Node]:
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


def render(
    steps: list[Step],
    outputs: list[str],
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
    not_roots: frozenset[str] = frozenset(),
) -> Rendered:
    """The Triton kernel computing ``outputs`` with the ATen ``steps`` of one group."""
    b = ops.Builder(buffers, known, not_roots)
    for step in steps:
        try:
            ops.lower(b, step)
        except ops.Unsupported as e:
            raise NotFusible(str(e)) from None
    try:
        out_nodes = [b.env[o] for o in outputs]
    except KeyError as e:
        raise NotFusible(f"output {e} is not computed by the group") from None
    if not out_nodes:
        raise NotFusible("nothing to compute")
    order = _walk(out_nodes)
    reduces = [n for n in order if n.kind == "reduce"]
    out_shapes = [b.shape(o) for o in outputs]
    out_numels = [ix.numel(s) for s in out_shapes]

    def maxv(e: Size) -> int:
        try:
            return max_value(sympy.sympify(e), ranges)
        except (TypeError, ValueError) as err:
            raise NotFusible(f"size {e} cannot be bounded: {err}") from None

    if reduces:
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
            n_rows = max(1, min(MAX_ROWS, REDUCTION_TILE // block_r, next_pow2(max(rows_max, 1))))
            warps = reduction_warps(n_rows * block_r)
        else:
            mode = "loop"
            block_r, n_rows, warps = LOOP_BLOCK, 1, LOOP_WARPS
        masks = {
            "r": not (rows.is_Integer and int(rows) % n_rows == 0),
            "c": not (
                width.is_Integer
                and (int(width) == block_r if mode == "single" else int(width) % block_r == 0)
            ),
        }
        row_lin = ix.atom("r", rows)
        full_lin = ix.make_lin([(width, ix.Frag("r", rows)), (ix.ONE, ix.Frag("c", width))])
        domain_max = rows_max * width_max
        grid = (_cdiv_text(rows, n_rows),)
        config: dict[str, Any] = {"kind": f"reduction-{mode}", "ROWS": n_rows, "BLOCK_R": block_r}
    else:
        levels = ["full"] * len(outputs)
        numel0 = out_numels[0]
        if any(not ix.same(n, numel0) for n in out_numels):
            raise NotFusible("outputs of different sizes")
        n_max = maxv(numel0)
        block = (
            POINTWISE_BLOCK
            if n_max >= POINTWISE_BLOCK
            else max(POINTWISE_MIN_BLOCK, next_pow2(max(n_max, 1)))
        )
        mode, warps = "pointwise", pointwise_warps(block)
        masks = {"x": not (numel0.is_Integer and int(numel0) % block == 0)}
        row_lin, full_lin = None, ix.atom("x", numel0)
        domain_max = n_max
        grid = (_cdiv_text(numel0, block),)
        config = {"kind": "pointwise", "BLOCK": block}

    w = _Writer(mode, row_lin, full_lin, masks)
    out_dtypes = [b.spec(o).dtype for o in outputs]
    if mode == "loop":
        _write_loop(w, order, out_nodes, out_dtypes, levels, width)
    else:
        if mode == "single":
            w.outer.append("c = tl.arange(0, BLOCK_R)[None, :]")
            if masks["c"]:
                w.outer.append(f"c_mask = c < {ix.triton_size(width)}")
            w.outer.append(_rc_mask_line(masks))
        values = [
            w.value(node, full_lin if level == "full" else row_lin) for node, level in zip(out_nodes, levels)
        ]
        for i, (v, dt, level) in enumerate(zip(values, out_dtypes, levels)):
            w.outer.append(_store(f"out{i}", v, dt, w, level))

    # buffers touched, for the index width and the traffic estimate
    touched = [(buf, b.shape(buf), dt) for buf, dt in w.ptr_dtypes.items()] + [
        (o, s, b.spec(o).dtype) for o, s in zip(outputs, out_shapes)
    ]
    shapes = {ix.numel(n.shape) for n in order} | {ix.numel(s) for _, s, _ in touched}  # views included
    biggest = max([domain_max] + [maxv(n) for n in shapes])
    block_elems = config.get("BLOCK", 0) + config.get("ROWS", 0) * config.get("BLOCK_R", 0)
    index_ty = "i32" if biggest + 2 * block_elems <= INT32_LIMIT else "i64"
    traffic = sum((ix.numel(s) * ops.ITEMSIZE[dt] for _, s, dt in touched), sympy.Integer(0))

    body = "\n".join(_prologue(mode, masks, full_lin, row_lin, index_ty) + w.outer)
    sizes = sorted({m for m in re.findall(r"\bs_([A-Za-z_][A-Za-z0-9_]*)\b", body)})
    unknown = [s for s in sizes if s not in ranges]
    if unknown:
        raise NotFusible(f"size symbols {unknown} have no declared range")
    params: list[KernelParam] = []
    signature: dict[str, str] = {}
    args: list[Any] = []
    for buf, pname in w.ptrs.items():
        dt = w.ptr_dtypes[buf]
        params.append(KernelParam(pname, ParamKind.PTR, dt))
        signature[pname] = "*" + STORAGE[dt]
        args.append(Buf(buf))
    for i, o in enumerate(outputs):
        dt = b.spec(o).dtype
        params.append(KernelParam(f"out{i}", ParamKind.PTR, dt))
        signature[f"out{i}"] = "*" + STORAGE[dt]
        args.append(Buf(o))
    for s in sizes:
        params.append(KernelParam(f"s_{s}", ParamKind(index_ty), ""))
        signature[f"s_{s}"] = index_ty
        args.append(Sym(s))

    name = kernel_name(steps)
    config.update({"heuristic": HEURISTIC, "index": index_ty, "num_warps": warps, "num_stages": NUM_STAGES})
    note = f"rows = {ix.size_text(rows)}, reduced extent = {ix.size_text(width)}" if reduces else ""
    source = _module_source(name, steps, signature, config, mode, body, grid, note)
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=tuple(args),
        outputs=tuple(outputs),
        grid=grid,
        num_warps=warps,
        num_stages=NUM_STAGES,
        config=config,
        ops=tuple(s.target for s in steps),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def rows_text(reduces: list[Node], first: Node | None) -> str:
    if first is None:
        return ""
    rows = sympy.cancel(ix.numel(first.inputs[0].shape) / first.width)
    return f"rows = {ix.size_text(rows)}, reduced extent = {ix.size_text(first.width)}"


def _rc_mask_line(masks: dict[str, bool]) -> str:
    if masks["r"] and masks["c"]:
        return "rc_mask = r_mask & c_mask"
    if masks["r"]:
        return "rc_mask = r_mask & (c >= 0)"
    if masks["c"]:
        return "rc_mask = (r >= 0) & c_mask"
    return "rc_mask = (r >= 0) & (c >= 0)"


def _store(param: str, v: Val, dtype: str, w: _Writer, level: str) -> str:
    """Store a full (``x`` or ``r``/``c``) or row (``r``) value; every lane writes its element."""
    if w.mode == "pointwise":
        lin, atoms = w.full_lin, ("x",)
    elif level == "full":
        lin, atoms = w.full_lin, ("r", "c")
    else:
        lin, atoms = w.row_lin, ("r",)
    offset = ix.render(lin)
    missing = [a for a in atoms if a not in lin.atoms]  # size-1 extents vanish from the index
    if missing:
        offset += "".join(f" + 0 * {a}" for a in missing)
    mask = w.mask_for(frozenset(atoms))
    if w.mode != "pointwise" and level == "full" and (w.masks["r"] or w.masks["c"]):
        mask = "rc_mask"
    storage = STORAGE[dtype]
    value = v.name if v.ty == storage else f"{v.name}.to({TL_TYPE[storage]})"
    return f"tl.store({param} + ({offset}), {value}" + (f", mask={mask})" if mask else ")")


def _write_loop(
    w: _Writer,
    order: list[Node],
    out_nodes: list[Node],
    out_dtypes: list[str],
    levels: list[str],
    width: Size,
) -> None:
    """Looped reduction: one pass per reduction stage, then one pass for the full outputs."""
    stage: dict[int, int] = {}
    for node in order:  # inputs come first
        s = max((stage[id(i)] for i in node.inputs), default=0)
        stage[id(node)] = s + 1 if node.kind == "reduce" else s
    reduces = [n for n in order if n.kind == "reduce"]
    n_stages = max(stage[id(n)] for n in reduces)
    loop_head = [
        f"for c0 in range(0, {ix.triton_size(width)}, BLOCK_R):",
        "    c = c0 + tl.arange(0, BLOCK_R)[None, :]",
    ]
    if w.masks["c"]:
        loop_head.append(f"    c_mask = c < {ix.triton_size(width)}")
    loop_head.append("    " + _rc_mask_line(w.masks))

    def run_loop(fill) -> None:
        w.body, w.cache_body = [], {}
        fill()
        w.outer.extend(loop_head + ["    " + line for line in w.body])
        w.body, w.cache_body = None, {}

    n_acc = 0
    for k in range(1, n_stages + 1):
        here = [n for n in reduces if stage[id(n)] == k]
        accs = [f"acc{n_acc + i}" for i in range(len(here))]
        n_acc += len(here)
        for red, acc in zip(here, accs):
            w.outer.append(
                f"{acc} = tl.full([ROWS, BLOCK_R], {_identity(red.reduce, red.ty)}, {TL_TYPE[red.ty]})"
            )

        def fill(here=here, accs=accs) -> None:
            for red, acc in zip(here, accs):
                v = w.value(red.inputs[0], w.full_lin)
                term = f"tl.where(rc_mask, {w.cast(v, red.ty)}, {_identity(red.reduce, red.ty)})"
                update = {
                    "sum": f"{acc} + {term}",
                    "max": f"tl.maximum({acc}, {term})",
                    "min": f"tl.minimum({acc}, {term})",
                }[red.reduce]
                w.body.append(f"{acc} = {update}")

        run_loop(fill)
        for red, acc in zip(here, accs):
            fn = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}[red.reduce]
            w.reduced[id(red)] = w.emit(f"{fn}({acc}, axis=1, keep_dims=True)", red.ty, False)

    full = [i for i, lv in enumerate(levels) if lv == "full"]
    if full:

        def fill_outputs() -> None:
            values = [w.value(out_nodes[i], w.full_lin) for i in full]
            for i, v in zip(full, values):
                w.body.append(_store(f"out{i}", v, out_dtypes[i], w, "full"))

        run_loop(fill_outputs)
    for i, lv in enumerate(levels):
        if lv == "row":
            w.outer.append(_store(f"out{i}", w.value(out_nodes[i], w.row_lin), out_dtypes[i], w, "row"))


def _module_source(name, steps, signature, config, mode, body, grid, shape_note) -> str:
    ops_list = ", ".join(dict.fromkeys(s.target for s in steps))
    head = [
        f'"""Fused kernel ({config["kind"]}): {ops_list}.',
        "",
        f"grid: ({', '.join(grid)},)" + (f"; {shape_note}" if shape_note else ""),
        '"""',
        "",
        "import triton",
        "import triton.language as tl",
        "",
    ]
    if mode == "pointwise":
        head.append(f"BLOCK = tl.constexpr({config['BLOCK']})")
    else:
        head.append(f"ROWS = tl.constexpr({config['ROWS']})")
        head.append(f"BLOCK_R = tl.constexpr({config['BLOCK_R']})")
    head += ["", "", "@triton.jit", f"def {name}({', '.join(signature)}):"]
    sig_doc = ", ".join(f"{p}: {t}" for p, t in signature.items())
    lines = [f"# {sig_doc}"] + body.split("\n")
    return "\n".join(head) + "\n" + "\n".join("    " + ln for ln in lines) + "\n"


def _prologue(
    mode: str, masks: dict[str, bool], full_lin: Lin, row_lin: Lin | None, index_ty: str
) -> list[str]:
    pid = "tl.program_id(0)" + (".to(tl.int64)" if index_ty == "i64" else "")
    if mode == "pointwise":
        numel = ix.triton_size(full_lin.terms[0][1].extent) if full_lin.terms else "1"
        lines = [f"x = {pid} * BLOCK + tl.arange(0, BLOCK)"]
        if masks["x"]:
            lines.append(f"x_mask = x < {numel}")
        return lines
    rows = row_lin.terms[0][1].extent if row_lin.terms else sympy.Integer(1)
    lines = [f"r = {pid} * ROWS + tl.arange(0, ROWS)[:, None]"]
    if masks["r"]:
        lines.append(f"r_mask = r < {ix.triton_size(rows)}")
    return lines
