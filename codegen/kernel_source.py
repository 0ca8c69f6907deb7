"""The Triton source writer: a group's value graph (``valuegraph``) and its launch (``launch``)
in, the kernel's module source out.

Every value is read at an index expressed over ``x`` or ``r``/``c`` (``index.Lin``): views and
broadcasts only change that index, and a value is computed once per index it is read at. A row
value (a reduction result) can only be read at its own row; a group where that fails raises
``NotFusible`` and the partitioner splits it. A looped reduction runs one pass over ``c`` per
dependent reduction (mean before variance, max before sum of exponentials) plus one pass for the
outputs; otherwise a row sits in registers and every value is loaded once.

Dynamic sizes are kernel parameters (one per dim symbol, ``s_batch``); static sizes are literals;
block sizes are module-level constexprs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy

from aot import settings
from aot.codegen import index as ix
from aot.codegen.classify import VIEW_OPS
from aot.codegen.index import Frag, Lin, Size
from aot.codegen.launch import Launch
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.codegen.valuegraph import Node, NotFusible
from aot.errors import CodegenError
from aot.schema import KernelParam, ParamKind, Step, Sym, TensorSpec

_REDUCE_FN = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}


@dataclass(frozen=True)
class Val:
    name: str
    ty: str  # compute type
    in_loop: bool  # depends on the loop index ``c`` (looped reductions only)


class SourceWriter:
    """Writes the statements of one kernel body: each value at each index it is read at, once.

    ``outer`` holds the statements outside any loop, ``body`` (while a loop of a looped reduction
    is being written) those inside it; ``ptrs`` the root buffers read, in order of first read.
    """

    def __init__(self, launch: Launch):
        self.mode = launch.mode  # "pointwise" | "tiled" | "single" | "loop"
        self.row_lin = launch.row_lin
        self.full_lin = launch.full_lin
        self.masks = launch.masks  # atom -> needs a mask
        self.outer: list[str] = []
        self.body: list[str] | None = None
        self.cache_outer: dict[tuple[int, Lin], Val] = {}
        self.cache_body: dict[tuple[int, Lin], Val] = {}
        self.reduced: dict[int, Val] = {}
        self.ptrs: dict[str, str] = {}  # root buffer -> parameter name
        self.ptr_dtypes: dict[str, str] = {}
        self.load_lins: list[Lin] = []  # the index of every load written
        self.n = 0
        # conditions under which the value being written is read (inside a ``cat`` piece): its
        # loads are masked by them, and its values are cached apart from unconditional ones
        self.conds: tuple[str, ...] = ()
        self.cond_in_loop = False
        # per output, where it lies in memory: (shape, order) when not row-major (``aot.layout``)
        self.out_layouts: list[tuple[tuple[Size, ...], tuple[int, ...]] | None] = []

    def store_lin(self, i: int, lin: Lin) -> Lin:
        """The offset at which output ``i`` stores the element of flat index ``lin``."""
        layout = self.out_layouts[i] if i < len(self.out_layouts) else None
        return lin if layout is None else ix.to_memory(lin, *layout)

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
        key = (id(node), lin, self.conds)
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
        elif node.kind == "cat":
            val = self._cat(node, lin)
        elif node.kind == "gather":
            val = self._gather(node, lin)
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
        # a cat piece: lanes that read another piece must not touch this buffer. One element read
        # by every lane (no atoms: a scalar pointer, which a lane mask cannot guard) is one the piece
        # holds, so reading it is safe whichever piece a lane takes
        if self.conds and atoms:
            mask = " & ".join(([mask] if mask else []) + [f"({c})" for c in self.conds])
        self.load_lins.append(lin)
        offset = ix.triton_index(lin)
        expr = f"tl.load({ptr} + ({offset})" + (f", mask={mask}, other=0)" if mask else ")")
        if STORAGE[node.dtype] != node.ty:
            expr += f".to({TL_TYPE[node.ty]})"
        return self.emit(expr, node.ty, "c" in atoms or (self.cond_in_loop and bool(self.conds)))

    def _cat(self, node: Node, lin: Lin) -> Val:
        """Each piece is read under the condition that it holds the element (masked loads), and
        the element takes the value of the piece that does."""
        per = ix.unflatten(lin, node.shape)
        d = per[node.cat_dim]
        if not d.atoms:
            raise NotFusible("cat read at a constant position along its dim")
        where = ix.triton_index(d)
        where = where if re.fullmatch(r"\w+", where) else f"({where})"
        d_in_loop = "c" in d.atoms
        values, in_loop, start = [], d_in_loop, ix.ZERO
        last = len(node.inputs) - 1
        for i, (inp, end, cast) in enumerate(zip(node.inputs, node.cat_ends, node.casts)):
            conds = []
            if i > 0:
                conds.append(f"{where} >= {ix.triton_size(start)}")
            if i < last:
                conds.append(f"{where} < {ix.triton_size(end)}")
            sub = list(per)
            if len(node.inputs) > 1:  # within its piece the index spans the piece's extent only
                shifted = ix.make_lin(d.terms, d.const - start)
                sub[node.cat_dim] = ix.make_lin([(ix.ONE, ix.Frag(shifted, ix.canon(end - start)))])
            saved = (self.conds, self.cond_in_loop)
            self.conds = self.conds + tuple(conds)
            self.cond_in_loop = self.cond_in_loop or (d_in_loop and bool(conds))
            try:
                v = self.value(inp, ix.flatten(sub, inp.shape))
            finally:
                self.conds, self.cond_in_loop = saved
            in_loop = in_loop or v.in_loop
            values.append(self.operand(inp, v, cast))
            start = end
        expr = values[-1]
        for i in range(last - 1, -1, -1):
            expr = f"tl.where({where} < {ix.triton_size(node.cat_ends[i])}, {values[i]}, {expr})"
        return self.emit(expr, node.ty, in_loop)

    def _gather(self, node: Node, lin: Lin) -> Val:
        """The input read at the index values: each value (a negative one counted from the end,
        as ATen does) becomes a fragment of the input's index, so its views map it to memory as
        they map the kernel's own index. A value still outside its dim reads nothing and gives
        NaN (-1 for integers), as the library-free gathers do (``codegen/gathers.py``)."""
        x, indices = node.inputs[0], node.inputs[1:]
        per = ix.unflatten(lin, node.shape)
        d, shape = node.gather_dim, node.gather_shape
        at = ix.flatten(per[d : d + len(shape)], shape)
        coords, valid = list(per[:d]), {True: [], False: []}  # by whether the index varies by lane
        for j, inp in enumerate(indices):
            where = ix.broadcast_in(at, shape, inp.shape)
            v = self.value(inp, where)
            if v.in_loop:
                raise NotFusible("a gather's index computed inside a reduction's loop")
            size = x.shape[d + j]
            n = ix.triton_size(size)
            k = self.emit(f"tl.where({v.name} < 0, {v.name} + {n}, {v.name})", v.ty, False)
            ok = f"({k.name} >= 0) & ({k.name} < {n})"
            if not where.atoms:  # one index for every lane: kept inside its dim, no lane mask
                k = self.emit(f"tl.where({ok}, {k.name}, 0)", v.ty, False)
            valid[bool(where.atoms)].append(ok)
            coords.append(ix.make_lin([(ix.ONE, Frag(k.name, size))]))
        coords += per[d + len(shape) :]
        lanes = self.emit(" & ".join(valid[True]), "i1", False) if valid[True] else None
        saved = self.conds
        self.conds = self.conds + ((lanes.name,) if lanes else ())
        try:
            val = self.value(x, ix.flatten(coords, x.shape))
        finally:
            self.conds = saved
        missing = 'float("nan")' if node.ty in ("fp32", "fp64") else "-1"
        out = self.cast(val, node.ty)
        for ok in ([lanes.name] if lanes else []) + valid[False]:
            out = self.emit(f"tl.where({ok}, {out}, {missing})", node.ty, val.in_loop).name
        return Val(out, node.ty, val.in_loop)

    def _op(self, node: Node, lin: Lin) -> Val:
        uses_idx = "$idx" in node.fmt
        args, in_loop = [], uses_idx and "c" in lin.atoms
        for inp, cast in zip(node.inputs, node.casts):
            v = self.value(inp, ix.broadcast_in(lin, node.shape, inp.shape))
            in_loop = in_loop or v.in_loop
            args.append(self.operand(inp, v, cast))
        idx = ""
        if uses_idx:  # an index without atoms is a Python int in the source: make it a tensor
            idx = (
                f"({ix.triton_index(lin)})" if lin.atoms else f"tl.full([], {ix.triton_index(lin)}, tl.int32)"
            )
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
        saved = (self.conds, self.cond_in_loop)
        self.conds, self.cond_in_loop = (), False  # a row's statistic reads every element of the row
        try:
            src = self.value(node.inputs[0], self.full_lin)
        finally:
            self.conds, self.cond_in_loop = saved
        ident = _identity(node.reduce, node.ty)
        fn = _REDUCE_FN[node.reduce]
        val = self.emit(
            f"{fn}(tl.where(rc_mask, {self.cast(src, node.ty)}, {ident}), axis=1, keep_dims=True)",
            node.ty,
            False,
        )
        self.reduced[id(node)] = val
        return val


def _terms(lin: Lin, atom: str) -> list[tuple[Size, Frag]]:
    """The (coefficient, fragment) terms of ``lin`` over the kernel index ``atom``."""
    return [(coef, f) for coef, f in lin.terms if f.base == atom]


def transposed_width(load_lins: list[Lin]) -> Size | None:
    """The output columns of a pointwise group (the span of the innermost fragment of ``x``) when
    some load reads it transposed: that fragment with a coefficient other than 1, and another
    fragment of ``x`` with coefficient 1 (the load's adjacent elements lie a row apart)."""
    for lin in load_lins:
        xs = _terms(lin, "x")
        inner = [(coef, f) for coef, f in xs if f.div == 1 and f.mod is not None]
        if inner and inner[0][0] != 1 and any(coef == 1 and f.div != 1 for coef, f in xs):
            return inner[0][1].mod
    return None


def strided_rows(load_lins: list[Lin]) -> bool:
    """Whether some load of a reduction walks the reduced elements ``c`` with a stride while its
    rows ``r`` are consecutive in memory: ``c`` only in terms of coefficient other than 1, ``r``
    in a term of coefficient 1 without division."""
    for lin in load_lins:
        c, r = _terms(lin, "c"), _terms(lin, "r")
        if c and all(coef != 1 for coef, _ in c) and any(coef == 1 and f.div == 1 for coef, f in r):
            return True
    return False


def _identity(kind: str, ty: str) -> str:
    if ty not in ("fp32", "fp64"):
        if kind != "sum":
            raise NotFusible("integer max/min reductions")
        return "0"
    return {"sum": "0.0", "max": '-float("inf")', "min": 'float("inf")'}[kind]


def online_softmax_lines(
    precision: str, indent: str = "", v_load: str | None = None, weighted: str | None = None
) -> list[str]:
    """One block's step of flash attention's online softmax, as kernel source lines: the block's
    scores ``s`` (float32, log2 units, masked slots -inf) folded into the running maximum ``m_i``,
    sum ``l_i`` and accumulator ``acc`` (rescaled by ``alpha``), the values ``v`` weighted by
    ``p`` in the dot's ``precision`` argument (``""`` or ``", input_precision=..."``). ``v_load``:
    the line that loads ``v``, placed where it is first needed; ``indent``: each line's, inside
    a loop; ``weighted``: the block's weighted values instead of the dot, where the scores are one
    row (``acc`` a row, ``alpha`` its one factor)."""
    values = (
        f"acc = acc * alpha + {weighted}"
        if weighted is not None
        else f"acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v{precision})"
    )
    lines = [
        "m_new = tl.maximum(m_i, tl.max(s, 1))",
        "alpha = tl.exp2(m_i - m_new)",
        "p = tl.exp2(s - m_new[:, None])",
        "l_i = l_i * alpha + tl.sum(p, 1)",
        *([v_load] if v_load is not None else []),
        values,
        "m_i = m_new",
    ]
    return [indent + line for line in lines]


def rc_mask_line(masks: dict[str, bool]) -> str:
    if masks["r"] and masks["c"]:
        return "rc_mask = r_mask & c_mask"
    if masks["r"]:
        return "rc_mask = r_mask & (c >= 0)"
    if masks["c"]:
        return "rc_mask = (r >= 0) & c_mask"
    return "rc_mask = (r >= 0) & (c >= 0)"


def store(i: int, v: Val, dtype: str, w: SourceWriter, level: str) -> str:
    """Store output ``i``'s full (``x`` or ``r``/``c``) or row (``r``) value; every lane writes
    its element, at the offset the output's memory order gives it."""
    param = f"out{i}"
    if w.mode == "pointwise":
        lin, atoms = w.full_lin, ("x",)
    elif level == "full":
        lin, atoms = w.full_lin, ("r", "c")
    else:
        lin, atoms = w.row_lin, ("r",)
    lin = w.store_lin(i, lin)
    offset = ix.triton_index(lin)
    missing = [a for a in atoms if a not in lin.atoms]  # size-1 extents vanish from the index
    if missing:
        offset += "".join(f" + 0 * {a}" for a in missing)
    mask = w.mask_for(frozenset(atoms))
    if w.mode != "pointwise" and level == "full" and (w.masks["r"] or w.masks["c"]):
        mask = "rc_mask"
    storage = STORAGE[dtype]
    value = v.name if v.ty == storage else f"{v.name}.to({TL_TYPE[storage]})"
    return f"tl.store({param} + ({offset}), {value}" + (f", mask={mask})" if mask else ")")


def write_body(
    w: SourceWriter, launch: Launch, order: list[Node], out_nodes: list[Node], out_dtypes: list[str]
) -> None:
    """The statements computing and storing every output, after the prologue."""
    if launch.mode == "loop":
        write_loop(w, order, out_nodes, out_dtypes, list(launch.levels), launch.width)
        return
    if launch.mode == "single":  # (a tiled program's c and masks come with its prologue)
        w.outer.append("c = tl.arange(0, BLOCK_R)[None, :]")
        if launch.masks["c"]:
            w.outer.append(f"c_mask = c < {ix.triton_size(launch.width)}")
        w.outer.append(rc_mask_line(launch.masks))
    values = [
        w.value(node, launch.full_lin if level == "full" else launch.row_lin)
        for node, level in zip(out_nodes, launch.levels)
    ]
    for i, (v, dt, level) in enumerate(zip(values, out_dtypes, launch.levels)):
        w.outer.append(store(i, v, dt, w, level))


def write_loop(
    w: SourceWriter,
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
    loop_head.append("    " + rc_mask_line(w.masks))

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
            fn = _REDUCE_FN[red.reduce]
            w.reduced[id(red)] = w.emit(f"{fn}({acc}, axis=1, keep_dims=True)", red.ty, False)

    full = [i for i, lv in enumerate(levels) if lv == "full"]
    if full:

        def fill_outputs() -> None:
            values = [w.value(out_nodes[i], w.full_lin) for i in full]
            for i, v in zip(full, values):
                w.body.append(store(i, v, out_dtypes[i], w, "full"))

        run_loop(fill_outputs)
    for i, lv in enumerate(levels):
        if lv == "row":
            w.outer.append(store(i, w.value(out_nodes[i], w.row_lin), out_dtypes[i], w, "row"))


# Programmatic dependent launch (sm_90 on): the loader may start a kernel while the one before it
# still runs, so that its blocks are resident and launched when that one ends. Every kernel first
# waits (griddepcontrol.wait: the kernel before has finished and its writes are visible) and only
# then touches memory, reads and writes alike, so no buffer the kernel before reads is overwritten
# early; then it lets the kernel after it start. The build compiles sm_90+ cubins with GDC true
# (codegen/compile.py) and records those archs in ``Kernel.dependent_launch``; elsewhere, and in
# Triton's interpreter, GDC is false and the lines compile to nothing.
DEPENDENT_LAUNCH = ("GDC = tl.constexpr(False)  # true in sm_90+ cubins: see the first lines of the kernel",)
GDC_PROLOGUE = (
    "if GDC:  # wait for the kernel before (its writes), then let the kernel after start",
    "    tl.extra.cuda.gdc_wait()",
    "    tl.extra.cuda.gdc_launch_dependents()",
)
GDC_LAUNCH = (  # a kernel that lets the kernel after start later than its prologue
    "if GDC:  # let the kernel after start",
    "    tl.extra.cuda.gdc_launch_dependents()",
)
# A kernel that lets the kernel after it start *before* its own wait (``launch_first``): once all
# of its blocks are resident, the next kernel's blocks may be too, and load their weights (their
# early lines) while this one still waits for the kernel before. Safe where every kernel touches
# memory but the weights only after its wait: a kernel's wait returns when the kernel before has
# ended, which ended only after its own wait returned, so everything before it has ended too. The
# one exception is a kernel that reads a program's state before its wait (the decode attention
# loads its cache early, written by the same kernel a step before): the kernel just before it must
# wait first, so that it starts only once everything before that kernel has ended
# (``aot.program.state_next``, asked by ``gemm_sites.find_sites`` and ``decode_attention``).
# Measured on an H200: bench/RESULTS.md, "launched before the wait".
GDC_LAUNCH_FIRST = (
    "if GDC:  # let the kernel after start (and load its weights), then wait for the kernel before",
    "    tl.extra.cuda.gdc_launch_dependents()",
    "    tl.extra.cuda.gdc_wait()",
)
LAUNCH_FIRST = True
LAUNCH_FIRST_ENV = "AOTPACK_LAUNCH_FIRST"  # "off"/"on" at build time, for measuring


def launch_first_where(condition: str, then: bool = True) -> tuple[str, ...]:
    """``GDC_LAUNCH_FIRST`` where ``condition`` (Triton, on the kernel's arguments) holds; elsewhere
    the wait first, as ``GDC_PROLOGUE`` (``then=False``: the wait alone, the body letting the
    kernel after start where ``launch_after(condition)`` stands). Each program lets the kernel after
    start once."""
    lines = (
        f"if GDC:  # where {condition}: let the kernel after start first; elsewhere wait first",
        f"    if {condition}:",
        "        tl.extra.cuda.gdc_launch_dependents()",
        "    tl.extra.cuda.gdc_wait()",
    )
    return lines + launch_after(condition)[1:] if then else lines


def launch_after(condition: str) -> tuple[str, ...]:
    """``GDC_LAUNCH`` where ``condition`` does not hold (where it does, ``launch_first_where`` let
    the kernel after start already)."""
    return (
        f"if GDC:  # let the kernel after start, unless {condition} let it before the wait",
        f"    if not ({condition}):",
        "        tl.extra.cuda.gdc_launch_dependents()",
    )


# A build setting among its choices (``aot.settings.setting``): the environment variable where set,
# else the default; any other value is a ``CodegenError`` naming the choices.
setting = functools.partial(settings.setting, error=CodegenError)


def on_off(env: str, default: str) -> bool:
    """A build switch: the environment variable ``env`` where set ("on" or "off", in any case),
    else ``default``; any other value is a ``CodegenError`` naming the two."""
    return setting(env, default, ("on", "off")) == "on"


def launch_first() -> bool:
    """Whether the kernels that may (``kernel_module(launch_first=)``) let the kernel after them
    start before their own wait: ``AOTPACK_LAUNCH_FIRST`` ("on"/"off"), else ``LAUNCH_FIRST``."""
    return on_off(LAUNCH_FIRST_ENV, "on" if LAUNCH_FIRST else "off")


def kernel_module(
    doc: list[str],
    consts: dict[str, Any],
    name: str,
    signature: dict[str, str],
    body: list[str],
    early: Sequence[str] = (),
    launch_dependents: bool = True,
    launch_first: bool | str = False,
) -> str:
    """A kernel's module, as every kernel the codegen writes has it: the docstring (``doc``, one
    line each), the imports, one ``tl.constexpr`` per entry of ``consts``, ``GDC`` (see
    ``DEPENDENT_LAUNCH``), and the ``@triton.jit`` function, its body opened by a comment listing
    the signature and the wait for the kernel before. ``early``: lines before that wait, which
    may read only what no kernel writes (the weights; the decode attention its cache, which only
    the same kernel writes, a step before: see ``GDC_LAUNCH_FIRST``): under dependent launch they
    run while the kernel before still does. ``launch_dependents=False``: the prologue only waits, and ``body``
    lets the kernel after start where it says so (``GDC_LAUNCH``; nowhere: when the grid ends).
    ``launch_first``: the kernel after may start before this one's wait (``GDC_LAUNCH_FIRST``);
    a condition on the kernel's arguments (``"B == 1"``): there, and after the wait elsewhere (with
    ``launch_dependents=False``, where the body says: ``launch_after``)."""
    head = [*module_head(doc, consts), "@triton.jit", f"def {name}({', '.join(signature)}):"]
    if isinstance(launch_first, str):
        prologue = launch_first_where(launch_first, then=launch_dependents)
    elif launch_first:
        prologue = GDC_LAUNCH_FIRST
    else:
        prologue = GDC_PROLOGUE if launch_dependents else GDC_PROLOGUE[:2]
    lines = [f"# {', '.join(f'{p}: {t}' for p, t in signature.items())}", *early, *prologue, *body]
    return "\n".join(head) + "\n" + "\n".join("    " + ln for ln in lines) + "\n"


def module_head(doc: list[str], consts: dict[str, Any]) -> list[str]:
    """A kernel module's lines before its functions: the docstring (``doc``, one line each), the
    imports, one ``tl.constexpr`` per entry of ``consts``, and ``GDC``."""
    return [
        f'"""{doc[0]}',
        *doc[1:],
        '"""',
        "",
        "import triton",
        "import triton.language as tl",
        "",
        *(f"{k} = tl.constexpr({v})" for k, v in consts.items()),
        *DEPENDENT_LAUNCH,
        "",
        "",
    ]


def memory_strides(spec: TensorSpec) -> list[sympy.Expr]:
    """Element strides of each dim of a tensor laid out in ``spec.order`` (row-major when empty):
    size expressions where its sizes are symbolic."""
    order = list(spec.order) or list(range(len(spec.shape)))
    out = [sympy.Integer(0)] * len(order)
    for dim, stride in zip(order, ix.strides(tuple(ix.parse_size(spec.shape[d]) for d in order))):
        out[dim] = sympy.expand(stride)
    return out


def size_arguments(
    consts: dict[str, Any], index: str
) -> tuple[dict[str, int], tuple[KernelParam, ...], tuple[Sym, ...]]:
    """A kernel's sizes and strides ``consts`` (ints or size expressions) apart: the static ones as
    constants; the symbolic ones (a symbolic length's) as ``index`` arguments of the same names,
    with the expressions each call evaluates for them."""
    sizes = {k: sympy.expand(v) for k, v in consts.items() if not sympy.sympify(v).is_Integer}
    static = {k: int(v) for k, v in consts.items() if k not in sizes}
    params = tuple(KernelParam(k, ParamKind(index), "") for k in sizes)
    return static, params, tuple(Sym(ix.size_text(v)) for v in sizes.values())


def signature_of(params: Sequence[KernelParam], index: str) -> dict[str, str]:
    """The Triton signature of ``params``: a pointer's element type, ``index`` for every size."""
    return {p.name: ("*" + STORAGE[p.dtype] if p.kind == ParamKind.PTR else index) for p in params}


def module_source(name, steps, signature, config, mode, body, grid, shape_note) -> str:
    """The kernel's module: a docstring naming its ops and grid, block constexprs, the function."""
    ops_list = ", ".join(dict.fromkeys(s.target for s in steps))
    doc = [
        f"Fused kernel ({config['kind']}): {ops_list}.",
        "",
        f"grid: ({', '.join(grid)},)" + (f"; {shape_note}" if shape_note else ""),
    ]
    if mode == "pointwise":
        consts = {"BLOCK": config["BLOCK"]}
    else:
        consts = {"ROWS": config["ROWS"], "BLOCK_R": config["BLOCK_R"]}
    return kernel_module(doc, consts, name, signature, body.split("\n"))


def prologue(launch: Launch, index_ty: str) -> list[str]:
    """The program's own indices (``x``, or rows ``r``) and their masks."""
    mode, masks, full_lin, row_lin = launch.mode, launch.masks, launch.full_lin, launch.row_lin
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
    if mode == "tiled":
        lines.append(f"c = {pid.replace('(0)', '(1)')} * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]")
        if masks["c"]:
            lines.append(f"c_mask = c < {ix.triton_size(launch.width)}")
        lines.append(rc_mask_line(masks))
    return lines


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
        if s.target in VIEW_OPS:
            continue
        n = _short(s.target)
        if n not in names:
            names.append(n)
    text = "_".join(names[:4]) + ("_etc" if len(names) > 4 else "")
    return ("fused_" + re.sub(r"[^a-z0-9_]", "_", text.lower()))[:60].rstrip("_") or "fused"
