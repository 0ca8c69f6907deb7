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

- on the same GPU (``bench/results/run/tune-gpt-h200-2026-11-29-night.log``, the example GPT at
  one token, K 768), tune took ``vec_1x2x1024`` (one masked K step) over ``vec_1x2x512`` (a whole
  step and a masked one): with the LayerNorm in the prologue fc 5.5-5.8 µs against 6.5-6.9, q/k/v
  5.2-5.8 against 5.7-6.3; without it the o projection 3.3-3.5 against 3.4-3.8.

So: a half-precision GEMM site at a bucket of one row runs ``vec_1x4x512`` where it is a
vocabulary head (N at least ``VOCAB_N``) of K up to ``SHORT_K`` (GPT-2's LM head: its 25k blocks
of two rows took 31-33 µs in the decode step, four rows per block 21.6 alone on the sweep), else
``vec_1x2x512`` where K is at most 512 or is 1024, ``vec_1x2x1024`` at other K up to ``SHORT_K``, ``vec_1x1x512`` where K is below
``LONG_K`` and not a multiple of 2048 (GPT-2's mlp out), ``vec_1x2x1024`` otherwise (``_rms`` or
``_ln``: with the RMSNorm or LayerNorm kernel before it, and the residual add in that kernel,
computed in the GEMV's prologue; there, at K past 512 up to ``SHORT_K``, ``vec_1x4x1024``:
``PROLOGUE_ROWS``). At buckets of 2-16 rows (decode at batch 2-16, a small batch of
a forward) a site of at most ``SMALL_WEIGHT_BYTES`` of weights runs the tensor-core tile tune
chose there (``BUILT_IN_FEW_ROWS``; the norm kernel before it kept), or where that tile makes too
few blocks (N below ``SLICED_SMALL_N``, K from ``SLICED_SMALL_K``) the swapped form in K slices
(``SMALL_SLICED``); larger sites the swapped forms of ``BUILT_IN_LARGE`` (W's rows on the
tensor-core product's wide side; a stacked gate/up counted by its 2N rows), and a vocabulary head
``fewe_16x64x128`` (its ``_rms`` variant where an RMSNorm kernel made A). At 17-32 rows
(``SWAPPED_ROWS_MAX``) every half-precision site runs a swapped form of 32 rows (``BUILT_IN_32``),
but at K below ``SLICED_MIN_K`` tune's ``tile_64x32x128``; at 33-128 rows (``MANY_ROWS_MAX``)
a site of K below ``SLICED_MIN_K`` and at most ``SMALL_WEIGHT_BYTES`` of weights a tile of 64 rows
held to those rows, its first W step loaded before the wait (``MANY_ROW_TILES``' ``tileme_``),
at longer K where N is below ``SLICED_SMALL_N`` the narrow tile in K slices (the library past
them). Attention
sites without a mask (``aot.codegen.flash``) run its flash forms at up to ``ATTENTION_MAX_T``
queries in float16. Every other site and bucket keeps the library. ``FEW_ROWS`` or
``AOTPACK_FEW_ROWS`` name forms for every site instead (or ``off``), for measuring. The table is
recorded for ``DEFAULT_ARCH`` only (the loader applies a tuning table on a
GPU of its arch), and only those forms are compiled, so a build takes a few kernels more, not the
whole candidate set. ``aotpack tune`` on the user's GPU replaces the table (with
``--gemm-candidates`` builds it searches every form).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from aot.codegen.flash import AttnSite
from aot.codegen.gemm_forms import (
    CONFIGS,
    FEW_ROW_CONFIGS,
    MANY_ROW_TILES,
    PROLOGUE_CONFIGS,
    PROLOGUE_MAX_BLOCK_M,
    PROLOGUE_MIN_BLOCK_K,
    VOCAB_N,
    TileConfig,
)
from aot.codegen.gemm_sites import Site, find_sites
from aot.codegen.kernel_source import on_off, setting
from aot.dtypes import ITEMSIZE
from aot.errors import CodegenError
from aot.schema import Program, TuningChoice, TuningTable
from aot.tuning import TUNING_FORMAT

DEFAULT_ARCH = "sm_90"
DEVICE = "built-in table (aotpack's measurements on an NVIDIA H200)"
HALF = ("float16", "bfloat16")
SHORT_K = 1024  # up to here (K at most 512, or 1024), blocks of 2 rows x 512 columns of W
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
# few_ forms, still not there at its sizes; the built-in entry takes them at vocabulary heads only.
# FEW_ROWS at every site, FEW_ROWS_WIDE where N >= WIDE_N, FEW_ROWS_LONG_K where K >= LONG_K (a site
# where a form makes no kernel keeps the library). The environment overrides them for a build
# (bench/decode.py): FEW_ROWS_ENV="<form>[,<form at long K>[,<form at wide N>]]" or "off",
# FEW_ROWS_PROLOGUE_ENV="0"/"1".
FEW_ROWS: str | None = None
FEW_ROWS_LONG_K: str | None = None
FEW_ROWS_WIDE: str | None = None
WIDE_N = 8192
# The built-in few-row entry, where neither FEW_ROWS nor the environment names forms: at sites of
# at most SMALL_WEIGHT_BYTES of weights (a GEMM that reads little, so that cuBLAS's launch and its
# loading cost more than its speed brings) the tensor-core tiles ``aotpack tune`` chose for the
# example mlp at 2-16 rows (bench/results/tune-mlp-vec-h200-2026-11-26.log: 1024 -> 4096
# ``gemv_16x32x128`` 8.8 us against cuBLAS's 10.7, 4096 -> 1024 ``splitk8_16x64x128`` 8.1 against
# 9.3), the norm kernel before them kept; at vocabulary heads (N >= VOCAB_N, where cuBLAS is far
# off at odd N) ``fewe_16x64x128``, the norm kernel in its prologue; larger sites the swapped forms of
# BUILT_IN_LARGE (below; cuBLAS until 2026-11-30). On an H200 at 8 rows:
# - the example mlp (8 MiB sites), paired in one process (bench/results/ab-mlp-tune-forms-h200-
#   2026-11-29-night.json): 0.0921 ms against cuBLAS's 0.1025 (10% faster, 12 of 12 rounds), and no
#   cuBLAS in the process (74 MiB of device memory against 172); the ``fewe_`` forms with the
#   LayerNorm in their prologue had been 7% slower than cuBLAS there
#   (bench/results/ab-mlp-few-rows-h200-2026-11-29.json);
# - Llama-3.2-1B (2026-11-29, bench/results/decode/decode-*-b8-*-h200-2026-11-29-pm.json): its
#   layer GEMMs (8-64 MiB) on the ``fewe_`` forms at every site 1.170 ms a token against cuBLAS's
#   1.001, the LM head alone on ``fewe_16x64x128`` 0.983; GPT-2 (1-4.5 MiB, LM head N 50257) on
#   the ``fewe_`` forms 0.446 against cuBLAS's 0.473, the LM head alone 23.6 us against 109
#   (fewrow_sweep).
BUILT_IN_FEW_ROWS = (
    "gemv_16x32x128",
    None,
    "fewe_16x64x128",
)  # small, small at long K (none: a small site of K >= LONG_K has N <= 1024, SMALL_SLICED), vocabulary
# Llama-3.2-1B's o (8 MiB) makes 64 blocks of 32 columns on gemv_16x32x128 (7.45 us a layer on
# the step's chain at 8 rows, against about 3 for its one-row GEMV at batch 1). On
# ``gemv_16x16x256`` (128 blocks) its first 8 layers at batch 8 took 0.5399 ms a token against
# 0.5298 (1.9% slower, 12 of 12 rounds; bench/results/decode/paired-llama-3.2-1b-8layers-b8-o-tile-
# 16-wide-h200-2026-12-04c.json), but not like for like: its 128 column tiles pass
# ``gemm_stats.MAX_TILES`` (64), so the RMSNorm statistics join with gate/up fell away and the norm
# kernel came back (71 launches a step against 63, about 2 us each at 8 rows). Like for like (its
# MAX_TILES raised to 128 in gemm_stats and gemm_pairs: the join kept, 63 launches both) it still
# lost: 0.5351 against 0.5307 (0.8% slower, 10 of 12 rounds; paired-llama-3.2-1b-8layers-b8-o-tile-
# 16-wide-128-tiles-h200-2026-12-04d.json). Whether o's twice the blocks gained and gate/up's
# twice the statistics tiles (a [128, 16] pair in its registers) took it back was not separated.
SMALL_WEIGHT_BYTES = 8 << 20  # a site's weight of at most this many bytes
# BUILT_IN_FEW_ROWS's small form with W's first two K steps loaded before the wait for the kernel
# before (``gemve_16x32x128``), as the swapped forms and the tiles of 33-128 rows load theirs.
# Without them each of the form's blocks issues its first copies of W only after the wait, from
# memory. SMALL_EARLY (or AOTPACK_SMALL_EARLY): "short" (the default) where K is at most
# SMALL_EARLY_MAX_K, the two steps a third of K or more; "on" at every small site; "off" none.
# Measured on an H100 (2026-12-06, torch 2.11, triton 3.6; both bundles in one process round by
# round, 12 rounds, B / A the median of rounds; bench/RESULTS.md, "the early steps' A tiles held"):
# - K 768 (GPT-2's q/k/v, o, fc): the example GPT at batch 8 x 1 token 0.960 (ab-gpt-small-early-
#   h100-2026-12-06h.json), GPT-2's decode at batch 8, first 8 layers, 0.937 (11 of 12 rounds, the
#   same tokens; decode/paired-gpt2-8layers-b8-small-early-h100-2026-12-06h.json);
# - K 1024 (the example mlp's up): batch 8 1.013, batch 2 1.010 (ab-mlp-small-early-h100-...);
# - K 2048 (Llama-3.2-1B's o): its decode at batch 8, first 8 layers, 1.006 (0 of 12 rounds).
# Two steps of 128 are a third of K 768 and an eighth of 2048, for 50 more registers a thread.
SMALL_EARLY = "short"
SMALL_EARLY_ENV = "AOTPACK_SMALL_EARLY"
SMALL_EARLY_FORM = "gemve_16x32x128"
SMALL_EARLY_MAX_K = 768
SMALL_EARLY_STEPS = 2
# ... but where N is under SLICED_SMALL_N and K at least SLICED_SMALL_K (a down projection: GPT-2's
# mlp out, 3072 -> 768; the example mlp's 4096 -> 1024), tune's tile of 32 rows makes 24-32 blocks
# each streaming long rows: the swapped form in K slices instead (SMALL_SLICED). On an H200 at 8
# rows (bench/split_sweep.py, bench/results/split-sweep-small-h200-2026-12-01.json: a chain of the
# model's layers, cold weights, dependent launch on, µs a GEMM): GPT-2's mlp out 6.1 against 8.5
# on gemv_16x32x128, its four GEMMs a layer 186 against 216 us a step; the mlp's down 6.3-6.4
# against 6.7 on splitk_16x64x128. In whole runs: GPT-2's decode at 8 rows 0.364 ms a token
# against 0.405 (the same tokens; one launch a layer more, the slices' sum), the example mlp at
# batch 8 2.4% faster paired in one process (12 of 12 rounds), batch 1 unchanged; Qwen3-0.6B's
# decode at 8 rows (8 of its layers: o 2048 -> 1024, down 3072 -> 1024) 0.356 against 0.369, the
# same tokens (bench/results/decode/decode-{gpt2-b8,qwen3-0.6b-8layers-b8}-small-{sliced,tile}-
# h200-2026-12-01.json, bench/results/ab-mlp-small-sliced-h200-2026-12-01.json). Wider sites keep the tile: Llama-3.2-1B's
# o (2048 -> 2048), faster alone in K slices (5.8 against 6.7 us), measured slower in the decode
# (below); GPT-2's q/k/v, o and fc (K 768) and the mlp's up (K 1024) are fastest on it.
SLICED_SMALL_N = 2048
SLICED_SMALL_K = 2048
# Larger weights (past SMALL_WEIGHT_BYTES, not a vocabulary head) at 2-16 rows: the swapped forms
# (``fews_``: W's 64 rows on the tensor-core product's wide side, A's rows on its narrow side,
# bench/swap_rows.py), K in slices where the tiles are few, the norm kernels before them kept:
# (at K >= LONG_K, at N >= WIDE_N, elsewhere). On an H200, Llama-3.2-1B's decode at 8 rows with
# them at every layer GEMM (bfloat16, dependent launch on; its o projection, 8 MiB, on the K-sliced
# form too, where the built-in entry keeps ``gemv_16x32x128``) took 0.913 ms a token against the
# built-in entry's 0.980 with cuBLAS there (bench/results/decode/
# decode-llama-3.2-1b-b8-{fews-plain,}-h200-2026-11-30-night.json; 0.980-1.001 on four machines
# since 2026-11-29); the GEMMs alone in a decode step's chain (bench/results/
# swap-rows-h200-2026-11-30-night.json) 756 us against cuBLAS's 828, each site's form as fast at
# 8 rows as the one-row forms at one row on gate/up, down and the LM head, slower on q/k/v and o
# (6.4 and 5.2 us a GEMM against 4.2 and 3.5): their 32-48 tiles of 64 rows need K slices and a
# second kernel to sum them. The default build itself (o on ``gemv_16x32x128``, the LM head on
# ``fewe_16x64x128``): 0.929-0.932 ms a token against 0.788 at one row; with o on the K-sliced form
# 0.973-0.977 (bench/results/decode/decode-llama-3.2-1b-b8-{default,o-sliced}-ab-h200-2026-12-01.json,
# one machine), so an 8 MiB site keeps tune's tile.
# A stacked gate/up (``Site.halves``: N the output's width, W of 2N rows, each block both halves of
# its 64 columns) is wide by its 2N rows, as the measurements above counted it (Llama-3.2-1B's
# 16384); by N it took the K-sliced form at the 0.58B Llama's 2 x 5632 (TinyLlama's shape) and
# Qwen2.5-0.5B's 2 x 4864. On an H200 at 8 rows (bench/split_sweep.py,
# bench/results/split-sweep-h200-2026-12-01.json: a chain of the model's layers, every GEMM its
# own cold weights, dependent launch on, µs a GEMM): the 0.58B's gate/up whole 14.6-15.1 against
# 18.6-18.9 in 2 slices (any other slice count 17.6-22.2), Qwen2.5-0.5B's 7.2 against 11.5; the
# 0.58B's decode at 8 rows 0.542 ms a token against 0.557, one launch a layer fewer, the same
# tokens (bench/results/decode/decode-llama-b8-halves-{wide,n}-h200-2026-12-01.json, one machine,
# one command). Its bytes stay a half's against SMALL_WEIGHT_BYTES: Qwen3-0.6B's gate/up (2 x 3072
# x 1024, 6 MiB a half) on tune's tile took 5.6 us against 9.0 in K slices and 6.5 whole.
BUILT_IN_LARGE = ("fews_splitk_16x64x64", "fews_splitk_16x64x128", "fews_16x64x128")
SMALL_SLICED = BUILT_IN_LARGE[0]
# 17-32 rows (decode at batch 17-32, a forward's small batch): the swapped forms with A's 32 rows
# on the product's narrow side (``gemm_forms.SWAPPED_32``), by BUILT_IN_LARGE's rules at every
# half-precision site (vocabulary heads whole), but at K below SLICED_MIN_K (where the K-sliced
# form makes no kernel) tune's ``tile_64x32x128``; the norm kernels before them kept. On an H200:
# - alone, at 32 rows (bench/split_sweep.py --rows 32, bench/results/split-sweep-32-h200-2026-12-01.json:
#   a chain of the model's layers, every GEMM its own cold weight, dependent launch on, µs a GEMM;
#   cuBLAS as a bundle's library step runs it): Llama-3.2-1B's down (K 8192) 13.4 in K slices of
#   128 against cuBLAS's 14.3 (the 0.58B's, K 5632, 11.2 against 11.9), its gate/up whole 18.4
#   against 18.8, its q/k/v and o in K slices 8.4 and 6.9 against cuBLAS's 7.1 and 6.6 and the
#   tile's 7.2 and 6.7; the LM heads whole: Llama-3.2-1B's 132.7 against 133.9, GPT-2's (N 50257)
#   27.6 against 66.5; GPT-2's mlp out (3072 -> 768) 7.3 in K slices of 64 against 8.1; GPT-2's q/k/v
#   and fc (K 768) on the tile 3.7 and 4.3 (the fastest measured);
# - in the decode at 32 rows, one command each (bench/results/decode/decode-*-b32-*-h200-2026-12-01.json):
#   Llama-3.2-1B with these forms 1.028-1.032 ms a token (two machines) against 1.080 with cuBLAS
#   at every layer GEMM, and 1.073-1.076 with q/k/v and o, or o alone, on the tile: what a GEMM
#   alone measures misses the swapped forms' first W step loaded while the kernel before (the
#   attention, before o) still runs; GPT-2 (the tile at q/k/v, o and fc, the rest as here) 0.596
#   against 0.652 with cuBLAS, the same tokens.
# Past SWAPPED_ROWS_MAX rows: MANY_ROWS below.
BUILT_IN_32 = ("tile_64x32x128", "fews_splitk_32x64x64", "fews_splitk_32x64x128", "fews_32x64x128")
SWAPPED_ROWS_MAX = 32
# BUILT_IN_32's tile with W's first K step (and the bias) loaded before the wait for the kernel
# before (``tilee_64x32x128``, held to 17-SWAPPED_ROWS_MAX rows) where ROWS32_EARLY (or
# AOTPACK_ROWS32_EARLY where set) says "on", as the tiles of 33-128 rows do (MANY_ROWS_EARLY).
# Off: on an H200 (bench/results/ab-gpt-rows32-early-h200-2026-12-03b.json, gpt, both bundles in
# one process, 12 rounds) a prompt of 32 or 24 tokens at batch 1 took 0.978 of the time with it
# (11-12 of 12 rounds), one token at batch 32 (a decode step's shape) 1.014 (1 of 12 faster); a
# decode step runs far more often than a prompt of 17-32 tokens, and both are 32 rows, so the
# rows cannot tell them apart.
ROWS32_EARLY = "off"
ROWS32_EARLY_ENV = "AOTPACK_ROWS32_EARLY"
ROWS32_EARLY_TILE = "tilee_64x32x128"
SLICED_MIN_K = next(c.min_k for c in FEW_ROW_CONFIGS if c.name == BUILT_IN_32[1])  # its shortest K
# 33-MANY_ROWS_MAX rows (a forward's prompt at batch 1): tune's tiles (``gemm_forms.MANY_ROW_TILES``)
# at sites of at most SMALL_WEIGHT_BYTES, ``tilem_64x64x128`` where K is below SLICED_MIN_K and N
# at least SLICED_SMALL_N, else ``tilem_64x32x128`` (``tileme_``: MANY_ROWS_EARLY below; a
# vocabulary head keeps the library). MANY_ROWS or its environment: "split" (the default) those
# tiles at K below SLICED_MIN_K and ``tilem_splitk_64x32x128`` (K slices, whose reduce can run the
# next norm: ``gemm_pairs``) at longer K where N is below SLICED_SMALL_N; "short" only the first;
# "on" the whole tiles at every K; "off" the library. Measured on an H200 (torch 2.11,
# triton 3.6, bench/bundle_paired.py, 12 rounds, bench/results/ab-many-rows-h200-2026-12-03.log),
# B / A per round's median, A the library:
# - the example GPT (K 768 at q/k/v, o and fc; K 3072 at mlp out) "short": 0.958 at B=1 S=128
#   (0.460 -> 0.441 ms, 12/12 rounds), 0.976 at S=64 (12/12); as built (q/k/v after mlp out kept
#   on the library at 33-128 rows, ``gemm_pairs.join``; ab-gpt-many-rows-default-*.json) 0.965 at
#   S=128 (0.482 -> 0.467 ms), 0.974 at S=64 and S=100, 0.983 at B=2 S=48; "on" (the mlp out on
#   a tile too): 1.050 and 1.036 (slower); alone (bench/split_sweep.py --rows 128, 2026-12-02,
#   cold W) q/k/v 4.93 -> 4.57 µs, o 3.70 -> 3.08, fc 5.46 -> 4.77, mlp out 8.26 -> 8.66;
# - the example MLP (K 1024 and 4096) "on": 1.131 at 64 rows, 1.116 at 48 ("short" keeps its
#   library); the 0.58B Llama (K 2048, its o the only site of at most 8 MiB) "on": 1.005 at S=128;
#   Llama-3.2-1B alone: q/k/v 7.44 library against 8.69 on the tile.
# - "split" against "short", both bundles in one process (bench/results/ab-gpt-many-rows-split-
#   h200-2026-12-04.json, 12 rounds, outputs within 0.0039): the example GPT (its mlp out, K 3072
#   N 768, in 4 K slices whose reduce runs the next layer's residual add + LayerNorm, that kernel
#   gone) 0.955 at B=1 S=128 (0.431 -> 0.412 ms), 0.906 at S=64, 0.955 at S=100, 12/12 rounds
#   each; the example MLP (its last down projection, K 4096 N 1024; ab-mlp-many-rows-split-h200-
#   2026-12-04.json, a noisier machine) 0.987 at 64 rows, 0.979 at 48.
# The swapped forms of A's 64 or 128 rows (the 17-32-row rules carried further) lost at every
# site measured (GPT-2's mlp out in K slices 12.4-13.1 µs against the library's 8.26; the 0.58B
# Llama's forward 1.25x slower).
MANY_ROWS = "split"
MANY_ROWS_MAX = 128
MANY_ROWS_ENV = "AOTPACK_MANY_ROWS"
# Those tiles with W's first K step (and the bias) loaded before the wait for the kernel before
# (``tileme_``): "on" or "off" (MANY_ROWS_EARLY, or AOTPACK_MANY_ROWS_EARLY where set). On by
# default: the example GPT, both bundles in one process (bench/results/ab-gpt-many-rows-early-
# h200-2026-12-03.json, tileme_ / tilem_): 0.987 at B=1 S=128 (10 of 12 rounds faster), 0.984 at
# S=64 and S=100, 0.991 at B=2 S=48; outputs bit for bit equal.
MANY_ROWS_EARLY = "on"
MANY_ROWS_EARLY_ENV = "AOTPACK_MANY_ROWS_EARLY"
FEW_ROWS_PROLOGUE = True
FEW_ROWS_MAX = 16
FEW_ROWS_ENV = "AOTPACK_FEW_ROWS"
FEW_ROWS_PROLOGUE_ENV = "AOTPACK_FEW_ROWS_PROLOGUE"
# One row at a site whose norm the GEMV computes in its prologue (``_rms``, ``_ln``): every block
# loads the row and sums its statistics again before its products, so there a form's blocks cost
# more than the bytes of W they stream. Where K is past half SHORT_K and at most SHORT_K and
# ``default_form`` names two rows of W a block, such a site runs four in a step of 1024
# (PROLOGUE_ROWS: half the blocks or fewer, half the row's loads and statistics per byte of W). On an H200, decode at batch 1, the first 8
# layers, each build a bundle of its own, both in one process round by round
# (bench/decode_paired.py, 16 rounds; bench/results/decode/paired-*-h200-2026-12-02d.json):
# - GPT-2 (K 768, its LayerNorms in q/k/v and fc): four rows 0.1617 ms a token against two rows'
#   0.1676 (3.4% faster, 16 of 16 rounds), eight rows (``vec_1x8x1024``) 0.1514 against four
#   rows' 0.1505 (another machine); the same tokens in every arm;
# - Llama-3.2-1B (K 2048, its RMSNorms in q/k/v and gate/up): four rows 0.4627 against 0.4630
#   (10 of 16 rounds: no gain; its greedy tokens part at the fifth step, the sums' order changed,
#   random weights' logits lie close), and the 0.58B Llama (K 2048) took 0.389 ms a token with
#   four rows in a process of its own (0.374-0.378 with two in earlier commands, not paired);
#   so K past SHORT_K keeps two rows. With the RMSNorm applied after the products (the default
#   since 2026-12-04, ``gemm_prologue.FACTORED``) again (bench/results/decode/paired-llama-3.2-1b-
#   8layers-{four-rows-factored,vec-1x2x512}-h200-2026-12-04c.json, 12 rounds): four rows 0.4493
#   against two rows' 0.4504 (7 of 12 rounds: a tie), ``vec_1x2x512`` (two rows, 4 warps, K in
#   steps of 512) 0.4848: 7% slower.
# - the mlp (K 1024, its LayerNorms in the four up projections, ``vec_1x2x512`` before: two rows
#   on 4 warps in two K steps, 2,048 blocks), a forward call at batch 1 under the torch loader,
#   both bundles in one process (bench/bundle_paired.py, 12 rounds of 100 calls;
#   bench/results/ab-mlp-prologue-{rows,eight-rows}-h200-2026-12-05.json): four rows in one K step of 1024
#   0.0558 ms a call against 0.0643 (13% faster, 12 of 12 rounds), eight rows 0.0580 against
#   0.0656; batch 8 (not one row) unchanged, 0.9953 and 1.0009. So at K 1024 ``vec_1x2x512``
#   takes four rows too; at K up to 512 (a step of 1024 half masked) it keeps its form, unmeasured.
# ONE_ROW_PROLOGUE (or ONE_ROW_PROLOGUE_ENV, for a build) names the one-row form of every such
# site instead, for measuring.
PROLOGUE_ROWS = {"vec_1x2x1024": "vec_1x4x1024", "vec_1x2x512": "vec_1x4x1024"}
ONE_ROW_PROLOGUE: str | None = None
ONE_ROW_PROLOGUE_ENV = "AOTPACK_ONE_ROW_PROLOGUE"


# Attention (``aot.codegen.flash``: an SDPA call without a mask over heads of row-major
# projections, as the example GPT's): ``aotpack tune`` chose the Triton flash forms over the
# library's (cuDNN's flash kernel) at every site it timed, fp16, head dim 64 (on an H100,
# bench/results/tune-gpt-whole-plan-h100-2026-11-26.log, µs per call, library → form):
# one query 4.8-5.7 → 1.4-2.2 (``flash_16x32``), 128 queries 5.7-6.9 → 3.8-4.3 at batch 1 and
# 7.6-8.0 → 6.0-6.2 at batch 8 (``flash_64x64``); the whole program at 128 queries 488 → 411 µs.
# On an H200, the example GPT's default build with and without them, paired in one process
# (bench/results/ab-gpt-flash-default-h200-2026-11-29-night.json): 0.462 against 0.504 ms at batch
# 1 x 128 tokens, 0.736 against 0.766 at batch 8, 0.272 against 0.323 at one token. So a default
# build runs them where that was measured: float16, head dim up to ATTENTION_MAX_HEAD_DIM, query
# lengths up to ATTENTION_MAX_T (the 16-row form below ATTENTION_WIDE_T; 2-127 queries were not
# timed but 1 and 128); longer queries keep the library, whose kernels were not timed against them.
ATTENTION_SHORT = "flash_16x32"
ATTENTION_WIDE = "flash_64x64"
ATTENTION_WIDE_T = 16
ATTENTION_MAX_T = 128
ATTENTION_MAX_HEAD_DIM = 64
# bfloat16 too: the example GPT in bfloat16 (bench/models/gpt_bf16.py), its default build with and
# without them paired in one process on an H200 (bench/results/ab-gpt-bf16-flash-default-h200-
# 2026-11-29-late.json): 0.458 against 0.494 ms at batch 1 x 128 tokens, 0.730 against 0.755 at
# batch 8, 0.251 against 0.284 at one token. Triton's interpreter computes a bfloat16 tl.dot
# wrongly, so the GPU checks their bfloat16 numerics (tests/gpu/test_gemm_gpu.py), not CI.
ATTENTION_DTYPES = ("float16", "bfloat16")
ATTENTION_ENV = "AOTPACK_DEFAULT_ATTENTION"  # "off": the library at every attention site, for measuring


# A form's pipeline stages (``TileConfig.num_stages``: K steps of A and W in flight a block, less
# one) instead of its own, for measuring: "<form>=<stages>[,<form>=<stages>...]" (the form's name
# as ``aotpack inspect`` and the candidates table give it, before its ``_ln``/``_rms``/``_stats``
# suffixes; stages 1-8), e.g. "fews_16x64x128=4". Read where a GEMM kernel is rendered
# (``gemm_render``), so every site and bucket that runs the form takes it.
FORM_STAGES_ENV = "AOTPACK_FORM_STAGES"


def form_stages() -> dict[str, int]:
    """``FORM_STAGES_ENV``'s stages by form name (empty where unset); a name that is no GEMM form
    or a count outside 1-8 is a ``CodegenError`` naming the variable and what it takes."""
    text = os.environ.get(FORM_STAGES_ENV, "").strip()
    if not text:
        return {}
    forms = {c.name for c in (*default_configs(), *CONFIGS, *FEW_ROW_CONFIGS)}
    stages: dict[str, int] = {}
    for part in text.split(","):
        name, _, count = (t.strip() for t in part.partition("="))
        if name not in forms or not count.isdigit() or not 1 <= int(count) <= 8:
            raise CodegenError(
                f"{FORM_STAGES_ENV}={text!r}: expected '<form>=<stages 1-8>[,<form>=<stages>...]' "
                f"({part.strip()!r} is not), the forms among {', '.join(sorted(forms))}; unset it for "
                "each form's own"
            )
        stages[name] = int(count)
    return stages


def few_row_configs() -> tuple[TileConfig, ...]:
    """The forms FEW_ROWS and its environment may name: the few-row forms, and the tensor-core
    forms of CONFIGS that take 2-FEW_ROWS_MAX rows (those ``aotpack tune`` chooses among there),
    held to those rows: at a bucket of one row the one-row form stays (``gemm.add_gemm_alternatives``
    gives each bucket the narrowest form named for it)."""
    tiles = (c for c in CONFIGS if c.dot and c.min_m <= 2 and c.max_m >= FEW_ROWS_MAX)
    return (*FEW_ROW_CONFIGS, *(replace(c, min_m=2, max_m=FEW_ROWS_MAX) for c in tiles))


def default_configs() -> tuple[TileConfig, ...]:
    """The configs the default build's form names refer to (``gemm.add_gemm_alternatives``'s
    ``configs``): the one-row forms, ``few_row_configs``, the tile of ``BUILT_IN_32`` held to
    17-SWAPPED_ROWS_MAX rows and the tiles of 33-MANY_ROWS_MAX rows."""
    tiles = [
        replace(c, min_m=FEW_ROWS_MAX + 1, max_m=SWAPPED_ROWS_MAX) for c in CONFIGS if c.name in BUILT_IN_32
    ]
    (tile,) = [c for c in tiles if c.name == BUILT_IN_32[0]]
    tiles.append(replace(tile, name=ROWS32_EARLY_TILE, w_early=1))
    return (
        *(c for c in CONFIGS if not c.dot),
        *PROLOGUE_CONFIGS,
        *few_row_configs(),
        small_early_config(),
        *tiles,
        *MANY_ROW_TILES,
    )  # one-row forms first, as sites list them


def small_early() -> str:
    """Where the built-in small form of 2-16 rows loads W early: "short", "on" or "off"
    (SMALL_EARLY, or AOTPACK_SMALL_EARLY where set)."""
    return setting(SMALL_EARLY_ENV, SMALL_EARLY, ("short", "on", "off"))


def small_early_at(k: int) -> bool:
    """Whether a small site of inner dimension ``k`` runs SMALL_EARLY_FORM at 2-16 rows."""
    where = small_early()
    return where == "on" or (where == "short" and k <= SMALL_EARLY_MAX_K)


def small_early_config() -> TileConfig:
    """``SMALL_EARLY_FORM``: BUILT_IN_FEW_ROWS's small form with W's first SMALL_EARLY_STEPS K
    steps loaded before the wait, held to 2-FEW_ROWS_MAX rows."""
    (small,) = [c for c in CONFIGS if c.name == BUILT_IN_FEW_ROWS[0]]
    return replace(small, name=SMALL_EARLY_FORM, w_early=SMALL_EARLY_STEPS, min_m=2, max_m=FEW_ROWS_MAX)


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
    names = [f.name for f in few_row_configs()]
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
    flag = setting(FEW_ROWS_PROLOGUE_ENV, None, ("0", "1"))
    if flag is not None:
        prologue = flag == "1"
    for name in forms:
        if name is not None and name not in names:
            raise CodegenError(
                f"few-row form {name!r} (gemm_defaults.FEW_ROWS or {FEW_ROWS_ENV}) is not a form of "
                f"gemm_forms.FEW_ROW_CONFIGS nor a tile form of CONFIGS for 2-{FEW_ROWS_MAX} rows: expected one "
                f"of {', '.join(names)}, or 'off'"
            )
    if not every:
        forms = list(BUILT_IN_FEW_ROWS)
    return FewRows(*forms, prologue=prologue, every_site=every)


def many_rows() -> str:
    """Where tiles run at 33-MANY_ROWS_MAX rows: "on", "split", "short" or "off" (MANY_ROWS, or the
    environment's where set)."""
    return setting(MANY_ROWS_ENV, MANY_ROWS, ("on", "split", "short", "off"))


def many_row_tile(n: int, sliced: bool = False) -> str:
    """The tile of 33-MANY_ROWS_MAX rows for an output N wide: 64 columns where N is at least
    SLICED_SMALL_N, else 32 (``sliced``: 32 in K slices); ``tileme_`` where MANY_ROWS_EARLY (or
    its environment) says "on"."""
    prefix = "tileme_" if on_off(MANY_ROWS_EARLY_ENV, MANY_ROWS_EARLY) else "tilem_"
    if sliced:
        return prefix + "splitk_64x32x128"
    return prefix + ("64x64x128" if n >= SLICED_SMALL_N else "64x32x128")


def default_attention_form(site: AttnSite, seq: int) -> str | None:
    """The flash form a default build runs attention ``site`` with at query length ``seq`` on
    ``DEFAULT_ARCH``; None: the library."""
    if (
        not on_off(ATTENTION_ENV, "on")
        or site.dtype not in ATTENTION_DTYPES
        or site.head_dim > ATTENTION_MAX_HEAD_DIM
        or not 1 <= seq <= ATTENTION_MAX_T
    ):
        return None
    return ATTENTION_SHORT if seq < ATTENTION_WIDE_T else ATTENTION_WIDE


def built_in_configs(site: Site) -> tuple[TileConfig, ...]:
    """The configs of the built-in entry's forms for ``site`` at one row, 2-16 and
    17-SWAPPED_ROWS_MAX rows that CONFIGS lacks (a norm-prologue site's form of
    PROLOGUE_CONFIGS, the swapped forms of ``BUILT_IN_LARGE``, ``SMALL_SLICED`` and
    ``BUILT_IN_32``, a vocabulary head's ``fewe_16x64x128``): what a candidates build offers
    ``aotpack tune`` beside CONFIGS, so that tune chooses among the forms a default build would
    run too."""
    plain = {c.name for c in CONFIGS}
    forms = {
        _one_row(site),
        *(default_form(rows, site.k, site.dtype, site.n, site.halves) for rows in (2, FEW_ROWS_MAX + 1)),
    } - {None, *plain}
    return tuple(c for c in (*PROLOGUE_CONFIGS, *FEW_ROW_CONFIGS, small_early_config()) if c.name in forms)


def default_form(rows: int, k: int, dtype: str, n: int = 0, halves: bool = False) -> str | None:
    """The form a default build runs a GEMM of ``rows`` x ``k`` (x ``n`` columns; 0: not known,
    which the built-in few-row entry does not take) in ``dtype`` with on ``DEFAULT_ARCH``; None:
    the library. ``halves``: the site computes both halves of a stacked weight of ``2 * n`` rows
    (``Site.halves``, a gate/up): at 2-16 rows its tiles are ``2 * n`` rows of W for ``WIDE_N``
    (see ``BUILT_IN_LARGE``)."""
    if dtype not in HALF:
        return None
    w_rows = 2 * n if halves else n  # the rows of W a swapped form's tiles stream
    if rows == 1:
        if n >= VOCAB_N and k <= SHORT_K:  # a vocabulary head of short K: its blocks' fixed cost
            return "vec_1x4x512"
        if k <= SHORT_K:  # one step of 1024 where 512 would take a whole step and a masked one
            return "vec_1x2x512" if k <= 512 or k % 512 == 0 else "vec_1x2x1024"
        if k < LONG_K and k % 2048:
            return "vec_1x1x512"
        return "vec_1x2x1024"
    if 2 <= rows <= FEW_ROWS_MAX:
        few = few_row_forms()
        if not few.every_site:  # the built-in entry: vocabulary heads, small and large weights
            if n >= VOCAB_N:
                return few.wide
            if n <= 0:
                return None
            if k * n * ITEMSIZE[dtype] <= SMALL_WEIGHT_BYTES:  # a half's bytes (see BUILT_IN_LARGE)
                if n < SLICED_SMALL_N and k >= SLICED_SMALL_K:  # tune's tile: too few blocks
                    return SMALL_SLICED
                return SMALL_EARLY_FORM if small_early_at(k) else few.form
            form, long_k, wide = BUILT_IN_LARGE
            return long_k if k >= LONG_K else wide if w_rows >= WIDE_N else form
        if few.long_k is not None and k >= LONG_K:
            return few.long_k
        if few.wide is not None and w_rows >= WIDE_N:
            return few.wide
        return few.form
    if FEW_ROWS_MAX < rows <= SWAPPED_ROWS_MAX and n > 0:
        tile, sliced, long_k, wide = BUILT_IN_32
        if n >= VOCAB_N:
            return wide
        if n < SLICED_SMALL_N and k >= SLICED_SMALL_K:  # few tiles of 64 rows, long K
            return sliced
        if k >= LONG_K:
            return long_k
        if w_rows >= WIDE_N:
            return wide
        if k >= SLICED_MIN_K:
            return sliced
        return ROWS32_EARLY_TILE if on_off(ROWS32_EARLY_ENV, ROWS32_EARLY) else tile
    if SWAPPED_ROWS_MAX < rows <= MANY_ROWS_MAX and 0 < n < VOCAB_N:
        where = many_rows()
        if where == "off" or k * w_rows * ITEMSIZE[dtype] > SMALL_WEIGHT_BYTES:
            return None
        if k < SLICED_MIN_K:
            return many_row_tile(n)
        if where == "split":  # long K: the narrow tile in K slices where N makes few tiles
            return many_row_tile(n, sliced=True) if n < SLICED_SMALL_N else None
        return many_row_tile(0) if where == "on" else None
    return None


FORMS = (
    "vec_1x2x512",
    "vec_1x1x512",
    "vec_1x2x1024",
    "vec_1x4x512",
)  # every form ``default_form`` names at one row
PROLOGUE_FORMS = tuple(c.name for c in PROLOGUE_CONFIGS)  # what ONE_ROW_PROLOGUE may name besides FORMS


def one_row_prologue_form() -> str | None:
    """The one-row form of sites with a norm prologue: the environment's, else ONE_ROW_PROLOGUE
    (None: ``default_form``'s)."""
    name = os.environ.get(ONE_ROW_PROLOGUE_ENV, "").strip() or ONE_ROW_PROLOGUE
    if name is not None and name not in (*FORMS, *PROLOGUE_FORMS):
        raise CodegenError(
            f"one-row prologue form {name!r} (gemm_defaults.ONE_ROW_PROLOGUE or {ONE_ROW_PROLOGUE_ENV}): "
            f"expected one of {', '.join((*FORMS, *PROLOGUE_FORMS))}"
        )
    return name


def _one_row(site: Site) -> str | None:
    """The form ``site`` runs at one row: ``default_form``'s, but where the site has a norm
    prologue (and ``default_form`` names a form) ``one_row_prologue_form``, else
    ``prologue_rows``'s for ``default_form``'s."""
    one = default_form(1, site.k, site.dtype, site.n)
    if one is not None and site.prologue is not None:
        return one_row_prologue_form() or prologue_rows(one, site.k)
    return one


def prologue_rows(form: str, k: int) -> str:
    """``default_form``'s one-row ``form`` at K ``k`` where the site's norm is its prologue:
    PROLOGUE_ROWS's where K is past half SHORT_K and at most SHORT_K (see PROLOGUE_ROWS)."""
    return PROLOGUE_ROWS.get(form, form) if SHORT_K // 2 < k <= SHORT_K else form


def _variant(site: Site, form: str) -> str:
    """``form`` as its ``_rms`` or ``_ln`` variant where ``site`` has that prologue and the form
    has the variant (``gemm_render.render_candidates``); else ``form``."""
    if site.prologue is None:
        return form
    cfg = next((c for c in default_configs() if c.name == form), None)
    if cfg is None or cfg.split_k != 1 or cfg.rows_apart:  # no prologue forms
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
    one = _one_row(site)
    if one is not None:
        forms.append(_variant(site, one))
    few = default_form(2, site.k, site.dtype, site.n, site.halves)
    if few is not None:
        forms.append(_variant(site, few) if few_row_forms().prologue else few)
    more = default_form(FEW_ROWS_MAX + 1, site.k, site.dtype, site.n, site.halves)
    if more is not None:  # 17-SWAPPED_ROWS_MAX rows: a swapped form (none has a prologue variant)
        forms.append(more)
    many = default_form(SWAPPED_ROWS_MAX + 1, site.k, site.dtype, site.n, site.halves)
    if many is not None and many not in forms:  # 33-MANY_ROWS_MAX rows, where named
        forms.append(many)
    return tuple(forms)


def one_row_forms(program: Program) -> dict[str, str]:
    """Site id -> the form ``default_site_forms`` runs at one row, for each GEMM site of
    ``program`` that has one (the ids ``aot.codegen.gemm.add_gemm_alternatives`` gives the same
    program's sites)."""
    out = {}
    for site in find_sites(program):
        one = _one_row(site)
        if one is not None:
            out[site.id] = _variant(site, one)
    return out


def default_table(programs: Sequence[Program]) -> TuningTable | None:
    """The built-in table of ``programs`` (a bundle's program and its variants, built with only
    the default forms as candidates): each GEMM or attention site's form at every bucket it was
    compiled for; None where no site has one."""
    choices = [
        TuningChoice(program=index, site=site.id, sizes=dict(sizes), choice=cand.name, times_us={})
        for index, program in enumerate(programs)
        for site in program.alternatives
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
