"""GEMM candidate forms: the tile configs compiled for every site and the knobs that pick them.

The performance knobs of the GEMM candidates (``aot.codegen.gemm``) live here: which forms are
compiled (``CONFIGS``), how split-K slices K, when a LayerNorm prologue is fused, and how much
shared memory a block may take per arch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

HEURISTIC = "gemm-candidates-v1"


@dataclass(frozen=True)
class TileConfig:
    """One candidate form: block sizes, warps, pipeline stages, K slices (1: no split-K; 0: chosen
    per site by ``split_factor``), and the bucket rows ``M`` it is meant for (inclusive)."""

    name: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    min_m: int = 1
    max_m: int = 1 << 62
    min_k: int = 1  # a candidate only where K is at least this (split-K: a couple of K blocks a slice)
    min_n: int = 0  # a candidate only where N is at least this (a vocabulary head's form)
    dot: bool = True  # False: a dot-free GEMV body for one row (BLOCK_M = 1), products summed over K
    target_blocks: int = 0  # split-K: blocks to aim for (0: SPLIT_TARGET_BLOCKS)
    # a tensor-core form of at most PROLOGUE_MAX_BLOCK_M rows, no split: also rendered with a
    # row-norm (RMSNorm) prologue (``<form>_rms``); the one-row forms always are
    row_norm: bool = False
    # a tensor-core form: W's first ``w_early`` K steps loaded before the wait for the kernel
    # before (``kernel_source.kernel_module``'s ``early``): under dependent launch they stream
    # while that kernel still runs; the loop takes the rest
    w_early: int = 0
    # its ``_rms`` form: the row norm's statistics summed in the K loop, from the same loads of A's
    # row inputs as the products, the statistic applied to the accumulator once at the end, where
    # the norm allows it (``gemm_prologue.RowNorm.factored``, ``ONE_PASS_DTYPES``); else the
    # statistics pass before the loop
    norm_one_pass: bool = False
    # a tensor-core form whose product is turned around (``fews_``): C^T's tile = W's BLOCK_N rows
    # @ A's BLOCK_M rows^T, so that W's rows are the product's wide side (M = 64 per warpgroup on
    # sm_90's ``wgmma``, W read from shared memory) and A's few rows the narrow one; the
    # accumulator is turned back before the epilogue
    swap: bool = False

    def __post_init__(self):
        if not self.dot and self.block_m != 1 and self.split_k != 1:
            raise ValueError(f"{self.name}: a dot-free form of several rows per block has no split-K")

    @property
    def rows_apart(self) -> bool:
        """A dot-free form of several rows of A per block (``vecm_*``): each row's products summed
        apart, W loaded once for all of them; no prologue forms."""
        return not self.dot and self.block_m > 1


VOCAB_N = 32000  # an N this wide is a vocabulary's (an LM head)

# Performance knobs: the candidate forms compiled for every site.
CONFIGS: tuple[TileConfig, ...] = (
    # One row (decode, batch 1) without tensor cores: each block multiplies a few whole rows of W
    # by A's row and sums along K, so a block's loads are wide and contiguous and there are enough
    # blocks (about four per SM) to keep HBM busy; a BLOCK_M = 16 tile wastes 15/16 of its dot.
    # Two rows of W per block (one where K is short of a whole step), K in steps of 512-1024: on
    # an H200 with cold weights (bench/gemv_sweep.py, bench/results/gemv-sweep-h200-2026-11-28.json)
    # within 1-7% of the fastest of 60-132 forms at every decode GEMV of GPT-2, a 0.58B Llama and
    # Llama-3.2-1B alone, and the fastest in a decode step's chain of them under dependent launch
    # (gemv-chain-h200-2026-11-28.json: Llama-3.2-1B 666 µs; one row per block 794, its blocks too
    # many to launch early; cuBLAS 853). The forms of 4 and 8 rows per block they replace were
    # 5-16% slower at every site alone.
    TileConfig("vec_1x2x512", 1, 2, 512, num_warps=4, num_stages=1, max_m=1, dot=False),
    TileConfig("vec_1x1x512", 1, 1, 512, num_warps=4, num_stages=1, max_m=1, dot=False),
    # At Llama-3.2-1B's down (K 8192) a thread of it holds its two rows' W for all of K (loaded
    # before the wait) and A's row: 243 registers, and ptxas issues A's loads in two waves after
    # the wait (bench/sass_waves.py). On 4 warps (120 registers, one wave) the first 8 layers at
    # batch 1 took 0.5899 ms a token against 0.5770 (2.2% slower, 12 of 12 rounds), NVIDIA H100,
    # 2026-12-06 (bench/results/decode/paired-llama-3.2-1b-8layers-b1-down-4-warps-h100-2026-12-06f.json).
    TileConfig("vec_1x2x1024", 1, 2, 1024, num_warps=2, num_stages=1, max_m=1, dot=False),
    # A vocabulary head of short K (GPT-2's LM head, 768 -> 50257): two rows of W per block make
    # 25k blocks of 3 KiB each, whose fixed cost the stream does not cover; four rows per block
    # streamed the 77 MB in 21.6 µs alone (3.57 TB/s; vec_1x2x512 25.7, one row per block 34.4)
    # on the sweep above, where vec_1x2x1024 took 31-33 µs in GPT-2's decode step on the same GPU
    # (bench/results/profiles/decode-gpt2-*-h200-2026-11-30.txt). A candidate at vocabulary heads only.
    TileConfig("vec_1x4x512", 1, 4, 512, num_warps=4, num_stages=1, max_m=1, dot=False, min_n=VOCAB_N),
    TileConfig(
        "splitk_1x8x512",
        1,
        8,
        512,
        num_warps=4,
        num_stages=2,
        split_k=0,
        max_m=1,
        min_k=2048,
        dot=False,
        target_blocks=512,
    ),
    # Skinny M (decode, batch 1): narrow N tiles, so that even N = 768 spreads over 48 blocks and a
    # 1024 x 4096 weight over 256, each streaming whole rows of W (K contiguous).
    TileConfig("gemv_16x16x256", 16, 16, 256, num_warps=4, num_stages=3, max_m=16),
    # 6 stages (5 K steps of W in flight a block): Llama-3.2-1B's o projection (2048 -> 2048, 8 MiB)
    # makes 64 blocks of 32 columns, each streaming 16 K steps; at 4 stages its first 8 layers at
    # batch 8 took 0.6669 ms a token against 0.6448 (3.4% slower, 12 of 12 rounds, the same tokens;
    # K steps of 256 at 4 stages 0.6499), NVIDIA H100, 2026-12-05 (bench/results/decode/paired-
    # llama-3.2-1b-8layers-b8-o-stages-{6,4x256}-h100-2026-12-05b.json)
    TileConfig("gemv_16x32x128", 16, 32, 128, num_warps=4, num_stages=6, max_m=16),
    TileConfig("splitk_16x16x256", 16, 16, 256, num_warps=4, num_stages=3, split_k=0, max_m=16, min_k=2048),
    TileConfig("tile_16x64x128", 16, 64, 128, num_warps=4, num_stages=4, max_m=64),  # decode, batch 1
    # Middle M (a prompt of one sequence, 17-512 rows): 64-row tiles with long K steps and four
    # stages, narrow in N so that a 768-wide output still spreads over 24-48 blocks. At 128 rows
    # on an H100 with cold weights (bench/gemm_sweep.py, bench/results/gemm-sweep-m128-*.json):
    # qkv 768 -> 2304 4.85 us against cuBLAS's 4.84, attention out 768 -> 768 3.87 against 4.23,
    # fc 768 -> 3072 with GELU 5.78 against 5.76 (cuBLASLt's fused epilogue), mlp out 3072 -> 768
    # 8.98 against 7.28.
    TileConfig("tile_64x64x128", 64, 64, 128, num_warps=4, num_stages=4, min_m=17, max_m=512),
    TileConfig("tile_64x32x128", 64, 32, 128, num_warps=4, num_stages=4, min_m=17, max_m=512),
    TileConfig("tile_64x128x64", 64, 128, 64, num_warps=4, num_stages=3),
    TileConfig("tile_128x128x32", 128, 128, 32, num_warps=8, num_stages=3, min_m=128),
    TileConfig("splitk_16x64x128", 16, 64, 128, num_warps=4, num_stages=3, split_k=0, max_m=64, min_k=1024),
)

# tune's middle-M tiles held to 33-128 rows (``tilem_``; ``gemm_defaults.MANY_ROWS``): a prompt of
# up to 128 tokens at batch 1 on Triton's tiles, under dependent launch, where the library ran;
# ``tileme_``: the same with W's first K step (and the bias) loaded before the wait for the kernel
# before (``gemm_defaults.MANY_ROWS_EARLY``). ``tilem_splitk_64x32x128``: the narrow tile in K
# slices for long K (GPT-2's mlp out, 3072 -> 768: 24 column tiles of one 64-row tile each
# streaming all of K, where 4 slices make 96 blocks a 64-row tile), the slices summed by a reduce
# kernel in a fixed order, which can run the next GEMM's norm too (``gemm_pairs``)
_MANY_ROW_BASE: tuple[TileConfig, ...] = (
    *(c for c in CONFIGS if c.name in ("tile_64x32x128", "tile_64x64x128")),
    TileConfig(
        "tile_splitk_64x32x128",
        64,
        32,
        128,
        num_warps=4,
        num_stages=4,
        split_k=0,
        min_k=1024,
        target_blocks=96,
    ),
)
MANY_ROW_TILES: tuple[TileConfig, ...] = tuple(
    replace(c, name=c.name.replace("tile_", prefix), min_m=33, max_m=128, w_early=early)
    for prefix, early in (("tilem_", 0), ("tileme_", 1))
    for c in _MANY_ROW_BASE
)

# One-row forms of more rows of W per block, for sites whose norm each block computes again in its
# prologue (``_rms``, ``_ln``): fewer blocks, so fewer loads of the row and sums of its statistics
# per byte of W (gemm_defaults.PROLOGUE_ROWS). Not among every site's candidates: the default
# build and tune offer them where a site has such a prologue (gemm_defaults.built_in_configs).
PROLOGUE_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig("vec_1x4x1024", 1, 4, 1024, num_warps=4, num_stages=1, max_m=1, dot=False),
    TileConfig("vec_1x8x1024", 1, 8, 1024, num_warps=4, num_stages=1, max_m=1, dot=False),
)
# A few rows (decode at batch 2-8) without tensor cores (``vecm_``): the one-row forms' body for
# BLOCK_M rows of A at once, W's rows loaded once per block (before the wait, as the one-row forms
# do) and each row's products summed apart in registers, so W streams as at one row while the
# tensor-core tiles of 16 rows waste half their work or more at 2-8 rows and load W after the wait.
# Named by FEW_ROWS or its environment only, for measuring: the norm kernel before it stays (no
# prologue forms). On an H200 GPT-2's decode at 8 rows took 0.428 ms a token with vecm_8x4x256 at
# its layer GEMMs against 0.409 with the built-in entry (bench/results/decode/
# decode-gpt2-b8-vecm-h200-2026-11-30.json), and Llama-3.2-1B's at 8 rows 2.268 ms with
# vecm_8x2x512 at every site against 0.980 with the built-in entry (cuBLAS at its 8-64 MiB sites;
# decode-llama-3.2-1b-b8-vecm-h200-2026-11-30.json; not profiled: 8 rows' products of its 1.2B
# weights on the CUDA cores, 10 G multiply-adds a step, are the likely cost). So the built-in
# entry does not take them.
VECM_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig("vecm_8x4x256", 8, 4, 256, num_warps=4, num_stages=1, min_m=2, max_m=8, dot=False),
    TileConfig("vecm_8x2x512", 8, 2, 512, num_warps=4, num_stages=1, min_m=2, max_m=8, dot=False),
    TileConfig("vecm_4x4x256", 4, 4, 256, num_warps=4, num_stages=1, min_m=2, max_m=4, dot=False),
)
# Few rows (decode at batch 2-16; ``gemm_defaults.FEW_ROWS``): tensor-core tiles of 16 rows, the
# rows past M masked off, narrow in N and long in K so that W streams from HBM through enough
# blocks (N = 2048 makes 128 blocks of 16 columns); each also with a row-norm prologue (``_rms``:
# the statistics in a pass over A's rows before the K loop, A normalized as it is loaded) and the
# LayerNorm one (``_ln``), so that the norm kernel before the GEMM goes at 2-16 rows too. Not in
# CONFIGS (a --gemm-candidates build does not compile them): the built-in table names them, and
# only once bench/fewrow_sweep.py has measured them on the GPU.
_FEW_ROW_BASE: tuple[TileConfig, ...] = (
    TileConfig("few_16x16x256", 16, 16, 256, num_warps=4, num_stages=4, min_m=2, max_m=16, row_norm=True),
    TileConfig("few_16x16x512", 16, 16, 512, num_warps=4, num_stages=3, min_m=2, max_m=16, row_norm=True),
    TileConfig("few_16x32x256", 16, 32, 256, num_warps=4, num_stages=4, min_m=2, max_m=16, row_norm=True),
    # wide N (gate/up, an LM head): tile_16x64x128's tile with the row-norm prologue
    TileConfig("few_16x64x128", 16, 64, 128, num_warps=4, num_stages=4, min_m=2, max_m=16, row_norm=True),
    # long K (a down projection): splitk_16x64x128's tile at 2-16 rows
    TileConfig(
        "few_splitk_16x64x128",
        16,
        64,
        128,
        num_warps=4,
        num_stages=3,
        split_k=0,
        min_m=2,
        max_m=16,
        min_k=4096,
    ),
    # long K, few columns (a down projection, 8192 -> 2048): K in slices, about 512 blocks
    TileConfig(
        "few_splitk_16x16x512",
        16,
        16,
        512,
        num_warps=4,
        num_stages=3,
        split_k=0,
        min_m=2,
        max_m=16,
        min_k=4096,
        target_blocks=512,
    ),
)
# W's rows on the product's wide side (``swap``; bench/swap_rows.py): 64 rows of W per block
# (one warpgroup's ``wgmma`` on sm_90), the first K step loaded before the wait. No ``_rms``
# forms: Llama-3.2-1B's gate/up with the RMSNorm in the one-pass prologue took 27.0 us at 8
# rows where the plain form took 19.5 after a 1.6 us norm kernel (H200, dependent launch off;
# bench/results/profiles/decode-llama-3.2-1b-b8-fews-{split-rms,plain}-nopdl-h200-2026-11-30-night.txt),
# and the decode step 1.029 ms a token against 0.913 (dependent launch on).
SWAPPED: tuple[TileConfig, ...] = (
    TileConfig(
        "fews_16x64x64", 16, 64, 64, num_warps=4, num_stages=6, min_m=2, max_m=16, w_early=1, swap=True
    ),
    TileConfig(
        "fews_16x64x128", 16, 64, 128, num_warps=4, num_stages=3, min_m=2, max_m=16, w_early=1, swap=True
    ),
    TileConfig(
        "fews_splitk_16x64x128",
        16,
        64,
        128,
        num_warps=4,
        num_stages=4,
        split_k=0,
        min_m=2,
        max_m=16,
        min_k=4096,
        w_early=1,
        swap=True,
    ),
    # K of 1024-4095 in slices: a q/k/v or o projection (2048 -> 2048-3072) makes 32-48 tiles of 64 rows
    TileConfig(
        "fews_splitk_16x64x64",
        16,
        64,
        64,
        num_warps=4,
        num_stages=6,
        split_k=0,
        min_m=2,
        max_m=16,
        min_k=1024,
        w_early=1,
        swap=True,
    ),
)
# The same forms at 17-32 rows (decode at batch 17-32: ``gemm_defaults.SWAPPED_ROWS_MAX``): A's 32
# rows on the product's narrow side (``wgmma``'s N of 32), W's stream as at 2-16 rows.
SWAPPED_32: tuple[TileConfig, ...] = tuple(
    replace(c, name=c.name.replace("_16x", "_32x"), block_m=32, min_m=17, max_m=32) for c in SWAPPED
)
FEW_ROW_CONFIGS: tuple[TileConfig, ...] = (
    *_FEW_ROW_BASE,
    *VECM_CONFIGS,
    # The same tiles (``fewe_``) with W's first two K steps loaded before the wait for the kernel
    # before, as the one-row forms load all of theirs, and their ``_rms`` forms in one pass over
    # A (``norm_one_pass``): the two costs the forms above pay in a decode step (RESULTS.md, the
    # decode at 1 and 8 rows of 2026-11-29). ``fewp_16x32x256``: the one pass alone, W after the
    # wait, so that a sweep tells the two apart.
    *(
        replace(c, name="fewe_" + c.name.removeprefix("few_"), w_early=2, norm_one_pass=c.row_norm)
        for c in _FEW_ROW_BASE
    ),
    *SWAPPED,
    *SWAPPED_32,
    TileConfig(
        "fewp_16x32x256",
        16,
        32,
        256,
        num_warps=4,
        num_stages=4,
        min_m=2,
        max_m=16,
        row_norm=True,
        norm_one_pass=True,
    ),
)
# The one-pass ``_rms`` forms (``TileConfig.norm_one_pass``) multiply the norm's input by its
# weight before the statistics are known (A = x * g rounded to the dtype, the 1/rms applied to the
# fp32 accumulator): in float16 x * g may pass 65504 where the normalized x * rms * g does not, so
# only dtypes of fp32's range take the one pass; a float16 site runs the statistics pass.
ONE_PASS_DTYPES = ("bfloat16",)
# Split-K: enough K slices that a skinny GEMM's tiles fill about one wave of the GPU (an H100 has
# 132 SMs, an A100 108), each slice keeping at least MIN_SLICE_BLOCKS blocks of K.
SPLIT_TARGET_BLOCKS = 128
MAX_SPLIT = 8
MIN_SLICE_BLOCKS = 2
ROUND = {"float16": "tl.float16", "bfloat16": "tl.bfloat16"}
# LayerNorm prologue: the statistics read K in chunks of this many columns, all at once, so the
# rows of a block stay in registers: only for skinny blocks (BLOCK_M <= PROLOGUE_MAX_BLOCK_M) and
# K <= PROLOGUE_MAX_K; other sites keep their LayerNorm kernel. Each block reads A's rows again
# per K step to normalize them, so only configs with long K steps and no split get a prologue form
# (BLOCK_K >= PROLOGUE_MIN_BLOCK_K): on an H200, gpt at batch 1 with K = 768, the 16x32x128 form
# with the prologue took 12.0 us where the LayerNorm kernel and the plain form took 8.0 us together.
# The one-row forms (``<form>_ln``) load A's row once, K step by K step, and keep it in registers
# for the statistics and the products, as the row-norm forms below do.
STATS_CHUNK = 256
PROLOGUE_MAX_K = 2048
# Row-norm (RMSNorm) prologue (``<form>_rms``), the one-row forms and the few-row ones
# (``row_norm``): a one-row block loads A's whole row once, K step by K step, keeps it in
# registers for the statistics and the products, so a row of up to ROW_NORM_MAX_K elements
# (32 KiB in fp32 over a block's threads) is cheap beside the block's rows of W; a few-row block
# reads its rows twice (the statistics, then the products), from L2 after the first block; the
# norm kernel before the GEMM and its launch go.
ROW_NORM_MAX_K = 8192
# A stacked GEMM (gate/up) whose two column halves one pointwise kernel alone reads (SiLU(gate) *
# up) takes that kernel as its epilogue: each block computes W's rows j and N/2 + j (twice the W
# rows per block, half the blocks) and writes the product; False: the stacked GEMM's forms write
# both halves and the kernel stays.
STACKED_HALVES_EPILOGUE = True
# the forms that compute a prologue as they load A, named after their config
PROLOGUE_SUFFIXES = ("_ln", "_rms")


def base_form(name: str) -> str:
    """The config a form is named after (``vec_1x2x1024_rms`` → ``vec_1x2x1024``)."""
    for suffix in PROLOGUE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def config_name(form: str) -> str:
    """A rendered form's name as its config names it: the K slices chosen per site dropped
    (``few_splitk4_16x16x512_rms`` → ``few_splitk_16x16x512_rms``)."""
    return re.sub(r"splitk\d+_", "splitk_", form)


PROLOGUE_MAX_BLOCK_M = 16
PROLOGUE_MIN_BLOCK_K = 256
