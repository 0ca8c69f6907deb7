"""``aotpack build --library-free``: a program whose every step is a compiled kernel, a view that
keeps its bytes, or a driver copy (``aot.program.check_library_free``), so that the runtime
without torch (``aot.runtime``) runs it on the CUDA driver alone, and the torch loader runs the
very same steps.

It starts from a candidates build (``aot.codegen.gemm.add_gemm_alternatives``: Triton forms for
every library GEMM and attention site) and puts, at each site, the first candidate in
``PREFERENCE`` order that was offered at every bucket (or, for the forms that mask their rows
against any length, at the most buckets), where the library steps were
(``aot.tuning.plan_steps``, as a tuning does). The kernel steps keep the library steps as their
reference, which is what the CPU runs. What is left that no form covers is refused with the step.

At one-row buckets a site runs what the default build's built-in table runs there
(``aot.codegen.gemm_defaults``: a dot-free GEMV, its ``_rms``/``_ln`` variant taking the norm
kernel before it into its prologue), recorded as that build records it: the site stays an
alternative of the library-free program, whose "library" steps are now the chosen tile form's
kernels and whose one candidate is the GEMV form, and the bundle's ``tuning.json`` chooses it at
those buckets (``default_table``). Both loaders apply it through ``aot.tuning.tuned_plans`` on a
GPU of the table's arch, so they run the same kernels at every bucket; elsewhere the tile form
runs, as the default build runs the library there.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

from aot.codegen.attention import SDPA
from aot.codegen.batched_matmul import BMM
from aot.codegen.cache_attention import token_major
from aot.codegen.cache_writes import strided_view
from aot.errors import BundleError, CodegenError, EnvError
from aot.program import (
    RESHAPE_VIEWS,
    aliases,
    check_library_free,
    fresh_name,
    is_view,
    live_steps,
    producer_of,
    readers_of,
)
from aot.schema import Bucket, Buf, GemmSite, Program, Step, StepKind
from aot.tuning import check_alternatives, spliced

# Candidate forms by name prefix, best default first when nothing was timed: whole tiles serve any
# row count; split-K forms need a second reduction launch; the GEMV forms cover few rows.
PREFERENCE = ("tile_16x64x128", "tile_64x128x64", "tile_", "flash_64x64", "flash", "splitk", "gemv_", "vec_")
# Forms that mask every row against the sequence length (``codegen/flash.py``: ``rm < T``), so they
# run correctly at any length; their buckets only say where they are worth timing. When none was
# offered at every bucket, the one offered at the most runs everywhere.
ANY_LENGTH = ("flash_",)
# suffixes the rewrites give a result they rename (``layouts.split_conv_bias``, sibling stacking)
RENAMED = ("_nobias", "_siblings")


def _rank(name: str) -> int:
    return next((i for i, p in enumerate(PREFERENCE) if name.startswith(p)), len(PREFERENCE))


def _bucket_sizes(buckets: tuple[Bucket, ...]) -> list[dict[str, int]]:
    symbols = [b.symbol for b in buckets]
    return [dict(zip(symbols, key)) for key in itertools.product(*[b.sizes for b in buckets])]


def choose(site: GemmSite, buckets: tuple[Bucket, ...]) -> str:
    """The candidate of ``site`` the library-free program runs (module docstring)."""
    wanted = _bucket_sizes(buckets)
    fits = [c for c in site.candidates if not c.buckets or all(b in c.buckets for b in wanted)]
    anywhere = [c for c in site.candidates if c.name.startswith(ANY_LENGTH)]
    if not fits and anywhere:
        most = max(sum(b in c.buckets for b in wanted) for c in anywhere)
        fits = [c for c in anywhere if sum(b in c.buckets for b in wanted) == most]
    if not fits:
        raise CodegenError(
            f"--library-free: {site.id} (a {site.m}x{site.n}x{site.k} library call, result "
            f"{', '.join(site.outputs)}) has no Triton candidate compiled for every bucket "
            f"({len(wanted)} bucket sizes; candidates: {', '.join(c.name for c in site.candidates) or 'none'}); "
            f"build without --library-free and run it with the torch loader"
        )
    return min(fits, key=lambda c: (_rank(c.name), site.candidates.index(c))).name


def model_line(step, lines: Mapping[str, str]) -> str:
    """The model line (``Traced.model_lines``) that made ``step``'s result, or of the steps it
    stands for; "" when none is known (a result the codegen named)."""
    for s in (step, *step.reference):
        for name in s.outputs:
            for candidate in (name, *(name[: -len(x)] for x in RENAMED if name and name.endswith(x))):
                if candidate and candidate in lines:
                    return lines[candidate]
    return ""


def library_free(
    program: Program,
    buckets: tuple[Bucket, ...],
    say=lambda msg: None,
    lines: Mapping[str, str] | None = None,
    one_row: Mapping[str, str] | None = None,
) -> Program:
    """``program`` (with ``alternatives``) as a library-free program: each site's chosen candidate
    spliced in, the kernels no step or kept alternative launches dropped; ``CodegenError`` naming
    the first step no form covers, and the model line that made it (``lines``: result -> line).
    ``one_row``: site id -> the form the default table runs it with at one row
    (``aot.codegen.gemm_defaults.one_row_forms``); each such candidate compiled for some
    bucket stays the site's one alternative, over the chosen form's steps (module docstring)."""
    chosen = {site.id: choose(site, buckets) for site in program.alternatives}
    steps, spans = spliced(program, chosen)
    kept: list[GemmSite] = []
    for site in program.alternatives:
        form = (one_row or {}).get(site.id)
        cand = next((c for c in site.candidates if c.name == form and c.buckets), None)
        if cand is not None and form != chosen[site.id]:
            kept.append(replace(site, library=spans[site.id], candidates=(cand,)))
    used = {s.target for s in steps if s.kind == StepKind.KERNEL} | {
        s.target for site in kept for s in site.candidates[0].steps
    }
    used.add(program.greedy)  # launched by the torch loader's decode blocks, not a step
    out = replace(
        program,
        steps=steps,
        alternatives=tuple(kept),
        kernels=tuple(k for k in program.kernels if k.id in used),
    )
    try:
        check_library_free(out, live_steps(out), "--library-free", lambda step: model_line(step, lines or {}))
    except EnvError as e:
        raise CodegenError(
            f"{e}".replace(
                "rebuild with `aotpack build --library-free`, or load it with the torch loader (`aotpack load`)",
                "no Triton form exists for it yet: build without --library-free and run it with the torch loader",
            )
        ) from None
    try:
        check_alternatives(out, "--library-free")
    except BundleError as e:  # pragma: no cover - a build fault, not the model's
        raise CodegenError(f"the one-row forms of the library-free program: {e}") from None
    forms = sorted(set(chosen.values()))
    gemv = sorted({site.candidates[0].name for site in kept})
    say(
        f"  library-free: {len(chosen)} sites on Triton candidates ({', '.join(forms)}), no library call left"
        + (f"; {len(kept)} run the default one-row forms at one row ({', '.join(gemv)})" if kept else "")
    )
    return out


# the operand a Triton form reads row-major from its buffer: a GEMM's A, a lookup's ids, the image
# of a convolution or a pool (CoAtNet's shortcut pools its LayerNorm2d's [B, C, H, W] permute of
# [B, H, W, C] rows)
ROW_MAJOR_OPERAND = {
    "aten.mm.default": 0,
    "aten.addmm.default": 1,
    "aten._addmm_activation.default": 1,
    "aten.embedding.default": 1,
    "aten.convolution.default": 0,
    "aten.avg_pool2d.default": 0,
    "aten.max_pool2d_with_indices.default": 0,
}
COPY = "aten.clone.default"


def attention_row_buffers(program: Program) -> set[str]:
    """The ``[B, T, H*D]`` rows each SDPA's result becomes through ``permute([0, 2, 1, 3])`` (maybe
    ``clone``) and a view (``cache_attention.token_major``): the attention kernels write those rows
    themselves, which an output projection then reads in place (Llama's ``o_proj``). MaxViT's
    windows, a 4-D view of the transpose, are not such rows."""
    readers = readers_of(program.steps)
    found = set()
    for i, step in enumerate(program.steps):
        spec = program.buffers.get(step.outputs[0]) if step.target == SDPA and step.outputs else None
        if spec is None or len(spec.shape) != 4 or not all(d.isdigit() for d in spec.shape[1::2]):
            continue
        width = int(spec.shape[1]) * int(spec.shape[3])
        rows, _ = token_major(program, readers, i, step.outputs[0], spec.shape[0], spec.shape[2], width)
        if rows != step.outputs[0]:
            found.add(rows)
    return found


def _copied_operands(step: Step, program: Program) -> list[int]:
    """The arguments of ``step`` that ``copy_strided_operands`` lays out row-major where they are
    views: ``ROW_MAJOR_OPERAND``'s, and a ``bmm``'s operand that is no strided view of a row-major
    buffer (``cache_writes.strided_view``: MobileViT's heads of one patch, ``[4B, 4, 1, 60]``
    merged to ``[16B, 1, 60]``, from a slice of the stacked q/k/v projections' rows)."""
    if step.kind != StepKind.ATEN:
        return []
    if step.target == BMM:
        return [
            i
            for i, a in enumerate(step.args[:2])
            if isinstance(a, Buf) and strided_view(a.name, program) is None
        ]
    at = ROW_MAJOR_OPERAND.get(step.target, -1)
    return [at] if 0 <= at < len(step.args) and isinstance(step.args[at], Buf) else []


def copy_strided_operands(program: Program) -> tuple[Program, int]:
    """``program`` with each GEMM's A, each lookup's ids and each convolution's or pool's image
    (``ROW_MAJOR_OPERAND``; a ``bmm``'s operands where they are no strided view, ``_copied_operands``)
    that is a view no kernel can read as rows in place (not a view at its
    base's address, ``aot.program.aliases``, or rows apart: BERT's pooler reads the first token,
    ``hidden[:, 0]`` of ``[B, T, C]``; BERT without ``token_type_ids`` looks up its buffered zeros
    expanded to ``[B, T]``; not the rows an attention kernel writes, ``attention_row_buffers``) copied by a ``clone`` first, which the fuser makes a kernel: those
    forms read the operand row-major, and a library-free program has no other copy that gathers
    strided elements. A program output that is such a view is copied so too (the runtime returns
    a buffer, a view at its base's address or rows of one apart). Also how many. Before fusion, for library-free
    builds only (the torch loader lays such an operand out by itself)."""
    aliased = aliases(program, program.steps)
    producer = producer_of(program.steps)

    written = attention_row_buffers(program)

    def attention_rows(name: str) -> bool:
        """A view of the ``[B, T, H*D]`` rows an attention kernel writes (``written``)."""
        while name not in written:
            made = producer.get(name)
            if made is None or program.steps[made].target not in RESHAPE_VIEWS:
                return False
            name = program.steps[made].args[0].name
        return True

    def in_place(name: str, rows_apart: bool = False) -> bool:
        """A view at its base's address (or, with ``rows_apart``, rows of it apart), of a base
        that some step writes (MaxViT's window rows are views of a permute of the attention's
        result, itself a view no step writes)."""
        at = aliased.get(name)
        if at is None or (at.width and not rows_apart):
            return False
        made = producer.get(at.base)
        return made is None or not is_view(program.steps[made])

    buffers = dict(program.buffers)
    steps: list[Step] = []
    copied: dict[str, str] = {}
    for step in program.steps:
        for at in _copied_operands(step, program):
            a = step.args[at]
            if a.name in buffers and not in_place(a.name) and not attention_rows(a.name):
                made = producer.get(a.name)
                if made is not None and is_view(program.steps[made]):
                    if a.name not in copied:
                        copied[a.name] = fresh_name(f"{a.name}_rows", buffers)
                        buffers[copied[a.name]] = replace(buffers[a.name], order=())
                        steps.append(Step(StepKind.ATEN, COPY, (a,), {}, (copied[a.name],)))
                    args = list(step.args)
                    args[at] = Buf(copied[a.name])
                    step = replace(step, args=tuple(args))
        steps.append(step)
    outputs = list(program.outputs)
    # a view returned (GhostNet's channels of a sum) that the runtime cannot return as it lies:
    # its own rows (rows apart it returns: a vocabulary head's logits of padded rows)
    for i, name in enumerate(outputs):
        made = producer.get(name)
        if name in buffers and not in_place(name, rows_apart=True) and made is not None:
            if is_view(program.steps[made]) and name not in copied:
                copied[name] = fresh_name(f"{name}_rows", buffers)
                buffers[copied[name]] = replace(buffers[name], order=())
                steps.append(Step(StepKind.ATEN, COPY, (Buf(name),), {}, (copied[name],)))
            outputs[i] = copied.get(name, name)
    if not copied:
        return program, 0
    return replace(program, steps=tuple(steps), buffers=buffers, outputs=tuple(outputs)), len(copied)
