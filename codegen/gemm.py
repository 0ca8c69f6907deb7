"""GEMM candidates: Triton forms of a program's library GEMMs, with their epilogues fused.

``aotpack build --gemm-candidates`` runs this on the fused program. A *site* is a library GEMM
whose second operand is a transposed weight (``permute(W, [1, 0])``, ``W: [N, K]`` static) or a
weight as stored (``W: [K, N]``, transformers' Conv1D; no one-row forms, which read W along K):
``aten.mm``, ``aten.addmm`` (bias ``[N]``) or ``aten._addmm_activation`` (bias + ReLU or tanh-GELU),
and, when the GEMM's result is read only by one pointwise kernel, that kernel too: its reference
steps become the GEMM's epilogue (GELU/tanh-GELU/ReLU/SiLU/sigmoid/tanh, add/sub/mul/div with an
``[M, N]`` or ``[N]`` tensor such as a residual, dtype casts). When that kernel also reads a second
GEMM of the same input ``A`` (the Llama MLP's ``silu(A @ Wg^T) * (A @ Wu^T)``), both GEMMs run in one
kernel that shares the loads of ``A`` (a *dual* GEMM) and the product is its epilogue.

Each site gets one candidate per tile config (``CONFIGS``: dot-free one-row forms and skinny-M
tiles for decode and batch 1, a middle and a large tile) plus deterministic split-K forms: a first
kernel writes each K slice's fp32 partial sums to its own slab of a workspace, a second adds the
slabs in a fixed order and applies the epilogue; no atomics, so two runs give the same bits. A
candidate is compiled like every kernel (``compile``: same cache, same determinism) and lists the
bucket sizes it is meant for.

The program keeps its library steps; ``Program.alternatives`` records, per site, the indices of
the steps a candidate replaces and the candidate's kernel steps, whose ``reference`` is exactly
those steps (the kernel of an absorbed epilogue expanded to its own reference). ``aotpack tune``
chooses on the target GPU; an untuned bundle runs the library steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.kernel_source import kernel_module, signature_of
from aot.codegen.launch import max_value
from aot.codegen.render import Rendered, kernel_record
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.program import calls_cublas, step_reads
from aot.schema import (
    Bucket,
    Buf,
    DType,
    GemmCandidate,
    GemmSite,
    Kernel,
    KernelParam,
    ParamKind,
    Program,
    Step,
    StepKind,
    Sym,
    TensorSpec,
)
from aot.symexpr import compile_expr

GEMM_TARGETS = ("aten.mm.default", "aten.addmm.default", "aten._addmm_activation.default")
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
HEURISTIC = "gemm-candidates-v1"


@dataclass(frozen=True)
class TileConfig:
    """One candidate form: block sizes, warps, pipeline stages, K slices (1: no split-K; 0: chosen
    per site by ``split_factor``), and the bucket rows ``M`` it is meant for (inclusive)."""

    name: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    min_m: int = 1
    max_m: int = 1 << 62
    min_k: int = 1  # split-K: each slice must keep at least a couple of K blocks
    dot: bool = True  # False: a dot-free GEMV body for one row (BLOCK_M = 1), products summed over K
    target_blocks: int = 0  # split-K: blocks to aim for (0: SPLIT_TARGET_BLOCKS)

    def __post_init__(self):
        if not self.dot and self.block_m != 1:
            raise ValueError(f"{self.name}: the dot-free form computes one row per block (BLOCK_M = 1)")


# Performance knobs: the candidate forms compiled for every site.
CONFIGS: tuple[TileConfig, ...] = (
    # One row (decode, batch 1) without tensor cores: each block multiplies a few whole rows of W
    # by A's row and sums along K, so a block's loads are wide and contiguous and there are enough
    # blocks (about four per SM) to keep HBM busy; a BLOCK_M = 16 tile wastes 15/16 of its dot.
    TileConfig("vec_1x8x512", 1, 8, 512, num_warps=4, num_stages=2, max_m=1, dot=False),
    TileConfig("vec_1x4x1024", 1, 4, 1024, num_warps=4, num_stages=2, max_m=1, dot=False),
    TileConfig(
        "splitk_1x8x512",
        1,
        8,
        512,
        num_warps=4,
        num_stages=2,
        split_k=0,
        max_m=1,
        min_k=2048,
        dot=False,
        target_blocks=512,
    ),
    # Skinny M (decode, batch 1): narrow N tiles, so that even N = 768 spreads over 48 blocks and a
    # 1024 x 4096 weight over 256, each streaming whole rows of W (K contiguous).
    TileConfig("gemv_16x16x256", 16, 16, 256, num_warps=4, num_stages=3, max_m=16),
    TileConfig("gemv_16x32x128", 16, 32, 128, num_warps=4, num_stages=4, max_m=16),
    TileConfig("splitk_16x16x256", 16, 16, 256, num_warps=4, num_stages=3, split_k=0, max_m=16, min_k=2048),
    TileConfig("tile_16x64x128", 16, 64, 128, num_warps=4, num_stages=4, max_m=64),  # decode, batch 1
    # Middle M (a prompt of one sequence, 17-512 rows): 64-row tiles with long K steps and four
    # stages, narrow in N so that a 768-wide output still spreads over 24-48 blocks. At 128 rows
    # on an H100 with cold weights (bench/gemm_sweep.py, bench/results/gemm-sweep-m128-*.json):
    # qkv 768 -> 2304 4.85 us against cuBLAS's 4.84, attention out 768 -> 768 3.87 against 4.23,
    # fc 768 -> 3072 with GELU 5.78 against 5.76 (cuBLASLt's fused epilogue), mlp out 3072 -> 768
    # 8.98 against 7.28.
    TileConfig("tile_64x64x128", 64, 64, 128, num_warps=4, num_stages=4, min_m=17, max_m=512),
    TileConfig("tile_64x32x128", 64, 32, 128, num_warps=4, num_stages=4, min_m=17, max_m=512),
    TileConfig("tile_64x128x64", 64, 128, 64, num_warps=4, num_stages=3),
    TileConfig("tile_128x128x32", 128, 128, 32, num_warps=8, num_stages=3, min_m=128),
    TileConfig("splitk_16x64x128", 16, 64, 128, num_warps=4, num_stages=3, split_k=0, max_m=64, min_k=1024),
)
# Split-K: enough K slices that a skinny GEMM's tiles fill about one wave of the GPU (an H100 has
# 132 SMs, an A100 108), each slice keeping at least MIN_SLICE_BLOCKS blocks of K.
SPLIT_TARGET_BLOCKS = 128
MAX_SPLIT = 8
MIN_SLICE_BLOCKS = 2
ROUND = {"float16": "tl.float16", "bfloat16": "tl.bfloat16"}
# LayerNorm prologue: the statistics read K in chunks of this many columns, all at once, so the
# rows of a block stay in registers: only for skinny blocks (BLOCK_M <= PROLOGUE_MAX_BLOCK_M) and
# K <= PROLOGUE_MAX_K; other sites keep their LayerNorm kernel. Each block reads A's rows again
# per K step to normalize them, so only configs with long K steps and no split get a prologue form
# (BLOCK_K >= PROLOGUE_MIN_BLOCK_K): on an H200, gpt at batch 1 with K = 768, the 16x32x128 form
# with the prologue took 12.0 us where the LayerNorm kernel and the plain form took 8.0 us together.
STATS_CHUNK = 256
PROLOGUE_MAX_K = 2048
PROLOGUE_MAX_BLOCK_M = 16
PROLOGUE_MIN_BLOCK_K = 256
# Shared memory a block may use per arch (bytes, opt-in maximum): a candidate whose pipelined tiles
# need more would compile but never launch there, so it is left out.
SHARED_LIMIT = {75: 64 << 10, 80: 163 << 10, 86: 99 << 10, 87: 163 << 10, 89: 99 << 10, 90: 227 << 10}
DEFAULT_SHARED_LIMIT = 99 << 10


class NoSite(Exception):
    """A GEMM (or its epilogue) this module cannot express; it stays as it is."""


@dataclass(frozen=True)
class Prologue:
    """A LayerNorm of A's rows over K, and the residual add before it, that a candidate computes
    as it loads A: ``A = layer_norm(x [+ y], (K,), weight, bias, eps)``. ``sum_out``: the add's
    result, which later steps read; the blocks of the first N tile write it."""

    x: str
    y: str | None
    weight: str | None
    bias: str | None
    eps: float
    sum_out: str | None
    kernel: Step  # the LayerNorm kernel's step, which the forms without the prologue keep
    ln_out: str  # its LayerNorm output (A, through same-index views)


@dataclass(frozen=True)
class Site:
    """A GEMM site of the fused program (build-time view; ``GemmSite`` is what the bundle keeps)."""

    id: str
    library: tuple[int, ...]  # indices of Program.steps the candidates replace, ascending
    a: str  # A: [M, K]
    weights: tuple[str, ...]  # W: [N, K] (or [K, N]: ``w_kn``), one, or two for the dual GEMM
    biases: tuple[str | None, ...]  # per GEMM: bias [N] or None
    activation: str  # "", "relu", "gelu_tanh" (``_addmm_activation`` of the first GEMM)
    gemm_outputs: tuple[str, ...]  # the GEMM results as the program names them
    m: str  # rows, size text
    n: int
    k: int
    dtype: str
    epilogue: tuple[Step, ...] = ()  # the absorbed kernel's reference steps
    outputs: tuple[str, ...] = ()  # the buffers the site hands to later steps
    reference: tuple[Step, ...] = field(default=())
    prologue: Prologue | None = None  # the LayerNorm kernel that made A, absorbed
    w_kn: bool = False  # W stored [K, N] (N contiguous), read as is: transformers' Conv1D


# ---------------------------------------------------------------------------------------------
# Finding sites


def _shape(buffers: dict[str, TensorSpec], known: dict[str, TensorSpec], name: str) -> TensorSpec | None:
    return buffers.get(name) or known.get(name)


def _same(a: str, b: str) -> bool:
    return ix.same(ix.parse_size(a), ix.parse_size(b))


# views that keep every element at its index in row-major order
SAME_INDEX_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
LAYER_NORM = "aten.native_layer_norm.default"


def _row_major_rows(spec: TensorSpec | None, m: str, k: int, dtype: str) -> bool:
    """``spec`` is ``[..., K]`` row-major with ``M * K`` elements of ``dtype``: element (m, k) at m*K + k."""
    if spec is None or spec.dtype != dtype or spec.order or not spec.shape:
        return False
    dims = tuple(ix.parse_size(d) for d in spec.shape)
    return ix.same(dims[-1], sympy.Integer(k)) and ix.same(ix.numel(dims), ix.parse_size(m) * k)


def _prologue(
    program: Program,
    a: str,
    m: str,
    k: int,
    dtype: str,
    known: dict[str, TensorSpec],
    producer: dict[str, int],
    readers: dict[str, list[int]],
    reader: int,
) -> tuple[Prologue, list[int]] | None:
    """The LayerNorm kernel that made ``a`` (through same-index views only ``reader`` reads), as a
    prologue, and the steps it replaces; None when ``a`` is not such a kernel's output.
    ``known``: the program's inputs' and weights' specs."""
    steps = program.steps
    views, name, nxt = [], a, reader
    while True:
        if readers.get(name) != [nxt] or name in program.outputs:
            return None
        p = producer.get(name)
        if p is None:
            return None
        s = steps[p]
        if s.kind == StepKind.ATEN and s.target in SAME_INDEX_VIEWS and isinstance(s.args[0], Buf):
            views.append(p)
            name, nxt = s.args[0].name, p
            continue
        break
    if s.kind != StepKind.KERNEL or name not in s.outputs:
        return None
    alias: dict[str, str] = {}  # a reference view's output -> the buffer it views
    summed: dict[str, tuple[str, str]] = {}
    found = None
    for r in s.reference:
        if r.kind != StepKind.ATEN:
            return None
        if r.target in SAME_INDEX_VIEWS and isinstance(r.args[0], Buf) and len(r.outputs) == 1:
            alias[r.outputs[0]] = alias.get(r.args[0].name, r.args[0].name)
        elif r.target == "aten.add.Tensor" and len(r.args) == 2 and not r.kwargs and len(r.outputs) == 1:
            if not all(isinstance(x, Buf) for x in r.args):
                return None
            summed[r.outputs[0]] = tuple(alias.get(x.name, x.name) for x in r.args)
        elif r.target == LAYER_NORM and found is None and r is s.reference[-1]:
            found = r
        else:
            return None
    if found is None or len(found.args) != 5 or found.kwargs or found.outputs[0] != name:
        return None
    src, shape, weight, bias, eps = found.args
    if any(o is not None and readers.get(o) for o in found.outputs[1:]):
        return None  # mean / rstd read elsewhere
    if not isinstance(src, Buf) or shape != [k] or not isinstance(eps, float) or k > PROLOGUE_MAX_K:
        return None
    if any(
        w is not None and not (isinstance(w, Buf) and known.get(w.name) is not None) for w in (weight, bias)
    ):
        return None
    for w in (weight, bias):
        if w is not None and (known[w.name].dtype != dtype or list(known[w.name].shape) != [str(k)]):
            return None
    if src.name in summed:
        x, y = summed[src.name]
        sum_out = src.name if src.name in s.outputs else None
    elif not summed:
        x, y, sum_out = alias.get(src.name, src.name), None, None
    else:
        return None
    if set(o for o in s.outputs if o is not None) - {name, sum_out}:
        return None
    rows = [b for b in (x, y, sum_out) if b is not None]
    if not all(_row_major_rows(_shape(program.buffers, known, b), m, k, dtype) for b in rows):
        return None
    w_name = weight.name if weight is not None else None
    b_name = bias.name if bias is not None else None
    return Prologue(x, y, w_name, b_name, eps, sum_out, s, name), [p, *views]


def find_sites(program: Program) -> list[Site]:
    """The program's GEMM sites, in program order; a step belongs to at most one site."""
    steps = program.steps
    known = {t.name: t.spec for t in program.inputs + program.weights}
    weights = {w.name for w in program.weights}
    readers: dict[str, list[int]] = {}
    producer: dict[str, int] = {}
    for i, s in enumerate(steps):
        for r in dict.fromkeys(step_reads(s)):
            readers.setdefault(r, []).append(i)
        for o in s.outputs:
            if o is not None:
                producer[o] = i
    outputs = set(program.outputs)

    def gemm(i: int) -> dict[str, Any] | None:
        s = steps[i]
        if s.kind != StepKind.ATEN or s.target not in GEMM_TARGETS or len(s.outputs) != 1:
            return None
        if s.target == "aten.mm.default":
            if len(s.args) != 2 or s.kwargs:
                return None
            bias, a, b = None, *s.args
        else:
            if len(s.args) != 3:
                return None
            allowed = {"use_gelu"} if s.target == "aten._addmm_activation.default" else set()
            if set(s.kwargs) - allowed:
                return None
            bias, a, b = s.args
            if not isinstance(bias, Buf):
                return None
            bias = bias.name
        if not isinstance(a, Buf) or not isinstance(b, Buf):
            return None
        if b.name in weights:  # A @ W with W [K, N] as stored (transformers' Conv1D)
            p, w, w_kn = None, b.name, True
        else:
            if b.name not in producer:
                return None
            p = producer[b.name]
            perm = steps[p]
            if not (
                perm.kind == StepKind.ATEN
                and (
                    (perm.target == "aten.permute.default" and list(perm.args[1:]) == [[1, 0]])
                    or (perm.target == "aten.t.default" and len(perm.args) == 1)
                )
                and isinstance(perm.args[0], Buf)
                and perm.args[0].name in weights
            ):
                return None
            w, w_kn = perm.args[0].name, False
        wspec, aspec, ospec = (
            known[w],
            _shape(program.buffers, known, a.name),
            program.buffers.get(s.outputs[0]),
        )
        if aspec is None or ospec is None or len(wspec.shape) != 2 or len(aspec.shape) != 2:
            return None
        if not all(d.isdigit() for d in wspec.shape) or wspec.order:
            return None
        n, k = int(wspec.shape[0]), int(wspec.shape[1])
        if w_kn:
            n, k = k, n
        dtype = wspec.dtype
        if dtype not in FLOAT_DTYPES or aspec.dtype != dtype or ospec.dtype != dtype:
            return None
        if not _same(aspec.shape[1], str(k)) or list(ospec.shape[1:]) != [str(n)]:
            return None
        if not _same(ospec.shape[0], aspec.shape[0]):
            return None
        if bias is not None:
            bspec = _shape(program.buffers, known, bias)
            if bspec is None or bspec.dtype != dtype or list(bspec.shape) != [str(n)]:
                return None
        activation = ""
        if s.target == "aten._addmm_activation.default":
            activation = "gelu_tanh" if s.kwargs.get("use_gelu") is True else "relu"
        # the permute goes with the GEMM when nothing else reads the transposed view
        library = ([p] if p is not None and readers.get(b.name) == [i] and b.name not in outputs else []) + [
            i
        ]
        return dict(
            index=i,
            a=a.name,
            w=w,
            bias=bias,
            activation=activation,
            out=s.outputs[0],
            m=aspec.shape[0],
            n=n,
            k=k,
            dtype=dtype,
            library=library,
            w_kn=w_kn,
        )

    def a_key(name: str) -> tuple:
        """Two views of one buffer with the same arguments read the same A."""
        p = producer.get(name)
        if (
            p is not None
            and steps[p].kind == StepKind.ATEN
            and steps[p].target
            in (
                "aten.view.default",
                "aten._unsafe_view.default",
                "aten.reshape.default",
            )
        ):
            return (
                "view",
                a_key(step_reads(steps[p])[0]) if step_reads(steps[p]) else name,
                repr(steps[p].args[1:]),
            )
        return ("buf", name)

    used: set[int] = set()
    sites: list[Site] = []
    for i in range(len(steps)):
        if i in used:
            continue
        g = gemm(i)
        if g is None:
            continue
        gemms = [g]
        library = list(g["library"])
        epilogue: tuple[Step, ...] = ()
        site_outputs: tuple[str, ...] = (g["out"],)
        rd = readers.get(g["out"], [])
        if (
            len(rd) == 1
            and g["out"] not in outputs
            and steps[rd[0]].kind == StepKind.KERNEL
            and rd[0] not in used
        ):
            kstep = steps[rd[0]]
            extra = []
            for r in dict.fromkeys(step_reads(kstep)):
                j = producer.get(r)
                if r == g["out"] or j is None or j in used or j == i:
                    continue
                other = gemm(j)
                if (
                    other is not None
                    and not other["activation"]
                    and readers.get(other["out"]) == [rd[0]]
                    and other["out"] not in outputs
                    and a_key(other["a"]) == a_key(g["a"])
                    and (other["n"], other["k"], other["dtype"], other["w_kn"])
                    == (g["n"], g["k"], g["dtype"], g["w_kn"])
                    and not g["activation"]
                    and not set(other["library"]) & set(library)
                ):
                    extra.append(other)
            candidate_gemms = gemms + extra[:1]
            try:
                _Epilogue([x["out"] for x in candidate_gemms], g["m"], g["n"], program.buffers, known).lower(
                    kstep.reference, kstep.outputs
                )
                gemms = candidate_gemms
                epilogue = kstep.reference
                site_outputs = tuple(o for o in kstep.outputs if o is not None)
                for x in extra[:1]:
                    library += x["library"]
                library.append(rd[0])
            except NoSite:
                pass
        prologue = None
        if len(gemms) == 1:
            found = _prologue(
                program, g["a"], g["m"], g["k"], g["dtype"], known, producer, readers, g["index"]
            )
            if found is not None and not set(found[1]) & used:
                prologue, before = found
                # the candidate writes the add's result where the site's last step was: nothing
                # the site leaves in between may read it
                kept = set(range(before[0] + 1, max(library))) - set(library) - set(before)
                if prologue.sum_out is None or not set(readers.get(prologue.sum_out, ())) & kept:
                    library += before
                    if prologue.sum_out is not None:
                        site_outputs = (*site_outputs, prologue.sum_out)
                else:
                    prologue = None
        library = sorted(set(library))
        if set(library) & used:
            continue
        used.update(library)
        reference: list[Step] = []
        for j in library:
            reference.extend(steps[j].reference if steps[j].kind == StepKind.KERNEL else (steps[j],))
        sites.append(
            Site(
                id=f"gemm_{len(sites)}",
                library=tuple(library),
                a=g["a"],
                weights=tuple(x["w"] for x in gemms),
                biases=tuple(x["bias"] for x in gemms),
                activation=g["activation"],
                gemm_outputs=tuple(x["out"] for x in gemms),
                m=g["m"],
                n=g["n"],
                k=g["k"],
                dtype=g["dtype"],
                epilogue=epilogue,
                outputs=site_outputs,
                reference=tuple(reference),
                prologue=prologue,
                w_kn=g["w_kn"],
            )
        )
    return sites


# ---------------------------------------------------------------------------------------------
# Epilogues: the absorbed kernel's reference steps as fp32 tile arithmetic over ``acc``


_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.clone.default")
_UNARY = {
    "aten.relu.default": "tl.maximum({0}, 0.0)",
    "aten.sigmoid.default": "tl.sigmoid({0})",
    "aten.silu.default": "({0} * tl.sigmoid({0}))",
    "aten.tanh.default": "(1.0 - 2.0 / (tl.exp(2.0 * {0}) + 1.0))",  # no libdevice in the interpreter
    "aten.neg.default": "(-{0})",
}
_BINARY = {
    "aten.add.Tensor": "({0} + {1})",
    "aten.sub.Tensor": "({0} - {1})",
    "aten.mul.Tensor": "({0} * {1})",
    "aten.div.Tensor": "({0} / {1})",
}
GELU = "(0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476)))"
GELU_TANH = "(0.5 * {0} * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * (0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0}))) + 1.0))))"


@dataclass
class Load:
    param: str
    layout: str  # "full" ([M, N] row-major), "row" ([N], broadcast over rows), "scalar"
    dtype: str


class _Epilogue:
    """Lowers an epilogue's steps to lines of fp32 tile arithmetic (``lines``), the tensors it
    loads (``loads``: buffer → ``Load``) and its outputs (``stores``: buffer, value, dtype).
    Raises ``NoSite`` for anything it cannot express."""

    def __init__(self, gemm_outputs: list[str], m: str, n: int, buffers, known):
        self.buffers, self.known = buffers, known
        self.M, self.N = ix.parse_size(m), sympy.Integer(n)
        self.vals: dict[str, str] = {o: f"acc{i}" for i, o in enumerate(gemm_outputs)}
        self.alias: dict[str, tuple[str, tuple[str, ...]]] = {}  # external view -> (root, shape)
        self.loads: dict[str, Load] = {}
        self.lines: list[str] = []
        self.stores: list[tuple[str, str, str]] = []

    def spec(self, name: str) -> TensorSpec:
        spec = _shape(self.buffers, self.known, name)
        if spec is None:
            raise NoSite(f"no spec for {name}")
        return spec

    def layout(self, shape: tuple[str, ...]) -> str:
        dims = [ix.parse_size(s) for s in shape]
        numel = ix.numel(tuple(dims))
        if ix.same(numel, sympy.Integer(1)):
            return "scalar"
        if not dims or not ix.same(dims[-1], self.N):
            raise NoSite(f"shape {shape} does not end in N")
        if ix.same(numel, self.N):
            return "row"
        if ix.same(numel, self.M * self.N):
            return "full"
        raise NoSite(f"shape {shape} is neither [M, N] nor [N]")

    def value(self, arg: Any) -> str:
        if isinstance(arg, Buf):
            if arg.name in self.vals:
                return self.vals[arg.name]
            root, shape = self.alias.get(arg.name, (arg.name, self.spec(arg.name).shape))
            spec = self.spec(root)
            if spec.dtype not in FLOAT_DTYPES:
                raise NoSite(f"{root} is {spec.dtype}")
            layout = self.layout(shape)
            if root not in self.loads:
                self.loads[root] = Load(f"e{len(self.loads)}", layout, spec.dtype)
            elif self.loads[root].layout != layout:
                raise NoSite(f"{root} read in two layouts")
            return f"{self.loads[root].param}_v"
        if isinstance(arg, bool) or not isinstance(arg, (int, float)):
            raise NoSite(f"argument {str(arg)[:40]}")
        return repr(float(arg))

    def lower(self, steps: tuple[Step, ...], outputs: tuple[str | None, ...]) -> None:
        n = 0
        for s in steps:
            if s.kind != StepKind.ATEN or len(s.outputs) != 1 or s.outputs[0] is None:
                raise NoSite(f"{s.target}")
            out = s.outputs[0]
            ospec = self.spec(out)
            t = s.target
            if t in _VIEWS:
                src = s.args[0]
                if not isinstance(src, Buf):
                    raise NoSite(t)
                if t == "aten.clone.default" and set(s.kwargs) - {"memory_format"}:
                    raise NoSite(t)
                if src.name in self.vals:
                    if self.layout(ospec.shape) != "full":
                        raise NoSite(f"{t} of the GEMM result to {ospec.shape}")
                    self.vals[out] = self.vals[src.name]
                else:
                    root, _ = self.alias.get(src.name, (src.name, ()))
                    self.alias[out] = (root, ospec.shape)
                continue
            if t == "aten._to_copy.default":
                if set(s.kwargs) - {"dtype", "layout", "device", "memory_format"} or len(s.args) != 1:
                    raise NoSite(t)
                dt = s.kwargs.get("dtype")
                if not isinstance(dt, DType) or dt.name not in FLOAT_DTYPES:
                    raise NoSite(f"{t} to {dt}")
                x = self.value(s.args[0])
                # values are fp32 in registers; the reference rounds a half value when it is
                # made, so round it here: to the narrower of its own dtype and the target
                src = self.spec(self.alias.get(s.args[0].name, (s.args[0].name,))[0]).dtype
                narrow = dt.name if dt.name in ROUND else src if src in ROUND else None
                if narrow is None:
                    if self.layout(ospec.shape) != "full":
                        raise NoSite(f"{t} result {ospec.shape} is not [M, N]")
                    self.vals[out] = x
                    continue
                expr = f"{x}.to({ROUND[narrow]}).to(tl.float32)"
            elif t in _UNARY and len(s.args) == 1 and not s.kwargs:
                expr = _UNARY[t].format(self.value(s.args[0]))
            elif t == "aten.gelu.default":
                approx = s.kwargs.get("approximate", s.args[1] if len(s.args) > 1 else "none")
                if approx not in ("none", "tanh"):
                    raise NoSite(f"gelu approximate={approx!r}")
                expr = (GELU if approx == "none" else GELU_TANH).format(self.value(s.args[0]))
            elif t in _BINARY and len(s.args) == 2:
                if set(s.kwargs) - {"alpha"}:
                    raise NoSite(t)
                a, b = self.value(s.args[0]), self.value(s.args[1])
                alpha = s.kwargs.get("alpha", 1)
                if alpha != 1:
                    if t not in ("aten.add.Tensor", "aten.sub.Tensor"):
                        raise NoSite(t)
                    b = f"({self.value(alpha)} * {b})"
                expr = _BINARY[t].format(a, b)
            else:
                raise NoSite(f"{t} in the epilogue")
            if ospec.dtype not in FLOAT_DTYPES:
                raise NoSite(f"{t} makes {ospec.dtype}")
            if self.layout(ospec.shape) != "full":
                raise NoSite(f"{t} result {ospec.shape} is not [M, N]")
            var = f"v{n}"
            n += 1
            self.lines.append(f"{var} = {expr}")
            self.vals[out] = var
        for o in outputs:
            if o is None:
                continue
            if o not in self.vals or self.layout(self.spec(o).shape) != "full":
                raise NoSite(f"output {o} is not an [M, N] value of the epilogue")
            self.stores.append((o, self.vals[o], self.spec(o).dtype))


# ---------------------------------------------------------------------------------------------
# Rendering


def _grid_rows(m: str, block: int) -> str:
    return f"({ix.size_text(ix.parse_size(m))} + {block - 1})//{block}"


def render_candidates(
    site: Site,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
    configs: tuple[TileConfig, ...] | None = None,
) -> list[tuple[TileConfig, list[Rendered], dict[str, TensorSpec], tuple[Step, ...]]]:
    """Per form that fits the site: its config (named as the form), its kernels (one, or the
    split-K pair), the buffers they add to the program, and the program steps that run before
    them. A site with a LayerNorm prologue gets each config twice: ``<config>`` runs the program's
    LayerNorm kernel first (into a buffer of its own), then the plain GEMM; ``<config>_ln``, for
    the skinny configs, computes the LayerNorm as it loads A. Which is faster depends on the GPU
    and the sizes, so ``aotpack tune`` decides."""
    if site.prologue is not None:
        pro = site.prologue
        scratch = f"{site.id}_a"
        plain = replace(site, prologue=None, a=scratch, outputs=_gemm_outputs(site))
        ln_step = replace(
            pro.kernel,
            args=tuple(
                Buf(scratch) if isinstance(x, Buf) and x.name == pro.ln_out else x for x in pro.kernel.args
            ),
            outputs=tuple(scratch if o == pro.ln_out else o for o in pro.kernel.outputs),
            reference=(),
        )
        a_spec = buffers[pro.ln_out]
        out = []
        for cfg, kernels, extra, pre in render_candidates(plain, buffers, known, ranges, configs):
            out.append((cfg, kernels, {**extra, scratch: a_spec}, (ln_step, *pre)))
        fused = [
            c
            for c in (CONFIGS if configs is None else configs)
            if c.block_m <= PROLOGUE_MAX_BLOCK_M and c.block_k >= PROLOGUE_MIN_BLOCK_K and c.split_k == 1
        ]
        for cfg, kernels, extra, pre in _render_forms(site, buffers, known, ranges, tuple(fused)):
            out.append((replace(cfg, name=cfg.name + "_ln"), kernels, extra, pre))
        return out
    return _render_forms(site, buffers, known, ranges, configs)


def _render_forms(
    site: Site,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
    configs: tuple[TileConfig, ...] | None,
) -> list[tuple[TileConfig, list[Rendered], dict[str, TensorSpec], tuple[Step, ...]]]:
    configs = CONFIGS if configs is None else configs
    ep = _Epilogue(list(site.gemm_outputs), site.m, site.n, buffers, known)
    if site.epilogue:
        ep.lower(site.epilogue, _gemm_outputs(site))
    else:
        ep.stores.append((site.gemm_outputs[0], "acc0", site.dtype))
    m_max = max_value(ix.parse_size(site.m), ranges)
    out = []
    for cfg in configs:
        if cfg.split_k != 1 and site.k < cfg.min_k:
            continue
        if site.w_kn and not cfg.dot:
            continue  # a one-row form reads W's rows along K: strided where W is [K, N]
        if cfg.split_k == 0:
            split = split_factor(site, cfg)
            if split < 2:
                continue
            cfg = replace(cfg, split_k=split, name=cfg.name.replace("splitk", f"splitk{split}", 1))
        s, g = cfg.split_k, len(site.weights)
        biggest = max(m_max * max(site.k, site.n * s * g, site.n), site.k * site.n)
        index = "i64" if biggest >= 2**31 - 1 else "i32"
        if cfg.split_k == 1:
            kernels = [_render_fused(site, ep, cfg, index)]
            extra: dict[str, TensorSpec] = {}
        else:
            ws = f"{site.id}_{cfg.name}_partial"
            extra = {ws: TensorSpec("float32", (str(s), str(g), site.m, str(site.n)))}
            kernels = [_render_partial(site, cfg, index, ws), _render_reduce(site, ep, cfg, index, ws)]
        out.append((cfg, kernels, extra, ()))
    return out


def split_factor(site: Site, cfg: TileConfig) -> int:
    """K slices for ``site``: its N tiles times the slices should reach ``SPLIT_TARGET_BLOCKS``."""
    n_tiles = -(-site.n // cfg.block_n)
    want = -(-(cfg.target_blocks or SPLIT_TARGET_BLOCKS) // n_tiles)
    return max(1, min(MAX_SPLIT, want, site.k // (MIN_SLICE_BLOCKS * cfg.block_k)))


def _what(site: Site) -> str:
    parts = ["dual GEMM" if len(site.weights) > 1 else "GEMM"]
    if site.prologue is not None:
        parts.insert(0, "LayerNorm" + (" of a sum" if site.prologue.y is not None else "") + " prologue")
    if any(site.biases):
        parts.append("bias")
    if site.activation:
        parts.append(site.activation)
    if site.epilogue:
        parts.append("epilogue " + ", ".join(dict.fromkeys(s.target.split(".")[1] for s in site.epilogue)))
    return " + ".join(parts)


def _doc(site: Site, cfg: TileConfig, kind: str, grid: tuple[str, ...]) -> list[str]:
    return [
        f"GEMM candidate {cfg.name} ({kind}): {_what(site)}.",
        "",
        f"C[M, N] = A[M, K] @ {'W[K, N]' if site.w_kn else 'W[N, K]^T'} with M = {ix.size_text(ix.parse_size(site.m))}, N = {site.n}, K = {site.k}, {site.dtype};",
        f"grid: ({', '.join(grid)},)",
    ]


def _indices(site: Site, index: str) -> list[str]:
    cast = ".to(tl.int64)" if index == "i64" else ""
    return [
        f"rm = tl.program_id(0){cast} * BLOCK_M + tl.arange(0, BLOCK_M)",
        f"rn = tl.program_id(1){cast} * BLOCK_N + tl.arange(0, BLOCK_N)",
        "mask_m = rm < M",
        f"mask_n = rn < {site.n}",
        "mask = mask_m[:, None] & mask_n[None, :]",
    ]


def _k_loop(site: Site, cfg: TileConfig, k_offset: str, k_extent: int, index: str = "i32") -> list[str]:
    """Accumulate ``acc{g}`` over ``k_offset <= k < k_offset + k_extent`` (and ``k < K``) in
    BLOCK_K steps; the loop bounds are constants, so the compiler can pipeline the loads (a dot's)
    or unroll the steps (the dot-free form's). ``index``: "i64" where W's offsets may pass 2**31."""
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    weights = range(len(site.weights))
    if not cfg.dot:
        return _vec_steps(site, cfg, k_offset, k_extent)
    lines = [f"acc{g} = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)" for g in weights]
    lines.append(f"for k0 in range(0, {k_extent}, BLOCK_K):")
    lines.append(
        f"    rk = {k_offset} + k0 + tl.arange(0, BLOCK_K)"
        if k_offset != "0"
        else "    rk = k0 + tl.arange(0, BLOCK_K)"
    )
    need_k_mask = k_offset != "0" or site.k % cfg.block_k != 0
    kmask_a = " & (rk[None, :] < " + str(site.k) + ")" if need_k_mask else ""
    kmask_w = " & (rk[:, None] < " + str(site.k) + ")" if need_k_mask else ""
    if site.prologue is None:
        lines.append(
            f"    a = tl.load(a_ptr + rm[:, None] * {site.k} + rk[None, :], mask=mask_m[:, None]{kmask_a}, other=0.0)"
        )
    else:
        lines += ["    " + ln for ln in _prologue_a(site)]
    for g in weights:
        rk_w = "rk.to(tl.int64)" if index == "i64" else "rk"
        at = (
            f"{rk_w}[:, None] * {site.n} + rn[None, :]"
            if site.w_kn
            else f"rn[None, :] * {site.k} + rk[:, None]"
        )
        lines.append(
            f"    w{g} = tl.load(w{g}_ptr + {at}, "
            f"mask=mask_n[None, :]{kmask_w}, other=0.0)  # W^T tile: [BLOCK_K, BLOCK_N]"
        )
        lines.append(f"    acc{g} = tl.dot(a, w{g}, acc{g}{precision})")
    return lines


def _vec_k(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[tuple[str, str]]:
    """The dot-free form's K steps, unrolled (a row of W is a few steps at most): per step, the
    expression of its K indices and the mask of K it needs ("" where every step is whole)."""
    need_k_mask = k_offset != "0" or site.k % cfg.block_k != 0
    steps = []
    for k0 in range(0, k_extent, cfg.block_k):
        base = f"{k_offset} + {k0}" if k_offset != "0" else str(k0)
        steps.append(
            (f"{base} + tl.arange(0, BLOCK_K)", f" & (rk[None, :] < {site.k})" if need_k_mask else "")
        )
    return steps


def _vec_w_early(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[str]:
    """The dot-free form loads all of its W rows first, before the wait for the kernel before (a
    weight: no kernel writes it), so that under dependent launch a GEMV streams its weights while
    the kernel before still runs; each step's tile stays in registers until A's row is there."""
    lines = ["# this block's rows of W, every K step, before the wait (see kernel_module)"]
    for i, (rk, kmask) in enumerate(_vec_k(site, cfg, k_offset, k_extent)):
        lines.append(f"rk = {rk}")
        for g in range(len(site.weights)):
            lines.append(
                f"w{g}_{i} = tl.load(w{g}_ptr + rn[:, None] * {site.k} + rk[None, :], "
                f"mask=mask_n[:, None]{kmask}, other=0.0)  # [BLOCK_N, BLOCK_K]"
            )
    return lines


def _vec_steps(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[str]:
    """A's one row times the early-loaded W rows, summed elementwise across K steps, reduced once
    after."""
    lines = [f"part{g} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)" for g in range(len(site.weights))]
    for i, (rk, kmask) in enumerate(_vec_k(site, cfg, k_offset, k_extent)):
        lines.append(f"rk = {rk}")
        if site.prologue is None:
            lines.append(
                f"a = tl.load(a_ptr + rm[:, None] * {site.k} + rk[None, :], mask=mask_m[:, None]{kmask}, other=0.0)"
            )
        else:
            lines += _prologue_a(site)
        for g in range(len(site.weights)):
            lines.append(
                f"part{g} += w{g}_{i}.to(tl.float32) * a.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]"
            )
    lines += [f"acc{g} = tl.sum(part{g}, axis=1)[None, :]" for g in range(len(site.weights))]
    return lines


def _prologue_rows(site: Site, rk: str = "rk", xs: str = "xs") -> list[str]:
    """``xs``: the rows of ``x [+ y]`` at ``rk`` as fp32, rounded to the dtype as the add's result is."""
    pro = site.prologue
    k = site.k
    kmask = f"mask_m[:, None] & ({rk}[None, :] < {k})"
    at = f"rm[:, None] * {k} + {rk}[None, :]"
    lines = [f"{xs} = tl.load(x_ptr + {at}, mask={kmask}, other=0.0).to(tl.float32)"]
    if pro.y is not None:
        lines.append(f"{xs} = {xs} + tl.load(y_ptr + {at}, mask={kmask}, other=0.0).to(tl.float32)")
        if site.dtype in ROUND:
            lines.append(f"{xs} = {xs}.to({ROUND[site.dtype]}).to(tl.float32)")
    return lines


def _stats_chunks(k: int) -> tuple[int, int]:
    """(width, count) of the column chunks the prologue's statistics read K in."""
    width = min(STATS_CHUNK, 1 << (k - 1).bit_length())
    return width, -(-k // width)


def _prologue_stats(site: Site, write_sum: str) -> list[str]:
    """Mean and 1/std of the block's rows over all of K, as straight-line code: every chunk of
    the rows is loaded before the first sum (one memory latency, not one per chunk), the mean
    taken, then the squared deviations from the chunks already in registers. The add's result
    is written on the way where ``write_sum`` (a condition) holds."""
    k = site.k
    width, count = _stats_chunks(k)
    lines = []
    for c in range(count):
        lines.append(f"rs{c} = {c * width} + tl.arange(0, {width})")
        lines += _prologue_rows(site, f"rs{c}", f"xs{c}")
    if site.prologue.sum_out is not None:
        dt = TL_TYPE[STORAGE[site.dtype]]
        lines.append(f"if {write_sum}:")
        for c in range(count):
            lines.append(
                f"    tl.store(sum_ptr + rm[:, None] * {k} + rs{c}[None, :], xs{c}.to({dt}), "
                f"mask=mask_m[:, None] & (rs{c}[None, :] < {k}))"
            )
    lines.append(f"mean = ({' + '.join(f'tl.sum(xs{c}, axis=1)' for c in range(count))}) / {k}")
    for c in range(count):
        lines.append(f"dev{c} = tl.where(rs{c}[None, :] < {k}, xs{c} - mean[:, None], 0.0)")
    lines.append(f"var = ({' + '.join(f'tl.sum(dev{c} * dev{c}, axis=1)' for c in range(count))}) / {k}")
    lines.append(f"rstd = 1.0 / tl.sqrt(var + {site.prologue.eps!r})")
    return lines


def _prologue_a(site: Site) -> list[str]:
    """The A tile at ``rk``: the rows normalized, scaled and shifted, rounded to the dtype as the
    LayerNorm's output is (masked elements 0, so they add nothing)."""
    pro = site.prologue
    k = site.k
    lines = _prologue_rows(site)
    lines.append("a = (xs - mean[:, None]) * rstd[:, None]")
    if pro.weight is not None:
        lines.append(f"a = a * tl.load(lnw_ptr + rk, mask=rk < {k}, other=0.0).to(tl.float32)[None, :]")
    if pro.bias is not None:
        lines.append(f"a = a + tl.load(lnb_ptr + rk, mask=rk < {k}, other=0.0).to(tl.float32)[None, :]")
    lines.append(
        f"a = tl.where(mask_m[:, None] & (rk[None, :] < {k}), a, 0.0).to({TL_TYPE[STORAGE[site.dtype]]})"
    )
    return lines


def _epilogue_lines(site: Site, ep: _Epilogue) -> list[str]:
    lines = []
    for g, bias in enumerate(site.biases):
        if bias is not None:
            lines.append(
                f"acc{g} = acc{g} + tl.load(b{g}_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]"
            )
    if site.activation == "relu":
        lines.append("acc0 = tl.maximum(acc0, 0.0)")
    elif site.activation == "gelu_tanh":
        lines.append("acc0 = " + GELU_TANH.format("acc0"))
    for load in ep.loads.values():
        p = load.param
        if load.layout == "full":
            lines.append(
                f"{p}_v = tl.load({p}_ptr + rm[:, None] * {site.n} + rn[None, :], mask=mask, other=0.0).to(tl.float32)"
            )
        elif load.layout == "row":
            lines.append(f"{p}_v = tl.load({p}_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]")
        else:
            lines.append(f"{p}_v = tl.load({p}_ptr).to(tl.float32)")
    lines += ep.lines
    for i, (_, val, dtype) in enumerate(ep.stores):
        lines.append(
            f"tl.store(out{i}_ptr + rm[:, None] * {site.n} + rn[None, :], {val}.to({TL_TYPE[STORAGE[dtype]]}), mask=mask)"
        )
    return lines


def _params(site: Site, ep: _Epilogue | None, index: str, ws: str | None, part: str):
    """(params, signature, args) for ``part``: "fused", "partial" or "reduce"."""
    params: list[KernelParam] = []
    args: list[Any] = []

    def ptr(name: str, buf: str, dtype: str) -> None:
        params.append(KernelParam(name, ParamKind.PTR, dtype))
        args.append(Buf(buf))

    if part in ("fused", "partial"):
        pro = site.prologue
        if pro is None:
            ptr("a_ptr", site.a, site.dtype)
        else:
            ptr("x_ptr", pro.x, site.dtype)
            if pro.y is not None:
                ptr("y_ptr", pro.y, site.dtype)
            if pro.weight is not None:
                ptr("lnw_ptr", pro.weight, site.dtype)
            if pro.bias is not None:
                ptr("lnb_ptr", pro.bias, site.dtype)
            if pro.sum_out is not None:
                ptr("sum_ptr", pro.sum_out, site.dtype)
        for g, w in enumerate(site.weights):
            ptr(f"w{g}_ptr", w, site.dtype)
    if part == "partial":
        ptr("ws_ptr", ws, "float32")
    if part == "reduce":
        ptr("ws_ptr", ws, "float32")
    if part in ("fused", "reduce"):
        for g, b in enumerate(site.biases):
            if b is not None:
                ptr(f"b{g}_ptr", b, site.dtype)
        for buf, load in ep.loads.items():
            ptr(f"{load.param}_ptr", buf, load.dtype)
        for i, (buf, _, dtype) in enumerate(ep.stores):
            ptr(f"out{i}_ptr", buf, dtype)
    params.append(KernelParam("M", ParamKind(index), ""))
    args.append(Sym(ix.size_text(ix.parse_size(site.m))))
    return params, signature_of(params, index), args


def _rendered(site, cfg, name, kind, body, params, signature, args, outputs, grid, ops, early=()) -> Rendered:
    blocks = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    source = kernel_module(_doc(site, cfg, kind, grid), blocks, name, signature, body, early)
    m = ix.parse_size(site.m)
    elem = ITEMSIZE[site.dtype]
    pro = site.prologue
    rows = 1 if pro is None else 1 + (pro.y is not None) + (pro.sum_out is not None)  # A, or x [+ y] [+ sum]
    stored = [o for o in outputs if pro is None or o != pro.sum_out]
    traffic = (
        rows * m * site.k * elem
        + len(site.weights) * site.n * site.k * elem
        + m * site.n * elem * len(stored)
    )
    config = {
        "kind": "gemm",
        "candidate": cfg.name,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "split_k": cfg.split_k,
        "heuristic": HEURISTIC,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=tuple(args),
        outputs=tuple(outputs),
        grid=grid,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        config=config,
        ops=tuple(s.target for s in site.reference),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def _tag(site: Site) -> str:
    tag = "dual" if len(site.weights) > 1 else ("addmm" if any(site.biases) else "mm")
    tag = ("ln_" if site.prologue is not None else "") + tag
    return tag + ("_" + site.activation if site.activation else "") + ("_epilogue" if site.epilogue else "")


def _prologue_outputs(site: Site) -> list[str]:
    pro = site.prologue
    return [pro.sum_out] if pro is not None and pro.sum_out is not None else []


def _gemm_outputs(site: Site) -> tuple[str, ...]:
    """The site's outputs but the prologue's sum: what the GEMM and its epilogue write."""
    return tuple(o for o in site.outputs if o not in _prologue_outputs(site))


def _render_fused(site: Site, ep: _Epilogue, cfg: TileConfig, index: str) -> Rendered:
    grid = (_grid_rows(site.m, cfg.block_m), str(-(-site.n // cfg.block_n)))
    early, body = _opening(site, cfg, index, "0", site.k)
    if site.prologue is not None:
        body += _prologue_stats(site, "(tl.program_id(1) == 0)")
    body += _k_loop(site, cfg, "0", site.k, index) + _epilogue_lines(site, ep)
    params, signature, args = _params(site, ep, index, None, "fused")
    outputs = [buf for buf, _, _ in ep.stores] + _prologue_outputs(site)
    name = f"gemm_{_tag(site)}_{cfg.name}"
    return _rendered(site, cfg, name, "fused", body, params, signature, args, outputs, grid, (), early)


def _opening(
    site: Site, cfg: TileConfig, index: str, k_offset: str, k_extent: int, sliced: bool = False
) -> tuple[list[str], list[str]]:
    """(lines before the wait for the kernel before, the body's first lines): the block's indices
    (and K slice, ``sliced``), and for the dot-free form its rows of W, go before the wait."""
    opening = _indices(site, index)
    if sliced:
        opening.append(f"ks = tl.program_id(2){'.to(tl.int64)' if index == 'i64' else ''}")
    if cfg.dot:
        return [], opening
    return opening + _vec_w_early(site, cfg, k_offset, k_extent), []


def _render_partial(site: Site, cfg: TileConfig, index: str, ws: str) -> Rendered:
    s, g = cfg.split_k, len(site.weights)
    per_slice = -(-site.k // s)
    chunk = -(-per_slice // cfg.block_k) * cfg.block_k  # K per slice, a multiple of BLOCK_K
    grid = (_grid_rows(site.m, cfg.block_m), str(-(-site.n // cfg.block_n)), str(s))
    early, body = _opening(site, cfg, index, f"ks * {chunk}", chunk, sliced=True)
    body += _k_loop(site, cfg, f"ks * {chunk}", chunk, index)
    body.append("# each K slice writes its own slab: ws[ks, g, m, n]; the reduce kernel adds them in order")
    for gi in range(g):
        body.append(
            f"tl.store(ws_ptr + ((ks * {g} + {gi}) * M + rm[:, None]) * {site.n} + rn[None, :], acc{gi}, mask=mask)"
        )
    params, signature, args = _params(site, None, index, ws, "partial")
    name = f"gemm_{_tag(site)}_{cfg.name}_partial"
    return _rendered(
        site, cfg, name, "split-K partial sums", body, params, signature, args, [ws], grid, (), early
    )


def _render_reduce(site: Site, ep: _Epilogue, cfg: TileConfig, index: str, ws: str) -> Rendered:
    s, g = cfg.split_k, len(site.weights)
    grid = (_grid_rows(site.m, cfg.block_m), str(-(-site.n // cfg.block_n)))
    body = _indices(site, index)
    body += [f"acc{gi} = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)" for gi in range(g)]
    body.append(f"for ks in tl.static_range({s}):  # fixed order: the same bits on every run")
    for gi in range(g):
        body.append(
            f"    acc{gi} += tl.load(ws_ptr + ((ks * {g} + {gi}) * M + rm[:, None]) * {site.n} + rn[None, :], "
            f"mask=mask, other=0.0)"
        )
    body += _epilogue_lines(site, ep)
    params, signature, args = _params(site, ep, index, ws, "reduce")
    outputs = [buf for buf, _, _ in ep.stores]
    name = f"gemm_{_tag(site)}_{cfg.name}_reduce"
    return _rendered(
        site, cfg, name, "split-K reduce + epilogue", body, params, signature, args, outputs, grid, ()
    )


# ---------------------------------------------------------------------------------------------
# Buckets and the program's alternatives


def bucket_sizes(program: Program, buckets: tuple[Bucket, ...]) -> list[dict[str, int]]:
    """Every bucket combination of ``program`` (the CUDA-graph keys), as symbol → size."""
    by_symbol = {b.symbol: b.sizes for b in buckets}
    symbols = list(dict.fromkeys(s.symbol for s in program.symbols))
    if any(s not in by_symbol for s in symbols):
        return []
    return [dict(zip(symbols, combo)) for combo in itertools.product(*(by_symbol[s] for s in symbols))]


def candidate_buckets(site: Site, cfg: TileConfig, sizes: list[dict[str, int]]) -> tuple[dict[str, int], ...]:
    rows = compile_expr(ix.size_text(ix.parse_size(site.m)))
    return tuple(s for s in sizes if cfg.min_m <= rows(s) <= cfg.max_m)


def candidate_steps(
    site: Site, kernels: list[Rendered], ids: list[str], pre: tuple[Step, ...] = ()
) -> tuple[Step, ...]:
    """The candidate's kernel steps after ``pre`` (program kernels it runs first); the last
    carries the site's reference (what it replaces)."""
    steps = list(pre)
    for i, (r, kid) in enumerate(zip(kernels, ids)):
        steps.append(
            Step(
                kind=StepKind.KERNEL,
                target=kid,
                args=r.args,
                kwargs={},
                outputs=r.outputs,
                grid=r.grid,
                reference=site.reference if i == len(kernels) - 1 else (),
            )
        )
    return tuple(steps)


def add_gemm_alternatives(
    program: Program,
    buckets: tuple[Bucket, ...],
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes], int]:
    """``program`` with ``alternatives`` (and the candidates' kernels and workspaces) added.

    ``compile_kernels([(kernel id, rendered)])`` → (``{(id, arch): Result}``, ``{id: why}`` for
    those that failed); a candidate with a kernel that failed is left out."""
    from aot.codegen import kernel_id

    known = {t.name: t.spec for t in program.inputs + program.weights}
    sites = find_sites(program)
    sizes = bucket_sizes(program, buckets)
    pending = []  # (site, cfg, rendered kernels, ids, extra buffers, buckets)
    for site in sites:
        try:
            forms = render_candidates(site, program.buffers, known, ranges)
        except NoSite as e:  # pragma: no cover - find_sites checked the epilogue
            say(f"  GEMM {site.id} has no candidate: {e}")
            continue
        for cfg, kernels, extra, pre in forms:
            fit = candidate_buckets(site, cfg, sizes)
            if sizes and not fit:
                continue
            ids = [kernel_id(r.source, r.signature, r.config) for r in kernels]
            pending.append((site, cfg.name, kernels, ids, extra, fit, pre))
    from aot.codegen.flash import attention_buckets, find_attention_sites, render_attention

    taken = {i for site in sites for i in site.library}
    attention = [a for a in find_attention_sites(program) if not taken & set(a.library)]
    for site in attention:
        for cfg, kernel in render_attention(site, ranges):
            fit = attention_buckets(site, cfg, sizes)
            if sizes and not fit:
                continue
            kid = kernel_id(kernel.source, kernel.signature, kernel.config)
            pending.append((site, cfg.name, [kernel], [kid], {}, fit, ()))
    todo = {kid: r for _, _, kernels, ids, _, _, _ in pending for kid, r in zip(ids, kernels)}
    results, failed = compile_kernels(list(todo.items()))
    for (kid, arch), res in results.items():
        limit = SHARED_LIMIT.get(int("".join(c for c in arch if c.isdigit())), DEFAULT_SHARED_LIMIT)
        if kid not in failed and res.meta["shared"] > limit:
            failed[kid] = f"{arch}: needs {res.meta['shared']} bytes of shared memory, the arch has {limit}"
    for kid, why in failed.items():
        say(f"  warning: GEMM candidate kernel {todo[kid].name} ({kid}) failed to compile, left out: {why}")
    existing = {k.id for k in program.kernels}
    kernels_out: dict[str, Kernel] = {}
    cubins: dict[tuple[str, str], bytes] = {}
    buffers = dict(program.buffers)
    by_site: dict[str, list[GemmCandidate]] = {}
    for site, name, kernels, ids, extra, fit, pre in pending:
        if any(k in failed for k in ids):
            continue
        for r, kid in zip(kernels, ids):
            if kid in existing or kid in kernels_out:
                continue
            kernels_out[kid] = kernel_record(kid, r, results, archs)
            for a in archs:
                cubins[(kid, a)] = results[(kid, a)].cubin
        buffers.update(extra)
        by_site.setdefault(site.id, []).append(
            GemmCandidate(name=name, steps=candidate_steps(site, kernels, ids, pre), buckets=fit)
        )
    alternatives = tuple(
        GemmSite(
            id=site.id,
            library=site.library,
            outputs=site.outputs,
            m=ix.size_text(ix.parse_size(site.m)),
            n=site.n,
            k=site.k if isinstance(site, Site) else site.head_dim,
            candidates=tuple(by_site[site.id]),
        )
        for site in [*sites, *attention]
        if by_site.get(site.id)
    )
    new = replace(
        program,
        kernels=program.kernels + tuple(kernels_out.values()),
        buffers=buffers,
        alternatives=alternatives,
    )
    n = sum(len(s.candidates) for s in alternatives)
    n_attn = sum(s.id.startswith("attn_") for s in alternatives)
    say(
        f"  GEMM and attention candidates: {n} for {len(alternatives) - n_attn} GEMM and {n_attn} "
        f"attention sites, {len(kernels_out)} kernels "
        f"(the library steps stay the default; `aotpack tune` picks on the GPU)"
    )
    return new, cubins, len(alternatives)


# ---------------------------------------------------------------------------------------------
# Small GEMMs in the default build

# A program whose only cuBLAS call is its head (a GEMM site with small weights whose result is
# the program's output, as a CNN's classifier) runs it as a Triton kernel in the default build: a
# process that calls cuBLAS once loads it, ~98 MiB of device memory on an H100, far more than one
# small GEMM is worth. A build with --gemm-candidates leaves the choice to ``aotpack tune``.
# On an H100 (bench/results/tune-{cnn,resnet50}-library-free-*.log) the form below took 4.0-4.8
# us against cuBLAS's 4.6-7.3 for ResNet-18's 512 -> 1000 head at 1-16 rows, and 7.3-7.4 against
# 6.9-7.7 for ResNet-50's 2048 -> 1000.
SMALL_GEMM_FORM = "gemv_16x16x256"
SMALL_GEMM_ELEMENTS = 1 << 22  # the weights of the program's GEMM sites, elements in all


def small_gemm_kernels(
    program: Program,
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with its head run by a Triton kernel (``SMALL_GEMM_FORM``, its epilogue fused)
    where its only cuBLAS call is one GEMM site whose outputs are the program's and whose weights
    come to at most ``SMALL_GEMM_ELEMENTS``; else ``program`` as it is. The kernel step keeps the
    library steps as its reference (what the CPU runs)."""
    from aot.codegen import kernel_id

    sites = find_sites(program)
    in_sites = {i for s in sites for i in s.library}
    if (
        len(sites) != 1
        or sites[0].n * sites[0].k * len(sites[0].weights) > SMALL_GEMM_ELEMENTS
        or not set(sites[0].outputs) <= set(program.outputs)
        or any(calls_cublas(s) for i, s in enumerate(program.steps) if i not in in_sites)
    ):
        return program, {}
    (cfg,) = [c for c in CONFIGS if c.name == SMALL_GEMM_FORM]
    known = {t.name: t.spec for t in program.inputs + program.weights}
    forms = []
    for site in sites:
        try:
            rendered = render_candidates(site, program.buffers, known, ranges, (cfg,))
        except NoSite:
            return program, {}
        # a LayerNorm prologue site gets the plain form first: the program's LayerNorm kernel, then the GEMM
        if not rendered or rendered[0][0].name != cfg.name:
            return program, {}
        _, kernels, extra, pre = rendered[0]
        forms.append(
            (site, kernels, [kernel_id(r.source, r.signature, r.config) for r in kernels], extra, pre)
        )
    todo = {kid: r for _, kernels, ids, _, _ in forms for kid, r in zip(ids, kernels)}
    results, failed = compile_kernels(list(todo.items()))
    if failed:
        say(
            f"  warning: a small GEMM's kernel failed to compile, the GEMMs stay cuBLAS calls: {next(iter(failed.values()))}"
        )
        return program, {}
    existing = {k.id for k in program.kernels}
    kernels = {kid: kernel_record(kid, r, results, archs) for kid, r in todo.items() if kid not in existing}
    ((site, site_kernels, ids, extra, pre),) = forms
    buffers = {**program.buffers, **extra}
    # the kernel steps stand where the site's last library step was; its other steps go
    last, dropped = site.library[-1], set(site.library)
    steps = []
    for i, step in enumerate(program.steps):
        if i == last:
            steps.extend(candidate_steps(site, site_kernels, ids, pre))
        elif i not in dropped:
            steps.append(step)
    say("  the small GEMM at the end runs as a Triton kernel (no cuBLAS for this program)")
    cubins = {(kid, a): results[(kid, a)].cubin for kid in kernels for a in archs}
    return (
        replace(
            program, steps=tuple(steps), buffers=buffers, kernels=program.kernels + tuple(kernels.values())
        ),
        cubins,
    )
