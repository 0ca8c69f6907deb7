"""Codegen stage: ``Traced`` → ``Compiled``.

Partitions the ATen program into fusion groups (``partition``), renders each group as a Triton
kernel (``render``), and compiles every distinct kernel once per target arch to a cubin
(``compile``; no GPU needed). The program it hands on has one ``kernel`` step per group: the
kernel's runtime arguments (root buffers and dim symbols), its launch grid, and its reference
decomposition, the ATen steps it replaces. A kernel that fails to compile falls back to those
steps; an op the fuser does not know stays an ATen step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aot.archs import parse_arch, shared_limit
from aot.codegen.gemm_defaults import (
    DEFAULT_ARCH,
    default_attention_form,
    default_configs,
    default_site_forms,
    default_table,
    one_row_forms,
)
from aot.errors import CodegenError, counted
from aot.schema import BuildStats, Program, StepKind
from aot.stages import DEFAULT_ARCHS, BuildOptions, Compiled, Traced
from aot.tuning import ATTENTION_SITE

PROGRESS_INTERVAL = 1.0  # seconds between progress lines while compiling


def parse_archs(text: str) -> tuple[str, ...]:
    """``"sm_80,sm_90a"`` (or ``"80,90a"``) → ``("sm_80", "sm_90a")``, validated."""
    try:
        archs = tuple(dict.fromkeys(parse_arch(a).name for a in text.split(",") if a.strip()))
    except ValueError:
        archs = ()
    if not archs:
        raise CodegenError(f"--arch expects a comma list like sm_80,sm_90; got {text!r}")
    return archs


def compile_kernels(
    rendered: dict[str, Any], archs: tuple[str, ...], say: Callable[[str], None], what: str = "kernel"
) -> tuple[dict[tuple[str, str], Any], dict[str, str], int]:
    """Compile each rendered kernel (id → ``Rendered``) for every arch, through the kernel cache.
    Returns the results by (id, arch), why each kernel that cannot be launched failed (a compiler
    error, scratch memory the launcher does not pass, more shared memory than the arch has
    (``aot.archs.SHARED_LIMIT``), PTX entries that differ across archs), and
    how many compiles came from the cache. Never raises for a kernel: its steps stay library calls."""
    from aot.codegen.compile import Job, compile_job

    jobs = [
        Job(k, r.name, r.source, r.signature, r.num_warps, r.num_stages, a)
        for k, r in rendered.items()
        for a in archs
    ]
    results, failed, hits = {}, {}, 0
    last = 0.0
    cache_warned = False
    for n, job in enumerate(jobs, 1):
        try:
            res = compile_job(job)
            if res.cache_error and not cache_warned:
                say(f"  warning: the kernel cache cannot be written ({res.cache_error}); building without it")
                cache_warned = True
            scratch = res.meta["global_scratch_size"], res.meta["profile_scratch_size"]
            if scratch != (0, 0):
                raise CodegenError(f"kernel needs scratch memory {scratch}; the launcher passes none")
            limit = shared_limit(job.arch)
            if res.meta["shared"] > limit:  # it would compile, and never launch there
                raise CodegenError(f"needs {res.meta['shared']} bytes of shared memory, the arch has {limit}")
            results[(job.kernel_id, job.arch)] = res
            hits += res.cached
        except Exception as e:  # any compiler failure: this kernel's steps stay ATen calls
            failed.setdefault(job.kernel_id, f"{job.arch}: {type(e).__name__}: {str(e).strip()[:300]}")
        now = time.perf_counter()
        if n == len(jobs) or now - last >= PROGRESS_INTERVAL:
            say(
                f"  compiling {counted(len(rendered), what)} × {counted(len(archs), 'arch')}: "
                f"{n}/{len(jobs)} ({hits} cached)"
            )
            last = now
    for k, r in rendered.items():  # every arch must agree on the entry point the launcher looks up
        metas = [results[(k, a)].meta for a in archs if (k, a) in results]
        if k not in failed and (
            {m["name"] for m in metas} != {r.name} or len({m["ptx_params"] for m in metas}) != 1
        ):
            failed[k] = f"PTX entries differ across archs: {[(m['name'], m['ptx_params']) for m in metas]}"
    return results, failed, hits


def generate(
    traced: Traced,
    archs: tuple[str, ...] = DEFAULT_ARCHS,
    progress: Callable[[str], None] | None = None,
    fuse: bool = True,
    gemm_candidates: bool = False,
    stack_siblings: bool = True,
    channels_last: bool = True,
    decode_attention: bool = True,
    library_free: bool = False,
) -> Compiled:
    """Fuse and compile ``traced``'s program for ``archs``; ``fuse=False`` keeps every ATen step.
    ``gemm_candidates``: also compile Triton candidates for the library GEMMs
    (``Program.alternatives``, ``aot.codegen.gemm``); the program's steps stay as without it.
    ``stack_siblings=False`` keeps sibling matmuls apart (``aot.codegen.sibling_matmuls``): with
    candidates, a gated MLP's gate and up then get a dual-GEMM candidate, but the library steps
    (an untuned bundle, and every bucket where tune keeps the library) launch one GEMM per
    sibling. ``channels_last=False`` keeps every tensor row-major (``aot.codegen.layouts``).
    ``library_free`` (with ``gemm_candidates``): every site runs a Triton candidate, and a step no
    form covers is a ``CodegenError`` (``aot.codegen.library_free``); with sm_90 among ``archs``,
    the one-row buckets run the built-in table's GEMV forms, as a default build's do (its table
    comes with the bundle). ``decode_attention=False``
    keeps one-token SDPA calls over a KV cache library calls (``aot.codegen.decode_attention``).

    A model traced as several programs (``Traced.programs``) has each fused on its own; they come
    out as one ``Program`` with the others in ``variants``, kernels compiled once across them."""
    options = BuildOptions(
        tuple(archs), fuse, gemm_candidates, stack_siblings, channels_last, decode_attention, library_free
    )
    say = progress or (lambda msg: None)
    if traced.programs:
        compiled = _generate_programs(traced, options, say)
    elif not options.fuse:
        program = traced.program
        return Compiled(
            traced=traced,
            program=program,
            archs=options.archs,
            stats=BuildStats(programs=1 + len(program.variants)),
        )
    else:
        compiled = _generate_one(traced, options, say)
    if options.gemm_candidates and not options.library_free:
        return compiled
    table = default_table((compiled.program, *compiled.program.variants))
    if table is not None and not options.library_free:  # library_free says its own
        sites = {(c.program, c.site) for c in table.choices}
        attention = sum(site.startswith(ATTENTION_SITE) for _, site in sites)
        gemm = len(sites) - attention
        parts = [f"{counted(gemm, 'GEMM site')} on Triton GEMM forms"] if gemm else []
        parts += [f"{counted(attention, 'attention site')} on Triton flash forms"] if attention else []
        say(
            f"  built-in table: {' and '.join(parts)} on {DEFAULT_ARCH} GPUs, at the buckets where they were "
            "measured faster (`aotpack tune` measures yours)"
        )
    return replace(compiled, tuning=table)


def _generate_one(traced: Traced, options: BuildOptions, say: Callable[[str], None]) -> Compiled:
    """One program: rewritten for the kernels, fused, compiled; then its small head or its GEMM
    candidates."""
    import triton

    from aot.codegen.compile import ptxas_release

    archs = options.archs
    start = time.perf_counter()
    eager: dict = {}  # capped eager attention's own steps, by its SDPA step's output
    traced, program, folded, padded = _rewrite_for_kernels(traced, options, say, eager)
    ranges = _ranges(traced)
    graph, groups, unfused, standalone, by_id = _fuse(program, ranges, say, start, options.library_free)
    results, failed, hits = compile_kernels(by_id, archs, say)
    for k, why in failed.items():
        say(
            f"  warning: kernel {by_id[k].name} ({k}) failed to compile, its {len(by_id[k].ops)} ATen ops "
            f"stay library calls: {why}"
        )
    new_program, cubins = _with_kernels(
        program, graph, groups, standalone, by_id, results, failed, archs, say
    )

    def compiler(what: str) -> Callable[[list[tuple[str, Any]]], tuple[dict, dict[str, str]]]:
        """A pass's ``compile_kernels``: its kernels for ``archs``, progress said as ``what``."""
        return lambda todo: compile_kernels(dict(todo), archs, say, what)[:2]

    one_kernel: dict = {}  # the decode attention sites of one kernel, by their outputs
    if options.decode_attention:
        from aot.codegen.decode_attention import decode_attention_kernels

        new_program, decode_cubins = decode_attention_kernels(
            new_program,
            archs,
            compiler("decode attention kernel"),
            say,
            ranges,
            one_kernel,
        )
        cubins.update(decode_cubins)
    if eager:  # what no decode attention kernel took keeps the model's own steps
        from aot.codegen.attention import restore_eager_attention

        new_program = restore_eager_attention(new_program, eager, say)
    from aot.codegen.grouped_gemm import grouped_gemm_kernels

    new_program, grouped_cubins = grouped_gemm_kernels(
        new_program,
        ranges,
        archs,
        compiler("grouped GEMM kernel"),
        say,
    )
    cubins.update(grouped_cubins)
    if options.library_free:
        from aot.codegen.cache_writes import cache_write_kernels

        new_program, write_cubins = cache_write_kernels(
            new_program,
            ranges,
            archs,
            compiler("cache write kernel"),
            say,
        )
        cubins.update(write_cubins)
        from aot.codegen.cache_attention import cache_attention_kernels

        new_program, attention_cubins = cache_attention_kernels(
            new_program,
            archs,
            compiler("cache attention kernel"),
            say,
        )
        cubins.update(attention_cubins)
        from aot.codegen.batched_matmul import bmm_kernels

        new_program, bmm_cubins = bmm_kernels(
            new_program,
            ranges,
            archs,
            compiler("batched matmul kernel"),
            say,
        )
        cubins.update(bmm_cubins)
        from aot.codegen.index_rows import index_row_kernels

        new_program, index_cubins = index_row_kernels(
            new_program,
            ranges,
            archs,
            compiler("row gather kernel"),
            say,
        )
        cubins.update(index_cubins)
        from aot.codegen.gathers import gather_kernels

        new_program, gather_cubins = gather_kernels(
            new_program, ranges, archs, compiler("gather kernel"), say
        )
        cubins.update(gather_cubins)
    if not options.gemm_candidates:  # a candidates build leaves every GEMM to tune
        from aot.codegen.gemm import small_gemm_kernels

        new_program, small_cubins = small_gemm_kernels(
            new_program,
            ranges,
            archs,
            compiler("small GEMM kernel"),
            say,
        )
        cubins.update(small_cubins)
    if not options.gemm_candidates and DEFAULT_ARCH in archs:  # the built-in table's forms
        from aot.codegen.gemm import add_gemm_alternatives
        from aot.codegen.norm_sums import SCALE_SUM, drop_unread_sums

        new_program, default_cubins, _ = add_gemm_alternatives(
            new_program,
            traced.buckets,
            ranges,
            archs,
            compiler("built-in table kernel"),
            say,
            pick=default_site_forms,
            pick_attention=default_attention_form,
            configs=default_configs(),
        )
        cubins.update(default_cubins)
        from aot.codegen.qkv_in_attention import qkv_in_attention

        new_program, summing_cubins = qkv_in_attention(
            new_program, one_kernel, archs, compiler("decode attention kernel"), say, ranges
        )
        cubins.update(summing_cubins)
        new_program, weights, dropped = drop_unread_sums(new_program, traced.weights)
        if dropped:  # the column sums of GEMMs whose forms did not take them
            traced = replace(traced, weights=weights)
        kept = sum(w.name.endswith(SCALE_SUM) for w in new_program.weights)
        if kept:
            say(
                f"  a LayerNorm's column sums with {counted(kept, 'matmul weight')} kept: the forms that apply the norm after their products read them"
            )
    if options.decode_attention:  # a causal LM's decode step: its greedy step as one kernel
        from aot.codegen.greedy import greedy_kernel

        new_program, greedy_cubins = greedy_kernel(new_program, archs, compiler("greedy step kernel"), say)
        cubins.update(greedy_cubins)
    steps, n_default_kernels = new_program.steps, len(new_program.kernels)
    # a library-free program runs the built-in table's one-row forms where a default build would
    one_row = one_row_forms(new_program) if options.library_free and DEFAULT_ARCH in archs else {}
    if options.gemm_candidates:
        from aot.codegen.gemm import add_gemm_alternatives

        new_program, gemm_cubins, _ = add_gemm_alternatives(
            new_program,
            traced.buckets,
            ranges,
            archs,
            compiler("GEMM or attention candidate"),
            say,
        )
        cubins.update(gemm_cubins)
    if options.library_free:
        from aot.codegen.library_free import library_free as make_library_free

        if not options.fuse or not options.gemm_candidates:
            raise CodegenError("--library-free needs fused kernels and GEMM candidates (drop --no-fuse)")
        new_program = make_library_free(new_program, traced.buckets, say, traced.model_lines, one_row)
        kept = {k.id for k in new_program.kernels}
        cubins = {key: cubin for key, cubin in cubins.items() if key[0] in kept}
        steps, n_default_kernels = new_program.steps, len(new_program.kernels)
    n_kernel_steps = sum(s.kind == StepKind.KERNEL for s in steps)
    stats = BuildStats(
        kernels=n_default_kernels,
        kernel_steps=n_kernel_steps,
        aten_ops_fused=sum(len(s.reference) for s in steps if s.kind == StepKind.KERNEL),
        fallbacks=len(failed),
        unfused_ops=len(unfused),
        activations_folded=folded,
        weights_padded=padded,
    )
    compiles = len(by_id) * len(archs)
    say(
        f"  codegen done in {time.perf_counter() - start:.1f}s: {counted(n_default_kernels, 'kernel')}, "
        f"{counted(n_kernel_steps, 'launch', 'launches')}, {counted(len(failed), 'fallback')}"
        + (f", {hits}/{compiles} compiles from the cache" if compiles else "")
    )
    return Compiled(
        traced=traced,
        program=new_program,
        archs=archs,
        cubins=cubins,
        triton_version=triton.__version__ if cubins else "",  # a bundle without kernels needs no triton
        cuda_versions={arch: ptxas_release(arch) for arch in archs} if cubins else {},
        stats=stats,
    )


def _ranges(traced: Traced) -> dict[str, tuple[int, int]]:
    return {g.name: (g.min, g.max) for g in traced.guards.symbols}


def _rewrite_for_kernels(
    traced: Traced, options: BuildOptions, say: Callable[[str], None], eager: dict | None = None
) -> tuple[Traced, Program, int, int]:
    """The rewrites before fusion (matmul weights stored [N, K], siblings stacked, weights
    padded, attention masks and GQA repeats folded, activations into their matmuls, indexes by
    whole aranges and position lookups as views, convolution biases and layouts): ``traced`` with the transposed, stacked and padded
    weights, the rewritten program, and how many activations were folded and weights padded.
    ``eager``: where given, capped eager attention of one query becomes an SDPA step only the
    decode attention kernel computes, its own steps kept there (``restore_eager_attention``)."""
    from aot.codegen.activation_folding import fold_activations
    from aot.codegen.attention import (
        eager_attention_as_sdpa,
        fold_gqa_repeats,
        merge_batch_dims,
        simplify_attention_masks,
    )
    from aot.codegen.embeddings import positions_as_slices
    from aot.codegen.gemm_pairs import tile_stats
    from aot.codegen.gemm_prologue import factored_one_row
    from aot.codegen.gemm_sites import through_slices
    from aot.codegen.index_views import (
        extremes_as_amax,
        gathers_as_slices,
        indexes_as_views,
        rolls_as_slices,
        strides_as_views,
    )
    from aot.codegen.layouts import channels_last as lay_out_channels_last
    from aot.codegen.layouts import relayout_conv_inputs, split_conv_bias
    from aot.codegen.norm_sums import add_layer_norm_sums
    from aot.codegen.outer_products import outer_products_as_mul
    from aot.codegen.sibling_matmuls import fuse_sibling_matmuls
    from aot.codegen.weight_layout import split_weights_apart, transpose_matmul_weights
    from aot.codegen.weight_padding import PAD_TO, pad_matmul_weights

    program, outer = outer_products_as_mul(traced.program)
    if outer:
        say(f"  {counted(outer, 'matmul')} over an inner dim of one run as multiplies (outer products)")
    program, weights, apart = split_weights_apart(program, dict(traced.weights))
    if apart:
        say(f"  stored {counted(apart, 'weight')} that only a split reads as its pieces")
        traced = replace(traced, program=program, weights=weights)
    # before the stacking, which takes the transposed weights' ``permute → mm`` form too
    program, weights, transposed = transpose_matmul_weights(program, dict(traced.weights))
    if transposed:
        say(
            f"  stored {counted(transposed, 'matmul weight')} [K, N] as [N, K] "
            "(read along K by the one-row GEMV forms)"
        )
        traced = replace(traced, program=program, weights=weights)
    # Siblings are stacked with or without GEMM candidates: the library steps of a candidates
    # build are then the default build's, so neither an untuned bundle nor a bucket where tune
    # keeps the library is slower than the default build (kept apart, Llama-0.58B's library steps
    # took 0.92 ms at batch 1 x seq 128 on an H200 against 0.78 ms stacked).
    stacked = 0
    if options.stack_siblings:
        program, weights, stacked = fuse_sibling_matmuls(program, dict(traced.weights))
    if stacked:
        say(f"  stacked the weights of {stacked} groups of sibling matmuls (one GEMM each)")
        traced = replace(traced, program=program, weights=weights)
    program, weights, padded = pad_matmul_weights(program, dict(traced.weights))
    if padded:
        say(f"  padded {padded} matmul weights to a multiple of {PAD_TO} columns (aligned cuBLAS kernels)")
        traced = replace(traced, program=program, weights=weights)
    # a LayerNorm's column sums with the weight after it, for the forms that apply the norm after
    # their products: the joined tiles (only a default build joins: tune's candidates keep sites
    # apart) and the factored one-row forms
    sums = tile_stats() or factored_one_row(layer_norm=True, head=True)
    if sums and options.fuse and not options.gemm_candidates and not options.library_free:
        # through slices only where a norm prologue is found through them (the head's final norm)
        program, weights, summed = add_layer_norm_sums(program, dict(traced.weights), through_slices())
        if summed:  # kept where a chosen form reads them (``drop_unread_sums``, after the table)
            traced = replace(traced, program=program, weights=weights)
    ranges = _ranges(traced)
    if options.decode_attention and not options.library_free:  # eager attention at one query: SDPA
        program, _ = eager_attention_as_sdpa(program, log=say, originals=eager)
    program, _ = merge_batch_dims(program, log=say)
    program, _ = simplify_attention_masks(program, traced.weights, ranges, log=say)
    program, _ = fold_gqa_repeats(program, log=say, any_length=options.library_free)
    program, folded = fold_activations(program)
    program, n_strided = strides_as_views(program)
    if n_strided:
        say(f"  {counted(n_strided, 'as_strided view')} at row-major strides read as plain views")
    program, n_gathers = gathers_as_slices(program, traced.weights)
    if n_gathers:
        say(f"  {counted(n_gathers, 'gather')} by a weight's leading positions read as slices")
    program, n_rolls = rolls_as_slices(program)
    if n_rolls:
        say(f"  {counted(n_rolls, 'roll')} read as slices")
    program, n_extremes = extremes_as_amax(program)
    if n_extremes:
        say(f"  {counted(n_extremes, 'max or min over a dim')} without indices as reductions")
    program, n_views = indexes_as_views(program)
    if n_views:
        say(f"  {counted(n_views, 'index', 'indexes')} by whole aranges read in place as views")
    program, n_positions = positions_as_slices(program, ranges)
    if n_positions:
        say(f"  position lookups read in place from their table: {n_positions}")
    if folded:
        say(
            f"  folded {counted(folded, 'activation')} into their matmuls (cuBLASLt bias+activation epilogue)"
        )
    if options.library_free:
        from aot.codegen.library_free import copy_strided_operands

        program, n_copied = copy_strided_operands(program)
        if n_copied:
            say(
                f"  {counted(n_copied, 'operand')} of a GEMM, lookup, convolution or pool read through a strided "
                "view copied by a kernel"
            )
    program, split = split_conv_bias(program)
    if split:
        say(f"  {split} convolution biases join the kernels after them")
    if options.channels_last and not options.library_free:  # aotpack-rt runs row-major bundles
        program, n_cl = lay_out_channels_last(program)
        if n_cl:
            say(f"  {n_cl} convolutions run channels-last (NHWC tensors and weights, no cuDNN transposes)")
        program, n_copies = relayout_conv_inputs(program)
        if n_copies:
            say(
                f"  {n_copies} convolution inputs copied NHWC by a kernel (no ATen copy inside the convolution)"
            )
    return traced, program, folded, padded


def _fuse(program, ranges, say: Callable[[str], None], start: float, library_free: bool = False):
    """The fusion groups of ``program`` and its standalone kernels (embedding lookups and max and
    average pools: a Triton kernel each, so a call launches no ATen kernel for them; with
    ``library_free``, every convolution a form covers and every cumsum too, and index-only values
    a library call reads computed by kernels, ``partition(materialize=)``): (the partition's
    graph, its groups, the ops left unfused, the replaced step's output -> (its kernel's id, the
    kernel, the step it was rendered from), every distinct kernel by id)."""
    from aot.codegen.embeddings import gather_sites, render_gather
    from aot.codegen.partition import partition
    from aot.codegen.pooling import pool_sites, render_pool
    from aot.codegen.render import kernel_id

    graph, groups, unfused = partition(program, ranges, log=say, materialize=library_free)
    ids = [kernel_id(g.rendered.source, g.rendered.signature, g.rendered.config) for g in groups]
    groups = list(zip(groups, ids))
    by_id = {i: g.rendered for g, i in groups}
    standalone: dict[str, tuple[str, Any, Any]] = {}
    sites = [(s, render_gather(s, program, ranges)) for s in gather_sites(program)]
    sites += [(s, render_pool(s, program, ranges)) for s in pool_sites(program, ranges)]
    # where a library-free bundle has no other way: convolutions (cuDNN's elsewhere), cumsums and
    # bilinear resizes (ATen's elsewhere, until their kernels have run on a GPU)
    if library_free:
        from aot.codegen.convolution import conv_sites, render_convolution
        from aot.codegen.resize import render_resize, resize_sites
        from aot.codegen.scans import render_scan, scan_sites

        sites += [(s, render_convolution(s, program, ranges)) for s in conv_sites(program)]
        sites += [(s, render_scan(s, program, ranges)) for s in scan_sites(program)]
        sites += [(s, render_resize(s, program, ranges)) for s in resize_sites(program)]
    for step, r in sites:
        if r is not None:
            k = kernel_id(r.source, r.signature, r.config)
            standalone[step.outputs[0]] = k, r, step
            by_id[k] = r
    partition_s = time.perf_counter() - start
    say(
        f"  fused {counted(sum(len(g.members) for g, _ in groups), 'ATen op')} into "
        f"{counted(len(groups), 'kernel launch', 'kernel launches')} "
        f"({len(dict.fromkeys(ids))} distinct) in {partition_s:.1f}s"
    )
    return graph, groups, unfused, standalone, by_id


def _with_kernels(program, graph, groups, standalone, by_id, results, failed, archs, say):
    """``program`` with each fusion group and standalone kernel that compiled as a kernel step
    (the others stay ATen steps), and the kernels' cubins by (id, arch)."""
    from aot.codegen.partition import rewrite
    from aot.codegen.render import kernel_record, standalone_step

    kept = [(g, i) for g, i in groups if i not in failed]
    try:
        steps = rewrite(graph, [g for g, _ in kept], [i for _, i in kept])
    except AssertionError as e:  # never fail a build over a fusion decision: ship the ATen program
        say(f"  warning: fusion produced an unschedulable program ({e}); every step stays an ATen call")
        kept, steps = [], program.steps
    alone = {out: site for out, site in standalone.items() if site[0] not in failed}

    used: list[str] = []  # standalone kernels whose step the fusion left (a nearest resize it
    # read inside a kernel needs none)

    def on_its_own(s):  # the ATen step a standalone kernel replaces, as that kernel's step
        site = alone.get(s.outputs[0]) if s.kind == StepKind.ATEN and s.outputs else None
        if site is None or s.target != site[2].target:
            return s
        k, r, source = site
        used.append(k)
        return standalone_step(s, r, k, source)

    steps = tuple(map(on_its_own, steps))
    kernels, cubins = [], {}
    for k in dict.fromkeys([*(i for _, i in kept), *used]):
        kernels.append(kernel_record(k, by_id[k], results, archs))
        for a in archs:
            cubins[(k, a)] = results[(k, a)].cubin
    return replace(program, steps=steps, kernels=tuple(kernels)), cubins


def _generate_programs(traced: Traced, options: BuildOptions, say: Callable[[str], None]) -> Compiled:
    parts = []
    for tp in traced.programs:
        say(f"  program {tp.name}:")
        single = replace(traced, program=tp.program, guards=tp.guards, buckets=tp.buckets, programs=())
        if options.fuse:
            parts.append(_generate_one(single, options, say))
        else:
            parts.append(Compiled(traced=single, program=single.program, archs=options.archs))
    main = parts[0]
    # Programs that read different weights (an encoder entry point beside decoder steps) may lay
    # out different ones (siblings stacked where a program reads them); a weight two programs
    # read must be laid out alike. The bundle holds the general program's weights and those the
    # others read besides.
    weights = dict(main.traced.weights)
    for tp, part in zip(traced.programs[1:], parts[1:]):
        read = _weights_read(part.program)
        for k, v in part.traced.weights.items():
            if k in weights and tuple(weights[k].shape) != tuple(v.shape):
                raise CodegenError(
                    f"the program for {tp.name} laid out the shared weight {k} as {list(v.shape)}, the general "
                    f"one as {list(weights[k].shape)}; build with --no-fuse"
                )
            if k not in weights and k in read:
                weights[k] = v
    cubins = {}
    for part in parts:
        cubins.update(part.cubins)
    program = replace(main.program, variants=tuple(p.program for p in parts[1:]))
    stats = replace(
        main.stats, programs=len(parts), kernels=len({k.id for p in parts for k in p.program.kernels})
    )
    return Compiled(
        traced=replace(traced, program=main.traced.program, weights=weights),
        program=program,
        archs=main.archs,
        cubins=cubins,
        triton_version=next((p.triton_version for p in parts if p.triton_version), ""),
        cuda_versions=next((p.cuda_versions for p in parts if p.cuda_versions), {}),
        stats=stats,
    )


def _weights_read(program) -> set[str]:
    """The buffers some step of ``program`` or of its sites' candidates reads, kernels' reference
    steps included (a LayerNorm's column sums may be read by a candidate alone: ``norm_sums``)."""
    from aot.program import all_steps, buffers_read

    return set(program.outputs) | buffers_read(all_steps(program))
