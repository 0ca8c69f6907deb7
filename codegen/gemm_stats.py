"""Two tensor-core tiles joined across a LayerNorm that no reduce can run: the first tile writes
its rows' statistics over its columns, the second computes the LayerNorm from them as it loads A.

A forward of 33-128 rows (a prompt at batch 1) runs GPT-2's o projection (K 768) on a 64-row
tile without K slices, so no reduce holds whole rows to run the residual add and ``ln_2`` in
(``gemm_pairs``' split-K join), and a LayerNorm prologue that sums the statistics itself would
read A's 64 rows over all of K again in every block of fc (``gemm_forms.PROLOGUE_MAX_BLOCK_M``).
Each block of the first tile holds its rows over BLOCK_N columns in registers after its
epilogue: it adds the residual, stores the sum (which later steps read, or a scratch buffer),
and writes each row's sum and squared deviations from the tile's own mean over its columns
(``[tiles, 2, M]`` fp32). The second tile loads those pairs for its rows, combines them
(Chan's pairwise update: the mean of the whole row, then the tiles' squared deviations plus
each tile's count times its mean's distance from the row's, so no sum of squares cancels), and
normalizes the sum's rows as ``gemm_render._prologue_a`` does for the one-row forms. The add +
LayerNorm kernel and its launch go. The statistics' order of summation is fixed (tile order),
so a run repeats bit for bit; A's bits equal the LayerNorm kernel's but for that order.

Off by default (``gemm_pairs.TILE_STATS``: ``AOTPACK_TILE_STATS=on`` for measuring): on an H200
the second tile's normalizing A in its K loop costs more than the LayerNorm kernel it removes.
``render_tile_stats`` is what a LayerNorm folded into the next GEMM's weights would need as well.
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
    _k_masks,
    _opening,
    _params,
    _rendered,
    _site_epilogue,
    _tag,
    _w_early_steps,
    _w_tile,
)
from aot.codegen.gemm_sites import Site
from aot.codegen.kernel_source import signature_of
from aot.codegen.render import Rendered
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.schema import Buf, KernelParam, ParamKind, TensorSpec

# The most column tiles of the first GEMM whose statistics the second loads for its rows at once
# (a [tiles, BLOCK_M] pair of fp32 tiles in registers): GPT-2's o projection makes 24 of 32 columns.
MAX_TILES = 64


def stats_tiles(first: Site, cfg: TileConfig) -> int:
    """How many column tiles (statistics per row) ``first`` in form ``cfg`` writes."""
    return -(-first.n // cfg.block_n)


def stats_spec(first: Site, cfg: TileConfig) -> TensorSpec:
    """The statistics' buffer: per column tile, the rows' sums and squared deviations."""
    return TensorSpec("float32", (str(stats_tiles(first, cfg)), "2", first.m))


def sum_spec(first: Site) -> TensorSpec:
    """A scratch buffer for the residual sum where no later step reads it (the second reads it)."""
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
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    index: str,
) -> Rendered:
    """``site``'s tile (``cfg``, no split, no prologue) whose epilogue ends in the residual add
    that ``norm_site``'s LayerNorm prologue computes: what the epilogue would store (read by
    nothing but the norm: ``gemm_pairs.Pair``) stays in registers, rounded as the store would
    round it; the add's other row input is loaded; the sum, rounded as the add rounds, goes to
    ``sum_buf``; each row's sum and squared deviations from the tile's mean over the block's
    columns to ``stats[tile, 0 | 1, row]``."""
    n, dt = site.n, TL_TYPE[STORAGE[site.dtype]]
    ep = _site_epilogue(site, buffers, known)
    pro = norm_site.prologue
    held = {buf: (val, dtype) for buf, val, dtype in ep.stores}
    early, body = _opening(site, cfg, index, "0", site.k)
    biases, bias = _early_biases(site) if early else ([], None)
    early += biases
    body += _k_loop(site, cfg, "0", site.k, index) + _epilogue_lines(site, ep, store=False, bias=bias)
    body.append("# the next GEMM's residual add: the epilogue's value kept, rounded as stored")
    terms, loaded = [], []
    for name, buf in (("x", pro.x), ("y", pro.y)):
        if buf is None:
            continue
        if buf in held:
            val, dtype = held[buf]
            body.append(f"{name}_t = {val}.to({TL_TYPE[STORAGE[dtype]]}).to(tl.float32)")
        else:
            body.append(
                f"{name}_t = tl.load({name}_ptr + rm[:, None] * {n} + rn[None, :], mask=mask, other=0.0).to(tl.float32)"
            )
            loaded.append((name, buf))
        terms.append(f"{name}_t")
    body.append(f"xs = {' + '.join(terms)}")
    if len(terms) == 2 and site.dtype in ROUND:
        body.append(f"xs = xs.to({ROUND[site.dtype]}).to(tl.float32)")
    tile = f"tl.program_id({_axes(cfg)[1]})"
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
    params, _, args = _params(site, ep, index, None, "fused")
    params, args = _drop(params, args, {f"out{i}_ptr" for i in range(len(ep.stores))})
    more = [(f"{name}_ptr", buf, site.dtype) for name, buf in loaded]
    more += [("sum_ptr", sum_buf, site.dtype), ("stats_ptr", stats, "float32")]
    for name, buf, dtype in more:  # before M, the last
        params.insert(-1, KernelParam(name, ParamKind.PTR, dtype))
        args.insert(-1, Buf(buf))
    grid = _grid(site, cfg)
    return _rendered(
        site,
        cfg,
        f"gemm_{_tag(site)}_{cfg.name}_stats",
        "fused, then the next GEMM's residual add and its rows' statistics per tile",
        body,
        params,
        signature_of(params, index),
        args,
        [sum_buf, stats],
        grid,
        (),
        early,
    )


def _vectors(pro) -> list[tuple[str, str]]:
    return [(name, buf) for name, buf in (("lnw", pro.weight), ("lnb", pro.bias)) if buf is not None]


def _normed_k_loop(view: Site, cfg: TileConfig, index: str) -> tuple[list[str], list[str]]:
    """(lines before the wait, the K loop) of a tile whose A is the rows of ``x`` normalized with
    ``mean`` and ``rstd`` in registers, scaled and shifted. The scale's and shift's slices of each
    K step are loaded a step ahead (the first ones before the wait: weights): loaded in the step
    that uses them, as ``gemm_render._prologue_a`` does, they are no tensor-core operand, so the
    compiler's pipelining leaves them a memory latency of their own in every step."""
    k, dt = view.k, TL_TYPE[STORAGE[view.dtype]]
    vectors = _vectors(view.prologue)
    first = _w_early_steps(cfg, k)
    steps = -(-k // cfg.block_k)
    kmasks = _k_masks(view, cfg, "0")

    def vec_loads(at: str, suffix: str) -> list[str]:
        return [
            f"{name}_{suffix} = tl.load({name}_ptr + {at}, mask={at} < {k}, other=0.0).to(tl.float32)[None, :]"
            for name, _ in vectors
        ]

    def a_lines(suffix: str) -> list[str]:
        lines = [
            f"xs = tl.load(x_ptr + rm[:, None] * {k} + rk[None, :], mask=mask_m[:, None]{kmasks[0]}, other=0.0).to(tl.float32)",
            "a = (xs - mean[:, None]) * rstd[:, None]",
        ]
        lines += [f"a = a {'*' if name == 'lnw' else '+'} {name}_{suffix}" for name, _ in vectors]
        return lines + [f"a = tl.where(mask_m[:, None]{kmasks[0]}, a, 0.0).to({dt})"]

    early = ["# the LayerNorm's scale and shift for the first K steps (weights)"]
    for i in range(min(first + 1, steps)):
        early += vec_loads(f"({i * cfg.block_k} + tl.arange(0, BLOCK_K))", f"e{i}")
    loop = ["acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)"]
    for i in range(first):  # the steps whose W tiles were loaded before the wait
        loop.append(f"rk = {i * cfg.block_k} + tl.arange(0, BLOCK_K)  # K step {i}: W loaded early")
        loop += a_lines(f"e{i}") + [f"acc0 = tl.dot(a, w0_e{i}, acc0)"]
    if first >= steps:
        return early, loop
    loop += [f"{name}_n = {name}_e{first}" for name, _ in vectors]
    loop.append(f"for k0 in range({first * cfg.block_k}, {k}, BLOCK_K):")
    body = ["rk = k0 + tl.arange(0, BLOCK_K)"]
    body += [f"{name}_c = {name}_n" for name, _ in vectors]
    body += vec_loads("(rk + BLOCK_K)", "n")  # the next step's, a step ahead
    body += a_lines("c")
    body.append(f"w0 = {_w_tile(view, cfg, 0, index, kmasks)}  # W^T tile: [BLOCK_K, BLOCK_N]")
    body.append("acc0 = tl.dot(a, w0, acc0)")
    return early, loop + ["    " + ln for ln in body]


def render_tile_from_stats(
    norm_site: Site,
    cfg: TileConfig,
    first_cfg: TileConfig,
    first_n: int,
    stats: str,
    sum_buf: str,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    index: str,
) -> Rendered:
    """``norm_site``'s tile (``cfg``) with its LayerNorm computed as it loads A: the rows of
    ``sum_buf`` (the residual sum ``render_tile_stats`` stored), normalized with the mean and
    1/std combined from the first GEMM's (``first_cfg``, ``first_n`` columns) statistics per
    tile, scaled and shifted (``gemm_render._prologue_a``)."""
    pro = norm_site.prologue
    view = replace(norm_site, prologue=replace(pro, x=sum_buf, y=None, sum_out=None, gathered=()))
    ep = _site_epilogue(norm_site, buffers, known)
    tiles = -(-first_n // first_cfg.block_n)
    width = 1 << (tiles - 1).bit_length()
    bn = first_cfg.block_n
    early, body = _opening(view, cfg, index, "0", view.k)
    biases, bias = _early_biases(view) if early else ([], None)
    early += biases
    body += [
        f"# the LayerNorm's statistics from the first GEMM's {tiles} column tiles (gemm_stats)",
        f"tiles = tl.arange(0, {width})",
        f"tmask = (tiles < {tiles})[:, None] & mask_m[None, :]",
        "t_sum = tl.load(stats_ptr + (tiles[:, None] * 2) * M + rm[None, :], mask=tmask, other=0.0)",
        "t_m2 = tl.load(stats_ptr + (tiles[:, None] * 2 + 1) * M + rm[None, :], mask=tmask, other=0.0)",
        f"count = tl.minimum({first_n} - tiles * {bn}, {bn}).to(tl.float32)[:, None]",
        f"mean = tl.sum(t_sum, axis=0) / {view.k}",
        "dm = tl.where(tmask, t_sum / tl.maximum(count, 1.0) - mean[None, :], 0.0)",
        f"var = (tl.sum(t_m2, axis=0) + tl.sum(count * dm * dm, axis=0)) / {view.k}",
        f"rstd = 1.0 / tl.sqrt(var + {pro.eps!r})",
    ]
    vec_early, loop = _normed_k_loop(view, cfg, index)
    early += vec_early
    body += loop + _epilogue_lines(view, ep, bias=bias)
    params, _, args = _params(view, ep, index, None, "fused")
    params.insert(-1, KernelParam("stats_ptr", ParamKind.PTR, "float32"))
    args.insert(-1, Buf(stats))
    grid = _grid(view, cfg)
    return _rendered(
        view,
        cfg,
        f"gemm_{_tag(view)}_{cfg.name}_from_stats",
        "fused, its LayerNorm from the GEMM before's statistics per tile",
        body,
        params,
        signature_of(params, index),
        args,
        [buf for buf, _, _ in ep.stores],
        grid,
        (),
        early,
    )
