"""GEMM candidates: Triton forms of a program's library GEMMs, with their epilogues fused.

``aotpack build --gemm-candidates`` runs this on the fused program. A *site* is a library GEMM
whose second operand is a transposed weight (``permute(W, [1, 0])``, ``W: [N, K]`` static) or a
weight as stored (``W: [K, N]``, transformers' Conv1D; no one-row forms, which read W along K):
``aten.mm``, ``aten.addmm`` (bias ``[N]``) or ``aten._addmm_activation`` (bias + ReLU or tanh-GELU),
and, when the GEMM's result is read only by one pointwise kernel, that kernel too: its reference
steps become the GEMM's epilogue (GELU/tanh-GELU/ReLU/SiLU/sigmoid/tanh, add/sub/mul/div with an
``[M, N]`` or ``[N]`` tensor such as a residual, dtype casts). When that kernel also reads a second
GEMM of the same input ``A`` (the Llama MLP's ``silu(A @ Wg^T) * (A @ Wu^T)``), both GEMMs run in one
kernel that shares the loads of ``A`` (a *dual* GEMM) and the product is its epilogue; the same
where the two GEMMs were stacked into one (``sibling_matmuls``) and the kernel reads its two
column halves (each block computes W's rows j and N/2 + j). A LayerNorm kernel, or a row-norm
(RMSNorm) kernel, that made ``A`` (with a residual add before it or not) is the site's prologue:
forms that normalize A's rows as they load them, the sum written by the first N tile
(``gemm_prologue`` lowers a row norm from its kernel's reference steps).

Each site gets one candidate per tile config (``CONFIGS``: dot-free one-row forms and skinny-M
tiles for decode and batch 1, a middle and a large tile) plus deterministic split-K forms: a first
kernel writes each K slice's fp32 partial sums to its own slab of a workspace, a second adds the
slabs in a fixed order and applies the epilogue; no atomics, so two runs give the same bits. A
candidate is compiled like every kernel (``compile``: same cache, same determinism) and lists the
bucket sizes it is meant for.

The program keeps its library steps; ``Program.alternatives`` records, per site, the indices of
the steps a candidate replaces and the candidate's kernel steps, whose ``reference`` is exactly
those steps (the kernel of an absorbed epilogue expanded to its own reference). ``aotpack tune``
chooses on the target GPU; a default build's built-in table (``gemm_defaults``) chooses the forms
it compiled on sm_90, and every other bucket and arch runs the library steps.

This module adds the candidates to a program (and runs a small head as a kernel in the default
build); its parts: ``gemm_sites`` finds the sites, ``gemm_epilogue`` lowers their epilogues,
``gemm_prologue`` their row-norm prologues, ``gemm_forms`` holds the forms and their knobs,
``gemm_render`` writes the kernels, ``gemm_pairs`` joins two sites of a default build where a row
norm sits between them (the first's split-K reduce runs the norm; ``AOTPACK_REDUCE_NORM=off``
keeps them apart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from aot.buckets import bucket_sizes
from aot.codegen import gemm_pairs, gemm_render
from aot.codegen import index as ix
from aot.codegen.flash import AttnSite, attention_buckets, find_attention_sites, render_attention
from aot.codegen.gemm_defaults import built_in_configs
from aot.codegen.gemm_epilogue import NoSite
from aot.codegen.gemm_forms import (
    CONFIGS,
    FEW_ROW_CONFIGS,
    TileConfig,
    base_form,
    config_name,
)
from aot.codegen.gemm_render import render_candidates
from aot.codegen.gemm_sites import Site, find_sites
from aot.codegen.render import Rendered, kernel_id, kernel_record, kernel_step
from aot.program import calls_cublas
from aot.schema import Bucket, GemmCandidate, GemmSite, Kernel, Program, Step
from aot.symexpr import compile_expr
from aot.tuning import ATTENTION_SITE


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
        steps.append(kernel_step(kid, r, site.reference if i == len(kernels) - 1 else ()))
    return tuple(steps)


def _joined(
    program: Program, sites: list[Site], pending: list[gemm_pairs.Pending], known: dict, ranges: dict
) -> list[tuple[gemm_pairs.Pair, list[gemm_pairs.Joined]]]:
    """``gemm_pairs``: each pair of sites whose forms join, with its candidates."""
    out = []
    for pair in gemm_pairs.find_pairs(program, sites):
        forms = gemm_pairs.join(
            pair,
            [e for e in pending if e.site.id == pair.first.id],
            [e for e in pending if e.site.id == pair.second.id],
            program.buffers,
            known,
            ranges,
        )
        if forms:
            out.append((pair, forms))
    return out


def add_gemm_alternatives(
    program: Program,
    buckets: tuple[Bucket, ...],
    ranges: dict[str, tuple[int, int]],
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
    pick: Callable[[Site], tuple[str, ...]] | None = None,
    pick_attention: Callable[[AttnSite, int], str | None] | None = None,
    configs: tuple[TileConfig, ...] | None = None,
) -> tuple[Program, dict[tuple[str, str], bytes], int]:
    """``program`` with ``alternatives`` (and the candidates' kernels and workspaces) added.

    ``compile_kernels([(kernel id, rendered)])`` → (``{(id, arch): Result}``, ``{id: why}`` for
    those that failed); a candidate with a kernel that failed is left out. ``pick``: only the
    forms it names per GEMM site (a split-K config by its name: ``few_splitk_16x16x512`` for
    ``few_splitk4_16x16x512``), each at the buckets its config's rows admit, and attention sites
    only where ``pick_attention`` names a form for them (``(site, query length) -> form or None``),
    each form at the buckets it is named for: the default build's forms,
    ``aot.codegen.gemm_defaults``; ``configs``: the configs ``pick``'s names refer to (None:
    ``CONFIGS`` and ``FEW_ROW_CONFIGS``)."""
    known = {t.name: t.spec for t in program.inputs + program.weights}
    sites = find_sites(program)
    sizes = bucket_sizes(program, buckets)
    pending: list[gemm_pairs.Pending] = []
    for site in sites:
        chosen = pick(site) if pick is not None else ()
        if pick is not None and not chosen:
            continue
        bases = {base_form(c) for c in chosen}
        every = configs if configs is not None else (*CONFIGS, *FEW_ROW_CONFIGS)
        named = tuple(c for c in every if c.name in bases) if chosen else None
        if (
            pick is None and configs is None
        ):  # a candidates build: also the built-in entry's forms CONFIGS lacks
            more = tuple(c for c in built_in_configs(site) if not sizes or candidate_buckets(site, c, sizes))
            named = (*gemm_render.CONFIGS, *more) if more else None  # the set render_candidates takes
        if chosen and sizes:  # a named form no bucket takes is not rendered
            named = tuple(c for c in named if candidate_buckets(site, c, sizes))
        try:
            forms = render_candidates(site, program.buffers, known, ranges, named)
        except NoSite as e:  # pragma: no cover - find_sites checked the epilogue
            say(f"  GEMM {site.id} has no candidate: {e}")
            continue
        for cfg, kernels, extra, pre in forms:
            if chosen and config_name(cfg.name) not in chosen:
                continue  # a prologue site's other form
            fit = candidate_buckets(site, cfg, sizes)
            if (sizes or chosen) and not fit:
                continue  # a named form no bucket takes is not compiled
            ids = [kernel_id(r.source, r.signature, r.config) for r in kernels]
            pending.append(gemm_pairs.Pending(site, cfg.name, kernels, ids, extra, fit, pre, cfg))

    taken = {i for site in sites for i in site.library}
    attention = (
        [a for a in find_attention_sites(program) if not taken & set(a.library)]
        if pick is None or pick_attention is not None
        else []
    )
    for site in attention:
        seq = compile_expr(ix.size_text(ix.parse_size(site.seq)))
        for cfg, kernel in render_attention(site, ranges):
            fit = attention_buckets(site, cfg, sizes)
            if pick_attention is not None:  # the forms named, each at the buckets it is named for
                fit = tuple(s for s in fit if pick_attention(site, seq(s)) == cfg.name)
                if not fit:
                    continue
            if sizes and not fit:
                continue
            kid = kernel_id(kernel.source, kernel.signature, kernel.config)
            pending.append(gemm_pairs.Pending(site, cfg.name, [kernel], [kid], {}, fit, (), cfg))
    joined = (
        _joined(program, sites, pending, known, ranges) if pick is not None and gemm_pairs.enabled() else []
    )
    todo = {kid: r for e in pending for kid, r in zip(e.ids, e.kernels)}
    todo.update({kid: r for _, forms in joined for j in forms for kid, r in j.kernels()})
    results, failed = compile_kernels(list(todo.items()))
    for kid, why in failed.items():
        say(f"  warning: GEMM candidate kernel {todo[kid].name} ({kid}) failed to compile, left out: {why}")
    # a pair whose every form compiled replaces its two sites; else the two stay
    joined = [
        (p, forms) for p, forms in joined if not any(k in failed for j in forms for k, _ in j.kernels())
    ]
    apart = {s.id for p, _ in joined for s in (p.first, p.second)}
    existing = {k.id for k in program.kernels}
    kernels_out: dict[str, Kernel] = {}
    cubins: dict[tuple[str, str], bytes] = {}
    buffers = dict(program.buffers)
    by_site: dict[str, list[GemmCandidate]] = {}

    def record(kernels: list[tuple[str, Rendered]]) -> None:
        for kid, r in kernels:
            if kid in existing or kid in kernels_out:
                continue
            kernels_out[kid] = kernel_record(kid, r, results, archs)
            for a in archs:
                cubins[(kid, a)] = results[(kid, a)].cubin

    for site, name, kernels, ids, extra, fit, pre, _ in pending:
        if any(k in failed for k in ids) or site.id in apart:
            continue
        record(list(zip(ids, kernels)))
        buffers.update(extra)
        by_site.setdefault(site.id, []).append(
            GemmCandidate(name=name, steps=candidate_steps(site, kernels, ids, pre), buckets=fit)
        )
    for _, forms in joined:
        for j in forms:
            record(j.kernels())
            buffers.update(j.extra)
            by_site.setdefault(j.pair.id, []).append(
                GemmCandidate(name=j.name, steps=j.steps(), buckets=j.buckets)
            )
    pairs = {p.first.id: p for p, _ in joined}
    alternatives = tuple(
        GemmSite(
            id=site.id,
            library=site.library,
            outputs=site.outputs,
            m=ix.size_text(ix.parse_size(site.m)),
            n=site.n,
            k=site.head_dim if isinstance(site, AttnSite) else site.k,
            candidates=tuple(by_site[site.id]),
        )
        for site in [*(pairs.get(s.id, s) for s in sites if s.id not in apart or s.id in pairs), *attention]
        if by_site.get(site.id)
    )
    new = replace(
        program,
        kernels=program.kernels + tuple(kernels_out.values()),
        buffers=buffers,
        alternatives=alternatives,
    )
    n = sum(len(s.candidates) for s in alternatives)
    n_attn = sum(s.id.startswith(ATTENTION_SITE) for s in alternatives)
    if pick is None:  # the default forms say what they do where the table is made
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
