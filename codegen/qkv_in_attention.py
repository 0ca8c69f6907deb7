"""The q/k/v projection's K slices summed in the decode attention kernel: one launch less a layer.

At 2-16 rows (a decode step at batch 2-16) the default forms run a q/k/v projection of a long K
in K slices (``gemm_defaults``: split-K): a partial kernel writes each slice's fp32 sums, a
reduce kernel adds them in slice order and stores q, k and v, and then the decode attention
kernel (``aot.codegen.decode_attention``) loads them. The reduce holds no work of its own worth
a launch (Llama-3.2-1B at 8 rows: 3 slices of 8 x 3072 sums), so here the attention kernel loads
the slices and adds them as the reduce does (the same order from 0.0, the same rounding to the
site's dtype: the same bits, ``render_decode_attention_summing``), and the reduce goes.

A GEMM site's candidates replace its library steps and nothing else, and the attention kernel is
a step of the program, not of the projection's site. So the site takes the attention step (and
the views between them) into its library: every candidate of it then runs the attention after
its own steps, its views folded into the attention step's reference, and a candidate whose last
kernel is a plain split-K reduce of the rows the attention reads (no epilogue: no bias, no
activation; ``[slices, 1, M, N]`` partials with M the attention's batch and N each row's stride)
runs the summing attention in the reduce's place, standing for both. The site is taken only where
nothing but the attention step and those views reads the projection's rows, and where every
candidate still fits ``MAX_CANDIDATE_STEPS``; a summing kernel that fails to compile leaves the
site as it was. ``AOTPACK_QKV_IN_ATTENTION`` ("on"/"off") overrides ``ENABLED`` at build time.

Measured on an H200 (2026-12-04, Llama-3.2-1B's first 8 layers at batch 8, both bundles with the
RMSNorm statistics join, ``bench/decode_paired.py``, 12 rounds;
``bench/results/decode/paired-llama-3.2-1b-8layers-qkv-in-attention-h200-2026-12-04b.json``): 0.5300
ms a token against 0.5261 without it, slower in 12 of 12 rounds, 55 launches a step against 63,
the same greedy tokens (the same bits); ``aotpack verify`` passes. So it is off: each of the 64
attention programs loads its q, k and v (and their rotary partners) as three fp32 slices from L2
after its wait, on the step's critical path, where the reduce spread that over 48 programs and
stored half-precision rows; a launch less (1.2 us) did not pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from aot.codegen import attention_tail
from aot.codegen import index as ix
from aot.codegen.attention_tail import tail_kernel
from aot.codegen.decode_attention import max_rows
from aot.codegen.decode_attention_render import (
    Slices,
    render_decode_attention_summing,
    render_decode_attention_tail,
    row_sources,
)
from aot.codegen.decode_sites import DecodeSite
from aot.codegen.kernel_source import on_off
from aot.codegen.render import Rendered, compile_site_kernels, kernel_step
from aot.program import VIEW_OPS, readers_of, step_writes
from aot.schema import Buf, GemmCandidate, GemmSite, Kernel, Program, Step, StepKind, Sym, TensorSpec
from aot.tuning import MAX_CANDIDATE_STEPS

ENABLED = "off"  # measured slower: the module docstring
ENV = "AOTPACK_QKV_IN_ATTENTION"


def enabled() -> bool:
    return on_off(ENV, ENABLED)


@dataclass(frozen=True)
class _Taken:
    """A GEMM site (``index`` in ``Program.alternatives``) that takes the attention step ``step``
    and the views ``between``; the attention's site and whether its kernel launches first."""

    index: int
    step: int
    between: tuple[int, ...]
    site: DecodeSite
    after: bool
    rows: str


def qkv_in_attention(
    program: Program,
    one_kernel: dict[str, tuple[DecodeSite, bool]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
    ranges: dict[str, tuple[int, int]] | None = None,
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each q/k/v projection site that feeds a one-kernel decode attention
    (``one_kernel``: ``decode_attention_kernels``') taking that attention in (module docstring):
    its split-K candidates summing in the attention where ``enabled()``, its one-row GEMVs running
    the attention at their end where ``attention_tail.enabled()`` (``ranges``: symbol -> (min,
    max), the largest batch sizing the tail's counters)."""
    summing, tail = enabled(), attention_tail.enabled()
    if not (summing or tail) or not one_kernel or not program.alternatives:
        return program, {}
    taken = _taken(program, one_kernel)
    kernels = {k.id: k for k in program.kernels}
    # each taken site's candidates, with the kernel that stands for its last step and the
    # attention (None: the attention after the candidate's steps) and whether that kernel is a
    # tail (it counts on the site's counters, ``counters``) or sums K slices
    forms: dict[int, list[tuple[GemmCandidate, Rendered | None, bool]]] = {}
    counters: dict[int, tuple[str, TensorSpec]] = {}
    for t in taken:
        site = program.alternatives[t.index]
        rows = max_rows(t.site, ranges or {}) if tail else None
        counts = f"{t.site.out}_tail_arrivals"
        tail_attention = (
            render_decode_attention_tail(t.site, attention_tail.max_block_n()) if rows is not None else None
        )
        out = []
        for cand in site.candidates:
            joined, is_tail = None, False
            if summing and (slices := _slices(program, kernels, cand.steps[-1], t)):
                joined = render_decode_attention_summing(t.site, slices, t.after)
            elif tail_attention is not None and cand.steps[-1].target in kernels:
                last = cand.steps[-1]  # the q/k/v GEMV (after the site it is joined with, if any)
                width = program.buffers[t.rows].shape[-1]  # the rows' columns: q | k | v
                if width.isdigit():
                    joined = tail_kernel(
                        kernels[last.target], last, int(width), tail_attention, t.site, counts
                    )
                if joined is not None:
                    is_tail = True
                    counters[t.index] = (counts, TensorSpec("int32", (str(rows * t.site.kv_heads),)))
            if joined is None and len(cand.steps) + 1 > MAX_CANDIDATE_STEPS:
                out = []
                break
            out.append((cand, joined, is_tail))
        if any(joined is not None for _, joined, _ in out):
            forms[t.index] = out
    rendered = [r for out in forms.values() for _, r, _ in out if r is not None]
    if not rendered:
        return program, {}
    built = compile_site_kernels(
        program, rendered, archs, compile_kernels, say, "decode attention", "the site keeps its kernels"
    )
    ids = iter(built.ids)
    alternatives = list(program.alternatives)
    summed = tails = 0
    scratch: dict[str, TensorSpec] = {}  # the counters of the sites whose tails were taken
    for t in taken:
        if t.index not in forms:
            continue
        site, attention = program.alternatives[t.index], program.steps[t.step]
        views = tuple(program.steps[j] for j in t.between)
        candidates, failed, fused = [], False, 0
        for cand, joined, is_tail in forms[t.index]:
            if joined is None:  # the attention after the candidate's steps, the views its reference's
                after = replace(attention, reference=(*views, *attention.reference))
                candidates.append(replace(cand, steps=(*cand.steps, after)))
                continue
            kid = next(ids)
            failed |= kid in built.failed
            last = cand.steps[-1]
            step = kernel_step(
                kid, joined, (*last.reference, *views, *attention.reference), attention.in_place
            )
            candidates.append(replace(cand, steps=(*cand.steps[:-1], step)))
            fused += not is_tail
        if failed:
            continue
        summed += fused
        if t.index in counters:
            tails += 1
            scratch.update([counters[t.index]])
        alternatives[t.index] = GemmSite(
            id=site.id,
            library=tuple(sorted({*site.library, *t.between, t.step})),
            outputs=(*(o for o in site.outputs if o != t.rows), *step_writes(attention)),
            m=site.m,
            n=site.n,
            k=site.k,
            candidates=tuple(candidates),
        )
    used = {s.target for site in alternatives for c in site.candidates for s in c.steps}
    records: dict[str, Kernel] = {k: r for k, r in built.records.items() if k in used}
    if summed:
        say(
            f"  {summed} q/k/v projections' K slices summed in their decode attention kernels (the reduce's launch gone)"
        )
    if tails:
        say(f"  {tails} one-row q/k/v GEMVs run their decode attention at their end (its launch gone)")
    out = replace(
        program,
        alternatives=tuple(alternatives),
        kernels=program.kernels + tuple(records.values()),
        buffers={**program.buffers, **scratch},
        scratch=(*program.scratch, *scratch),
    )
    return out, {key: cubin for key, cubin in built.cubins.items() if key[0] in records}


def _taken(program: Program, one_kernel: dict[str, tuple[DecodeSite, bool]]) -> list[_Taken]:
    """The GEMM sites that may take a one-kernel decode attention step in (module docstring)."""
    readers = readers_of(program.steps)
    by_output = {o: n for n, s in enumerate(program.alternatives) for o in s.outputs}
    out = []
    for i, step in enumerate(program.steps):
        if step.kind != StepKind.KERNEL or not step.outputs or step.outputs[0] not in one_kernel:
            continue
        site, after = one_kernel[step.outputs[0]]
        bases = {r.base for r in row_sources(site)}
        if len(bases) != 1:
            continue
        (rows,) = bases
        n = by_output.get(rows)
        if n is None:
            continue
        gemm = program.alternatives[n]
        between = tuple(range(gemm.library[-1] + 1, i))
        if any(
            program.steps[j].kind != StepKind.ATEN or program.steps[j].target not in VIEW_OPS for j in between
        ):
            continue
        inside = {*gemm.library, *between, i}
        handed = [rows, *(o for j in between for o in step_writes(program.steps[j]))]
        if any(set(readers.get(b, ())) - inside or b in program.outputs for b in handed):
            continue  # the rows, or a view of them, read past the attention
        out.append(_Taken(n, i, between, site, after, rows))
    return out


def _slices(program: Program, kernels: dict[str, Kernel], last: Step, t: _Taken) -> Slices | None:
    """The partials ``last`` sums where it is a plain split-K reduce of the rows ``t``'s attention
    reads and they fit its loads (module docstring); else None."""
    kernel = kernels.get(last.target)
    if kernel is None or kernel.config.get("kind") != "gemm" or not kernel.name.endswith("_reduce"):
        return None
    split = kernel.config.get("split_k", 1)
    if split < 2 or len(last.args) != 3 or last.args[1] != Buf(t.rows):
        return None
    ws, m = last.args[0], last.args[2]
    if not isinstance(ws, Buf) or not isinstance(m, Sym):
        return None
    spec = program.buffers.get(ws.name)
    if spec is None or spec.dtype != "float32" or len(spec.shape) != 4:
        return None
    slices, weights, rows, width = spec.shape
    if (slices, weights) != (str(split), "1") or not width.isdigit():
        return None
    if ix.parse_size(rows) != ix.parse_size(t.site.batch) or ix.parse_size(m.text) != ix.parse_size(rows):
        return None
    if any(r.batch_stride != int(width) for r in row_sources(t.site)):
        return None
    return Slices(ws.name, split, int(width))
