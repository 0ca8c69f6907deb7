"""Two tensor-core tiles joined across a LayerNorm that no reduce can run: the first tile writes
its rows' statistics over its columns, the second applies the LayerNorm after its products.

A forward of 33-128 rows (a prompt at batch 1) runs GPT-2's o projection (K 768) on a 64-row
tile without K slices, so no reduce holds whole rows to run the residual add and ``ln_2`` in
(``gemm_pairs``' split-K join), and a LayerNorm prologue that sums the statistics itself would
read A's 64 rows over all of K again in every block of fc (``gemm_forms.PROLOGUE_MAX_BLOCK_M``).
Each block of the first tile holds its rows over BLOCK_N columns in registers after its
epilogue: it adds the residual, stores the sum (which later steps read, or a scratch buffer) and
the sum times the LayerNorm's scale, and writes each row's sum and squared deviations from the
tile's own mean over its columns (``[tiles, 2, M]`` fp32). The second tile loads those pairs for
its rows and combines them (Chan's pairwise update: the mean of the whole row, then the tiles'
squared deviations plus each tile's count times its mean's distance from the row's, so no sum of
squares cancels). Normalizing A inside the K loop costs more than the LayerNorm kernel (measured:
``gemm_pairs.TILE_STATS``), so the second applies the LayerNorm after its products instead:

    LN(h) @ W^T = rstd * ((h * scale) @ W^T) - rstd * mean * u + c,
    u[n] = sum_k scale[k] W[n, k],  c[n] = sum_k shift[k] W[n, k]

with ``h * scale`` as the first stored it (its rows go to the tensor cores as loaded, the plain
tile's K loop) and u and c computed once by the build (``norm_sums``: weights of their own). The
add + LayerNorm kernel and its launch go. The statistics' order of summation is fixed (tile
order), so a run repeats bit for bit. Where the mean of a row is large against its spread, ``h * scale`` rounded to the dtype
carries more of the rounding than the normalized row the LayerNorm kernel rounds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aot.codegen.gemm_forms import ROUND, TileConfig
from aot.codegen.gemm_render import (
    _axes,
    _early_biases,
    _epilogue_lines,
    _grid,
    _k_loop,
    _params,
    _rendered,
    _site_epilogue,
    _tag,
    held_loads,
    opening_for_biases,
)
from aot.codegen.gemm_sites import Site
from aot.codegen.kernel_source import on_off, signature_of
from aot.codegen.render import Rendered
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.schema import Buf, KernelParam, ParamKind, TensorSpec

# The second tile loads the first's statistics before its K loop and combines them after it
# (True), or combines them before the loop (False, the form before 2026-12-06): compiled for
# sm_90, the example GPT's fc tile at 128 rows then ran 413 instructions and 12 block barriers after
# the wait before its first asynchronous copy of A or W (220 and none with True), at 16 rows 205
# and 5 (66 and none). Timed on an H100 (2026-12-06, both bundles in one process, 12 rounds; the older form
# against this one): the example GPT 1.3% slower at 1 x 16 tokens (9 of 12 rounds) and 1.5% at
# batch 8 (12 of 12), GPT-2's decode at batch 8 (8 layers) 2.0% (0.2653 against 0.2588 ms a token),
# Llama-3.2-1B's (8 layers, the RMSNorm join) 0.3% (11 of 12); the same numbers bit for bit
# (bench/results/ab-gpt-stats-after-loop-off-h100-2026-12-06f.json,
# decode/paired-*-b8-stats-after-loop-off-h100-2026-12-06f.json). With it the 64-row tiles of
# 33-128 rows joined (TILE_STATS "on") tie with the LayerNorm kernel (1.001 at 128 tokens, 0.998
# at 64; 1.013 slower before), so they stay apart. STATS_AFTER_LOOP_ENV ("on"/"off") sets it for
# a build, for measuring.
STATS_AFTER_LOOP = True
STATS_AFTER_LOOP_ENV = "AOTPACK_STATS_AFTER_LOOP"

# The most column tiles of the first GEMM whose statistics the second loads for its rows at once
# (a [tiles, BLOCK_M] pair of fp32 tiles in registers): GPT-2's o projection makes 24 of 32 columns.
MAX_TILES = 64


def stats_after_loop() -> bool:
    """Whether the second tile combines the first's statistics after its K loop (STATS_AFTER_LOOP)."""
    return on_off(STATS_AFTER_LOOP_ENV, "on" if STATS_AFTER_LOOP else "off")


def _loop_and_combine(plain: Site, cfg: TileConfig, index: str, combine: list[str]) -> list[str]:
    """The second tile's K loop over ``plain``, with ``combine`` (the lines that combine the
    first tile's loaded statistics) after it, or before it where ``stats_after_loop()`` is off."""
    loop = _k_loop(plain, cfg, "0", plain.k, index)
    return loop + combine if stats_after_loop() else combine + loop


def stats_tiles(first: Site, cfg: TileConfig) -> int:
    """How many column tiles (statistics per row) ``first`` in form ``cfg`` writes."""
    return -(-first.n // cfg.block_n)


def stats_spec(first: Site, cfg: TileConfig, row_norm: bool = False) -> TensorSpec:
    """The statistics' buffer: per column tile, the rows' sums and squared deviations (a LayerNorm)
    or the sums of the row norm's reduced value (``row_norm``: an RMSNorm's squares)."""
    return TensorSpec("float32", (str(stats_tiles(first, cfg)), "1" if row_norm else "2", first.m))


def sum_spec(first: Site) -> TensorSpec:
    """A scratch buffer of the first GEMM's shape: the residual sum where no later step reads it,
    the sum times the LayerNorm's scale."""
    return TensorSpec(first.dtype, (first.m, str(first.n)))


def _drop(params: list[KernelParam], args: list[Any], names: set[str]) -> tuple[list, list]:
    kept = [(p, a) for p, a in zip(params, args) if p.name not in names]
    return [p for p, _ in kept], [a for _, a in kept]


def render_tile_stats(
    site: Site,
    cfg: TileConfig,
    norm_site: Site,
    stats: str,
    sum_buf: str,
    scaled: str,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    index: str,
) -> Rendered:
    """``site``'s tile (``cfg``, no split, no prologue) whose epilogue ends in the residual add
    that ``norm_site``'s LayerNorm prologue computes: what the epilogue would store (read by
    nothing but the norm: ``gemm_pairs.Pair``) stays in registers, rounded as the store would
    round it; the add's other row input is loaded; the sum, rounded as the add rounds, goes to
    ``sum_buf``, and times the LayerNorm's scale (where it has one) to ``scaled``; each row's sum
    and squared deviations from the tile's mean over the block's columns to
    ``stats[tile, 0 | 1, row]``."""
    n, dt = site.n, TL_TYPE[STORAGE[site.dtype]]
    ep = _site_epilogue(site, buffers, known)
    pro = norm_site.prologue
    held = {buf: (val, dtype) for buf, val, dtype in ep.stores}
    early, body = opening_for_biases(site, cfg, index)
    biases, bias = _early_biases(site) if early else ([], None)
    early += biases
    if pro.norm is not None:
        return _tile_row_norm_stats(site, cfg, norm_site, ep, held, early, body, stats, scaled, index, bias)
    # the add's other row input: loaded (right after the wait where held_loads holds it)
    loaded = [
        (name, buf) for name, buf in (("x", pro.x), ("y", pro.y)) if buf is not None and buf not in held
    ]
    loads = [
        (
            f"{name}_t",
            f"tl.load({name}_ptr + rm[:, None] * {n} + rn[None, :], mask=mask, other=0.0).to(tl.float32)",
            site.dtype,
        )
        for name, _ in loaded
    ]
    after_wait, reads = held_loads(cfg, loads)
    body += (
        after_wait
        + _k_loop(site, cfg, "0", site.k, index)
        + _epilogue_lines(site, ep, store=False, bias=bias)
    )
    body.append("# the next GEMM's residual add: the epilogue's value kept, rounded as stored")
    terms = []
    for name, buf in (("x", pro.x), ("y", pro.y)):
        if buf is None:
            continue
        if buf in held:
            val, dtype = held[buf]
            body.append(f"{name}_t = {val}.to({TL_TYPE[STORAGE[dtype]]}).to(tl.float32)")
        else:
            (expr,) = [e for v, e, _ in loads if v == f"{name}_t"]
            body += reads.get(f"{name}_t", [f"{name}_t = {expr}"])
        terms.append(f"{name}_t")
    body.append(f"xs = {' + '.join(terms)}")
    if len(terms) == 2 and site.dtype in ROUND:
        body.append(f"xs = xs.to({ROUND[site.dtype]}).to(tl.float32)")
    tile = f"tl.program_id({_axes(cfg)[1]})"
    if pro.weight is not None:  # the sum times the LayerNorm's scale, what the next K loop reads
        # a weight: before the wait where the form's indices are (else here, they are after it)
        (early if early else body).append(
            "lnw_t = tl.load(lnw_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]"
        )
        body.append(
            f"tl.store(scaled_ptr + rm[:, None] * {n} + rn[None, :], (xs * lnw_t).to({dt}), mask=mask)"
        )
    body += [
        f"tl.store(sum_ptr + rm[:, None] * {n} + rn[None, :], xs.to({dt}), mask=mask)",
        "# the rows' statistics over this tile's columns: the sum, the squared deviations from its mean",
        "xs = tl.where(mask, xs, 0.0)",
        f"count = tl.minimum({n} - {tile} * BLOCK_N, BLOCK_N).to(tl.float32)",
        "t_sum = tl.sum(xs, axis=1)",
        "dev = tl.where(mask, xs - (t_sum / count)[:, None], 0.0)",
        "t_m2 = tl.sum(dev * dev, axis=1)",
        f"tl.store(stats_ptr + ({tile} * 2) * M + rm, t_sum, mask=mask_m)",
        f"tl.store(stats_ptr + ({tile} * 2 + 1) * M + rm, t_m2, mask=mask_m)",
    ]
    more = [(f"{name}_ptr", buf, site.dtype) for name, buf in loaded]
    if pro.weight is not None:
        more += [("lnw_ptr", pro.weight, site.dtype), ("scaled_ptr", scaled, site.dtype)]
    more += [("sum_ptr", sum_buf, site.dtype), ("stats_ptr", stats, "float32")]
    return _join_kernel(
        site,
        cfg,
        ep,
        f"gemm_{_tag(site)}_{cfg.name}_stats",
        "fused, then the next GEMM's residual add and its rows' statistics per tile",
        body,
        more,
        [sum_buf, stats] + ([scaled] if pro.weight is not None else []),
        index,
        early,
        stores=False,
    )


def _join_kernel(
    site: Site,
    cfg: TileConfig,
    ep: Any,
    name: str,
    what: str,
    body: list[str],
    more: list[tuple[str, str, str]],
    outputs: list[str],
    index: str,
    early: list[str],
    stores: bool,
) -> Rendered:
    """A kernel of a statistics join: ``site``'s fused parameters (without its epilogue's output
    pointers where not ``stores``: the first tile keeps what it would store) and ``more``'s
    (name, buffer, dtype) before M, the last."""
    params, _, args = _params(site, ep, index, None, "fused")
    if not stores:
        params, args = _drop(params, args, {f"out{i}_ptr" for i in range(len(ep.stores))})
    for param, buf, dtype in more:
        params.insert(-1, KernelParam(param, ParamKind.PTR, dtype))
        args.insert(-1, Buf(buf))
    return _rendered(
        site,
        cfg,
        name,
        what,
        body,
        params,
        signature_of(params, index),
        args,
        outputs,
        _grid(site, cfg),
        (),
        early,
    )


def _tile_row_norm_stats(
    site: Site,
    cfg: TileConfig,
    norm_site: Site,
    ep: Any,
    held: dict[str, tuple[str, str]],
    early: list[str],
    body: list[str],
    stats: str,
    scaled: str,
    index: str,
    bias: str | None,
) -> Rendered:
    """``render_tile_stats`` where ``norm_site``'s prologue is a row norm that factors out of A
    (an RMSNorm: ``RowNorm.factored``, A = s * p, s a statistic of the row): the norm's values
    before its statistic over the block's columns (its row inputs, the first GEMM's output among
    them as the epilogue holds it), the sum later steps read (``RowNorm.sum_out``) stored, ``p``
    rounded to the dtype stored to ``scaled``, and each row's sum of the norm's reduced value over
    those columns to ``stats[tile, 0, row]``."""
    norm = norm_site.prologue.norm
    part, _ = norm.factored
    dt = TL_TYPE[STORAGE[site.dtype]]
    ours = {f"x{i}_@": buf for i, (buf, _) in enumerate(norm.inputs) if buf in held}
    # the norm's other row inputs at the block's columns (right after the wait where held_loads holds them)
    inputs = {f"x{i}_@": dtype for i, (_, dtype) in enumerate(norm.inputs)}
    loads = [
        (var.replace("@", "n"), expr.replace("kmask@", "mask").replace("rk@", "rn"), inputs[var])
        for var, expr, stage in norm.row_ops
        if not stage and var in inputs and var not in ours and expr.startswith("tl.load(")
    ]
    after_wait, reads = held_loads(cfg, loads)
    body += (
        after_wait
        + _k_loop(site, cfg, "0", site.k, index)
        + _epilogue_lines(site, ep, store=False, bias=bias)
    )
    body += [
        "# the next GEMM's row norm over this tile's columns (its values before the statistic)",
        "rkn = rn",
        "kmaskn = mask",
    ]
    for var, expr, stage in norm.row_ops:
        if stage:
            continue
        if var in ours:  # the epilogue's value, rounded as its store would round it
            val, dtype = held[ours[var]]
            body.append(f"{var.replace('@', 'n')} = {val}.to({TL_TYPE[STORAGE[dtype]]}).to(tl.float32)")
        else:
            body += reads.get(var.replace("@", "n"), [f"{var.replace('@', 'n')} = {expr.replace('@', 'n')}"])
    outputs = [stats, scaled]
    if norm.sum_out is not None:
        sum_buf, var, dtype = norm.sum_out
        body.append(
            f"tl.store(sum_ptr + rm[:, None] * {site.n} + rn[None, :], "
            f"{var.replace('@', 'n')}.to({TL_TYPE[STORAGE[dtype]]}), mask=mask)"
        )
        outputs.append(sum_buf)
    tile = f"tl.program_id({_axes(cfg)[1]})"
    body += [
        f"tl.store(scaled_ptr + rm[:, None] * {site.n} + rn[None, :], ({part.replace('@', 'n')}).to({dt}), mask=mask)",
        "# the rows' sums of the norm's reduced value over this tile's columns",
        f"t_sum = tl.sum(tl.where(mask, {norm.reduced.replace('@', 'n')}, 0.0), axis=1)",
        f"tl.store(stats_ptr + {tile} * M + rm, t_sum, mask=mask_m)",
    ]
    more = [(f"x{i}_ptr", buf, dtype) for i, (buf, dtype) in enumerate(norm.inputs) if buf not in held]
    more += [(f"v{i}_ptr", buf, dtype) for i, (buf, dtype) in enumerate(norm.vectors)]
    if norm.sum_out is not None:
        more.append(("sum_ptr", norm.sum_out[0], norm.sum_out[2]))
    more += [("scaled_ptr", scaled, site.dtype), ("stats_ptr", stats, "float32")]
    return _join_kernel(
        site,
        cfg,
        ep,
        f"gemm_{_tag(site)}_{cfg.name}_stats",
        "fused, then the next GEMM's residual add and its row norm's sums per tile",
        body,
        more,
        outputs,
        index,
        early,
        stores=False,
    )


def _tiles_of(first: Site, first_cfg: TileConfig, what: str) -> list[str]:
    """``tiles``, the first GEMM's column tiles (a power of two wide), and ``tmask``, where a tile
    and the block's row are both there: the loads of the statistics per tile."""
    tiles = stats_tiles(first, first_cfg)
    return [
        f"# {what} from the first GEMM's {tiles} column tiles (gemm_stats)",
        f"tiles = tl.arange(0, {1 << (tiles - 1).bit_length()})",
        f"tmask = (tiles < {tiles})[:, None] & mask_m[None, :]",
    ]


def _stats_loads(first: Site, first_cfg: TileConfig) -> list[str]:
    """The first GEMM's statistics per column tile for the block's rows (``t_sum``, ``t_m2``):
    loaded before the K loop, combined after it (``_combined_stats``), so that their loads'
    latency and the reductions across the block's threads do not hold back the K loop's first
    loads of A and W."""
    return [
        *_tiles_of(first, first_cfg, "the LayerNorm's statistics"),
        "t_sum = tl.load(stats_ptr + (tiles[:, None] * 2) * M + rm[None, :], mask=tmask, other=0.0)",
        "t_m2 = tl.load(stats_ptr + (tiles[:, None] * 2 + 1) * M + rm[None, :], mask=tmask, other=0.0)",
    ]


def _combined_stats(first: Site, first_cfg: TileConfig, k: int, eps: float) -> list[str]:
    """``mean`` and ``rstd`` of the block's rows from ``_stats_loads``' statistics per column
    tile (Chan's pairwise update, in tile order)."""
    first_n, bn = first.n, first_cfg.block_n
    return [
        f"count = tl.minimum({first_n} - tiles * {bn}, {bn}).to(tl.float32)[:, None]",
        f"mean = tl.sum(t_sum, axis=0) / {k}",
        "dm = tl.where(tmask, t_sum / tl.maximum(count, 1.0) - mean[None, :], 0.0)",
        f"var = (tl.sum(t_m2, axis=0) + tl.sum(count * dm * dm, axis=0)) / {k}",
        f"rstd = 1.0 / tl.sqrt(var + {eps!r})",
    ]


def render_tile_from_stats(
    norm_site: Site,
    cfg: TileConfig,
    first: Site,
    first_cfg: TileConfig,
    stats: str,
    scaled: str,
    sums: tuple[str, str | None] | None,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    index: str,
) -> Rendered:
    """``norm_site``'s tile (``cfg``) with its LayerNorm applied after the products: the K loop is
    the plain tile's over the rows of ``scaled`` (the residual sum times the LayerNorm's scale,
    as ``render_tile_stats`` stored them), and the epilogue turns the result into the normalized
    rows' product with the mean and 1/std combined from the first GEMM's (``first`` in form
    ``first_cfg``) statistics per tile and the column sums u and c (``sums``: the weights
    ``norm_sums`` made; c's None where the LayerNorm has no shift), loaded with the first W tiles
    (before the wait, where the form loads any). A row norm's (RMSNorm's) join needs no sums
    (None): ``_tile_from_row_norm_stats``."""
    pro = norm_site.prologue
    plain = replace(norm_site, prologue=None, a=scaled)
    ep = _site_epilogue(norm_site, buffers, known)
    early, body = opening_for_biases(plain, cfg, index)
    biases, bias = _early_biases(plain) if early else ([], None)
    if pro.norm is not None:
        return _tile_from_row_norm_stats(
            norm_site, plain, cfg, first, first_cfg, ep, early + biases, body, bias, stats, index
        )
    loads = ["# the LayerNorm's column sums with W (weights: norm_sums)"]
    loads.append("u = tl.load(u_ptr + rn, mask=mask_n, other=0.0)")
    loads.append(
        "c = tl.load(c_ptr + rn, mask=mask_n, other=0.0)" if sums[1] is not None else "c = tl.zeros_like(u)"
    )
    early += biases + (loads if early else [])
    body += ([] if early else loads) + _stats_loads(first, first_cfg)
    body += _loop_and_combine(plain, cfg, index, _combined_stats(first, first_cfg, plain.k, pro.eps))
    body += [
        "# A @ W^T = rstd * (scaled sum @ W^T) - rstd * mean * u + c: the LayerNorm applied once",
        "acc0 = acc0 * rstd[:, None] - (rstd * mean)[:, None] * u[None, :] + c[None, :]",
    ]
    body += _epilogue_lines(plain, ep, bias=bias)
    more = [("stats_ptr", stats), ("u_ptr", sums[0])] + ([("c_ptr", sums[1])] if sums[1] is not None else [])
    return _join_kernel(
        plain,
        cfg,
        ep,
        f"gemm_ln_{_tag(plain)}_{cfg.name}_from_stats",  # named as a LayerNorm-prologue form
        "fused, its LayerNorm from the GEMM before's statistics per tile and the column sums",
        body,
        [(param, buf, "float32") for param, buf in more],
        [buf for buf, _, _ in ep.stores],
        index,
        early,
        stores=True,
    )


def _tile_from_row_norm_stats(
    norm_site: Site,
    plain: Site,
    cfg: TileConfig,
    first: Site,
    first_cfg: TileConfig,
    ep: Any,
    early: list[str],
    body: list[str],
    bias: str | None,
    stats: str,
    index: str,
) -> Rendered:
    """``render_tile_from_stats`` for a row norm that factors out of A (an RMSNorm): the plain
    K loop over ``scaled``'s rows (the norm's values before its statistic), the statistic from
    the first GEMM's sums per tile (added in tile order) applied to the products once, then the
    epilogue; each GEMM of a stacked pair (``Site.halves``) the same."""
    norm = norm_site.prologue.norm
    _, stat = norm.factored
    body += [  # loaded before the K loop, summed after it (see _stats_loads)
        *_tiles_of(first, first_cfg, "the row norm's statistic"),
        "t_sum = tl.load(stats_ptr + tiles[:, None] * M + rm[None, :], mask=tmask, other=0.0)",
    ]
    combine = ["s_sum = tl.sum(t_sum, axis=0)", *(f"{var} = {expr}" for var, expr in norm.stat_ops)]
    body += _loop_and_combine(plain, cfg, index, combine)
    body.append(f"# A @ W^T = {stat} * (the scaled rows @ W^T): the row norm applied once")
    body += [f"acc{g} = acc{g} * ({stat})[:, None]" for g in range(len(plain.weights))]
    body += _epilogue_lines(plain, ep, bias=bias)
    return _join_kernel(
        plain,
        cfg,
        ep,
        f"gemm_norm_{_tag(plain)}_{cfg.name}_from_stats",  # named as a row-norm-prologue form
        "fused, its row norm from the GEMM before's sums per tile",
        body,
        [("stats_ptr", stats, "float32")],
        [buf for buf, _, _ in ep.stores],
        index,
        early,
        stores=True,
    )
