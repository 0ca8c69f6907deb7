"""Two GEMM sites joined where a norm (RMSNorm, LayerNorm) sits between them: the split-K reduce
of the first runs the norm that the second has as its prologue.

A decoder layer at 2-32 rows (decode at batch 2-32) runs, between two projections, a norm
kernel: the down projection's K slices are summed by a reduce kernel, then the next layer's
residual add and RMSNorm (GPT-2: LayerNorm) run as a kernel of their own, then q/k/v (the same
between o and gate/up where o runs in K slices; in a forward of 2-32 rows, between a block's
last GEMM and the next block's first). At one row the norm is the next GEMV's prologue
(``gemm_render._vec_steps_norm``); at 2-32 rows the swapped tensor-core forms take no prologue,
so the norm stays a launch. The reduce already holds whole rows of the first GEMM's output
once it has added the slices, so ``gemm_render.render_reduce_norm`` runs the norm there, one
program per row making every load of its row at once, and the norm kernel and its launch go.

A site's candidates replace its library steps and nothing else, so the two sites become one
(``Pair``): its library is both sites' (the norm kernel among the second's, as its prologue), its
candidates the pairs of the two sites' default forms at each bucket, fused where the first
runs split-K and the second its plain form after the norm kernel. Only a default build joins
sites (each of its sites has one form per bucket, so each bucket has one pair of forms; tune's
candidates builds keep the sites apart); ``AOTPACK_REDUCE_NORM=off`` keeps them apart there too.
The second's norm is a row norm lowered from its kernel (RMSNorm) or a LayerNorm (GPT-2's ``ln_1``
after fc2; ``AOTPACK_REDUCE_NORM=rms`` joins at row norms only). On an H200 the joined forms took
GPT-2 (fp16) from 0.364 to 0.348 ms a token at batch 8 and from 0.594 to 0.569 at 32, the first 8
layers of Llama-3.2-1B (bf16) from 0.598 to 0.585 at 32 (0.538 either way at 8).

Where the first runs a tensor-core tile without K slices (no reduce holds whole rows) and the
norm is a LayerNorm, ``TILE_STATS`` joins the two tiles through the first's row statistics per
column tile instead (``gemm_stats``; by default only the 16-row tiles of 2-16 rows, see there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from aot.codegen import row_sum
from aot.codegen.gemm_forms import ONE_PASS_DTYPES
from aot.codegen.gemm_render import render_reduce_norm, split_index
from aot.codegen.gemm_sites import Site
from aot.codegen.gemm_stats import (
    MAX_TILES,
    render_tile_from_stats,
    render_tile_stats,
    stats_spec,
    stats_tiles,
    sum_spec,
)
from aot.codegen.kernel_source import on_off, setting
from aot.codegen.norm_sums import SCALE_SUM, SHIFT_SUM
from aot.codegen.render import Rendered, kernel_id, kernel_step
from aot.program import readers_of
from aot.schema import Program, Step, TensorSpec
from aot.tuning import MAX_CANDIDATE_STEPS

# "off" (or "0"): keep the sites apart; "rms": join at a row norm (RMSNorm) only; "on" (the
# default): at a LayerNorm too; anything else is a CodegenError. (The reduce's first form, whose
# loads the compiler spread out in several waves of memory latency, made GPT-2 slower joined:
# 0.371 against 0.361 ms a token.)
ENV = "AOTPACK_REDUCE_NORM"
REDUCE_NORM_MODES = ("on", "rms", "off")


# Where the first site runs a tensor-core tile without K slices and the second its tile after a
# LayerNorm kernel (GPT-2's o projection, ``ln_2`` and fc at 2-128 rows): "on" joins them through
# the first tile's per-tile row statistics (``gemm_stats``), "few" (the default) only where both
# tiles are of at most STATS_MAX_BLOCK_M rows (the 16-row tiles of 2-16 rows), "off" keeps the
# LayerNorm kernel. Measured on an H200 (2026-12-04, the example GPT, both bundles in one process,
# 12 rounds; ms joined / apart; bench/results/ab-gpt-tile-stats-*-h200-2026-12-04.json):
# - A normalized in fc's K loop, its scale and shift loaded in the step that uses them ("first"):
#   batch 1 x 128 tokens 0.514 / 0.423; loaded a step ahead (no suffix): 0.456 / 0.412 (1.108),
#   x 64 1.119, x 32 1.131, x 16 1.023, batch 8 x 1 1.029; on 8 warps ("8warps") 1.109 at x 128. On the
#   graph's chain (kernel-profile-gpt-b1-s128-tile-stats-h200-2026-12-04.txt) fc's tile took 10.4
#   us a call where q/k/v's plain tile (N 2304) took 4.6: A went shared memory -> registers ->
#   arithmetic -> the tensor cores in every K step.
# - The LayerNorm applied after the products (the scaled sum's rows to the tensor cores as
#   stored), the scale's and shift's column sums with W as a 16-row product in the same K loop
#   ("folded"): 0.439 / 0.417 at x 128 (1.055), 1.060 at x 64, x 32 and x 16, 1.065 at batch 8 x 1;
#   `aotpack verify` passed. Half the loss again, not a gain: the 16-row product takes W's tiles
#   from shared memory into registers in every step.
# - The form now: those column sums computed once by the build (``norm_sums``: two [N] fp32
#   weights a GEMM), so fc's K loop is the plain tile's ("sums"; `aotpack verify` passed): faster
#   with the 16-row tiles, batch 1 x 16 tokens 0.299 / 0.302 (0.986, 11 of 12 rounds), batch 8 x 1
#   0.322 / 0.323 (0.993, 10 of 12); slower with the 64-row tiles, x 128 0.423 / 0.419 (1.013), x 64
#   1.011. Hence "few". As built ("few" against "off", ab-gpt-tile-stats-few-h200-2026-12-04.json):
#   batch 8 x 1 0.2857 / 0.2890 ms, batch 1 x 16 0.2968 / 0.3005 (each 1.1-1.2% faster, 12 of 12
#   rounds), x 128 the same plan (1.000); GPT-2's decode at batch 8 (bench/decode_paired.py,
#   decode/paired-gpt2-b8-tile-stats-few-h200-2026-12-04.json) 0.3397 against 0.3427 ms a token
#   (12 of 12 rounds), 79 launches a step against 91, the same greedy tokens.
TILE_STATS = "few"
TILE_STATS_ENV = "AOTPACK_TILE_STATS"
# The same join where the norm is a row norm whose statistic factors out of A (an RMSNorm: the
# first tile writes its rows' sums of squares per column tile, the second applies 1/rms after its
# products; bfloat16 sites, as the one-pass forms), under TILE_STATS's rule of rows: Llama's o
# projection (the 16-row tile), the RMSNorm and gate/up (the swapped form) at 2-16 rows. "on"
# (the default) joins them, "off" keeps the norm kernel. Measured on an H200 (2026-12-04,
# Llama-3.2-1B's first 8 layers at batch 8, bench/decode_paired.py, 12 rounds): 0.5265 against
# 0.5346 ms a token (1.5% faster, 12 of 12 rounds) and, in a second command, 0.5288 against 0.5336
# (0.9%, 12 of 12); 63 launches a step against 71. The greedy tokens part at the fourth step (the
# norm applied after the products: another rounding); scored by the model in float32
# (``decode_paired --score``, 8 rows x 128 steps), the joined bundle's tokens were off float32's
# choice at 51 of 1024 steps (largest logit gap 0.045), the norm kernel's at 61 (0.051): as close.
# ``aotpack verify`` passes (bench/results/gpu-tests-row-norm-join-h200-2026-12-04.log).
ROW_NORM_STATS = "on"
ROW_NORM_STATS_ENV = "AOTPACK_TILE_STATS_ROW_NORM"


def row_norm_stats() -> bool:
    """Whether a row norm's tiles join through their statistics (ROW_NORM_STATS or its environment)."""
    return on_off(ROW_NORM_STATS_ENV, ROW_NORM_STATS)


TILE_STATS_MODES = ("few", "on", "off")
STATS_MAX_BLOCK_M = 16


def tile_stats_mode() -> str:
    """TILE_STATS, or ``AOTPACK_TILE_STATS`` where set ("0" reads as "off")."""
    return setting(TILE_STATS_ENV, TILE_STATS, TILE_STATS_MODES, aliases={"0": "off"})


def tile_stats() -> bool:
    """Whether any tiles join through their statistics (``tile_stats_mode`` not "off")."""
    return tile_stats_mode() != "off"


def _reduce_norm() -> str:
    """``AOTPACK_REDUCE_NORM`` as read now: "on" (unset), "rms" or "off" ("0" reads as "off")."""
    return setting(ENV, "on", REDUCE_NORM_MODES, aliases={"0": "off"})


def enabled() -> bool:
    """Whether a split-K reduce may run the next norm (``AOTPACK_REDUCE_NORM`` not "off")."""
    return _reduce_norm() != "off"


def layer_norms() -> bool:
    """Whether a reduce may run a LayerNorm too (unless ``AOTPACK_REDUCE_NORM=rms``)."""
    return _reduce_norm() != "rms"


class Pending(NamedTuple):
    """A form of a site before compiling (``gemm.add_gemm_alternatives``): its kernels and their
    ids, the buffers they add, the buckets it runs at, the program kernels it runs first (a norm
    kernel it keeps), and its config (a split-K form's with its K slices)."""

    site: Any  # a GEMM ``Site`` or an attention site
    name: str
    kernels: list[Rendered]
    ids: list[str]
    extra: dict[str, TensorSpec]
    fit: tuple[dict[str, int], ...]
    pre: tuple[Step, ...]
    cfg: Any  # TileConfig, or an attention form's config


@dataclass(frozen=True)
class Pair:
    """Two GEMM sites whose second's prologue (a row norm or a LayerNorm) reads the first's
    output, as one site:
    ``first``'s outputs are row inputs of that norm and read by nothing else (the joined reduce
    keeps them in registers, stores none), and no step lies between them."""

    first: Site
    second: Site

    @property
    def id(self) -> str:
        return self.first.id

    @property
    def library(self) -> tuple[int, ...]:
        return tuple(sorted({*self.first.library, *self.second.library}))

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.second.outputs

    @property
    def reference(self) -> tuple[Step, ...]:
        return (*self.first.reference, *self.second.reference)

    @property
    def m(self) -> str:
        return self.second.m

    @property
    def n(self) -> int:
        return self.second.n

    @property
    def k(self) -> int:
        return self.second.k


def find_pairs(program: Program, sites: list[Site]) -> list[Pair]:
    """The site pairs of ``program`` a reduce may run the norm of (module docstring)."""
    readers = readers_of(program.steps)
    by_step = {i: s for s in sites for i in s.library}
    pairs = []
    for second in sites:
        pro = second.prologue
        if (
            pro is None
            or (pro.norm is not None and pro.norm.more)
            or pro.sum_out == pro.ln_out
            or pro.gathered
        ):
            continue
        if pro.norm is None and not layer_norms():
            continue
        norm_at = second.library[0]
        if program.steps[norm_at] is not pro.kernel:
            continue
        first = by_step.get(norm_at - 1)
        if first is None or first is second or len(first.weights) != 1 or first.halves:
            continue
        if first.n != second.k or first.m != second.m or first.dtype != second.dtype:
            continue
        rows = {buf for buf, _ in pro.norm.inputs} if pro.norm is not None else {pro.x, pro.y} - {None}
        if not set(first.outputs) <= rows or set(first.outputs) & set(program.outputs):
            continue
        if any(set(readers.get(o, ())) - {norm_at} for o in first.outputs):
            continue  # a later step reads the first GEMM's output too
        # no step from the first's GEMM to the second's last (steps among the first's own, such
        # as A's view before its GEMM, run before the pair's candidate as they do before the site's)
        span = range(first.library[-1], second.library[-1] + 1)
        if set(span) - {*first.library, *second.library}:
            continue
        pairs.append(Pair(first, second))
    return pairs


@dataclass(frozen=True)
class Joined:
    """One candidate of a ``Pair``: its steps in launch order (a rendered kernel with its id, or
    a program kernel's step: the norm kernel, where it stays), the buffers it adds, its buckets."""

    pair: Pair
    name: str
    parts: tuple[tuple[Rendered, str] | Step, ...]
    extra: dict[str, TensorSpec]
    buckets: tuple[dict[str, int], ...]
    # where the two sites' forms run unfused: how many of ``parts`` are the first site's kernels
    first_parts: int = 0

    def kernels(self) -> list[tuple[str, Rendered]]:
        """(id, rendered) of each kernel it launches of its own."""
        return [(part[1], part[0]) for part in self.parts if not isinstance(part, Step)]

    def steps(self) -> tuple[Step, ...]:
        """The candidate's steps. Fused, the last kernel carries the pair's reference (what it
        replaces); unfused (``first_parts``), the first site's last kernel carries the first's
        and the last kernel the second's, so that ``aotpack verify`` and the interpreter check
        each site's kernels against that site's own steps."""
        last = len(self.parts) - 1
        ends = (
            {self.first_parts - 1: self.pair.first.reference, last: self.pair.second.reference}
            if self.first_parts
            else {last: self.pair.reference}
        )
        out = []
        for i, part in enumerate(self.parts):
            if isinstance(part, Step):
                out.append(part)
                continue
            r, kid = part
            out.append(kernel_step(kid, r, ends.get(i, ())))
        return tuple(out)


def _bucket_keys(forms: list[Pending]) -> list[tuple]:
    return [tuple(sorted(b.items())) for f in forms for b in f.fit]


def join(
    pair: Pair,
    first: list[Pending],
    second: list[Pending],
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
) -> list[Joined] | None:
    """The pair's candidates from its two sites' forms, one per bucket where both sites have one
    (a bucket where only one has a form runs the library at both: the example MLP's up projection
    keeps the library at 33-128 rows where its down projection before it has K slices,
    ``gemm_defaults.MANY_ROWS``, as GPT-2's q/k/v after its mlp out with ``MANY_ROWS`` "short",
    and the join at 2-32 rows is worth more: a norm launch a layer, 4% of a decode step at batch
    8 against about 1% of a forward at 128 rows); None where a site has two forms at one bucket,
    a pair of forms would pass ``MAX_CANDIDATE_STEPS``, or no bucket's reduce runs the norm
    (joined for nothing, the sites would lose their own alternatives)."""
    keys = _bucket_keys(first)
    others = _bucket_keys(second)
    if len(set(keys)) != len(keys) or len(set(others)) != len(others):
        return None
    out, fused_any = [], False
    for f in first:
        for s in second:
            common = tuple(b for b in f.fit if b in s.fit)
            if not common:
                continue
            name = f"{f.name}__{s.name}"
            if len(name) > 64 or f.pre:
                return None
            extra = {**f.extra, **s.extra}
            first_parts = 0  # fused: the pair's reference on the last kernel
            if len(f.kernels) == 2 and len(s.pre) == 1:  # split-K, then the norm kernel: joined
                (ws,) = f.extra
                (a_out,) = [o for o in s.pre[0].outputs if o != pair.second.prologue.sum_out]
                index = split_index(pair.first, f.cfg, ranges)
                fused = render_reduce_norm(pair.first, f.cfg, ws, pair.second, a_out, buffers, known, index)
                fid = kernel_id(fused.source, fused.signature, fused.config)
                parts = ((f.kernels[0], f.ids[0]), (fused, fid), *zip(s.kernels, s.ids))
                fused_any = True
            elif row_sum.joins(pair, f, s):  # one-row GEMVs: the first writes the residual's sum
                parts = row_sum.render(pair, f, s, buffers, known, ranges)
                fused_any = True
            elif _tiles_join(pair, f, s, known):  # two tiles, the norm kernel between: through the statistics
                parts, more = _tiles_joined(pair, f, s, buffers, known, ranges)
                extra.update(more)
                fused_any = True
            else:
                parts = (*zip(f.kernels, f.ids), *s.pre, *zip(s.kernels, s.ids))
                first_parts = len(f.kernels)
            if len(parts) > MAX_CANDIDATE_STEPS:
                return None
            out.append(Joined(pair, name, tuple(parts), extra, common, first_parts))
    return out if fused_any else None


def _tiles_join(pair: Pair, f: Pending, s: Pending, known: dict[str, TensorSpec]) -> bool:
    """Whether ``f`` and ``s`` join through the first tile's statistics (``gemm_stats``): both
    tensor-core tiles, neither swapped nor in K slices, the second after its LayerNorm kernel,
    the first without a prologue of its own and few enough column tiles, the LayerNorm's column
    sums with the second's W computed by the build."""
    pro = pair.second.prologue
    mode = tile_stats_mode()
    if not (
        (mode == "on" or (mode == "few" and max(f.cfg.block_m, s.cfg.block_m) <= STATS_MAX_BLOCK_M))
        and pair.first.prologue is None
        and len(f.kernels) == 1
        and len(s.kernels) == 1
        and len(s.pre) == 1
        and all(c.dot and c.split_k == 1 and not c.rows_apart for c in (f.cfg, s.cfg))
        and not f.cfg.swap
        and stats_tiles(pair.first, f.cfg) <= MAX_TILES
    ):
        return False
    if pro.norm is not None:  # a row norm whose statistic factors out of A (an RMSNorm)
        norm = pro.norm
        return (
            row_norm_stats()
            and norm.factored is not None
            and not norm.more
            and (norm.sum_out is None or norm.stage_of(norm.sum_out[1]) == 0)
            and pair.second.dtype in ONE_PASS_DTYPES
        )
    return layer_norms() and not s.cfg.swap and _column_sums(pair.second, known) is not None


def _column_sums(second: Site, known: dict[str, TensorSpec]) -> tuple[str, str | None] | None:
    """The weights holding the LayerNorm's column sums with ``second``'s W (``norm_sums``: u, and
    c where the LayerNorm has a shift), None where the build did not compute them."""
    w, shift = second.weights[0], second.prologue.bias is not None
    if w + SCALE_SUM not in known or (shift and w + SHIFT_SUM not in known):
        return None
    return w + SCALE_SUM, (w + SHIFT_SUM if shift else None)


def _tiles_joined(
    pair: Pair,
    f: Pending,
    s: Pending,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
) -> tuple[tuple[tuple[Rendered, str], ...], dict[str, TensorSpec]]:
    """The two kernels of a statistics join and the buffers they add (the statistics; the sum
    where no later step reads it)."""
    first, second = pair.first, pair.second
    row_norm = second.prologue.norm is not None
    stats = f"{first.id}_{f.cfg.name}_stats"
    extra = {stats: stats_spec(first, f.cfg, row_norm)}
    sum_buf = second.prologue.sum_out
    if sum_buf is None and not row_norm:
        sum_buf = f"{first.id}_sum"
        extra[sum_buf] = sum_spec(first)
    scaled = sum_buf  # the sum times the LayerNorm's scale: the sum itself where it has none
    if second.prologue.weight is not None or row_norm:  # a row norm's values before its statistic
        scaled = f"{first.id}_scaled"
        extra[scaled] = sum_spec(first)
    buffers = {**buffers, **extra}
    one = render_tile_stats(
        first, f.cfg, second, stats, sum_buf, scaled, buffers, known, split_index(first, f.cfg, ranges)
    )
    two = render_tile_from_stats(
        second,
        s.cfg,
        first,
        f.cfg,
        stats,
        scaled,
        None if row_norm else _column_sums(second, known),
        buffers,
        known,
        split_index(second, s.cfg, ranges),
    )
    return tuple((r, kernel_id(r.source, r.signature, r.config)) for r in (one, two)), extra
