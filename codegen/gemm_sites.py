"""GEMM sites: the library GEMMs of a fused program that a Triton form may replace, with the
pointwise kernel after each (its epilogue), the second GEMM of the same input it may share loads
with (a dual GEMM) and the LayerNorm kernel before it (its prologue)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy

from aot.codegen import index as ix
from aot.codegen.gemm_epilogue import Epilogue, NoSite, spec_of
from aot.codegen.gemm_forms import PROLOGUE_MAX_K
from aot.codegen.triton_types import FLOAT_DTYPES
from aot.program import RESHAPE_VIEWS, producer_of, readers_of, step_reads
from aot.schema import Buf, Program, Step, StepKind, TensorSpec

GEMM_TARGETS = ("aten.mm.default", "aten.addmm.default", "aten._addmm_activation.default")


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


def _same(a: str, b: str) -> bool:
    return ix.same(ix.parse_size(a), ix.parse_size(b))


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
        if s.kind == StepKind.ATEN and s.target in RESHAPE_VIEWS and isinstance(s.args[0], Buf):
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
        if r.target in RESHAPE_VIEWS and isinstance(r.args[0], Buf) and len(r.outputs) == 1:
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
    if not all(_row_major_rows(spec_of(program.buffers, known, b), m, k, dtype) for b in rows):
        return None
    w_name = weight.name if weight is not None else None
    b_name = bias.name if bias is not None else None
    return Prologue(x, y, w_name, b_name, eps, sum_out, s, name), [p, *views]


def find_sites(program: Program) -> list[Site]:
    """The program's GEMM sites, in program order; a step belongs to at most one site."""
    steps = program.steps
    known = {t.name: t.spec for t in program.inputs + program.weights}
    weights = {w.name for w in program.weights}
    readers = readers_of(steps)
    producer = producer_of(steps)
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
            spec_of(program.buffers, known, a.name),
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
            bspec = spec_of(program.buffers, known, bias)
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
        if p is not None and steps[p].kind == StepKind.ATEN and steps[p].target in RESHAPE_VIEWS:
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
                Epilogue([x["out"] for x in candidate_gemms], g["m"], g["n"], program.buffers, known).lower(
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
