"""The GEMM forms a default build runs without ``aotpack tune``: a built-in tuning table.

A decode step multiplies one row by every weight matrix: a GEMV, which cuBLAS runs below the
memory bandwidth that a dot-free Triton form reaches (``aot.codegen.gemm_forms``: ``vec_*``, each
block streaming whole rows of W). ``aotpack tune`` finds that on the GPU; a default build cannot
time anything, so it takes the forms tune took where the measurements agree:

- on an H200 (sm_90, bfloat16, Llama-3.2-1B's decode step at batch 1; ``aotpack tune --entry
  decode``, ``bench/results/decode/llama-3.2-1b-tuning-h200-2026-11-28.json``), µs per GEMM alone
  (library → form): q/k/v 2048 → 3072 7.9 → 7.5 (``vec_1x4x1024``), o 2048 → 2048 7.2 → 6.2
  (``vec_1x4x1024``), down 8192 → 2048 17.9 → 17.3 (``vec_1x8x512``), the LM head 2048 → 128256
  133 → 126 (``vec_1x4x1024``), gate/up 2048 → 16384 24.5 either way; the whole decode step with
  the forms 1027 µs against 1146 with the library (kernels launched early under
  programmatic dependent launch, which cuBLAS does not do); those two forms, of 4 and 8 rows per
  block, are replaced by the four below;
- on the same GPU, tune chose ``vec_*`` or their split-K forms at every one-row site of the
  example GPT and MLP (fp16, K 768-3072);
- on the same GPU (``bench/gemv_sweep.py``, ``bench/results/gemv-sweep-h200-2026-11-28.json``:
  every one-row form of 1-16 rows of W per block, K steps of 256-2048, 2-8 warps and 1-4 K slices,
  each launch reading its own copy of W, bfloat16), µs per GEMV alone, ``vec_1x4x1024`` → the
  form below → the best of the sweep: Llama-3.2-1B q/k/v 6.14 → 5.31 → 5.26, gate/up 20.5 → 18.7
  → 18.3, down (K 8192) 12.1 → 11.6 → 10.4, the LM head 126.9 → 118.7 → 118.3 (4.44 TB/s);
  GPT-2 (K 768) q/k/v 3.15 (``vec_1x8x512``) → 3.05 → 3.04, mlp out (K 3072) 4.29 → 3.31 (the
  best). Chained as a decode step runs them (``gemv-chain-h200-2026-11-28.json``: every layer its
  own weights, one graph), Llama-3.2-1B's GEMVs take 666 µs with these forms under dependent
  launch, 705 without; one row per block (each GEMV's fastest alone) 694 without and 794 with
  (a kernel of that many blocks launched early slows the one before); cuBLAS 853. GPT-2's: 149,
  cuBLAS 259.

So: a half-precision GEMM site at a bucket of one row runs ``vec_1x2x512`` where K is at most
``SHORT_K``, ``vec_1x1x512`` where K is below ``LONG_K`` and not a multiple of 2048 (GPT-2's mlp
out), ``vec_1x2x1024`` otherwise (``_rms`` or ``_ln``: with the RMSNorm or LayerNorm kernel
before it, and the residual add in that kernel, computed in the GEMV's prologue); every other
site and bucket keeps the library. The table is recorded for ``DEFAULT_ARCH`` only (the loader applies a tuning table on a
GPU of its arch), and only those forms are compiled, so a build takes a few kernels more, not the
whole candidate set. ``aotpack tune`` on the user's GPU replaces the table (with
``--gemm-candidates`` builds it searches every form).
"""

from __future__ import annotations

from collections.abc import Sequence

from aot.codegen.gemm_sites import Site, find_sites
from aot.schema import Program, TuningChoice, TuningTable
from aot.tuning import GEMM_SITE, TUNING_FORMAT

DEFAULT_ARCH = "sm_90"
DEVICE = "built-in table (aotpack's measurements on an NVIDIA H200)"
HALF = ("float16", "bfloat16")
SHORT_K = 1024  # up to here, blocks of 2 rows x 512 columns of W
LONG_K = 4096  # below it, K not a multiple of 2048: one row per block in steps of 512


def default_form(rows: int, k: int, dtype: str) -> str | None:
    """The form a default build runs a GEMM of ``rows`` x ``k`` in ``dtype`` with on
    ``DEFAULT_ARCH``; None: the library."""
    if rows != 1 or dtype not in HALF:
        return None
    if k <= SHORT_K:
        return "vec_1x2x512"
    if k < LONG_K and k % 2048:
        return "vec_1x1x512"
    return "vec_1x2x1024"


FORMS = ("vec_1x2x512", "vec_1x1x512", "vec_1x2x1024")  # every form ``default_form`` names


def default_site_form(site: Site) -> str | None:
    """The form a default build runs ``site`` with at one row: ``default_form``'s, as its
    ``_rms`` variant where the site has a row-norm (RMSNorm) prologue and its ``_ln`` variant
    where it has a LayerNorm one (GPT-2's), so that the norm kernel, with the residual add in
    it, and its launch go (each block loads A's row once and keeps it in registers for the
    statistics and the products: cheap beside the block's rows of W)."""
    form = default_form(1, site.k, site.dtype)
    if form is None or site.prologue is None:
        return form
    return form + ("_rms" if site.prologue.norm is not None else "_ln")


def default_site_forms(program: Program) -> dict[str, str]:
    """Site id -> ``default_site_form`` for each GEMM site of ``program`` that has one (the ids
    ``aot.codegen.gemm.add_gemm_alternatives`` gives the same program's sites)."""
    return {site.id: form for site in find_sites(program) if (form := default_site_form(site))}


def default_table(programs: Sequence[Program]) -> TuningTable | None:
    """The built-in table of ``programs`` (a bundle's program and its variants, built with only
    the default forms as candidates): each GEMM site's form at every bucket it was compiled for;
    None where no site has one."""
    choices = [
        TuningChoice(program=index, site=site.id, sizes=dict(sizes), choice=cand.name, times_us={})
        for index, program in enumerate(programs)
        for site in program.alternatives
        if site.id.startswith(GEMM_SITE)
        for cand in site.candidates
        for sizes in cand.buckets
    ]
    if not choices:
        return None
    return TuningTable(
        format=TUNING_FORMAT,
        arch=DEFAULT_ARCH,
        device=DEVICE,
        min_gain=0.0,
        choices=tuple(sorted(choices, key=lambda c: (c.program, c.site, sorted(c.sizes.items())))),
    )
