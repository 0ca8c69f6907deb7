"""GEMM sites: the library GEMMs of a fused program that a Triton form may replace, with the
pointwise kernel after each (its epilogue), the second GEMM of the same input it may share loads
with (a dual GEMM, or the two halves of one stacked GEMM that kernel reads as column slices) and
the LayerNorm or row-norm (RMSNorm) kernel before it (its prologue)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import sympy

from aot.codegen import gemm_forms
from aot.codegen import index as ix
from aot.codegen.embeddings import INDEX_DTYPES, lookup_of
from aot.codegen.gemm_epilogue import Epilogue, NoSite, spec_of
from aot.codegen.gemm_forms import PROLOGUE_MAX_K, ROW_NORM_MAX_K
from aot.codegen.gemm_prologue import RowNorm, gathered_input, is_copy, lower_row_norm
from aot.codegen.kernel_source import launch_first, on_off
from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
from aot.codegen.splice import whole_slice
from aot.codegen.triton_types import FLOAT_DTYPES
from aot.program import RESHAPE_VIEWS, producer_of, readers_of, state_aliases, state_next, step_reads
from aot.schema import Buf, Program, Step, StepKind, TensorSpec

GEMM_TARGETS = ("aten.mm.default", "aten.addmm.default", "aten._addmm_activation.default")


@dataclass(frozen=True)
class Gathered:
    """A row input of a prologue that an embedding lookup writes (``embeddings.render_gather``'s
    kernel) and no other step reads, which the candidate reads from the table: row m of ``buf``
    is ``table[ids[m]]`` (a row of NaN where the id is outside the table's first ``rows``, as
    the gather kernel writes it), so the lookup's launch goes (a decode step's token and
    position lookups, before its first norm). Where a later step reads the rows too (Llama's
    first residual), the prologue writes them (``Prologue.sum_out``). ``step``: the lookup's
    kernel step, which the forms without the prologue run first."""

    buf: str
    table: str
    ids: str
    ids_dtype: str
    rows: int
    step: Step


@dataclass(frozen=True)
class Prologue:
    """A LayerNorm of A's rows over K, and the residual add before it, that a candidate computes
    as it loads A: ``A = layer_norm(x [+ y], (K,), weight, bias, eps)``. ``sum_out``: the add's
    result, which later steps read; the blocks of the first N tile write it. ``norm``: instead
    of a LayerNorm, a row norm (RMSNorm) lowered from the kernel's steps (``gemm_prologue``),
    which only the one-row forms compute; ``x``/``y`` are then its row inputs."""

    x: str
    y: str | None
    weight: str | None
    bias: str | None
    eps: float
    sum_out: str | None
    kernel: Step  # the LayerNorm kernel's step, which the forms without the prologue keep
    ln_out: str  # its LayerNorm output (A, through same-index views)
    norm: RowNorm | None = None
    gathered: tuple[Gathered, ...] = ()  # row inputs read from their lookup's table

    def lookup(self, buf: str) -> Gathered | None:
        """The lookup a row input ``buf`` is read through, or None (read as it is)."""
        return next((g for g in self.gathered if g.buf == buf), None)


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
    # the two GEMMs are the halves of one stacked weight W [2N, K] (weights[0] == weights[1]):
    # the second reads W's rows N..2N-1, so each block computes both halves of its N columns
    halves: bool = False
    # every bias is a weight, so the forms may load it before the wait for the kernel before (a
    # bias computed by a kernel before is loaded after it)
    bias_weights: bool = True
    # the site's kernels let the kernel after them start before their own wait
    # (``kernel_source.GDC_LAUNCH_FIRST``): not where the step after the site reads or writes the
    # program's state (the decode attention, which loads its cache before its wait)
    launch_first: bool = False
    # a LayerNorm prologue's column sums with W (``norm_sums``: weights ``W @ scale`` and, where
    # the LayerNorm shifts, ``W @ shift``), which the build computed for this site's one weight;
    # None where it did not
    ln_sums: tuple[str, str | None] | None = None


def _same(a: str, b: str) -> bool:
    return ix.same(ix.parse_size(a), ix.parse_size(b))


LAYER_NORM = "aten.native_layer_norm.default"
# "on": a norm kernel is a prologue through slices that keep every value too: a decode step's
# final norm and its ``hidden[:, -1:]`` (the last position of one) before the vocabulary head. Off
# by default: on an H200 (bench/results/decode/decode-gpt2-sliced-prologue-{on,off}-h200-2026-11-30-eve.json,
# GPT-2, one command) the head with the LayerNorm in its prologue took 0.2436 ms a token against
# 0.2335 with the norm kernel (batch 8: 0.415 against 0.406), one launch fewer: each of the head's
# 12,564 blocks (four rows of K 768, six waves) computes the row's statistics again before its
# products, which costs the head more than the norm kernel and its launch. Where the norm is an
# RMSNorm applied after the products (``gemm_prologue.FACTORED``, the default since 2026-12-04)
# the blocks need not wait for the statistics: Llama-3.2-1B's first 8 layers at batch 1 0.4468
# against 0.4476 ms a token (0.2% faster, 12 of 12 rounds, the same tokens; one launch fewer;
# bench/results/decode/paired-llama-3.2-1b-8layers-sliced-prologue-h200-2026-12-04c.json). Left
# off: the rule would change the vocabulary head at 2-32 rows too (its ``fewe_`` form with the
# norm in its prologue), not measured there.
SLICED_PROLOGUE_ENV = "AOTPACK_SLICED_PROLOGUE"


def through_slices() -> bool:
    """``AOTPACK_SLICED_PROLOGUE`` as read now: whether a norm prologue is found through whole
    slices (``on``) or not (unset or ``off``)."""
    return on_off(SLICED_PROLOGUE_ENV, "off")


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
    views, name, nxt, shared = [], a, reader, False
    while True:
        rd = readers.get(name, [])
        if name in program.outputs or nxt not in rd:
            return None
        p = producer.get(name)
        if p is None:
            return None
        s = steps[p]
        view = s.kind == StepKind.ATEN and (
            (s.target in RESHAPE_VIEWS and isinstance(s.args[0], Buf))
            or (whole_slice(s, program.buffers) and through_slices())
        )
        if rd != [nxt]:  # read elsewhere too: the kernel's output itself, which the site then writes
            if view:
                return None
            shared = True
        if view:
            views.append(p)
            name, nxt = s.args[0].name, p
            continue
        break
    if s.kind != StepKind.KERNEL or name not in s.outputs:
        return None
    if not s.reference or s.reference[-1].target != LAYER_NORM:
        return _row_norm_prologue(
            program, s, name, m, k, dtype, known, producer, readers, [p, *views], shared
        )
    if shared:
        return None
    alias: dict[str, str] = {}  # a reference view's (or copy's) output -> the buffer it views
    summed: dict[str, tuple[str, str]] = {}
    found = None
    for r in s.reference:
        if r.kind != StepKind.ATEN:
            return None
        if (r.target in RESHAPE_VIEWS or is_copy(r)) and isinstance(r.args[0], Buf) and len(r.outputs) == 1:
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
    root = alias.get(src.name, src.name)
    if root in summed:
        x, y = summed[root]
        if x in summed or y in summed:  # a sum of three or more (Phi, Falcon): the prologue adds two
            return None
        # the sum as the kernel hands it on: the add's result, or a copy of it (GPT-2's dropout)
        same = [o for o in s.outputs if o is not None and alias.get(o, o) == root]
        if len(same) > 1:
            return None
        sum_out = same[0] if same else None
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
    # a lookup's rows read elsewhere too are written by the prologue: x alone, as the sum it writes
    gathered, at, stored = _lookups(
        program, [x, y], p, m, known, producer, readers, y is None and not sum_out
    )
    sum_out = stored or sum_out
    prologue = Prologue(x, y, w_name, b_name, eps, sum_out, s, name, gathered=gathered)
    return prologue, sorted([p, *views, *at])


def _lookups(
    program: Program,
    rows: list[str | None],
    norm_at: int,
    m: str,
    known: dict[str, TensorSpec],
    producer: dict[str, int],
    readers: dict[str, list[int]],
    may_store: bool,
) -> tuple[tuple[Gathered, ...], list[int], str | None]:
    """The row inputs ``rows`` of the norm kernel at ``norm_at`` that a lookup's kernel writes
    (``Gathered``), the indices of those kernels' steps, and the input the prologue must write
    (read by a later step too; at most one, where ``may_store``), or None."""
    found, at, stored = [], [], None
    for buf in rows:
        g = producer.get(buf) if buf is not None else None
        looked = lookup_of(program, program.steps[g]) if g is not None else None
        if looked is None or buf in program.outputs:
            continue
        table, ids, n_rows = looked
        ids_spec = spec_of(program.buffers, known, ids)
        if ids_spec is None or ids_spec.order or ids_spec.dtype not in INDEX_DTYPES:
            continue
        if not ix.same(ix.numel(tuple(ix.parse_size(d) for d in ids_spec.shape)), ix.parse_size(m)):
            continue
        if set(readers.get(buf, ())) - {norm_at}:
            if not may_store or stored is not None:
                continue
            stored = buf
        found.append(Gathered(buf, table, ids, ids_spec.dtype, n_rows, program.steps[g]))
        at.append(g)
    return tuple(found), at, stored


def _row_norm_prologue(
    program: Program,
    s: Step,
    name: str,
    m: str,
    k: int,
    dtype: str,
    known: dict[str, TensorSpec],
    producer: dict[str, int],
    readers: dict[str, list[int]],
    replaced: list[int],
    shared: bool = False,
) -> tuple[Prologue, list[int]] | None:
    """The kernel step ``s`` (whose output ``name`` is A) as a row-norm prologue; None where its
    steps are not one (``gemm_prologue.lower_row_norm``). ``shared``: later steps read A too
    (OLMo 2's residual sum after its post-norm, which the next GEMM reads as it is): the site
    writes A as the prologue's second output, so the kernel may have no other."""
    if k > ROW_NORM_MAX_K or program.buffers[name].dtype != dtype:
        return None
    try:
        norm = lower_row_norm(s.reference, s.outputs, name, m, k, program.buffers, known)
    except NoSite:
        return None
    if shared:
        if norm.sum_out is not None:
            return None
        norm = replace(norm, sum_out=(name, norm.out, program.buffers[name].dtype))
    rows = [b for b, _ in norm.inputs]
    gathered: tuple[Gathered, ...] = ()
    if not shared:  # the row inputs a lookup writes, read from its table
        gathered, at, stored = _lookups(
            program, rows, replaced[0], m, known, producer, readers, norm.sum_out is None
        )
        for g in gathered:
            norm = gathered_input(norm, rows.index(g.buf), k)
        if stored is not None:  # the input as loaded (stage 0), written for the later step
            i = rows.index(stored)
            norm = replace(norm, sum_out=(stored, f"x{i}_@", norm.inputs[i][1]))
        replaced = sorted([*replaced, *at])
    x, y = rows[0], rows[1] if len(rows) > 1 else None
    sum_out = norm.sum_out[0] if norm.sum_out is not None else None
    prologue = Prologue(x, y, None, None, 0.0, sum_out, s, name, norm=norm, gathered=gathered)
    return prologue, replaced


@dataclass(frozen=True)
class _Flow:
    """What the site search asks of a program: its steps, the specs of its inputs and weights,
    who writes and who reads each buffer."""

    program: Program
    known: dict[str, TensorSpec]
    weights: frozenset[str]
    producer: dict[str, int]
    readers: dict[str, list[int]]
    outputs: frozenset[str]

    @classmethod
    def of(cls, program: Program) -> _Flow:
        return cls(
            program=program,
            known={t.name: t.spec for t in program.inputs + program.weights},
            weights=frozenset(w.name for w in program.weights),
            producer=producer_of(program.steps),
            readers=readers_of(program.steps),
            outputs=frozenset(program.outputs),
        )


def find_sites(program: Program) -> list[Site]:
    """The program's GEMM sites, in program order; a step belongs to at most one site: each GEMM,
    with the pointwise kernel that alone reads it as its epilogue (and a second GEMM of the same
    A that kernel reads: a dual GEMM), and the LayerNorm kernel that made its A as its prologue."""
    flow = _Flow.of(program)
    used: set[int] = set()
    sites: list[Site] = []
    first = launch_first()
    state = state_aliases(program) if first else set()
    for i in range(len(program.steps)):
        g = None if i in used else _gemm_at(flow, i)
        if g is None:
            continue
        gemms, epilogue, site_outputs, library = _with_epilogue(flow, g, used)
        halves = len(gemms) == 2 and gemms[1]["index"] == g["index"]
        prologue = None
        if len(gemms) == 1 or halves:  # one GEMM step reads A
            prologue, library, site_outputs = _with_prologue(flow, g, library, site_outputs, used)
        library = sorted(set(library))
        if set(library) & used:
            continue
        used.update(library)
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
                n=gemms[0]["n"],
                k=g["k"],
                dtype=g["dtype"],
                epilogue=epilogue,
                outputs=site_outputs,
                reference=_reference(program, library),
                prologue=prologue,
                w_kn=g["w_kn"],
                halves=halves,
                bias_weights=all(x["bias"] is None or x["bias"] in flow.weights for x in gemms),
                launch_first=first and not state_next(program, library[-1], state),
                ln_sums=_ln_sums(prologue, gemms, flow.known),
            )
        )
    return sites


def _ln_sums(
    prologue: Prologue | None, gemms: list[dict[str, Any]], known: dict[str, TensorSpec]
) -> tuple[str, str | None] | None:
    """``Site.ln_sums`` of a site of ``gemms`` after ``prologue``: the column sums of its one W
    (stored [N, K]) with the LayerNorm's scale and shift, where the build computed them."""
    if prologue is None or prologue.norm is not None or len(gemms) != 1:
        return None
    (g,) = gemms
    scale, shift = g["w"] + SCALE_SUM, g["w"] + SHIFT_SUM
    if g["w_kn"] or scale not in known or (prologue.bias is not None and shift not in known):
        return None
    return scale, shift if prologue.bias is not None else None


def _gemm_at(flow: _Flow, i: int) -> dict[str, Any] | None:
    """Step ``i`` as a GEMM a candidate can replace: ``A @ W^T`` (W a weight, through its
    permute) or ``A @ W`` (transformers' Conv1D), with its bias and activation; None otherwise."""
    program, known, producer = flow.program, flow.known, flow.producer
    steps = program.steps
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
    if b.name in flow.weights:  # A @ W with W [K, N] as stored (transformers' Conv1D)
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
            and perm.args[0].name in flow.weights
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
    alone = p is not None and flow.readers.get(b.name) == [i] and b.name not in flow.outputs
    library = ([p] if alone else []) + [i]
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


def _a_key(flow: _Flow, name: str) -> tuple:
    """Two views of one buffer with the same arguments read the same A."""
    steps = flow.program.steps
    p = flow.producer.get(name)
    if p is not None and steps[p].kind == StepKind.ATEN and steps[p].target in RESHAPE_VIEWS:
        return (
            "view",
            _a_key(flow, step_reads(steps[p])[0]) if step_reads(steps[p]) else name,
            repr(steps[p].args[1:]),
        )
    return ("buf", name)


def _with_epilogue(
    flow: _Flow, g: dict[str, Any], used: set[int]
) -> tuple[list[dict[str, Any]], tuple[Step, ...], tuple[str, ...], list[int]]:
    """The GEMM ``g`` with the pointwise kernel that alone reads its result, when that kernel's
    steps lower to an epilogue, and the second GEMM of the same A it reads (a dual GEMM): (the
    GEMMs, the epilogue's steps, the site's outputs, its library steps)."""
    steps, producer, readers = flow.program.steps, flow.producer, flow.readers
    gemms, library = [g], list(g["library"])
    rd = readers.get(g["out"], [])
    if not (
        len(rd) == 1
        and g["out"] not in flow.outputs
        and steps[rd[0]].kind == StepKind.KERNEL
        and rd[0] not in used
    ):
        return gemms, (), (g["out"],), library
    kstep = steps[rd[0]]
    halves = _halves(flow, g, kstep)
    if halves is not None:
        candidate_gemms, epilogue = halves
        try:
            Epilogue(
                [x["out"] for x in candidate_gemms], g["m"], g["n"] // 2, flow.program.buffers, flow.known
            ).lower(epilogue, kstep.outputs)
        except NoSite:
            return gemms, (), (g["out"],), library
        library.append(rd[0])
        return candidate_gemms, epilogue, tuple(o for o in kstep.outputs if o is not None), library
    extra = []
    for r in dict.fromkeys(step_reads(kstep)):
        j = producer.get(r)
        if r == g["out"] or j is None or j in used or j == g["index"]:
            continue
        other = _gemm_at(flow, j)
        if (
            other is not None
            and not other["activation"]
            and readers.get(other["out"]) == [rd[0]]
            and other["out"] not in flow.outputs
            and _a_key(flow, other["a"]) == _a_key(flow, g["a"])
            and (other["n"], other["k"], other["dtype"], other["w_kn"])
            == (g["n"], g["k"], g["dtype"], g["w_kn"])
            and not g["activation"]
            and not set(other["library"]) & set(library)
        ):
            extra.append(other)
    candidate_gemms = gemms + extra[:1]
    try:
        Epilogue([x["out"] for x in candidate_gemms], g["m"], g["n"], flow.program.buffers, flow.known).lower(
            kstep.reference, kstep.outputs
        )
    except NoSite:
        return gemms, (), (g["out"],), library
    for x in extra[:1]:
        library += x["library"]
    library.append(rd[0])
    return candidate_gemms, kstep.reference, tuple(o for o in kstep.outputs if o is not None), library


def _halves(
    flow: _Flow, g: dict[str, Any], kstep: Step
) -> tuple[list[dict[str, Any]], tuple[Step, ...]] | None:
    """Where the kernel ``kstep`` reads the stacked GEMM ``g``'s result only as its two column
    halves (``slice(C, 1, 0, N/2)`` and ``slice(C, 1, N/2, N)``: gate and up stacked by
    ``sibling_matmuls``; or ``split_with_sizes(view(C, [..., N]), [N/2, N/2], -1)``: Phi-3's
    ``gate_up_proj`` output chunked): the two halves as GEMMs of N/2 columns over the same weight,
    and the kernel's other steps (its epilogue); else None."""
    if not gemm_forms.STACKED_HALVES_EPILOGUE:
        return None
    if g["w_kn"] or g["bias"] is not None or g["activation"] or g["n"] % 2:
        return None
    h = g["n"] // 2
    cut: dict[tuple[int, int], str] = {}
    rest = []
    rows = {g["out"]: 2}  # C and the views of it the kernel makes (each ending in N): their rank
    for r in kstep.reference:
        read = [a.name for a in r.args if isinstance(a, Buf) and a.name in rows]
        if not read:
            rest.append(r)
            continue
        if r.kind != StepKind.ATEN or r.kwargs or len(read) != 1 or r.args[0] != Buf(read[0]):
            return None
        rank = rows[read[0]]
        last = (rank - 1, -1)
        shape = r.args[1] if len(r.args) > 1 else None
        if r.target in RESHAPE_VIEWS and isinstance(shape, list) and shape and shape[-1] == 2 * h:
            rows[r.outputs[0]] = len(shape)  # a view keeping the rows of N: its halves are C's
        elif (
            r.target == "aten.slice.Tensor" and len(r.args) == 4 and r.args[1] in last and len(r.outputs) == 1
        ):
            if (r.args[2], r.args[3]) not in ((0, h), (h, 2 * h)):
                return None
            cut[(r.args[2], r.args[3])] = r.outputs[0]
        elif (
            r.target == "aten.split_with_sizes.default"
            and list(r.args[1:]) in ([[h, h], rank - 1], [[h, h], -1])
            and len(r.outputs) == 2
            and None not in r.outputs
        ):
            cut[(0, h)], cut[(h, 2 * h)] = r.outputs
        else:
            return None
    if len(cut) != 2:
        return None
    first = dict(g, n=h, out=cut[(0, h)])
    second = dict(g, n=h, out=cut[(h, 2 * h)])
    return [first, second], tuple(rest)


def _with_prologue(
    flow: _Flow, g: dict[str, Any], library: list[int], site_outputs: tuple[str, ...], used: set[int]
) -> tuple[Prologue | None, list[int], tuple[str, ...]]:
    """The LayerNorm kernel that made ``g``'s A, as a prologue, where the site can take its place:
    (the prologue or None, the library steps, the site's outputs) with it."""
    found = _prologue(
        flow.program, g["a"], g["m"], g["k"], g["dtype"], flow.known, flow.producer, flow.readers, g["index"]
    )
    if found is None or set(found[1]) & used:
        return None, library, site_outputs
    prologue, before = found
    # the candidate writes the add's result where the site's last step was: nothing the site
    # leaves in between may read it; nor may its own epilogue (the first N tile writes the sum
    # that the other tiles' epilogues would read, in no set order: ``h + W @ norm(h)``)
    kept = set(range(before[0] + 1, max(library) + 1)) - set(before) - {g["index"]}  # the GEMM reads A
    if prologue.sum_out is not None and set(flow.readers.get(prologue.sum_out, ())) & kept:
        return None, library, site_outputs
    if prologue.sum_out is not None:
        site_outputs = (*site_outputs, prologue.sum_out)
    return prologue, library + before, site_outputs


def _reference(program: Program, library: list[int]) -> tuple[Step, ...]:
    """What a site's library steps compute, as ATen steps (a kernel's by its reference)."""
    reference: list[Step] = []
    for j in library:
        step = program.steps[j]
        reference.extend(step.reference if step.kind == StepKind.KERNEL else (step,))
    return tuple(reference)
