"""Decode attention: one query token per row against a KV cache, as Triton kernels.

A decode step's SDPA call (``aot.hf.causal_lm``'s ``decode`` entry: one new token per row)
reads a query of one position per head and the whole static cache of its layer, under the
mask the wrapper builds. The library runs it as a flash kernel tiled for long queries
(cuDNN's took ~10 us per layer on an H200 for a 512-slot cache, work that moves ~1 MB). This
pass finds such calls by their shapes and operands, not by model, and replaces each with one
kernel step of its own, or two for a long cache (the split-KV form below; the SDPA step is the
reference, what the CPU runs). The sites are found in
``aot.codegen.decode_sites``; this module chooses each site's form and folds the steps it takes
over, ``aot.codegen.decode_attention_render`` writes the kernels:

- a *site* is ``scaled_dot_product_attention(q, k, v, mask)`` without dropout, not causal, whose
  query ``q`` is ``[B, H, 1, D]`` (a buffer a kernel wrote, or a head view of a projection's rows
  as ``aot.codegen.flash`` reads them) or, grouped-query heads folded into rows
  (``aot.codegen.attention.fold_gqa_repeats``), ``[B, KV, G, D]`` viewing such a query; whose
  ``k`` and ``v`` are ``[B, H, C, D]`` views of a row-major ``[B, KV, C, D]`` cache (full slices;
  grouped-query heads by ``unsqueeze`` / ``expand`` / ``view``, ``H = KV * G``) with a static
  ``C`` of at most ``MAX_CONTEXT``; and whose mask (or none) is a ``[B or 1, 1, 1, C]`` view of a
  row-major buffer, additive or boolean (True: attend);
- the kernel runs one program per (row, KV head): the ``G`` query heads sharing that KV head are
  the rows of one tile (padded to 16 for the tensor cores), so every cache element is read once;
  keys and values stream in blocks of up to 256 slots with the softmax computed online in fp32.
  The running maximum starts at a finite floor, so a block whose slots are all masked (left
  padding) adds nothing rather than NaN;
- where the cache a site reads is the result of this step's ``index_put_`` of one slot into the
  program's state (``cache[:, :, pos] = new``, ``pos`` a one-element input, the new keys and
  values a buffer a kernel wrote or a head view of a projection's rows), and nothing reads that
  state in between, the kernel also does the write (``Append``): each program stores its row's
  and KV head's new key and value at slot ``pos`` and uses them from registers at that slot, so
  the two ``index_put_`` launches of a layer go. The kernel step writes the state in place
  (``Step.in_place``); its reference holds the writes, the views between and the SDPA step;
- where the queries, or the new keys it appends, are what a kernel wrote computing rotary position
  embedding (``rotary_of``: ``x * cos + cat(-x2, x1) * sin`` over the first R elements of each head
  of a projection's rows, the rest of the head as it is; ``cos``/``sin`` ``[B or 1, 1, R]``
  buffers of the step's positions), and nothing else reads what that kernel wrote, the attention
  kernel loads the un-rotated rows and the step's cos/sin and rotates them in registers, so the
  two RoPE launches of a layer go too (their steps join the reference). Each product and the sum
  are rounded to the operands' dtype in the kernel's source as the library rounds them (on an
  H200 some rotated keys still differed from eager's bits by a rounding: within the dtype's
  tolerance, as every fused kernel of the build). The rows may hold each head's q, k and v side by
  side (GPT-NeoX: ``Rotary.head_stride``). Where that kernel also norms each head before rotating
  it (Qwen3's and Gemma 3's q_norm and k_norm: RMSNorm over the head dim, ``Rotary.norm``), the
  attention kernel norms the loaded heads first (the norm's steps lowered as a GEMM prologue's row
  norm is, ``gemm_prologue.lower_row_norm``; a rotary partner with its head's statistics). Other
  forms (GPT-J's interleaved pairs) keep their RoPE kernel;
- the *split-KV* form (``render_split_decode_attention``) runs a site as two kernels: partials on a
  grid (B * KV, SPLITS), program (p, s) walking a contiguous range of whole blocks of
  ``SPLIT_BLOCK_N`` slots, smaller where more splits are asked for than that makes blocks (split s
  holds blocks s * NB // SPLITS up to (s + 1) * NB // SPLITS), and
  writing its running max m, sum l and un-normalized acc (fp32) to a workspace
  ``[B, KV, SPLITS, G, D + 2]`` (acc, then m, then l), a program buffer the memory planner sizes
  per bucket; then a combine on a grid (B * KV,) that reads the partials in a fixed order (the
  same bits on every run, no atomics), rescales them to their common max and writes the output
  where the one-kernel form does. A split whose slots are all masked holds m at the finite floor
  and l = 0 and weighs 0. Everything above holds in it: the program whose range holds ``pos``
  stores the new key and value (the only one), every program takes them from registers at that
  slot, RoPE, masks, GQA, a head dim that pads its block; the cache is loaded before the wait only
  where the kernel appends and each program holds one block. The first step writes the workspace
  (and the cache, in place) and stands for the cache writes (its reference: the two ``index_put_``
  and the new keys' RoPE, so verify and the interpreter compare the cache it writes); the combine
  stands for the rest (``_split_reference``).
- the *vector* form of the one-kernel form (``decode_attention_render.VECTOR_FORM``, off by
  default; ``AOTPACK_DECODE_VECTOR``): a program per row and query head, without tensor cores,
  its scores and output sums of fp32 products over the keys and values as loaded. Everything
  above holds in it but the split; one program of each KV head stores the new key and value.

Measured: on an H200 (``bench/decode.py``, 448-token prompt and 64 new tokens: a 512-slot cache;
``bench/results/decode/decode-{gpt2,llama}-split-kv-h200-2026-11-29-night.json``) 8 splits of 64
slots against the one-kernel form: GPT-2 small (12 KV heads) 0.277 ms a token against 0.291 at
batch 1, 0.439 against 0.454 at batch 8; the 0.58B Llama (8 KV heads) 0.398 against 0.427 and
0.562 against 0.585; the same tokens. So a cache of ``SPLIT_MIN_CONTEXT`` up to
``ONE_KERNEL_MAX_CONTEXT`` slots takes ``SHORT_SPLITS`` splits; a shorter one (Llama-3.2-1B's
160-slot bench cache: one or two blocks) keeps the one-kernel form; a longer one
(up to ``decode_sites.MAX_CONTEXT``; the library's SDPA before) splits into enough programs to fill
the GPU, none walking more than ``ONE_KERNEL_MAX_CONTEXT`` slots: at 2048 slots the 0.58B Llama
(16 splits) took 0.429 ms a token against SDPA's 0.765
(``decode-llama-2048-slots-split-kv-h200-2026-11-29-night.json``); its numerics are checked on the
GPU at 512 and 4096 slots (``tests/gpu/test_decode_attention_gpu.py``).
``AOTPACK_DECODE_SPLIT`` (``off``: the one-kernel form, SDPA past its limit, as before the split
form; a number of splits) overrides the choice at build time, for measuring. Other split counts,
measured on an H200 (2026-11-30, ``bench/results/decode/decode-{gpt2,llama-3.2-1b}-split*-h200-
2026-11-30.json``, against the built-in choice on the same machine): GPT-2 at 512 slots 0.259 (4
splits) and 0.270 (16) against 0.232 (8) ms a token at batch 1, 0.429 and 0.455 against 0.404 at
batch 8; Llama-3.2-1B at 160 slots 0.799 (2 splits) and 0.830 (4) against 0.788 (one kernel).

The split form in *one* kernel (``render_split_combined_decode_attention``, the default where the
program's batch has a known maximum): the combine's launch goes. Each partial program, once its partial is stored, counts its arrival on its (row, KV head)'s
int32 counter (a CTA barrier, then one ``atomic_add`` with acquire-release semantics at GPU scope);
the one that arrives last reads every partial (``.cg``: from L2, where the others' stores are)
and combines them as the combine kernel does, in split order, so the output's bits do not depend
on which program arrived last; then it stores 0 to the counter. The counters are
``Program.scratch``: the runner allocates them once, zeroed, and every launch leaves them zeroed
(they are never an output, so no plan reuses their memory). ``AOTPACK_DECODE_COMBINE=separate``
builds the two-kernel form instead, for measuring. Both loaders (the torch loader and aotpack-rt)
allocate the scratch, so a ``--library-free`` build runs the one kernel too. The kernel lets the kernel after it start
(dependent launch) only once its partial is counted, not in its prologue as every other kernel
does. Measured on an H200 (``bench/decode.py``, a 512-slot cache, 8 splits,
``bench/results/decode/decode-split-combined-h200-2026-11-29-eve.json``), ms a token, the one
kernel against the two: GPT-2 small 0.260 against 0.286 at batch 1, 0.424 against 0.444 at batch
8; the 0.58B Llama 0.385 against 0.397, 0.553 against 0.568; the same tokens. With the kernel
after launched from the prologue, the Llama's batch 8 took 0.652 (its attention kernel alone,
dependent launch off, 7.3 µs against 5.7 + 2.6 for the two).

At Llama-3.2-1B's 160-slot bench cache the one kernel of 2 or 4 splits still lost to the one-kernel
form (H200, 2026-12-04, its first 8 layers at batch 1, ``bench/decode_paired.py``, 12 rounds,
``bench/results/decode/paired-llama-3.2-1b-8layers-b1-attention-split-{2,4}-h200-2026-12-04d.json``):
0.4580 (2 splits) and 0.4743 (4) ms a token against 0.4520 and 0.4496, slower in 12 of 12 rounds
each. The cache's keys and values load before the wait either way; the split's arrival count and
combine add to the step's chain what its 16 or 32 programs save.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import replace

from aot.codegen import index as ix
from aot.codegen.decode_attention_render import (
    MIN_SPLIT_BLOCK_N,
    SPLIT_BLOCK_N,
    Ahead,
    render_decode_attention,
    render_split_combined_decode_attention,
    render_split_decode_attention,
)
from aot.codegen.decode_sites import DecodeSite, find_decode_sites
from aot.codegen.kernel_source import launch_first, setting
from aot.codegen.render import Rendered, compile_site_kernels, kernel_step
from aot.dtypes import ITEMSIZE
from aot.errors import CodegenError, counted
from aot.program import VIEW_OPS, readers_of, state_aliases, state_next, step_reads, step_writes
from aot.schema import Program, Step, StepKind, TensorSpec

# The split-KV form (see the module docstring): a cache of SPLIT_MIN_CONTEXT up to
# ONE_KERNEL_MAX_CONTEXT slots takes SHORT_SPLITS splits (measured at 512 slots), a shorter one the
# one-kernel form, a longer one (up to decode_sites.MAX_CONTEXT) enough splits for
# SPLIT_TARGET_PROGRAMS programs. ``AOTPACK_DECODE_SPLIT`` (``off``, or a number of splits)
# overrides that at build time, for measuring.
ONE_KERNEL_MAX_CONTEXT = 1024
SPLIT_MIN_CONTEXT = 512
SHORT_SPLITS = 8
SPLIT_TARGET_PROGRAMS = 264  # B * KV * splits aimed at: two programs per SM of an H200 (132 SMs)
MAX_SPLITS = 64
_CLONE = "aten.clone.default"
SPLIT_ENV = "AOTPACK_DECODE_SPLIT"
COMBINE_ENV = "AOTPACK_DECODE_COMBINE"  # "separate": the split form's combine as a kernel of its own


def split_setting() -> str | int | None:
    """``AOTPACK_DECODE_SPLIT`` as read now: None where unset (the module's knobs decide),
    ``"off"``, or a number of splits (2 to ``MAX_SPLITS``)."""
    text = os.environ.get(SPLIT_ENV, "").strip()
    if not text:
        return None
    if text == "off":
        return text
    if text.isdigit() and 2 <= int(text) <= MAX_SPLITS:
        return int(text)
    raise CodegenError(
        f"{SPLIT_ENV}={text!r}: expected 'off' (the one-kernel decode attention; caches over "
        f"{ONE_KERNEL_MAX_CONTEXT} slots keep the library's SDPA) or a number of splits from 2 to "
        f"{MAX_SPLITS}; unset it for the built-in choice"
    )


# The one-kernel form's side programs (``decode_attention_render.Ahead``): while the attention
# runs, HBM idles but for the o projection's early loads, so programs of the attention's grid
# beyond its own stream the first AHEAD_MIB of the weight of the kernel after next (gate/up in a
# Llama layer, which no kernel loads yet) into L2. ``AOTPACK_ATTENTION_AHEAD``: "off" (the default:
# Llama-3.2-1B's first 8 layers at batch 1 were 1.3% slower with it, H100, 2026-12-07, seventh
# session, bench/RESULTS.md), "on" (AHEAD_MIB), or a number of MiB (1 to 256), for measuring.
AHEAD_ENV = "AOTPACK_ATTENTION_AHEAD"
AHEAD_MIB = 16
AHEAD_MAX_MIB = 256


def ahead_setting() -> int:
    """``AOTPACK_ATTENTION_AHEAD`` as read now: MiB of a later weight the side programs stream into
    L2 (0: none)."""
    given = os.environ.get(AHEAD_ENV, "").strip()
    text = given.lower()
    if text in ("", "off", "0"):
        return 0
    if text == "on":
        return AHEAD_MIB
    if text.isdigit() and 1 <= int(text) <= AHEAD_MAX_MIB:
        return int(text)
    raise CodegenError(
        f"{AHEAD_ENV}={given!r}: expected 'off', 'on' ({AHEAD_MIB} MiB) or MiB from 1 to {AHEAD_MAX_MIB} "
        "of the later kernel's weight that the decode attention streams into L2"
    )


def ahead_weight(program: Program, at: int, mib: int) -> Ahead | None:
    """What the decode attention at step ``at`` streams into L2 (``AOTPACK_ATTENTION_AHEAD``): the
    largest weight of the second step after it that reads weights (as stored or through views of
    them: a GEMM's ``permute``), its first ``mib`` MiB (all of it where smaller). The first such
    step (the o projection) loads its own weight early under dependent launch; the second's no
    kernel loads while the attention runs. None where no second step reads a weight."""
    sizes = {w.name: w.spec for w in program.weights}
    views: dict[str, str] = {name: name for name in sizes}  # a view of a weight -> the weight
    seen = 0
    for step in program.steps[at + 1 :]:
        read = {views[name] for name in step_reads(step) if name in views}
        if step.kind == StepKind.ATEN and step.target in VIEW_OPS:
            if len(read) == 1:
                views.update((out, next(iter(read))) for out in step.outputs if out is not None)
            continue
        if not read:
            continue
        seen += 1
        if seen < 2:
            continue

        def size(name: str) -> int:
            spec = sizes[name]
            return math.prod(int(d) for d in spec.shape) * ITEMSIZE[spec.dtype]

        biggest = max(sorted(read), key=size)
        nbytes = min(size(biggest), mib << 20) // 128 * 128
        return Ahead(biggest, sizes[biggest].dtype, nbytes) if nbytes else None
    return None


def combine_in_kernel() -> bool:
    """``AOTPACK_DECODE_COMBINE`` as read now: whether the split form combines in its one kernel
    (unset, or ``kernel``) or in a kernel of its own (``separate``)."""
    return setting(COMBINE_ENV, "kernel", ("kernel", "separate")) == "kernel"


def max_rows(site: DecodeSite, ranges: dict[str, tuple[int, int]]) -> int | None:
    """The most rows ``site`` runs at: its batch at the symbols' largest values (None where a
    symbol has no known range)."""
    rows = ix.parse_size(site.batch)
    if not all(str(sym) in ranges for sym in rows.free_symbols):
        return None
    value = rows.subs({sym: ranges[str(sym)][1] for sym in rows.free_symbols})
    return int(value) if value.is_Integer and int(value) > 0 else None


def decode_splits(site: DecodeSite, setting: str | int | None = None) -> int | None:
    """How ``site`` runs: 1 the one-kernel form, n >= 2 the split form of n splits, None the
    library's SDPA (a cache over ``ONE_KERNEL_MAX_CONTEXT`` slots with the split form off).
    ``setting``: ``split_setting()``'s. A cache of one block of ``SPLIT_BLOCK_N`` slots never
    splits; a number of splits asked for takes smaller blocks where the cache has fewer than that
    (each split one block of at least ``MIN_SPLIT_BLOCK_N`` slots)."""
    long = site.context > ONE_KERNEL_MAX_CONTEXT
    if setting == "off":
        return None if long else 1
    blocks = -(-site.context // SPLIT_BLOCK_N)
    if blocks < 2:
        return 1
    if not long and setting is None:
        if site.context < SPLIT_MIN_CONTEXT:
            return 1
        setting = SHORT_SPLITS
    if isinstance(setting, int):
        return min(setting, -(-site.context // MIN_SPLIT_BLOCK_N))
    # programs at the smallest batch a symbolic one admits: one row
    rows = ix.parse_size(site.batch)
    programs = (int(rows) if rows.is_Integer else 1) * site.kv_heads
    want = -(-SPLIT_TARGET_PROGRAMS // programs)
    # no program walks more slots than the one-kernel form was measured at
    fewest = -(-site.context // ONE_KERNEL_MAX_CONTEXT)
    splits = min(MAX_SPLITS, blocks, max(want, fewest))
    return splits if splits >= 2 else 1


def folded_steps(program: Program, site: DecodeSite) -> tuple[int, ...] | None:
    """The steps the kernel of ``site`` stands for beside the SDPA step, where it folds in the
    cache writes (``site.append``): the two writes and the views (and copies) of their results
    that only lead to the SDPA call; None where another step between the writes and the SDPA step reads the
    state or what was written (moving the writes to the SDPA step would change what it reads)."""
    a = site.append
    if a is None:
        return None
    folded = {a.k_write, a.v_write}
    written = {a.k_result, a.v_result}
    for i in range(min(folded), site.step):
        if i in folded:
            continue
        step = program.steps[i]
        reads = set(step_reads(step))
        if reads & {a.k_state, a.v_state}:
            return None
        if reads & written:
            # views, and repeat_kv's copy of the written cache (an eager attention's: the site
            # reads the cache through it), which then only the reference runs
            if step.kind != StepKind.ATEN or (step.target not in VIEW_OPS and step.target != _CLONE):
                return None
            folded.add(i)
            written.update(step_writes(step))
    readers = readers_of(program.steps)
    for name in written - {a.k_result, a.v_result}:  # the folded views: read by nothing else
        if name in program.outputs or any(r not in folded and r != site.step for r in readers.get(name, ())):
            return None
    return tuple(sorted(folded))


def rotary_steps(
    program: Program, site: DecodeSite, fold: tuple[int, ...] | None
) -> tuple[DecodeSite, tuple[int, ...]]:
    """``site`` with the rotary embeddings its kernel computes (``q_rotary``, ``Append.k_rotary``;
    the new keys' only where the cache writes fold in, ``fold``) kept where the kernels computing
    them can go, and the steps that go with them into its reference: those kernels and the views
    of what they wrote that lead only to the SDPA call. A kernel goes only when nothing else reads
    anything it wrote (a program output, another step), else the attention reads its result."""
    a = site.append if fold is not None else None
    q, k = site.q_rotary, a.k_rotary if a is not None else None
    readers = readers_of(program.steps)
    allowed = {site.step, *(fold or ())}
    while q is not None or k is not None:
        rotaries = [r for r in (q, k) if r is not None]
        results = {r.result for r in rotaries}
        going, kept = set(), set()
        for r in rotaries:
            kernel = program.steps[r.step]
            views, ok = set(), all(o is None or o in results for o in kernel.outputs)
            todo = [o for o in kernel.outputs if o is not None]
            while ok and todo:
                name = todo.pop()
                if name in program.outputs:
                    ok = False
                for j in readers.get(name, ()):
                    step = program.steps[j]
                    if j in allowed:
                        continue
                    if step.kind != StepKind.ATEN or step.target not in VIEW_OPS:
                        ok = False
                    elif j not in views:
                        views.add(j)
                        todo.extend(o for o in step.outputs if o is not None)
            (going if ok else kept).update({r.step, *views} if ok else {r.step})
        if not kept:
            break
        q = q if q is not None and q.step not in kept else None
        k = k if k is not None and k.step not in kept else None
    else:
        going = set()
    if a is not None:
        site = replace(site, append=replace(a, k_rotary=k))
    return replace(site, q_rotary=q), tuple(sorted(going))


def decode_attention_kernels(
    program: Program,
    archs: tuple[str, ...],
    compile_kernels: Callable[[list[tuple[str, Rendered]]], tuple[dict, dict[str, str]]],
    say: Callable[[str], None],
    ranges: dict[str, tuple[int, int]] | None = None,
    one_kernel: dict[str, tuple[DecodeSite, bool]] | None = None,
) -> tuple[Program, dict[tuple[str, str], bytes]]:
    """``program`` with each decode SDPA site run by its kernel, or by the split form
    (``decode_splits``): in one kernel that combines too (counting on ``Program.scratch``), where
    the batch's largest size is known (``ranges``: symbol -> (min, max)) and
    ``combine_in_kernel()``; else in two (the first writes the workspace and, where it appends, the
    cache, standing for the cache writes; the second for the rest). The SDPA step is the
    reference; a site whose kernels fail to compile stays the library call. ``one_kernel`` (filled
    where given): each site run by the one-kernel form, by its output, with whether its kernel
    lets the kernel after start first (``aot.codegen.qkv_in_attention`` renders it again)."""
    setting = split_setting()
    combine = combine_in_kernel()
    sites = [s for s in find_decode_sites(program) if decode_splits(s, setting) is not None]
    if not sites:
        return program, {}
    folds = [folded_steps(program, site) for site in sites]
    sites = [site if fold is not None else replace(site, append=None) for site, fold in zip(sites, folds)]
    rotated = [rotary_steps(program, site, fold) for site, fold in zip(sites, folds)]
    sites = [site for site, _ in rotated]
    references = [
        _reference(program, site, (*(fold or ()), *more))
        for site, fold, (_, more) in zip(sites, folds, rotated)
    ]
    # each site's kernels, workspace, and arrival counters (the one-kernel split form's)
    forms: list[tuple[list[Rendered], dict[str, TensorSpec], dict[str, TensorSpec]]] = []
    first = launch_first()
    state = state_aliases(program) if first else set()
    afters: dict[int, bool] = {}
    mib = ahead_setting()
    for s in sites:
        splits = decode_splits(s, setting)
        # the kernel after it may start first where it does not touch the state
        after = first and not state_next(program, s.step, state)
        afters[s.step] = after
        if splits == 1:
            ahead = ahead_weight(program, s.step, mib) if mib else None
            forms.append(([render_decode_attention(s, after, ahead=ahead)], {}, {}))
        elif combine and (rows := max_rows(s, ranges or {})) is not None:
            kernel, workspace, (counts, spec) = render_split_combined_decode_attention(s, splits, rows, after)
            assert not {*workspace, counts} & set(program.buffers), (workspace, counts)
            forms.append(([kernel], workspace, {counts: spec}))
        else:
            partial, combined, workspace = render_split_decode_attention(s, splits)
            assert not set(workspace) & set(program.buffers), workspace
            forms.append(([partial, combined], workspace, {}))
    forms = [  # the ops of the rotary kernels folded in, too
        (
            [
                replace(
                    r,
                    ops=tuple(
                        dict.fromkeys((*(x.target for j in more for x in program.steps[j].reference), *r.ops))
                    ),
                )
                for r in kernels
            ],
            workspace,
            counters,
        )
        for (kernels, workspace, counters), (_, more) in zip(forms, rotated)
    ]
    flat = [r for kernels, _, _ in forms for r in kernels]
    built = compile_site_kernels(program, flat, archs, compile_kernels, say, "decode attention", "SDPA stays")
    site_ids, taken = [], 0
    for kernels, _, _ in forms:
        site_ids.append(built.ids[taken : taken + len(kernels)])
        taken += len(kernels)
    failed = built.failed
    at = {
        s.step: (s, fold, more, ref, kids, form)
        for s, fold, (_, more), ref, kids, form in zip(sites, folds, rotated, references, site_ids, forms)
        if not set(kids) & set(failed)
    }
    steps: list[list[Step]] = [[s] for s in program.steps]
    appended = rotations = split = combined = 0
    gone: set[str] = set()  # the rotary kernels folded in
    workspaces: dict[str, TensorSpec] = {}
    scratch_specs: dict[str, TensorSpec] = {}
    for i, (site, fold, more, reference, kids, (kernels, workspace, counters)) in at.items():
        a = site.append
        for j in (*(fold if a is not None else ()), *more):
            if steps[j] and steps[j][0].kind == StepKind.KERNEL:
                gone.add(steps[j][0].target)
            steps[j] = []
        appended += a is not None
        rotations += (site.q_rotary is not None) + (a is not None and a.k_rotary is not None)
        in_place = {a.k_result: a.k_state, a.v_result: a.v_state} if a is not None else {}
        if len(kernels) == 1:  # one kernel (the split form's, combining too: its workspace, counters)
            steps[i] = [kernel_step(kids[0], kernels[0], reference, in_place)]
            if not counters and one_kernel is not None:
                one_kernel[site.out] = (site, afters[i])
            if counters:
                split += 1
                combined += 1
                workspaces.update(workspace)
                scratch_specs.update(counters)
        else:  # the partials (and the cache write) first, then the combine
            writes, rest = _split_reference(reference, a)
            steps[i] = [
                kernel_step(kids[0], kernels[0], writes, in_place),
                kernel_step(kids[1], kernels[1], rest),
            ]
            split += 1
            workspaces.update(workspace)
    if at:
        also = (
            f", {appended} of them writing the step's keys and values into the cache too" if appended else ""
        )
        if rotations:
            also += f", {counted(rotations, 'rotary embedding')} computed in them"
        if split:
            how = (
                "partials, the last program of each row combining them"
                if combined == split
                else "partials, then a combine kernel"
                if not combined
                else f"{combined} combining in their one kernel"
            )
            also += f", {split} split across the cache (split-KV: {how})"
        say(f"  {len(at)} one-token SDPA calls over a KV cache run as decode attention kernels{also}")
    out = built.program_with(program, [s for group in steps for s in group])
    used = {s.target for s in out.steps if s.kind == StepKind.KERNEL}
    # gone: the folded rotary kernels, and every kernel this pass built that no step launches (a
    # split site's kernel whose partner failed to compile)
    gone |= set(built.records)
    return replace(
        out,
        kernels=tuple(k for k in out.kernels if k.id in used or k.id not in gone),
        buffers={**out.buffers, **workspaces, **scratch_specs},
        scratch=(*out.scratch, *scratch_specs),
    ), {key: cubin for key, cubin in built.cubins.items() if key[0] in used}


def _reference(program: Program, site: DecodeSite, folded: tuple[int, ...]) -> tuple[Step, ...]:
    """What the kernel of ``site`` stands for: the ``folded`` steps in program order (a kernel
    among them by its own reference steps), then the SDPA step."""
    steps = []
    for j in sorted(set(folded)):
        s = program.steps[j]
        steps.extend(s.reference if s.kind == StepKind.KERNEL else (s,))
    return (*steps, program.steps[site.step])


def _split_reference(reference: tuple[Step, ...], append) -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    """The split form's ``reference`` shared between its two kernel steps: the partial step
    stands for the cache writes (``append``'s two ``index_put_``) and the steps only they need
    (the new keys' rotary embedding), so what it writes into the cache is checked against them
    (``aotpack verify``, the interpreter); the combine for the rest (the views of the written
    cache, the queries' rotary embedding, the SDPA step), which reads the cache the partial wrote
    and writes no state. Where the partial would need a step whose result the rest reads too (a
    step that is both sides' own), or the site does not append, the partial stands for nothing
    and the combine for all: the CPU path runs the same steps either way."""
    if append is None:
        return (), reference
    results = {append.k_result, append.v_result}
    need = set(results)
    writes: set[int] = set()
    for j in range(len(reference) - 1, -1, -1):  # the writes and what they read, back to front
        outs = set(step_writes(reference[j]))
        if outs & need:  # (a rotary kernel's reference may compute a name another's does too)
            writes.add(j)
            need = (need - outs) | set(step_reads(reference[j]))
    if not writes:
        return (), reference
    producer: dict[str, int] = {}
    for j, step in enumerate(reference):
        if j not in writes and any(
            producer.get(r, -1) in writes for r in step_reads(step) if r not in results
        ):
            return (), reference  # it reads what a step of the writes' computed
        producer.update((o, j) for o in step_writes(step))
    rest = tuple(s for j, s in enumerate(reference) if j not in writes)
    return tuple(s for j, s in enumerate(reference) if j in writes), rest
