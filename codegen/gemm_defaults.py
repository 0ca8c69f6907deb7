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
site and bucket keeps the library, but for the few-row entry: at buckets of 2-16 rows (decode at
batch 2-16) a site with small weights (below ``SMALL_WEIGHT_BYTES``) or a vocabulary's N runs a
tensor-core ``fewe_`` form (``BUILT_IN_FEW_ROWS``), as its ``_rms``/``_ln`` variant where a norm
kernel made A; larger sites keep cuBLAS, which streamed Llama-3.2-1B's layer weights faster in a
whole decode step. ``FEW_ROWS`` or ``AOTPACK_FEW_ROWS`` name forms for every site instead (or
``off``), for measuring. The table is recorded for ``DEFAULT_ARCH`` only (the loader applies a tuning table on a
GPU of its arch), and only those forms are compiled, so a build takes a few kernels more, not the
whole candidate set. ``aotpack tune`` on the user's GPU replaces the table (with
``--gemm-candidates`` builds it searches every form).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

from aot.codegen.gemm_forms import CONFIGS, FEW_ROW_CONFIGS, PROLOGUE_MAX_BLOCK_M, PROLOGUE_MIN_BLOCK_K
from aot.codegen.gemm_sites import Site, find_sites
from aot.dtypes import ITEMSIZE
from aot.errors import CodegenError
from aot.schema import Program, TuningChoice, TuningTable
from aot.tuning import GEMM_SITE, TUNING_FORMAT

DEFAULT_ARCH = "sm_90"
DEVICE = "built-in table (aotpack's measurements on an NVIDIA H200)"
HALF = ("float16", "bfloat16")
SHORT_K = 1024  # up to here, blocks of 2 rows x 512 columns of W
LONG_K = 4096  # below it, K not a multiple of 2048: one row per block in steps of 512


# Few rows (decode at batch 2..FEW_ROWS_MAX): tensor-core tiles of 16 rows
# (``gemm_forms.FEW_ROW_CONFIGS``), as their ``_rms``/``_ln`` variant where a norm kernel made A
# (FEW_ROWS_PROLOGUE), so that the norm kernel goes. On an H200 (``bench/fewrow_sweep.py``,
# ``bench/results/fewrow-sweep-h200-2026-11-29.json``: bfloat16, cold weights, 8 rows, µs per GEMM
# alone, cuBLAS → the form): Llama-3.2-1B q/k/v 6.83 → 7.07 (``few_16x32x256``), o 6.31 → 6.79,
# gate/up 19.58 → 19.99 (the 16x64x128 tile), down (K 8192) 14.81 → 15.12 (its split-K form), the
# LM head 127.7 → 123.6; GPT-2 q/k/v 4.49 → 4.04, o 4.16 → 3.47, fc 4.82 → 4.40, its LM head
# (N 50257) 109.1 → 23.6. About even alone on the Llama shapes. In a whole decode step they lose
# (``bench/results/decode/decode-*-fewrows-h200-2026-11-29.json``, 8 rows, the environment's
# ``few_16x32x256,few_splitk_16x64x128,few_16x64x128``):
# Llama-3.2-1B 1.298 ms/token against cuBLAS's 1.032, GPT-2 0.471 against 0.489 (another run):
# the ``_rms`` forms read A's rows again in every block, and W's loads wait for the kernel before
# (no early loads under dependent launch, as the one-row forms have). So FEW_ROWS, every site,
# stays None.
# The ``fewe_*`` forms (gemm_forms.FEW_ROW_CONFIGS) answer both: W's first K steps load before the
# wait, and their ``_rms`` forms sum the statistics in the K loop (bfloat16). At every site of
# Llama-3.2-1B at 8 rows they ran 1.170 ms a token against cuBLAS's 1.001 (below): better than the
# few_ forms, still not there at its sizes; so they take the small sites only.
# FEW_ROWS at every site, FEW_ROWS_WIDE where N >= WIDE_N, FEW_ROWS_LONG_K where K >= LONG_K (a site
# where a form makes no kernel keeps the library). The environment overrides them for a build
# (bench/decode.py): FEW_ROWS_ENV="<form>[,<form at long K>[,<form at wide N>]]" or "off",
# FEW_ROWS_PROLOGUE_ENV="0"/"1".
FEW_ROWS: str | None = None
FEW_ROWS_LONG_K: str | None = None
FEW_ROWS_WIDE: str | None = None
WIDE_N = 8192
# The built-in few-row entry, where neither FEW_ROWS nor the environment names forms: the fewe_
# forms (at long K, at wide N: as above) at the sites where they won in a whole step, weights
# below SMALL_WEIGHT_BYTES (a launch-bound GEMM, which the early W loads and the norm kernels
# folded away win) and vocabulary heads (N >= VOCAB_N, where cuBLAS is far off at odd N). On an
# H200 at 8 rows (2026-11-29: bench/results/decode/decode-*-b8-*-h200-2026-11-29-pm.json,
# bench/results/ab-mlp-few-rows-h200-2026-11-29.json):
# - Llama-3.2-1B's layer GEMMs (8-64 MiB of weights each) at every site 1.170 ms a token against
#   cuBLAS's 1.001; with the o projection (8 MiB) and the LM head on them 0.991, the LM head alone
#   (this table) 0.983 (each on another machine);
# - GPT-2 (1-4.5 MiB, LM head N 50257): 0.446 against cuBLAS's 0.473 in one command, 70 launches a
#   step against 118, the same tokens; the LM head alone 23.6 us against 109 (fewrow_sweep);
# - the example mlp (8 MiB sites, K 1024 and 4096), paired in one process: 0.1105 ms at batch 8
#   against cuBLAS's 0.1024 (7% slower, 12 of 12 rounds), though 74 MiB of device memory against
#   172 (cuBLAS never loads). Hence below 8 MiB, not at it.
BUILT_IN_FEW_ROWS = ("fewe_16x32x256", "fewe_splitk_16x64x128", "fewe_16x64x128")
SMALL_WEIGHT_BYTES = 8 << 20  # a site's weight below this many bytes
VOCAB_N = 32000
FEW_ROWS_PROLOGUE = True
FEW_ROWS_MAX = 16
FEW_ROWS_ENV = "AOTPACK_FEW_ROWS"
FEW_ROWS_PROLOGUE_ENV = "AOTPACK_FEW_ROWS_PROLOGUE"


class FewRows(NamedTuple):
    """The few-row forms in effect (``few_row_forms``)."""

    form: str | None  # at every site it takes
    long_k: str | None  # where K >= LONG_K
    wide: str | None  # where N >= WIDE_N
    prologue: bool  # whether their norm-prologue variants run
    every_site: bool  # named for every site (FEW_ROWS, the environment), not the built-in entry's


def few_row_forms() -> FewRows:
    """The few-row forms in effect: the module's settings, or the environment's where set, else
    the built-in entry (``BUILT_IN_FEW_ROWS`` at small and vocabulary sites)."""
    names = [f.name for f in FEW_ROW_CONFIGS]
    forms = [FEW_ROWS, FEW_ROWS_LONG_K, FEW_ROWS_WIDE]
    every = FEW_ROWS is not None
    prologue = FEW_ROWS_PROLOGUE
    text = os.environ.get(FEW_ROWS_ENV, "").strip()
    if text:
        parts = [p.strip() for p in text.split(",")]
        every = True
        if parts == ["off"]:
            forms = [None, None, None]
        elif 1 <= len(parts) <= 3 and all(parts):
            forms = [*parts, None, None][:3]
        else:
            raise CodegenError(
                f"{FEW_ROWS_ENV}={text!r}: expected 'off' or '<form>[,<form at K >= {LONG_K}>"
                f"[,<form at N >= {WIDE_N}>]]' with forms among {', '.join(names)}"
            )
    flag = os.environ.get(FEW_ROWS_PROLOGUE_ENV, "").strip()
    if flag:
        if flag not in ("0", "1"):
            raise CodegenError(f"{FEW_ROWS_PROLOGUE_ENV}={flag!r}: expected '0' or '1'")
        prologue = flag == "1"
    for name in forms:
        if name is not None and name not in names:
            raise CodegenError(
                f"few-row form {name!r} (gemm_defaults.FEW_ROWS or {FEW_ROWS_ENV}) is not a form of "
                f"gemm_forms.FEW_ROW_CONFIGS: expected one of {', '.join(names)}, or 'off'"
            )
    if not every:
        forms = list(BUILT_IN_FEW_ROWS)
    return FewRows(*forms, prologue=prologue, every_site=every)


def default_form(rows: int, k: int, dtype: str, n: int = 0) -> str | None:
    """The form a default build runs a GEMM of ``rows`` x ``k`` (x ``n`` columns; 0: not known,
    which the built-in few-row entry does not take) in ``dtype`` with on ``DEFAULT_ARCH``; None:
    the library."""
    if dtype not in HALF:
        return None
    if rows == 1:
        if k <= SHORT_K:
            return "vec_1x2x512"
        if k < LONG_K and k % 2048:
            return "vec_1x1x512"
        return "vec_1x2x1024"
    if 2 <= rows <= FEW_ROWS_MAX:
        few = few_row_forms()
        if not few.every_site and not (0 < k * n * ITEMSIZE[dtype] < SMALL_WEIGHT_BYTES or n >= VOCAB_N):
            return None  # the built-in entry: small weights and vocabulary heads only
        if few.long_k is not None and k >= LONG_K:
            return few.long_k
        if few.wide is not None and n >= WIDE_N:
            return few.wide
        return few.form
    return None


FORMS = ("vec_1x2x512", "vec_1x1x512", "vec_1x2x1024")  # every form ``default_form`` names at one row


def _variant(site: Site, form: str) -> str:
    """``form`` as its ``_rms`` or ``_ln`` variant where ``site`` has that prologue and the form
    has the variant (``gemm_render.render_candidates``); else ``form``."""
    if site.prologue is None:
        return form
    cfg = next((c for c in (*CONFIGS, *FEW_ROW_CONFIGS) if c.name == form), None)
    if cfg is None or cfg.split_k != 1:
        return form
    if site.prologue.norm is not None:
        return form + "_rms" if not cfg.dot or cfg.row_norm else form
    if cfg.block_m <= PROLOGUE_MAX_BLOCK_M and cfg.block_k >= PROLOGUE_MIN_BLOCK_K:
        return form + "_ln"
    return form


def default_site_forms(site: Site) -> tuple[str, ...]:
    """The forms a default build compiles for ``site`` (each runs at the buckets its config's
    rows admit): ``default_form``'s at one row, as its ``_rms`` variant where the site has a
    row-norm (RMSNorm) prologue and its ``_ln`` variant where it has a LayerNorm one (GPT-2's),
    so that the norm kernel, with the residual add in it, and its launch go (each block loads
    A's row once and keeps it in registers for the statistics and the products: cheap beside the
    block's rows of W); and the few-row form where FEW_ROWS (or its environment override) names
    one, as its prologue variant where it has one and FEW_ROWS_PROLOGUE holds."""
    forms = []
    one = default_form(1, site.k, site.dtype)
    if one is not None:
        forms.append(_variant(site, one))
    few = default_form(2, site.k, site.dtype, site.n)
    if few is not None:
        forms.append(_variant(site, few) if few_row_forms().prologue else few)
    return tuple(forms)


def one_row_forms(program: Program) -> dict[str, str]:
    """Site id -> the form ``default_site_forms`` runs at one row, for each GEMM site of
    ``program`` that has one (the ids ``aot.codegen.gemm.add_gemm_alternatives`` gives the same
    program's sites)."""
    out = {}
    for site in find_sites(program):
        one = default_form(1, site.k, site.dtype)
        if one is not None:
            out[site.id] = _variant(site, one)
    return out


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
