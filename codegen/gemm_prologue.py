"""Row-norm prologues: a normalization kernel's reference steps (RMSNorm as Llama, Mistral and
Qwen decompose it, with the residual add before it) as fp32 arithmetic over A's row, for the
one-row GEMM forms that compute it as they load A.

The kernel is matched by what its steps compute, not by the model: rows of ``[M, K]`` tensors
(at most two, e.g. the residual and the sublayer's output), per-column vectors ``[K]`` (the
weight), one mean over K of a row value (the statistics), pointwise arithmetic on rows and
statistics, and dtype casts; its output (the GEMM's A) is a row value. Each step's result is
rounded to its dtype as the reference's is (``x.to(float32)``, ``(x * rstd).to(bfloat16)``,
``weight * ...`` in bfloat16), so the form computes what the kernel computes, in fp32 between
the roundings. One more row value that does not depend on the statistics may be a kernel output
(``sum_out``: the residual sum, which later steps read).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from aot.codegen import index as ix
from aot.codegen.gemm_epilogue import BINARY, NoSite, float_cast, spec_of
from aot.codegen.gemm_forms import ROUND
from aot.codegen.kernel_source import setting
from aot.codegen.triton_types import FLOAT_DTYPES
from aot.program import RESHAPE_VIEWS
from aot.schema import Buf, MemoryFormat, Step, StepKind, TensorSpec

# "@" in a row op's text stands for the K step it is computed at (``r3_@`` → ``r3_0``, ``rk0``)
_ROW_UNARY = {"aten.neg.default": "(-{0})", "aten.sigmoid.default": "tl.sigmoid({0})"}
_STAT_UNARY = {
    "aten.rsqrt.default": "(1.0 / tl.sqrt({0}))",
    "aten.sqrt.default": "tl.sqrt({0})",
    "aten.neg.default": "(-{0})",
}
MAX_ROW_INPUTS = 2
# Means over K a prologue may compute: "2" also takes a norm of a sum with a normed value (Gemma
# 2's and 3's post-norm, residual add and pre-norm, ``RowNorm.more``) into the one-row GEMVs. Off
# by default: on an H200 every block of the GEMV recomputing both norms of its row made
# Gemma-2-2B's decode step (8 layers) 1.085 ms against 0.807 with the norm kernels kept.
MEANS_ENV = "AOTPACK_ROW_NORM_MEANS"
MAX_MEANS = 2
# Where the one-row forms (``vec_*``) apply a norm after their products, where it factors out of
# them, so that the statistics and the products come from the same loads of the row at once rather
# than one after the other: an RMSNorm (``RowNorm.factored``: ``A @ W^T = r * ((g * x) @ W^T)``)
# and a LayerNorm whose column sums with W the build computed (``norm_sums``: ``A @ W^T = rstd *
# ((x * scale) @ W^T) - rstd * mean * (W @ scale) + W @ shift``). "rms" (the default): RMSNorms
# only; "on": LayerNorms too; "off": the statistics first, then the products of the normalized
# row, everywhere. See gemm_render's one-row forms.
# LayerNorms stay statistics-first: no faster on an H200 (2026-12-04;
# bench/results/ab-mlp-one-row-factored-h200-2026-12-04.json,
# decode/paired-gpt2-one-row-factored-h200-2026-12-04.json): the example mlp at batch 1 1.002 of
# the statistics-first forms' time (both bundles in one process, 12 rounds), GPT-2's decode at
# batch 1 0.2127 against 0.2093 ms a token (the statistics-first forms faster in 7 of 12 rounds;
# the same greedy tokens), and the factored forms need the column sums stored beside W.
# RMSNorms factor (2026-12-04, decode/paired-llama-3.2-1b-8layers-factored-h200-2026-12-04c.json):
# Llama-3.2-1B's first 8 layers at batch 1 0.4496 against 0.4541 ms a token (1.0% faster, 12 of 12
# rounds, both bundles in one process); on the step's chain q/k/v 4.86 -> 4.44 us a layer and
# gate/up 18.51 -> 18.31; its greedy tokens scored against float32 2 of 128 steps off float32's
# choice against 9 (``bench/decode_paired.py --score``). ``test_factored_one_row_forms_verify``
# passed on the GPU (GPT-2, Llama).
# "head": the RMSNorms, and a LayerNorm where the site is a vocabulary head (N at least
# ``gemm_forms.VOCAB_N``): a decode step's final norm in the head's prologue
# (``gemm_sites.SLICED_PROLOGUE_ENV``), whose 25k blocks would otherwise each wait for the row's
# statistics before their products. Measured with the sliced prologue against the default (the
# norm kernel kept) on GPT-2's whole decode (H100, 2026-12-07, both bundles in one process, 12
# rounds; bench/results/decode/paired-gpt2-b1-b8-head-factored-h100-2026-12-07b.json): batch 1
# 0.2256 against 0.2197 ms a token (slower; 4 of 12 rounds faster, a noisy pair), batch 8 0.3343
# against 0.3377 (faster in 10 of 12), the same tokens; so not the default.
FACTORED = "rms"
FACTORED_ENV = "AOTPACK_ONE_ROW_FACTORED"
FACTORED_SETTINGS = ("on", "rms", "head", "off")


@dataclass(frozen=True)
class RowNorm:
    """A row normalization lowered for one-row forms. ``inputs``: the ``[M, K]`` buffers read
    (``x{i}_ptr``) with their dtypes; ``vectors``: the ``[K]`` buffers (``v{i}_ptr``);
    ``row_ops``: (variable, expression, stage) per row value, in order, with "@" for the K step,
    the stage 0 before the statistics, 1 after the first mean's (so truthy: after the
    statistics), 2 after the second's; ``reduced``: the row variable whose mean over K is
    ``s_mean``; ``stat_ops``: (variable, expression) of the per-row statistics after the mean;
    ``more``: a norm after the norm (Gemma 2's and 3's post-norm, the residual add, the next
    pre-norm: a second mean over K of a stage-1 value): (reduced, stat ops) of each later mean
    (``s_mean<j>``, ``s_sum<j>``), empty for one norm; ``out``: the row variable that is A, of
    the last stage; ``sum_out``: (buffer, row variable, dtype) written by the first N tile, of a
    stage before the last, or None; ``factored``: (p, s) where A is, in exact arithmetic, the row
    expression ``p`` of values before the statistics times the statistic expression ``s``
    (RMSNorm: ``g * (x * rstd)`` = ``(g * x) * rstd``), or None (see ``factor_out_statistic``;
    always None with ``more``)."""

    inputs: tuple[tuple[str, str], ...]
    vectors: tuple[tuple[str, str], ...]
    row_ops: tuple[tuple[str, str, int], ...]
    reduced: str
    stat_ops: tuple[tuple[str, str], ...]
    out: str
    sum_out: tuple[str, str, str] | None
    factored: tuple[str, str] | None = None
    more: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def stage_of(self, var: str) -> int:
        """The stage of a row variable (0 for one this norm does not compute)."""
        return next((st for v, _, st in self.row_ops if v == var), 0)

    @property
    def one_row_only(self) -> bool:
        """Whether only the one-row forms compute it: a second mean (``more``), or a second output
        of the last stage (A itself, stored: ``gemm_sites._row_norm_prologue``'s ``shared``)."""
        last = 1 + len(self.more)
        return bool(self.more) or (self.sum_out is not None and self.stage_of(self.sum_out[1]) == last)


def is_copy(step: Step) -> bool:
    """``clone(x)`` into a row-major or x's layout (the prologue's rows are row-major): a copy,
    to a prologue as good as the buffer it copies (what an inference-mode dropout traces to)."""
    return (
        step.target == "aten.clone.default"
        and len(step.args) == 1
        and set(step.kwargs) <= {"memory_format"}
        and step.kwargs.get("memory_format")
        in (None, MemoryFormat("contiguous_format"), MemoryFormat("preserve_format"))
    )


def factored_one_row(layer_norm: bool, head: bool = False) -> bool:
    """Whether the one-row forms apply a LayerNorm (``layer_norm``) or a row norm (an RMSNorm)
    after their products, at a vocabulary head (``head``) or another site:
    ``AOTPACK_ONE_ROW_FACTORED`` where set, else ``FACTORED``; a value other than
    ``FACTORED_SETTINGS`` is a ``CodegenError``."""
    text = setting(FACTORED_ENV, FACTORED, FACTORED_SETTINGS)
    if not layer_norm:
        return text != "off"
    return text == "on" or (text == "head" and head)


def _max_means() -> int:
    return int(setting(MEANS_ENV, "1", ("1", str(MAX_MEANS))))


def _round(expr: str, dtype: str) -> str:
    return f"{expr}.to({ROUND[dtype]}).to(tl.float32)" if dtype in ROUND else expr


def row_load(name: str, k: int, rk: str, mask: str, gathered: bool = False) -> str:
    """A row input's values at the K indices ``rk`` as fp32 (masked by ``mask``): rows ``rm`` of
    ``<name>_ptr``, or, ``gathered``, rows ``<name>_row`` of a lookup's table
    (``gemm_sites.Gathered``: the ids, 0 for one outside the table) and a row of NaN where
    ``<name>_in`` is false, as the lookup writes it (``gemm_render._lookup_rows`` loads both)."""
    rows = f"{name}_row" if gathered else "rm"
    load = (
        f"tl.load({name}_ptr + {rows}[:, None] * {k} + {rk}[None, :], mask={mask}, other=0.0).to(tl.float32)"
    )
    return f"tl.where({name}_in[:, None], {load}, float('nan'))" if gathered else load


def gathered_input(norm: RowNorm, i: int, k: int) -> RowNorm:
    """``norm`` with its row input ``i`` read through a lookup (``row_load``)."""
    load = row_load(f"x{i}", k, "rk@", "kmask@", gathered=True)
    ops = tuple((v, load if v == f"x{i}_@" else e, st) for v, e, st in norm.row_ops)
    return replace(norm, row_ops=ops)


def lower_row_norm(
    steps: tuple[Step, ...],
    outputs: tuple[str | None, ...],
    a_out: str,
    m: str,
    k: int,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
) -> RowNorm:
    """``steps`` (a kernel's reference, whose ``outputs`` are ``a_out`` and at most one more) as
    a ``RowNorm``; raises ``NoSite`` where they are not a row normalization of ``[M, K]`` rows."""
    M, K = ix.parse_size(m), sympy.Integer(k)

    def spec(name: str) -> TensorSpec:
        s = spec_of(buffers, known, name)
        if s is None or s.dtype not in FLOAT_DTYPES or s.order:
            raise NoSite(f"{name}: no floating-point row-major spec")
        return s

    def shape_kind(shape: tuple[str, ...]) -> str:
        dims = tuple(ix.parse_size(d) for d in shape)
        numel = ix.numel(dims)
        if dims and ix.same(dims[-1], K) and ix.same(numel, M * K):
            return "row"
        if dims and ix.same(dims[-1], K) and ix.same(numel, K):
            return "vec"
        if dims and ix.same(dims[-1], sympy.Integer(1)) and ix.same(numel, M):
            return "stat"
        raise NoSite(f"shape {shape} is not [M, K], [K] or [M, 1]")

    inputs: dict[str, int] = {}
    vectors: dict[str, int] = {}
    alias: dict[str, str] = {}  # a view of an outside buffer -> that buffer
    vals: dict[str, tuple[str, str, str]] = {}  # buffer -> (kind, variable, dtype)
    row_ops: list[tuple[str, str, int]] = []
    means: list[tuple[str, list[tuple[str, str]]]] = []  # per mean: (reduced, its statistics' ops)
    stages: dict[str, int] = {}  # variable -> stage (row values and statistics; absent: 0)
    n = 0
    # row value after the statistics -> (p, s): in exact arithmetic the row expression p of
    # values before them times the statistic expression s (``factored``); absent: not a product
    scaled: dict[str, tuple[str, str]] = {}

    def operand(arg) -> tuple[str, str, str]:
        """(kind, variable or literal, dtype) of a step's argument."""
        if isinstance(arg, Buf):
            if arg.name in vals:
                return vals[arg.name]
            root = alias.get(arg.name, arg.name)
            s = spec(root)
            kind = shape_kind(spec(arg.name).shape)
            if kind == "row":
                if shape_kind(s.shape) != "row":
                    raise NoSite(f"{root} is not [M, K] row-major")
                if root not in inputs:
                    if len(inputs) == MAX_ROW_INPUTS:
                        raise NoSite("more than two rows read")
                    inputs[root] = len(inputs)
                    i = inputs[root]
                    row_ops.append((f"x{i}_@", row_load(f"x{i}", k, "rk@", "kmask@"), 0))
                vals[root] = ("row", f"x{inputs[root]}_@", s.dtype)
                return vals[root]
            if kind == "vec":
                if root not in known or tuple(known[root].shape) != (str(k),):
                    raise NoSite(f"{root} is not a [K] weight")
                if root not in vectors:
                    vectors[root] = len(vectors)
                    i = vectors[root]
                    row_ops.append(
                        (
                            f"v{i}_@",
                            f"tl.load(v{i}_ptr + rk@, mask=rk@ < {k}, other=0.0).to(tl.float32)[None, :]",
                            0,
                        )
                    )
                vals[root] = ("row", f"v{vectors[root]}_@", s.dtype)
                return vals[root]
            raise NoSite(f"{arg.name}: a statistic read from memory")
        if isinstance(arg, bool) or not isinstance(arg, (int, float)):
            raise NoSite(f"argument {str(arg)[:40]}")
        return ("const", repr(float(arg)), "")

    def factor(kind: str, x: str) -> tuple[str | None, str | None] | None:
        """(row factor, statistic factor) of an operand, None where a row value after the
        statistics is not a product of the two."""
        if kind == "stat":
            return None, x
        if kind == "row" and stages.get(x, 0):
            return scaled.get(x)
        return x, None  # a row value before the statistics, or a constant

    def product(fa, fb, op: str) -> tuple[str, str] | None:
        """``fa op fb`` factored (op "*" or "/": the divisor a statistic or a constant)."""
        if fa is None or fb is None:
            return None
        (pa, sa), (pb, sb) = fa, fb
        if op == "/" and (pb is not None and (sb is not None or pa is None)):
            return None  # a divisor with a row factor: not a product
        if op == "*":
            p = pa if pb is None else pb if pa is None else f"({pa} * {pb})"
            st = sa if sb is None else sb if sa is None else f"({sa} * {sb})"
        else:
            p = pa if pb is None else f"({pa} / {pb})"
            st = sa if sb is None else f"({sa if sa is not None else '1.0'} / {sb})"
        return None if p is None or st is None else (p, st)

    def emit(kind: str, expr: str, out: str, dtype: str, stage: int) -> None:
        nonlocal n
        var = f"r{n}_@" if kind == "row" else f"s{n}"
        n += 1
        if kind == "row":
            row_ops.append((var, _round(expr, dtype), stage))
        else:
            means[-1][1].append((var, _round(expr, dtype)))
        stages[var] = stage
        vals[out] = (kind, var, dtype)

    for s in steps:
        if s.kind != StepKind.ATEN or len(s.outputs) != 1 or s.outputs[0] is None:
            raise NoSite(s.target)
        out, t = s.outputs[0], s.target
        ospec = spec(out)
        if t in RESHAPE_VIEWS or is_copy(s):
            src = s.args[0]  # a view, or a copy (Phi-3's dropout of the sublayer's output): the same values
            if not isinstance(src, Buf):
                raise NoSite(t)
            if src.name in vals:
                kind = vals[src.name][0]
                if kind != shape_kind(ospec.shape):
                    raise NoSite(f"{t} changes what {src.name} is")
                vals[out] = vals[src.name]
            else:
                alias[out] = alias.get(src.name, src.name)
            continue
        if t == "aten._to_copy.default":
            float_cast(s)
            kind, x, _ = operand(s.args[0])
            if kind == "const":
                raise NoSite(t)
            emit(kind, x, out, ospec.dtype, stages.get(x, 0))
            if x in scaled:
                scaled[vals[out][1]] = scaled[x]
            continue
        if t == "aten.mean.dim":
            if len(means) == _max_means() or len(s.args) != 3 or s.kwargs:
                raise NoSite("more means than two, or a mean with options")
            kind, x, _ = operand(s.args[0])
            src_rank = len(spec(s.args[0].name).shape) if isinstance(s.args[0], Buf) else 0
            if kind != "row" or stages.get(x, 0) != len(means):
                raise NoSite("a mean of anything but a row of the statistics so far")
            if s.args[1] not in ([-1], [src_rank - 1]) or s.args[2] is not True:
                raise NoSite("a mean over other dims than the last, or without keepdim")
            if shape_kind(ospec.shape) != "stat":
                raise NoSite(f"mean result {ospec.shape}")
            tag = str(len(means) + 1) if means else ""
            means.append((x, [(f"s_mean{tag}", _round(f"(s_sum{tag} / {k})", ospec.dtype))]))
            stages[f"s_mean{tag}"] = len(means)
            vals[out] = ("stat", f"s_mean{tag}", ospec.dtype)
            continue
        if t == "aten.pow.Tensor_Scalar" and len(s.args) == 2 and not s.kwargs and s.args[1] in (2, 2.0):
            kind, x, _ = operand(s.args[0])
            if kind == "const":
                raise NoSite(t)
            emit(kind, f"({x} * {x})", out, ospec.dtype, stages.get(x, 0))
            continue
        if t in BINARY and len(s.args) == 2 and not s.kwargs:
            (ka, a, _), (kb, b, _) = operand(s.args[0]), operand(s.args[1])
            kinds = {ka, kb} - {"const"}
            if not kinds:
                raise NoSite(f"{t} of two constants")
            stage = max(stages.get(a, 0), stages.get(b, 0))
            if "row" in kinds:
                fa, fb = factor(ka, a), factor(kb, b)
                a = f"{a}[:, None]" if ka == "stat" else a
                b = f"{b}[:, None]" if kb == "stat" else b
                emit("row", BINARY[t].format(a, b), out, ospec.dtype, stage)
                op = {"aten.mul.Tensor": "*", "aten.div.Tensor": "/"}.get(t)
                f = product(fa, fb, op) if op else None
                if stage and f:
                    scaled[vals[out][1]] = f
            else:
                emit("stat", BINARY[t].format(a, b), out, ospec.dtype, stage)
            continue
        if (t in _ROW_UNARY or t in _STAT_UNARY) and len(s.args) == 1 and not s.kwargs:
            kind, x, _ = operand(s.args[0])
            table = _STAT_UNARY if kind == "stat" else _ROW_UNARY
            if kind == "const" or t not in table:
                raise NoSite(f"{t} of a {kind}")
            emit(kind, table[t].format(x), out, ospec.dtype, stages.get(x, 0))
            continue
        raise NoSite(f"{t} in a row norm")

    if not means:
        raise NoSite("no mean over K")
    last = len(means)
    if a_out not in vals or vals[a_out][0] != "row" or stages.get(vals[a_out][1], 0) != last:
        raise NoSite(f"{a_out} is not a row value after the statistics")
    sum_out = None
    for o in outputs:
        if o is None or o == a_out:
            continue
        if sum_out is not None or o not in vals or vals[o][0] != "row" or stages.get(vals[o][1], 0) == last:
            raise NoSite(f"output {o} is not a row value before the last statistics")
        if vals[o][1].startswith(("x", "v")):
            raise NoSite(f"output {o} is an input")
        sum_out = (o, vals[o][1], vals[o][2])
    (reduced, stat_ops), more = means[0], means[1:]
    return RowNorm(
        inputs=tuple((b, spec(b).dtype) for b in inputs),
        vectors=tuple((b, spec(b).dtype) for b in vectors),
        row_ops=tuple(row_ops),
        reduced=reduced,
        stat_ops=tuple(stat_ops),
        out=vals[a_out][1],
        sum_out=sum_out,
        factored=None if more else scaled.get(vals[a_out][1]),
        more=tuple((r, tuple(ops)) for r, ops in more),
    )
