"""GEMM candidate rendering: a site's Triton kernels for each form that fits it (one fused
kernel, or a split-K pair of partial sums and a fixed-order reduce), with their parameters,
launch grid and documentation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import sympy

from aot.codegen import index as ix
from aot.codegen.gemm_defaults import form_stages
from aot.codegen.gemm_epilogue import GELU_TANH, Epilogue, Load
from aot.codegen.gemm_forms import (
    CONFIGS,
    HEURISTIC,
    MAX_SPLIT,
    MIN_SLICE_BLOCKS,
    ONE_PASS_DTYPES,
    PROLOGUE_MAX_BLOCK_M,
    PROLOGUE_MIN_BLOCK_K,
    ROUND,
    SPLIT_TARGET_BLOCKS,
    STATS_CHUNK,
    VOCAB_N,
    TileConfig,
)
from aot.codegen.gemm_prologue import factored_one_row, row_load
from aot.codegen.gemm_sites import Prologue, Site
from aot.codegen.kernel_source import kernel_module, on_off, signature_of
from aot.codegen.launch import max_value
from aot.codegen.render import Rendered
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.schema import Buf, KernelParam, ParamKind, Step, Sym, TensorSpec


def _grid_rows(m: str, block: int) -> str:
    return f"({ix.size_text(ix.parse_size(m))} + {block - 1})//{block}"


def _grid(site: Site, cfg: TileConfig, *more: str) -> tuple[str, ...]:
    """The launch grid: (row blocks, column blocks, ``more``), or for the dot-free forms (one or
    two columns of C per block: a vocabulary's 128K blocks) the column blocks first, since a
    grid's first dimension may hold 2**31 - 1 blocks and the others only 65,535."""
    rows, cols = _grid_rows(site.m, cfg.block_m), str(-(-site.n // cfg.block_n))
    return (rows, cols, *more) if cfg.dot else (cols, rows, *more)


def _axes(cfg: TileConfig) -> tuple[int, int]:
    """The grid axes of (row blocks, column blocks): see ``_grid``."""
    return (0, 1) if cfg.dot else (1, 0)


def render_candidates(
    site: Site,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
    configs: tuple[TileConfig, ...] | None = None,
) -> list[tuple[TileConfig, list[Rendered], dict[str, TensorSpec], tuple[Step, ...]]]:
    """Per form that fits the site: its config (named as the form), its kernels (one, or the
    split-K pair), the buffers they add to the program, and the program steps that run before
    them. A site with a LayerNorm prologue gets each config twice: ``<config>`` runs the program's
    LayerNorm kernel first (into a buffer of its own), then the plain GEMM; ``<config>_ln``, for
    the skinny configs, computes the LayerNorm as it loads A. Which is faster depends on the GPU
    and the sizes, so ``aotpack tune`` decides. A row-norm (RMSNorm) prologue gets
    ``<config>_rms`` for the one-row configs and the few-row ones (``TileConfig.row_norm``),
    which the built-in table takes."""
    if site.prologue is not None:
        pro = site.prologue
        # the norm kernel's A into a buffer of its own; where later steps read A too (a site's
        # output: ``gemm_sites._row_norm_prologue``'s ``shared``), into A's own buffer
        shared = pro.sum_out == pro.ln_out
        scratch = pro.ln_out if shared else f"{site.id}_a"
        plain = replace(site, prologue=None, a=scratch, outputs=_gemm_outputs(site))
        ln_step = replace(
            pro.kernel,
            args=tuple(
                Buf(scratch) if isinstance(x, Buf) and x.name == pro.ln_out else x for x in pro.kernel.args
            ),
            outputs=tuple(scratch if o == pro.ln_out else o for o in pro.kernel.outputs),
            reference=(),
        )
        a_spec = buffers[pro.ln_out]
        # the forms without the prologue run the lookups first (the site's reference has theirs)
        lookups = tuple(replace(g.step, reference=()) for g in pro.gathered)
        out = []
        for cfg, kernels, extra, pre in render_candidates(plain, buffers, known, ranges, configs):
            extra = extra if shared else {**extra, scratch: a_spec}
            out.append((cfg, kernels, extra, (*lookups, ln_step, *pre)))
        if pro.norm is not None:
            fused = [
                c
                for c in (CONFIGS if configs is None else configs)
                if c.split_k == 1
                and not c.rows_apart
                and (
                    not c.dot
                    or (c.row_norm and c.block_m <= PROLOGUE_MAX_BLOCK_M and not pro.norm.one_row_only)
                )
            ]
            suffix = "_rms"
        else:
            fused = [
                c
                for c in (CONFIGS if configs is None else configs)
                if c.block_m <= PROLOGUE_MAX_BLOCK_M
                and c.block_k >= PROLOGUE_MIN_BLOCK_K
                and c.split_k == 1
                and not c.rows_apart
            ]
            suffix = "_ln"
        for cfg, kernels, extra, pre in _render_forms(site, buffers, known, ranges, tuple(fused)):
            out.append((replace(cfg, name=cfg.name + suffix), kernels, extra, pre))
        return out
    return _render_forms(site, buffers, known, ranges, configs)


def _render_forms(
    site: Site,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    ranges: dict[str, tuple[int, int]],
    configs: tuple[TileConfig, ...] | None,
) -> list[tuple[TileConfig, list[Rendered], dict[str, TensorSpec], tuple[Step, ...]]]:
    configs = CONFIGS if configs is None else configs
    ep = _site_epilogue(site, buffers, known)
    out = []
    for cfg in configs:
        if site.k < cfg.min_k or site.n < cfg.min_n:
            continue
        if site.w_kn and not cfg.dot:
            continue  # a one-row form reads W's rows along K: strided where W is [K, N]
        if cfg.split_k == 0:
            split = split_factor(site, cfg)
            if split < 2:
                continue
            cfg = replace(cfg, split_k=split, name=cfg.name.replace("splitk", f"splitk{split}", 1))
        s, g = cfg.split_k, len(site.weights)
        index = split_index(site, cfg, ranges)
        if cfg.split_k == 1:
            kernels = [_render_fused(site, ep, cfg, index)]
            extra: dict[str, TensorSpec] = {}
        else:
            ws = f"{site.id}_{cfg.name}_partial"
            extra = {ws: TensorSpec("float32", (str(s), str(g), site.m, str(site.n)))}
            kernels = [_render_partial(site, cfg, index, ws), _render_reduce(site, ep, cfg, index, ws)]
        out.append((cfg, kernels, extra, ()))
    return out


def _site_epilogue(site: Site, buffers: dict[str, TensorSpec], known: dict[str, TensorSpec]) -> Epilogue:
    """``site``'s epilogue lowered: its absorbed kernel's steps, or the GEMM result stored."""
    ep = Epilogue(list(site.gemm_outputs), site.m, site.n, buffers, known)
    if site.epilogue:
        ep.lower(site.epilogue, _gemm_outputs(site))
    else:
        ep.stores.append((site.gemm_outputs[0], "acc0", site.dtype))
    return ep


def split_index(site: Site, cfg: TileConfig, ranges: dict[str, tuple[int, int]]) -> str:
    """The index type of ``site``'s kernels in form ``cfg`` (split: its K slices): int64 where an
    offset into A, W, C or the slices' workspace may pass int32."""
    m_max = max_value(ix.parse_size(site.m), ranges)
    s, g = cfg.split_k, len(site.weights)
    biggest = max(m_max * max(site.k, site.n * s * g, site.n), site.k * site.n * (2 if site.halves else 1))
    return "i64" if biggest >= 2**31 - 1 else "i32"


def split_factor(site: Site, cfg: TileConfig) -> int:
    """K slices for ``site``: its N tiles times the slices should reach ``SPLIT_TARGET_BLOCKS``."""
    n_tiles = -(-site.n // cfg.block_n)
    want = -(-(cfg.target_blocks or SPLIT_TARGET_BLOCKS) // n_tiles)
    return max(1, min(MAX_SPLIT, want, site.k // (MIN_SLICE_BLOCKS * cfg.block_k)))


def _what(site: Site) -> str:
    parts = ["dual GEMM" if len(site.weights) > 1 else "GEMM"]
    if site.halves:
        parts[0] = "the two halves of a stacked GEMM (W[N:2N] read as a second GEMM)"
    if site.prologue is not None:
        norm = "LayerNorm" if site.prologue.norm is None else "row norm (RMSNorm)"
        parts.insert(0, norm + (" of a sum" if site.prologue.y is not None else "") + " prologue")
    if any(site.biases):
        parts.append("bias")
    if site.activation:
        parts.append(site.activation)
    if site.epilogue:
        parts.append("epilogue " + ", ".join(dict.fromkeys(s.target.split(".")[1] for s in site.epilogue)))
    return " + ".join(parts)


def _doc(site: Site, cfg: TileConfig, kind: str, grid: tuple[str, ...]) -> list[str]:
    return [
        f"GEMM candidate {cfg.name} ({kind}): {_what(site)}.",
        "",
        f"C[M, N] = A[M, K] @ {'W[K, N]' if site.w_kn else 'W[N, K]^T'} with M = {ix.size_text(ix.parse_size(site.m))}, N = {site.n}, K = {site.k}, {site.dtype};",
        f"grid: ({', '.join(grid)},)",
    ]


def _indices(site: Site, cfg: TileConfig, index: str) -> list[str]:
    cast = ".to(tl.int64)" if index == "i64" else ""
    m_axis, n_axis = _axes(cfg)
    return [
        f"rm = tl.program_id({m_axis}){cast} * BLOCK_M + tl.arange(0, BLOCK_M)",
        f"rn = tl.program_id({n_axis}){cast} * BLOCK_N + tl.arange(0, BLOCK_N)",
        "mask_m = rm < M",
        f"mask_n = rn < {site.n}",
        "mask = mask_m[:, None] & mask_n[None, :]",
    ]


# A tensor-core form whose first W tiles load before the wait (``TileConfig.w_early``) takes their
# products after its K loop (EARLY_STEPS_LAST): the early tiles stay in registers through the loop,
# whose first asynchronous copies of A and W issue right after the wait. Before the loop, those
# copies issued only once A's first tiles were back and multiplied (compiled for sm_90: 87-172
# instructions after the wait before the first copy, no barrier, where there were 149-182 and one
# at the example GPT's 128-row tiles). The sum over K runs in another order. Timed on an H100
# (2026-12-06, bench/RESULTS.md, "the early-loaded W steps' products after the K loop"): the
# example GPT's 128-token forward 5.2% faster (12 of 12 rounds), 8 and 32 rows 0.4-0.5%, the
# 8-row decodes of GPT-2 and Llama-3.2-1B the same. Those steps' A tiles load after the wait and
# stay in registers through the loop where HOLD_EARLY_A holds (below), else after the loop (a round
# trip to L2 at the tile's end). EARLY_STEPS_LAST_ENV ("on"/"off") sets it for a build.
EARLY_STEPS_LAST = True
EARLY_STEPS_LAST_ENV = "AOTPACK_EARLY_STEPS_LAST"


def early_steps_last() -> bool:
    """Whether the early-loaded W steps' products come after the K loop (EARLY_STEPS_LAST)."""
    return on_off(EARLY_STEPS_LAST_ENV, "on" if EARLY_STEPS_LAST else "off")


# With their products after the loop (EARLY_STEPS_LAST), the early steps' A tiles load right after
# the wait and stay in registers through the loop (HOLD_EARLY_A), where a form reads A as stored
# (no prologue): no round trip to L2 at the tile's end. Written plainly before the loop, Triton
# stages such a tile into shared memory where it is loaded, and the loop's first copies wait for
# it; an opaque identity (inline PTX, ``_held``) at its use after the loop keeps the tile in
# registers until then. Compiled for sm_90 (the example GPT's fc at 128 rows): the A tile's loads
# issue after the loop's first copies, its product reads A from registers, no global load after
# the last copy (8 before), the same instructions before the first copy (86 against 87), 126
# registers (114). The same products in the same order: the same bits. Only where the kernel
# waits for the kernel before (``GDC``, sm_90+ cubins); Triton's interpreter and sm_80 load the
# tile after the loop as before. On by default: on an H100 (2026-12-06, both bundles in one
# process round by round, 12 rounds; bench/RESULTS.md, "the early steps' A tiles held") the
# example GPT's forward at batch 1 x 128 tokens 0.972 (12 of 12 rounds), x 64 0.967 (12 of 12),
# batch 8 and 32 x 1 0.998 and 0.995, outputs bit for bit; the decode at batch 8 (first 8 layers)
# of Llama-3.2-1B 0.990 (12 of 12) and Qwen3-0.6B 0.995 (11 of 12), the same tokens.
# HOLD_EARLY_A_ENV ("on"/"off") sets it for a build.
HOLD_EARLY_A = True
HOLD_EARLY_A_ENV = "AOTPACK_HOLD_EARLY_A"


def hold_early_a() -> bool:
    """Whether the early steps' plain A tiles load after the wait and stay in registers (HOLD_EARLY_A)."""
    return on_off(HOLD_EARLY_A_ENV, "on" if HOLD_EARLY_A else "off")


_TO_FP32 = ".to(tl.float32)"
_ASM_TYPES = {"float16": ("tl.float16", 2), "bfloat16": ("tl.bfloat16", 2), "float32": ("tl.float32", 1)}


def _held(var: str, dtype: str) -> str:
    """``var`` through an opaque identity (a PTX move the compiler keeps where it stands): the
    tile stays in registers until here, and its layout conversion for the dot happens here."""
    ty, pack = _ASM_TYPES[dtype]
    return f'tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [{var}], dtype={ty}, is_pure=False, pack={pack})'


# A tensor-core form's epilogue reads rows that a kernel before wrote (the residual of an add, a
# statistics join's other row input) only after its K loop: the tile's last memory latency. With
# HOLD_EPILOGUE_LOADS the form loads them right after the wait, beside the early steps' A tiles,
# and keeps them in registers through the loop (``_held``), as the one-row forms load the residual
# beside A's row (``row_sum``). Only where the kernel waits for the kernel before (``GDC``, sm_90+
# cubins); Triton's interpreter and sm_80 load after the loop as before. The same values, but the
# epilogue's arithmetic may then run in another register layout, and with it a statistics join's
# sums over the tile's columns in another order. Compiled for sm_90, the statistics joins' first
# tiles at 2-16 rows have no load after their last copy (1 before) and one wave of memory latency
# after the wait (2). Timed on an H100 (2026-12-07, 12 rounds each, bench/RESULTS.md, "the bias
# before the wait"): the example GPT at batch 8 x 1 1.001 and 1 x 16 tokens 1.001, GPT-2's decode
# at batch 8 (first 8 layers) 1.000 (7 of 12 rounds), the same tokens; Llama-3.2-1B's tokens at
# batch 8 part at step 15 (the RMSNorm statistics' order). No gain: off. HOLD_EPILOGUE_LOADS_ENV
# ("on"/"off") sets it for a build, for measuring.
HOLD_EPILOGUE_LOADS = False
HOLD_EPILOGUE_LOADS_ENV = "AOTPACK_HOLD_EPILOGUE_LOADS"


def hold_epilogue_loads() -> bool:
    """Whether a tensor-core form's epilogue row loads come right after the wait (HOLD_EPILOGUE_LOADS)."""
    return on_off(HOLD_EPILOGUE_LOADS_ENV, "on" if HOLD_EPILOGUE_LOADS else "off")


def held_loads(cfg: TileConfig, loads: list[tuple[str, str, str]]) -> tuple[list[str], dict[str, list[str]]]:
    """``loads`` ((variable, expression, dtype stored) of a tensor-core form's loads after its K
    loop: ``tl.load(...)``, then ``.to(tl.float32)`` and a ``[None, :]``, or not) held through the
    loop where HOLD_EPILOGUE_LOADS holds: (the lines right after the wait that load them as stored;
    per variable, the lines after the loop that read it back, else loaded as before). No lines and
    no variables where they are not held (a form without tensor cores: its loads already come
    beside A's; a dtype ``_held`` does not move)."""
    if not (cfg.dot and hold_epilogue_loads() and loads):
        return [], {}
    if not all(dtype in _ASM_TYPES and expr.startswith("tl.load(") for _, expr, dtype in loads):
        return [], {}
    after_wait = [
        "if GDC:  # the epilogue's row loads now, held in registers through the loop (HOLD_EPILOGUE_LOADS)"
    ]
    reads = {}
    for var, expr, dtype in loads:
        load, to_fp32, post = expr.partition(_TO_FP32)
        after_wait.append(f"    held_{var} = {load}")
        reads[var] = _held_read(var, f"held_{var}", dtype, f"{var} = {expr}", to_fp32 + post)
    return after_wait, reads


def _held_read(var: str, raw: str, dtype: str, load: str, post: str = "") -> list[str]:
    """``var`` after the K loop: the tile ``raw`` loaded after the wait, through ``_held`` (then
    ``post``), where the kernel waits for the one before (GDC); else ``load``, the plain line."""
    return ["if GDC:", f"    {var} = {_held(raw, dtype)}{post}", "else:", f"    {load}"]


def _holds_early_a(site: Site, first: int) -> bool:
    """Whether the ``first`` early steps' A tiles load after the wait and stay in registers through
    the K loop (HOLD_EARLY_A, with their products after it): A read as stored, a dtype ``_held`` moves."""
    return (
        bool(first)
        and early_steps_last()
        and hold_early_a()
        and site.prologue is None
        and site.dtype in _ASM_TYPES
    )


def _k_loop(site: Site, cfg: TileConfig, k_offset: str, k_extent: int, index: str = "i32") -> list[str]:
    """Accumulate ``acc{g}`` over ``k_offset <= k < k_offset + k_extent`` (and ``k < K``) in
    BLOCK_K steps; the loop bounds are constants, so the compiler can pipeline the loads (a dot's)
    or unroll the steps (the dot-free form's). ``index``: "i64" where W's offsets may pass 2**31."""
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    weights = range(len(site.weights))
    if not cfg.dot:
        return _vec_steps(site, cfg, k_offset, k_extent)
    one_pass = _one_pass(site, cfg)
    # a swapped form (``TileConfig.swap``) accumulates C^T = W @ A^T: W's rows on the product's wide side
    shape = "(BLOCK_N, BLOCK_M)" if cfg.swap else "(BLOCK_M, BLOCK_N)"
    lines = [f"acc{g} = tl.zeros({shape}, dtype=tl.float32)" for g in weights]
    if one_pass:
        lines.append(
            "s_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # the statistics, summed as A is loaded"
        )
    kmasks = _k_masks(site, cfg, k_offset)
    first = _w_early_steps(cfg, k_extent)
    held = _holds_early_a(site, first)
    early, loads = [], []  # loads: the held A tiles' lines after the wait
    for i in range(first):  # the steps whose W tiles were loaded before the wait
        rk = f"rk = {_plus(_k_base(k_offset, i * cfg.block_k))}tl.arange(0, BLOCK_K)"
        early.append(f"{rk}  # K step {i}: W loaded early")
        tile = _a_tile(site, cfg, kmasks)
        if held:
            (load,) = tile
            var, expr = load.split(" = ", 1)
            loads += ["    " + rk, f"    {var}_e{i} = {expr}"]
            tile = _held_read(var, f"{var}_e{i}", site.dtype, load)
        early += tile
        early += [_dot(site, cfg, g, f"w{g}_e{i}", precision) for g in weights]
    if loads:
        lines[:0] = [
            "if GDC:  # the early steps' A tiles now, held in registers through the loop (HOLD_EARLY_A)",
            *loads,
        ]
    last = early_steps_last()
    lines += [] if last else early
    lines.append(f"for k0 in range({first * cfg.block_k}, {k_extent}, BLOCK_K):")
    lines.append(
        f"    rk = {k_offset} + k0 + tl.arange(0, BLOCK_K)"
        if k_offset != "0"
        else "    rk = k0 + tl.arange(0, BLOCK_K)"
    )
    lines += ["    " + ln for ln in _a_tile(site, cfg, kmasks)]
    for g in weights:
        tile = "W tile: [BLOCK_N, BLOCK_K]" if cfg.swap else "W^T tile: [BLOCK_K, BLOCK_N]"
        lines.append(f"    w{g} = {_w_tile(site, cfg, g, index, kmasks)}  # {tile}")
        lines.append("    " + _dot(site, cfg, g, f"w{g}", precision))
    lines += early if last else []
    if cfg.swap:
        lines += [f"acc{g} = tl.trans(acc{g})  # C^T's tile back to [BLOCK_M, BLOCK_N]" for g in weights]
    if one_pass:
        _, stat = site.prologue.norm.factored
        lines += [f"{var} = {expr}" for var, expr in site.prologue.norm.stat_ops]
        lines.append(f"# the norm's statistic, applied once: A = {stat} * (the products above)")
        lines += [f"acc{g} = acc{g} * ({stat})[:, None]" for g in weights]
    return lines


def _dot(site: Site, cfg: TileConfig, g: int, w: str, precision: str) -> str:
    """One K step's product into ``acc{g}``: A @ W^T, or for a swapped form W @ A^T (A^T loaded
    as such where no prologue computes A: ``_a_tile``)."""
    if cfg.swap:
        a_t = "a_t" if site.prologue is None else "tl.trans(a)"
        return f"acc{g} = tl.dot({w}, {a_t}, acc{g}{precision})"
    return f"acc{g} = tl.dot(a, {w}, acc{g}{precision})"


def _w_tile(site: Site, cfg: TileConfig, g: int, index: str, kmasks: tuple[str, str]) -> str:
    """The load of GEMM ``g``'s W tile at ``rk`` x ``rn``: W^T's [BLOCK_K, BLOCK_N] (K its first
    axis: ``kmasks[1]``), or for a swapped form W's [BLOCK_N, BLOCK_K] (K its second: ``kmasks[0]``)."""
    if not cfg.swap:
        return f"tl.load({_w_at(site, g, index)}, mask=mask_n[None, :]{kmasks[1]}, other=0.0)"
    rk_w = "rk.to(tl.int64)" if index == "i64" else "rk"
    at = f"{rk_w}[None, :] * {site.n} + rn[:, None]" if site.w_kn else f"rn[:, None] * {site.k} + rk[None, :]"
    return f"tl.load({_w_ptr(site, g)} + {at}, mask=mask_n[:, None]{kmasks[0]}, other=0.0)"


def _plus(base: str) -> str:
    return "" if base == "0" else f"{base} + "


def _k_base(k_offset: str, k0: int) -> str:
    """The first K index of the K step ``k0`` elements into the kernel's K (its slice's, at ``k_offset``)."""
    return f"{k_offset} + {k0}" if k_offset != "0" else str(k0)


def _k_bounded(site: Site, cfg: TileConfig, k_offset: str) -> bool:
    """Whether a K step must mask K's end: the kernel reads a slice of K, or K is not whole steps."""
    return k_offset != "0" or site.k % cfg.block_k != 0


def _k_masks(site: Site, cfg: TileConfig, k_offset: str) -> tuple[str, str]:
    """The mask of K's end at ``rk`` for a tile whose second axis is K (A's [BLOCK_M, BLOCK_K]),
    and for one whose first axis is K (W^T's [BLOCK_K, BLOCK_N]), each to add to a load's mask; ""
    where K steps are whole."""
    if not _k_bounded(site, cfg, k_offset):
        return "", ""
    return f" & (rk[None, :] < {site.k})", f" & (rk[:, None] < {site.k})"


def _w_at(site: Site, g: int, index: str) -> str:
    """The address of GEMM ``g``'s W^T tile at ``rk`` x ``rn``."""
    rk_w = "rk.to(tl.int64)" if index == "i64" else "rk"
    at = f"{rk_w}[:, None] * {site.n} + rn[None, :]" if site.w_kn else f"rn[None, :] * {site.k} + rk[:, None]"
    return f"{_w_ptr(site, g)} + {at}"


def _w_early_steps(cfg: TileConfig, k_extent: int) -> int:
    """How many of a tensor-core form's K steps load their W tile before the wait."""
    return min(cfg.w_early, -(-k_extent // cfg.block_k)) if cfg.dot else 0


def _dot_w_early(site: Site, cfg: TileConfig, k_offset: str, k_extent: int, index: str) -> list[str]:
    """A tensor-core form's first ``w_early`` W tiles, loaded before the wait for the kernel
    before (a weight: no kernel writes it), kept in registers until A's rows are there."""
    kmasks = _k_masks(site, cfg, k_offset)
    lines = ["# W's first K steps, before the wait (see kernel_module)"]
    for i in range(_w_early_steps(cfg, k_extent)):
        base = _k_base(k_offset, i * cfg.block_k)
        lines.append(f"rk = {_plus(base)}tl.arange(0, BLOCK_K)")
        lines += [f"w{g}_e{i} = {_w_tile(site, cfg, g, index, kmasks)}" for g in range(len(site.weights))]
    return lines


def _one_pass(site: Site, cfg: TileConfig) -> bool:
    """Whether ``cfg`` computes ``site``'s row norm in its K loop (``TileConfig.norm_one_pass``)."""
    pro = site.prologue
    return (
        cfg.dot
        and cfg.norm_one_pass
        and cfg.split_k == 1
        and pro is not None
        and pro.norm is not None
        and pro.norm.factored is not None
        and site.dtype in ONE_PASS_DTYPES
    )


def _a_tile(site: Site, cfg: TileConfig, kmasks: tuple[str, str]) -> list[str]:
    """The lines that make the A tile ``a`` at ``rk`` (a tensor-core form's K step); ``kmasks``:
    ``_k_masks``'s."""
    if site.prologue is None:
        if cfg.swap:  # the product's narrow side, A^T: [BLOCK_K, BLOCK_M], loaded as the dot reads it
            return [
                f"a_t = tl.load(a_ptr + rm[None, :] * {site.k} + rk[:, None], mask=mask_m[None, :]{kmasks[1]}, other=0.0)"
            ]
        return [
            f"a = tl.load(a_ptr + rm[:, None] * {site.k} + rk[None, :], mask=mask_m[:, None]{kmasks[0]}, other=0.0)"
        ]
    if _one_pass(site, cfg):
        return _norm_a_one_pass(site, f"(tl.program_id({_axes(cfg)[1]}) == 0)")
    if site.prologue.norm is not None:
        return _norm_a(site)
    return _prologue_a(site)


def _vec_k(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[tuple[str, str]]:
    """The dot-free form's K steps, unrolled (a row of W is a few steps at most): per step, the
    expression of its K indices and the mask of K it needs ("" where every step is whole)."""
    kmask_a, _ = _k_masks(site, cfg, k_offset)
    steps = []
    for k0 in range(0, k_extent, cfg.block_k):
        steps.append((f"{_k_base(k_offset, k0)} + tl.arange(0, BLOCK_K)", kmask_a))
    return steps


def _vec_w_early(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[str]:
    """The dot-free form loads all of its W rows first, before the wait for the kernel before (a
    weight: no kernel writes it), so that under dependent launch a GEMV streams its weights while
    the kernel before still runs; each step's tile stays in registers until A's row is there."""
    lines = ["# this block's rows of W, every K step, before the wait (see kernel_module)"]
    pro = site.prologue
    factored = _factored(site, cfg)
    for i, (rk, kmask) in enumerate(_vec_k(site, cfg, k_offset, k_extent)):
        lines.append(f"rk = {rk}")
        for g in range(len(site.weights)):
            lines.append(
                f"w{g}_{i} = tl.load({_w_ptr(site, g)} + rn[:, None] * {site.k} + rk[None, :], "
                f"mask=mask_n[:, None]{kmask}, other=0.0)  # [BLOCK_N, BLOCK_K]"
            )
        if pro is not None and pro.norm is None:  # the LayerNorm's scale and shift: weights too
            for vec, ptr in (("lnw", pro.weight), ("lnb", None if factored else pro.bias)):
                if ptr is not None:
                    lines.append(
                        f"{vec}_{i} = tl.load({vec}_ptr + rk, mask=rk < {site.k}, other=0.0).to(tl.float32)[None, :]"
                    )
    if factored and pro.norm is None:  # the LayerNorm's column sums with W: weights (fp32)
        lines.append(
            "lnu = tl.load(lnu_ptr + rn, mask=mask_n, other=0.0)[None, :]  # W @ scale: [1, BLOCK_N]"
        )
        if site.ln_sums[1] is not None:
            lines.append("lnc = tl.load(lnc_ptr + rn, mask=mask_n, other=0.0)[None, :]  # W @ shift")
    return lines


def _factored(site: Site, cfg: TileConfig) -> bool:
    """Whether the one-row form ``cfg`` applies ``site``'s norm after its products
    (``gemm_prologue.FACTORED``): an RMSNorm that factors out of A (``RowNorm.factored``, one
    norm, its sum written before the statistics), or a LayerNorm with the build's column sums."""
    pro = site.prologue
    if cfg.dot or cfg.rows_apart or cfg.split_k != 1 or pro is None:
        return False
    norm = pro.norm
    if not factored_one_row(layer_norm=norm is None, head=site.n >= VOCAB_N):
        return False
    if norm is None:
        return site.ln_sums is not None
    return (
        norm.factored is not None
        and not norm.more
        and (norm.sum_out is None or norm.stage_of(norm.sum_out[1]) == 0)
    )


def _w_ptr(site: Site, g: int) -> str:
    """Where GEMM ``g``'s W starts: the second half of a stacked weight is N rows further."""
    return f"(w{g}_ptr + {site.n * site.k})" if site.halves and g == 1 else f"w{g}_ptr"


def _vec_steps(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[str]:
    """A's one row times the early-loaded W rows, summed elementwise across K steps, reduced once
    after."""
    if cfg.rows_apart:
        return _vecm_steps(site, cfg, k_offset, k_extent)
    if site.prologue is not None:
        if site.prologue.norm is not None:
            return _vec_steps_norm(site, cfg, k_offset, k_extent)
        return _vec_steps_ln(site, cfg, k_offset, k_extent)
    lines = [f"part{g} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)" for g in range(len(site.weights))]
    for i, (rk, kmask) in enumerate(_vec_k(site, cfg, k_offset, k_extent)):
        lines.append(f"rk = {rk}")
        if site.prologue is None:
            lines.append(
                f"a = tl.load(a_ptr + rm[:, None] * {site.k} + rk[None, :], mask=mask_m[:, None]{kmask}, other=0.0)"
            )
        else:
            lines += _prologue_a(site)
        for g in range(len(site.weights)):
            lines.append(
                f"part{g} += w{g}_{i}.to(tl.float32) * a.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]"
            )
    lines += [f"acc{g} = tl.sum(part{g}, axis=1)[None, :]" for g in range(len(site.weights))]
    return lines


def _vecm_steps(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[str]:
    """BLOCK_M rows of A times the early-loaded W rows (``TileConfig.rows_apart``): per K step,
    each row of A loaded as the one-row form loads its row (a row past M masked to 0) and its
    products summed into that row's own ``[BLOCK_N, BLOCK_K]`` partial; after the steps each
    partial reduced over K and set into its row of ``acc`` ``[BLOCK_M, BLOCK_N]``. No prologue
    (``render_candidates`` renders none for these forms)."""
    weights, rows = range(len(site.weights)), range(cfg.block_m)
    lines = [f"part{g}_{r} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)" for g in weights for r in rows]
    lines.append(f"m0 = tl.program_id({_axes(cfg)[0]}) * BLOCK_M")
    # each row's mask of A as a [1, BLOCK_K] tile (a row past M loads zeros)
    lines += [f"in_m{r} = (tl.zeros((1, BLOCK_K), dtype=tl.int32) + (m0 + {r})) < M" for r in rows]
    for i, (rk, kmask) in enumerate(_vec_k(site, cfg, k_offset, k_extent)):
        lines.append(f"rk = {rk}")
        for r in rows:
            lines.append(
                f"a = tl.load(a_ptr + (m0 + {r}) * {site.k} + rk[None, :], mask=in_m{r}{kmask}, other=0.0)"
            )
            for g in weights:
                lines.append(f"part{g}_{r} += w{g}_{i}.to(tl.float32) * a.to(tl.float32)")
    lines.append("ri = tl.arange(0, BLOCK_M)[:, None]")
    for g in weights:
        lines.append(f"acc{g} = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        lines += [f"acc{g} = tl.where(ri == {r}, tl.sum(part{g}_{r}, axis=1)[None, :], acc{g})" for r in rows]
    return lines


def _vec_steps_ln(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[str]:
    """The one-row form with a LayerNorm prologue: A's row inputs (``x [+ y]``, rounded as the
    add rounds) loaded once, K step by K step, and kept in registers for the statistics (the sum
    written by the first N tile); then per K step the row normalized, scaled and shifted (rounded
    as the LayerNorm's output is) times the early-loaded W rows."""
    pro = site.prologue
    k = site.k
    steps = _vec_k(site, cfg, k_offset, k_extent)
    need_k_mask = _k_bounded(site, cfg, k_offset)
    lines = ["# A's row inputs, per K step, loaded once"]
    for i, (rk, _) in enumerate(steps):
        lines.append(f"rk{i} = {rk}")
        lines.append(f"kmask{i} = mask_m[:, None]" + (f" & (rk{i}[None, :] < {k})" if need_k_mask else ""))
        lines += _prologue_rows(site, f"rk{i}", f"xs{i}")
    if pro.sum_out is not None:
        dt = TL_TYPE[STORAGE[site.dtype]]
        lines.append(
            f"if tl.program_id({_axes(cfg)[1]}) == 0:  # the first N tile writes the sum that later steps read"
        )
        for i in range(len(steps)):
            lines.append(
                f"    tl.store(sum_ptr + rm[:, None] * {k} + rk{i}[None, :], xs{i}.to({dt}), mask=kmask{i})"
            )
    # masked elements loaded as 0: they add nothing to the mean; their deviations are set to 0
    lines += _layer_norm_stats([f"kmask{i}" for i in range(len(steps))], k, pro.eps)
    lines += [f"part{g} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)" for g in range(len(site.weights))]
    if _factored(site, cfg):
        # the products of the scaled row, which do not wait for the statistics above; the
        # LayerNorm applied to their sums: rstd * (S - mean * (W @ scale)) + W @ shift
        for i in range(len(steps)):
            scaled = f"(xs{i} * lnw_{i})" if pro.weight is not None else f"xs{i}"
            lines.append(f"part0 += w0_{i}.to(tl.float32) * {scaled}  # [BLOCK_N, BLOCK_K]")
        shift = " + lnc" if site.ln_sums[1] is not None else ""
        lines.append(f"acc0 = rstd[:, None] * (tl.sum(part0, axis=1)[None, :] - mean[:, None] * lnu){shift}")
        return lines
    for i in range(len(steps)):
        lines.append(f"a = dev{i} * rstd[:, None]")
        if pro.weight is not None:
            lines.append(f"a = a * lnw_{i}")
        if pro.bias is not None:
            lines.append(f"a = a + lnb_{i}")
        lines.append(f"a = tl.where(kmask{i}, a, 0.0).to({TL_TYPE[STORAGE[site.dtype]]})  # A: [1, BLOCK_K]")
        for g in range(len(site.weights)):
            lines.append(f"part{g} += w{g}_{i}.to(tl.float32) * a.to(tl.float32)")
    lines += [f"acc{g} = tl.sum(part{g}, axis=1)[None, :]" for g in range(len(site.weights))]
    return lines


def _vec_steps_norm(site: Site, cfg: TileConfig, k_offset: str, k_extent: int) -> list[str]:
    """The one-row form with a row-norm prologue: A's row inputs loaded once, K step by K step,
    and the row values before the statistics computed (the sum written by the first N tile);
    the mean over K and the statistics; then per K step the rest of the norm (A) times the
    early-loaded W rows."""
    norm = site.prologue.norm
    steps = [rk for rk, _ in _vec_k(site, cfg, k_offset, k_extent)]
    need_k_mask = _k_bounded(site, cfg, k_offset)
    write_sum = f"tl.program_id({_axes(cfg)[1]}) == 0"
    lines = ["# the row norm's inputs and its values before the statistics, per K step"]
    lines += _norm_stats(site, write_sum, steps, need_k_mask)
    if _factored(site, cfg):
        part, stat = norm.factored
        lines.append(f"# A = {stat} * (the row before the statistic): the products do not wait for it")
        lines += [
            f"part{g} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)" for g in range(len(site.weights))
        ]
        for i in range(len(steps)):
            lines.append(f"a = tl.where(kmask{i}, {part.replace('@', str(i))}, 0.0)  # fp32: [1, BLOCK_K]")
            lines += [f"part{g} += w{g}_{i}.to(tl.float32) * a" for g in range(len(site.weights))]
        return lines + [
            f"acc{g} = tl.sum(part{g}, axis=1)[None, :] * ({stat})[:, None]" for g in range(len(site.weights))
        ]
    last = 1 + len(norm.more)
    for stage, (reduced, stat_ops) in enumerate(norm.more, start=1):  # a norm after the norm
        lines.append(
            f"# the values between statistics {stage} and {stage + 1}, per K step, and the next mean"
        )
        for i in range(len(steps)):
            lines += [
                f"{v.replace('@', str(i))} = {e.replace('@', str(i))}"
                for v, e, st in norm.row_ops
                if st == stage
            ]
        lines += _sum_out_stores(site, write_sum, {str(i): f"rk{i}" for i in range(len(steps))}, stage)
        total = " + ".join(
            f"tl.sum(tl.where(kmask{i}, {reduced.replace('@', str(i))}, 0.0), axis=1)"
            for i in range(len(steps))
        )
        lines.append(f"s_sum{stage + 1} = {total}")
        lines += [f"{v} = {e}" for v, e in stat_ops]
    lines += [f"part{g} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)" for g in range(len(site.weights))]
    for i in range(len(steps)):
        lines += [
            f"{var.replace('@', str(i))} = {expr.replace('@', str(i))}"
            for var, expr, stage in norm.row_ops
            if stage == last
        ]
        out = norm.out.replace("@", str(i))
        lines.append(
            f"a = tl.where(kmask{i}, {out}, 0.0).to({TL_TYPE[STORAGE[site.dtype]]})  # A: [1, BLOCK_K]"
        )
        for g in range(len(site.weights)):
            lines.append(f"part{g} += w{g}_{i}.to(tl.float32) * a.to(tl.float32)")
    lines += _sum_out_stores(site, write_sum, {str(i): f"rk{i}" for i in range(len(steps))}, last)
    lines += [f"acc{g} = tl.sum(part{g}, axis=1)[None, :]" for g in range(len(site.weights))]
    return lines


def _prologue_rows(site: Site, rk: str = "rk", xs: str = "xs") -> list[str]:
    """``xs``: the rows of ``x [+ y]`` at ``rk`` as fp32, rounded to the dtype as the add's result is."""
    pro = site.prologue
    k = site.k
    kmask = f"mask_m[:, None] & ({rk}[None, :] < {k})"

    def row(name: str, buf: str) -> str:
        return row_load(name, k, rk, kmask, gathered=pro.lookup(buf) is not None)

    lines = [f"{xs} = {row('x', pro.x)}"]
    if pro.y is not None:
        lines.append(f"{xs} = {xs} + {row('y', pro.y)}")
        if site.dtype in ROUND:
            lines.append(f"{xs} = {xs}.to({ROUND[site.dtype]}).to(tl.float32)")
    return lines


def _stats_chunks(k: int) -> tuple[int, int]:
    """(width, count) of the column chunks the prologue's statistics read K in."""
    width = min(STATS_CHUNK, 1 << (k - 1).bit_length())
    return width, -(-k // width)


def _prologue_stats(site: Site, write_sum: str) -> list[str]:
    """Mean and 1/std of the block's rows over all of K, as straight-line code: every chunk of
    the rows is loaded before the first sum (one memory latency, not one per chunk), the mean
    taken, then the squared deviations from the chunks already in registers. The add's result
    is written on the way where ``write_sum`` (a condition) holds."""
    k = site.k
    width, count = _stats_chunks(k)
    lines = []
    for c in range(count):
        lines.append(f"rs{c} = {c * width} + tl.arange(0, {width})")
        lines += _prologue_rows(site, f"rs{c}", f"xs{c}")
    if site.prologue.sum_out is not None:
        dt = TL_TYPE[STORAGE[site.dtype]]
        lines.append(f"if {write_sum}:")
        for c in range(count):
            lines.append(
                f"    tl.store(sum_ptr + rm[:, None] * {k} + rs{c}[None, :], xs{c}.to({dt}), "
                f"mask=mask_m[:, None] & (rs{c}[None, :] < {k}))"
            )
    lines += _layer_norm_stats([f"rs{c}[None, :] < {k}" for c in range(count)], k, site.prologue.eps)
    return lines


def _layer_norm_stats(valid: list[str], k: int, eps: float) -> list[str]:
    """``mean`` and ``rstd`` of the rows over all of K from the chunks ``xs0``, ``xs1``, ... in
    registers (``valid[i]``: where chunk i holds elements of the row; elsewhere loaded as 0, they
    add nothing to the mean, and their deviations ``dev<i>`` are set to 0)."""
    chunks = range(len(valid))
    lines = [f"mean = ({' + '.join(f'tl.sum(xs{i}, axis=1)' for i in chunks)}) / {k}"]
    lines += [f"dev{i} = tl.where({valid[i]}, xs{i} - mean[:, None], 0.0)" for i in chunks]
    lines.append(f"var = ({' + '.join(f'tl.sum(dev{i} * dev{i}, axis=1)' for i in chunks)}) / {k}")
    lines.append(f"rstd = 1.0 / tl.sqrt(var + {eps!r})")
    return lines


def _prologue_a(site: Site) -> list[str]:
    """The A tile at ``rk``: the rows normalized, scaled and shifted, rounded to the dtype as the
    LayerNorm's output is (masked elements 0, so they add nothing)."""
    pro = site.prologue
    k = site.k
    lines = _prologue_rows(site)
    lines.append("a = (xs - mean[:, None]) * rstd[:, None]")
    if pro.weight is not None:
        lines.append(f"a = a * tl.load(lnw_ptr + rk, mask=rk < {k}, other=0.0).to(tl.float32)[None, :]")
    if pro.bias is not None:
        lines.append(f"a = a + tl.load(lnb_ptr + rk, mask=rk < {k}, other=0.0).to(tl.float32)[None, :]")
    lines.append(
        f"a = tl.where(mask_m[:, None] & (rk[None, :] < {k}), a, 0.0).to({TL_TYPE[STORAGE[site.dtype]]})"
    )
    return lines


def _chunk_indices(c: str, rk: str, k: int, k_mask: bool, pad: str = "") -> list[str]:
    """Chunk ``c``'s indices of K (``rk<c>``) and its mask (``kmask<c>``; K's bound where ``k_mask``)."""
    bound = f" & (rk{c}[None, :] < {k})" if k_mask else ""
    return [f"{pad}rk{c} = {rk}", f"{pad}kmask{c} = mask_m[:, None]{bound}"]


def _norm_stats(
    site: Site, write_sum: str, steps: list[str] | None = None, k_mask: bool = True, indices: bool = True
) -> list[str]:
    """The row norm's statistics over all of K: A's row inputs in chunks of K (``rk<c>``, masked
    by ``kmask<c>``), each chunk's values before the statistics computed and its ``reduced``
    summed (the sum written on the way where ``write_sum`` holds); then the statistics.
    ``steps`` (the one-row form: its K steps' indices; ``k_mask``: whether they need K's bound)
    unrolls the chunks and keeps their values in registers for the K steps after; without, the
    few-row forms' pass over K in chunks before the K loop keeps only the running sum.
    ``indices=False``: the chunks' ``_chunk_indices`` are written already."""
    norm = site.prologue.norm
    k = site.k
    if steps is None:
        width, count = _stats_chunks(k)
        chunks, pad = {"s": f"c0 + tl.arange(0, {width})"}, "    "
        lines = [
            "s_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)",
            f"for c0 in range(0, {width * count}, {width}):  # the statistics: A's rows over all of K",
        ]
    else:
        chunks, pad, lines = {str(i): rk for i, rk in enumerate(steps)}, "", []
    for c, rk in chunks.items():
        lines += _chunk_indices(c, rk, k, k_mask, pad) if indices else []
        lines += [
            f"{pad}{var.replace('@', c)} = {expr.replace('@', c)}"
            for var, expr, post in norm.row_ops
            if not post
        ]
    lines += _sum_out_stores(site, write_sum, chunks, 0, pad)
    total = " + ".join(
        f"tl.sum(tl.where(kmask{c}, {norm.reduced.replace('@', c)}, 0.0), axis=1)" for c in chunks
    )
    lines.append(f"    s_sum += {total}" if steps is None else f"s_sum = {total}  # over all of K: [BLOCK_M]")
    lines += [f"{var} = {expr}" for var, expr in norm.stat_ops]
    return lines


def _sum_out_stores(
    site: Site, write_sum: str, chunks: dict[str, str], stage: int, pad: str = ""
) -> list[str]:
    """The stores of the row norm's second output (the residual sum later steps read), by the
    first N tile (``write_sum``), at each chunk ``c`` of K (``rk<c>``, ``kmask<c>``), where that
    output is of ``stage`` (``RowNorm.row_ops``)."""
    norm = site.prologue.norm
    if norm.sum_out is None or norm.stage_of(norm.sum_out[1]) != stage:
        return []
    _, var, dtype = norm.sum_out
    return [
        f"{pad}if {write_sum}:  # the first N tile writes the sum that later steps read",
        *(
            f"{pad}    tl.store(sum_ptr + rm[:, None] * {site.k} + rk{c}[None, :], "
            f"{var.replace('@', c)}.to({TL_TYPE[STORAGE[dtype]]}), mask=kmask{c})"
            for c in chunks
        ),
    ]


def _norm_a(site: Site) -> list[str]:
    """The A tile at ``rk`` (the few-row forms): the row norm's values recomputed from its inputs
    and the statistics, rounded as the norm kernel's output is (masked elements 0)."""
    norm = site.prologue.norm
    lines = [f"kmask = mask_m[:, None] & (rk[None, :] < {site.k})"]
    lines += [f"{var.replace('@', '')} = {expr.replace('@', '')}" for var, expr, _ in norm.row_ops]
    lines.append(f"a = tl.where(kmask, {norm.out.replace('@', '')}, 0.0).to({TL_TYPE[STORAGE[site.dtype]]})")
    return lines


def _norm_a_one_pass(site: Site, write_sum: str) -> list[str]:
    """The A tile at ``rk`` of a one-pass ``_rms`` form (``TileConfig.norm_one_pass``): the row
    norm's values before the statistics (the sum written on the way where ``write_sum`` holds,
    the statistics' sum of the reduced value added to ``s_sum``), and A without the statistic.

    RMSNorm's output is A = g * (x * r) per row, r = 1/rms(x) a statistic of the row; so
    A @ W^T = r * ((g * x) @ W^T): the dot takes ``g * x`` (``RowNorm.factored``'s row part),
    rounded to the dtype as the tensor cores need it, and r multiplies the fp32 accumulator once
    after the loop (``_k_loop``), when the sum over all of K is complete. Each element of A is
    rounded once (g * x) where the norm kernel rounds twice (x * r, then g times that), so the
    two differ by about one rounding of the dtype per element, within its tolerance. A's row
    inputs are read once, in the loop that multiplies them, where the statistics pass reads
    them twice."""
    norm = site.prologue.norm
    k = site.k
    part, _ = norm.factored
    lines = [f"kmask = mask_m[:, None] & (rk[None, :] < {k})"]
    lines += [
        f"{var.replace('@', '')} = {expr.replace('@', '')}" for var, expr, post in norm.row_ops if not post
    ]
    if norm.sum_out is not None:
        _, var, dtype = norm.sum_out
        lines.append(f"if {write_sum}:  # the first N tile writes the sum that later steps read")
        lines.append(
            f"    tl.store(sum_ptr + rm[:, None] * {k} + rk[None, :], "
            f"{var.replace('@', '')}.to({TL_TYPE[STORAGE[dtype]]}), mask=kmask)"
        )
    lines.append(f"s_sum += tl.sum(tl.where(kmask, {norm.reduced.replace('@', '')}, 0.0), axis=1)")
    lines.append(
        f"a = tl.where(kmask, {part.replace('@', '')}, 0.0).to({TL_TYPE[STORAGE[site.dtype]]})  # A / statistic"
    )
    return lines


def _epilogue_lines(
    site: Site, ep: Epilogue, store: bool = True, loaded: str | None = None, bias: str | None = None
) -> list[str]:
    """The epilogue on the fp32 tile ``acc<g>`` (bias, activation, the absorbed kernel's steps)
    and, ``store``, the stores of its outputs (``Epilogue.stores``). ``loaded``: the epilogue's
    loads are in registers already, as ``_epilogue_loads`` names them for that chunk; ``bias``:
    the biases too, named ``b<g>_<bias>`` (``_early_biases``, ``_epilogue_loads``)."""
    lines = []
    for g, b in enumerate(site.biases):
        if b is not None:
            value = f"b{g}_{bias}" if bias is not None else _bias_load(g, "rn", "mask_n")
            lines.append(f"acc{g} = acc{g} + {value}")
    if site.activation == "relu":
        lines.append("acc0 = tl.maximum(acc0, 0.0)")
    elif site.activation == "gelu_tanh":
        lines.append("acc0 = " + GELU_TANH.format("acc0"))
    for load in ep.loads.values():
        value = (
            f"{load.param}_{loaded}" if loaded is not None else _ep_load(site, load, "rn", "mask_n", "mask")
        )
        lines.append(f"{load.param}_v = {value}")
    lines += ep.lines
    for i, (_, val, dtype) in enumerate(ep.stores if store else ()):
        lines.append(
            f"tl.store(out{i}_ptr + rm[:, None] * {site.n} + rn[None, :], {val}.to({TL_TYPE[STORAGE[dtype]]}), mask=mask)"
        )
    return lines


def _bias_load(g: int, rn: str, mask_n: str) -> str:
    return f"tl.load(b{g}_ptr + {rn}, mask={mask_n}, other=0.0).to(tl.float32)[None, :]"


# A bias is a weight: the forms whose indices come before the wait for the kernel before (the
# one-row forms, tensor-core forms that load W early, split-K reduces) load it there too
# (``_early_biases``), in registers when the epilogue needs it. Loaded after the K loop, it adds a
# memory latency at the end of every GEMM with a bias: the SASS of GPT-2's one-row GEMVs (sm_90)
# had the bias load after the sum's block barrier, a second wait for memory after A's. Timed on an
# H200 (2026-12-02): GPT-2 decode at batch 1 0.237-0.244 -> 0.220 ms/token, the example MLP's
# forward at batch 1 4% faster. A tensor-core form that loads no W early (its indices after the
# wait) moves its indices before the wait where it has a bias, so the bias loads there too
# (``opening_for_biases``): sm_90 code of the 17-32-row tile (``tile_64x32x128``, the example
# GPT's q/k/v, o and fc) then issues its first copies 121 instructions after the wait where it
# issued them after 153, and no load follows its last copy (4 before). Timed on an H100
# (2026-12-07, both bundles in one process round by round, 12 rounds; bench/RESULTS.md, "the
# bias before the wait"): the example GPT at batch 1 x 32 tokens 0.954 and batch 32 x 1 0.953
# (12 of 12 rounds each), bit for bit. False renders the late loads (an A/B by ``sitecustomize``).
EARLY_BIAS = True


def _bias_lines(site: Site, suffix: str, rn: str, mask_n: str) -> list[str]:
    """The loads of the site's biases at the columns ``rn``, as ``b<g>_<suffix>``."""
    return [
        f"b{g}_{suffix} = {_bias_load(g, rn, mask_n)}" for g, b in enumerate(site.biases) if b is not None
    ]


def _early_biases(site: Site) -> tuple[list[str], str | None]:
    """(the lines that load the block's biases as ``b<g>_e``, the suffix for ``_epilogue_lines``;
    or no lines and None where the site has no bias or ``EARLY_BIAS`` is off). After ``_indices``."""
    if not EARLY_BIAS or not site.bias_weights or not any(b is not None for b in site.biases):
        return [], None
    lines = ["# the biases (weights) before the wait, in registers for the epilogue"]
    return lines + _bias_lines(site, "e", "rn", "mask_n"), "e"


def _ep_load(site: Site, load: Load, rn: str, mask_n: str, mask: str) -> str:
    """An epilogue load at the columns ``rn`` of the block's rows (by ``Load.layout``)."""
    p = load.param
    if load.layout == "full":
        return f"tl.load({p}_ptr + rm[:, None] * {site.n} + {rn}[None, :], mask={mask}, other=0.0).to(tl.float32)"
    if load.layout == "row":
        return f"tl.load({p}_ptr + {rn}, mask={mask_n}, other=0.0).to(tl.float32)[None, :]"
    return f"tl.load({p}_ptr).to(tl.float32)"


def _epilogue_loads(site: Site, ep: Epilogue, c: int, n: int) -> tuple[list[str], list[str]]:
    """The epilogue's loads at chunk ``c`` of a row (``rn<c>``, ``mask<c>``), named for
    ``_epilogue_lines(loaded=c)``: (the biases, weights that may load before the wait; the
    epilogue's other loads, after it)."""
    mask_n = f"rn{c} < {n}"
    biases = _bias_lines(site, str(c), f"rn{c}", mask_n)
    late = [
        f"{ld.param}_{c} = {_ep_load(site, ld, f'rn{c}', mask_n, f'mask{c}')}" for ld in ep.loads.values()
    ]
    return (biases, late) if site.bias_weights else ([], biases + late)


def _params(site: Site, ep: Epilogue | None, index: str, ws: str | None, part: str, factored: bool = False):
    """(params, signature, args) for ``part``: "fused", "partial" or "reduce"; ``factored``: a
    one-row form that applies a LayerNorm after its products reads its column sums too."""
    params: list[KernelParam] = []
    args: list[Any] = []

    def ptr(name: str, buf: str, dtype: str) -> None:
        params.append(KernelParam(name, ParamKind.PTR, dtype))
        args.append(Buf(buf))

    if part in ("fused", "partial"):
        pro = site.prologue
        if pro is None:
            ptr("a_ptr", site.a, site.dtype)
        elif pro.norm is not None:
            for i, (buf, dtype) in enumerate(pro.norm.inputs):
                ptr(f"x{i}_ptr", _table_or(pro, buf), dtype)
            _lookup_params(pro, ptr)
            for i, (buf, dtype) in enumerate(pro.norm.vectors):
                ptr(f"v{i}_ptr", buf, dtype)
            if pro.sum_out is not None:
                ptr("sum_ptr", pro.sum_out, pro.norm.sum_out[2])
        else:
            ptr("x_ptr", _table_or(pro, pro.x), site.dtype)
            if pro.y is not None:
                ptr("y_ptr", _table_or(pro, pro.y), site.dtype)
            _lookup_params(pro, ptr)
            if pro.weight is not None:
                ptr("lnw_ptr", pro.weight, site.dtype)
            if pro.bias is not None:
                ptr("lnb_ptr", pro.bias, site.dtype)
            if pro.sum_out is not None:
                ptr("sum_ptr", pro.sum_out, site.dtype)
        for g, w in enumerate(site.weights):
            ptr(f"w{g}_ptr", w, site.dtype)
        if factored and pro.norm is None:
            for name, buf in zip(("lnu_ptr", "lnc_ptr"), site.ln_sums, strict=True):
                if buf is not None:
                    ptr(name, buf, "float32")
    if part == "partial":
        ptr("ws_ptr", ws, "float32")
    if part == "reduce":
        ptr("ws_ptr", ws, "float32")
    if part in ("fused", "reduce"):
        for g, b in enumerate(site.biases):
            if b is not None:
                ptr(f"b{g}_ptr", b, site.dtype)
        for buf, load in ep.loads.items():
            ptr(f"{load.param}_ptr", buf, load.dtype)
        for i, (buf, _, dtype) in enumerate(ep.stores):
            ptr(f"out{i}_ptr", buf, dtype)
    params.append(KernelParam("M", ParamKind(index), ""))
    args.append(Sym(ix.size_text(ix.parse_size(site.m))))
    return params, signature_of(params, index), args


def _row_inputs(pro: Prologue) -> list[tuple[str, str]]:
    """(the name the kernel gives it, the buffer) of each row input of a prologue: ``x [, y]``
    of a LayerNorm, ``x0 [, x1]`` of a row norm."""
    if pro.norm is not None:
        return [(f"x{i}", buf) for i, (buf, _) in enumerate(pro.norm.inputs)]
    return [("x", pro.x)] + ([("y", pro.y)] if pro.y is not None else [])


def _table_or(pro: Prologue, buf: str) -> str:
    """What a row input's pointer points at: its lookup's table, or the buffer itself."""
    looked = pro.lookup(buf)
    return looked.table if looked is not None else buf


def _lookup_params(pro: Prologue, ptr: Callable[[str, str, str], None]) -> None:
    """The ids of each row input read through its lookup (``<x>_ids_ptr``)."""
    for name, buf in _row_inputs(pro):
        looked = pro.lookup(buf)
        if looked is not None:
            ptr(f"{name}_ids_ptr", looked.ids, looked.ids_dtype)


def _lookup_rows(site: Site) -> list[str]:
    """For each row input read through its lookup (``gemm_sites.Gathered``), after the wait (the
    kernel before wrote the ids): the block's rows' ids (``<x>_id``), whether each is inside the
    table (``<x>_in``), and the table row read (``<x>_row``: 0 for an id outside, whose row the
    loads then make NaN, as the lookup's kernel writes it)."""
    pro = site.prologue
    lines = []
    for name, buf in _row_inputs(pro) if pro is not None else ():
        looked = pro.lookup(buf)
        if looked is None:
            continue
        lines += [
            f"{name}_id = tl.load({name}_ids_ptr + rm, mask=mask_m, other=0).to(tl.int64)  # {buf}: a lookup",
            f"{name}_in = ({name}_id >= 0) & ({name}_id < {looked.rows})",
            f"{name}_row = tl.where({name}_in, {name}_id, 0)",
        ]
    return lines


def _rendered(
    site, cfg, name, kind, body, params, signature, args, outputs, grid, ops, early=(), first_ok=True
) -> Rendered:
    blocks = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    # The kernel after starts before this one's wait where the site allows it (``Site.launch_first``)
    # and the form is a one-row GEMV (dot-free, a row a block): measured on an H200 (2026-12-02, decode,
    # paired), GPT-2 and Llama-3.2-1B 1.3-1.6% faster a token at batch 1 so; with the tensor-core
    # forms too, GPT-2 at batch 8 0.2% slower. ``first_ok=False``: never (the reduce that runs the
    # next norm, at 2-32 rows: launching first cost GPT-2 3% at batch 8).
    first = first_ok and site.launch_first and not cfg.dot and cfg.block_m == 1
    source = kernel_module(
        _doc(site, cfg, kind, grid), blocks, name, signature, body, early, launch_first=first
    )
    m = ix.parse_size(site.m)
    elem = ITEMSIZE[site.dtype]
    pro = site.prologue
    rows = 1 if pro is None else 1 + (pro.y is not None) + (pro.sum_out is not None)  # A, or x [+ y] [+ sum]
    stored = [o for o in outputs if pro is None or o != pro.sum_out]
    traffic = (
        rows * m * site.k * elem
        + len(site.weights) * site.n * site.k * elem
        + m * site.n * elem * len(stored)
    )
    stages = form_stages().get(cfg.name, cfg.num_stages)
    config = {
        "kind": "gemm",
        "candidate": cfg.name,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "split_k": cfg.split_k,
        "heuristic": HEURISTIC,
        "num_warps": cfg.num_warps,
        "num_stages": stages,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=tuple(args),
        outputs=tuple(outputs),
        grid=grid,
        num_warps=cfg.num_warps,
        num_stages=stages,
        config=config,
        ops=tuple(s.target for s in site.reference),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def _tag(site: Site) -> str:
    tag = "dual" if len(site.weights) > 1 else ("addmm" if any(site.biases) else "mm")
    tag = "halves" if site.halves else tag
    if site.prologue is not None:
        tag = ("ln_" if site.prologue.norm is None else "norm_") + tag
    return tag + ("_" + site.activation if site.activation else "") + ("_epilogue" if site.epilogue else "")


def _prologue_outputs(site: Site) -> list[str]:
    pro = site.prologue
    return [pro.sum_out] if pro is not None and pro.sum_out is not None else []


def _gemm_outputs(site: Site) -> tuple[str, ...]:
    """The site's outputs but the prologue's sum: what the GEMM and its epilogue write."""
    return tuple(o for o in site.outputs if o not in _prologue_outputs(site))


def _render_fused(site: Site, ep: Epilogue, cfg: TileConfig, index: str) -> Rendered:
    grid = _grid(site, cfg)
    early, body = opening_for_biases(site, cfg, index)
    biases, bias = _early_biases(site) if early else ([], None)  # where the indices come early
    early += biases
    body += _lookup_rows(site)
    if site.prologue is not None and cfg.dot and not _one_pass(site, cfg):
        # a tensor-core form: the statistics before the K loop
        write_sum = f"(tl.program_id({_axes(cfg)[1]}) == 0)"
        if site.prologue.norm is None:
            body += _prologue_stats(site, write_sum)
        else:
            body += _norm_stats(site, write_sum)
    # the epilogue's row loads held through the K loop, where none of them is a scalar (the
    # epilogue reads its loads all held or all in place)
    all_rows = all(ld.layout != "scalar" for ld in ep.loads.values())
    loads = [
        (f"{ld.param}_h", _ep_load(site, ld, "rn", "mask_n", "mask"), ld.dtype)
        for ld in (ep.loads.values() if all_rows else ())
    ]
    after_wait, reads = held_loads(cfg, loads)
    body += after_wait + _k_loop(site, cfg, "0", site.k, index)
    body += [ln for lines in reads.values() for ln in lines]
    body += _epilogue_lines(site, ep, loaded="h" if reads else None, bias=bias)
    factored = _factored(site, cfg)
    params, signature, args = _params(site, ep, index, None, "fused", factored)
    outputs = [buf for buf, _, _ in ep.stores] + _prologue_outputs(site)
    name = f"gemm_{_tag(site)}_{cfg.name}" + ("_factored" if factored else "")
    return _rendered(site, cfg, name, "fused", body, params, signature, args, outputs, grid, (), early)


def _opening(
    site: Site, cfg: TileConfig, index: str, k_offset: str, k_extent: int, sliced: bool = False
) -> tuple[list[str], list[str]]:
    """(lines before the wait for the kernel before, the body's first lines): the block's indices
    (and K slice, ``sliced``), and for the dot-free form its rows of W, for a tensor-core form
    with ``w_early`` its first W tiles, go before the wait."""
    opening = _indices(site, cfg, index)
    if sliced:
        opening.append(f"ks = tl.program_id(2){'.to(tl.int64)' if index == 'i64' else ''}")
    if cfg.dot:
        if _w_early_steps(cfg, k_extent):
            return opening + _dot_w_early(site, cfg, k_offset, k_extent, index), []
        return [], opening
    return opening + _vec_w_early(site, cfg, k_offset, k_extent), []


def opening_for_biases(site: Site, cfg: TileConfig, index: str) -> tuple[list[str], list[str]]:
    """``_opening`` of a form without K slices; a tensor-core form's indices before the wait
    where it has a bias (and EARLY_BIAS holds), so that its biases (weights) load there too
    (``_early_biases``), not after its K loop."""
    early, body = _opening(site, cfg, index, "0", site.k)
    if not early and cfg.dot and _early_biases(site)[0]:
        return body, []
    return early, body


def _render_partial(site: Site, cfg: TileConfig, index: str, ws: str) -> Rendered:
    s, g = cfg.split_k, len(site.weights)
    per_slice = -(-site.k // s)
    chunk = -(-per_slice // cfg.block_k) * cfg.block_k  # K per slice, a multiple of BLOCK_K
    grid = _grid(site, cfg, str(s))
    early, body = _opening(site, cfg, index, f"ks * {chunk}", chunk, sliced=True)
    body += _k_loop(site, cfg, f"ks * {chunk}", chunk, index)
    body.append("# each K slice writes its own slab: ws[ks, g, m, n]; the reduce kernel adds them in order")
    for gi in range(g):
        body.append(
            f"tl.store(ws_ptr + ((ks * {g} + {gi}) * M + rm[:, None]) * {site.n} + rn[None, :], acc{gi}, mask=mask)"
        )
    params, signature, args = _params(site, None, index, ws, "partial")
    name = f"gemm_{_tag(site)}_{cfg.name}_partial"
    return _rendered(
        site, cfg, name, "split-K partial sums", body, params, signature, args, [ws], grid, (), early
    )


def _render_reduce(site: Site, ep: Epilogue, cfg: TileConfig, index: str, ws: str) -> Rendered:
    s, g = cfg.split_k, len(site.weights)
    grid = _grid(site, cfg)
    biases, bias = _early_biases(site)
    indices = _indices(site, cfg, index)
    early, body = (indices + biases, []) if biases else ([], indices)
    body += [f"acc{gi} = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)" for gi in range(g)]
    body.append(f"for ks in tl.static_range({s}):  # fixed order: the same bits on every run")
    for gi in range(g):
        body.append(
            f"    acc{gi} += tl.load(ws_ptr + ((ks * {g} + {gi}) * M + rm[:, None]) * {site.n} + rn[None, :], "
            f"mask=mask, other=0.0)"
        )
    body += _epilogue_lines(site, ep, bias=bias)
    params, signature, args = _params(site, ep, index, ws, "reduce")
    outputs = [buf for buf, _, _ in ep.stores]
    name = f"gemm_{_tag(site)}_{cfg.name}_reduce"
    return _rendered(
        site, cfg, name, "split-K reduce + epilogue", body, params, signature, args, outputs, grid, (), early
    )


_Ptr = Callable[[str, str, str], None]  # adds a pointer parameter: (name, buffer, dtype)
# The columns of a row the reduce + norm kernel takes at a time, and its warps (0: the split-K
# form's own, 4). On an H200, with the loads made at once, 1024 columns on 8 warps against 256 on
# 4: GPT-2 (fc2's reduce running ``ln_1``) 0.348 against 0.356 ms a token at batch 8, 0.569
# against 0.580 at 32; Llama-3.2-1B's first 8 layers 0.538 / 0.585 against 0.541 / 0.591.
REDUCE_NORM_CHUNK = 1024
REDUCE_NORM_WARPS = 8
# the most fp32 values a thread of the reduce + norm kernel holds for its loads made at once
# (``render_reduce_norm``); past it the loads are left to the compiler's order
REDUCE_NORM_HELD_MAX = 128


class _NormParts(NamedTuple):
    """A norm's lines in ``render_reduce_norm``: ``early``, before the wait (indices, the
    weights' loads); ``loads``, its row inputs' loads, issued with the slabs'; ``body``, the rest;
    ``rows``: the row values it loads (for the registers' estimate)."""

    early: list[str]
    loads: list[str]
    body: list[str]
    rows: int


def render_reduce_norm(
    site: Site,
    cfg: TileConfig,
    ws: str,
    norm_site: Site,
    a_out: str,
    buffers: dict[str, TensorSpec],
    known: dict[str, TensorSpec],
    index: str,
) -> Rendered:
    """A split-K reduce that also runs the row norm after it (``gemm_pairs``): one program per
    row of C = A @ W^T. Every load of the row is made at once: the weights it reads (the
    first GEMM's bias, the norm's scale and shift) before the wait for the kernel before; after
    it the ``cfg.split_k`` fp32 slabs (``ws``) of the whole row, the epilogue's and the norm's
    row inputs; then a block barrier, which the loads stay above. (With 8 to 32 programs in
    all, nothing hides a wait for memory: written chunk by chunk, ptxas interleaved the loads
    with the sums, one memory latency per few loads; 1024 columns on 8 warps make each thread's
    loads few and wide, 12 for GPT-2's or Llama-3.2-1B's rows.) The slabs are added in the
    plain reduce's fixed order and ``site``'s epilogue applied; what the epilogue would store
    (C, read by nothing but the norm) stays in registers, rounded to its dtype as the store
    would round it. Then the norm that ``norm_site`` (the next GEMM) has
    as its prologue, a row norm lowered from its kernel (RMSNorm: ``_reduce_row_norm``) or a
    LayerNorm (``_reduce_layer_norm``): the statistics over the row, the residual sum later
    steps read (``sum_out``) and the normalized row, A of the next GEMM, stored to ``a_out``.
    The norm kernel and its launch go; its steps and roundings are the one-row forms'
    (``_vec_steps_norm``, ``_vec_steps_ln``), so A's bits equal the norm kernel's but for the
    order of the statistics' sums."""
    n, s = site.n, cfg.split_k
    width = min(REDUCE_NORM_CHUNK, 1 << (n - 1).bit_length())
    count = -(-n // width)
    ep = _site_epilogue(site, buffers, known)
    pro = norm_site.prologue
    rows = [buf for buf, _ in pro.norm.inputs] if pro.norm is not None else [pro.x, pro.y]
    # the norm's row inputs that the epilogue would store: input i kept in registers as p<i>
    held = {buf: i for i, buf in enumerate(rows) if buf in {b for b, _, _ in ep.stores}}
    cast = ".to(tl.int64)" if index == "i64" else ""
    early = [f"rm = tl.program_id(0){cast} * BLOCK_M + tl.arange(0, BLOCK_M)", "mask_m = rm < M"]
    loads = ["# after the wait, every load of the row at once: the split-K slabs, the row inputs"]
    for c in range(count):
        early += [
            f"rn{c} = {c * width} + tl.arange(0, BLOCK_N)",
            f"mask{c} = mask_m[:, None] & (rn{c} < {n})[None, :]",
        ]
        loads += [
            f"ws{c}_{ks} = tl.load(ws_ptr + ({ks} * M + rm[:, None]) * {n} + rn{c}[None, :], mask=mask{c}, other=0.0)"
            for ks in range(s)
        ]
        ep_early, ep_late = _epilogue_loads(site, ep, c, n)
        early += ep_early
        loads += ep_late
    params: list[KernelParam] = [KernelParam("ws_ptr", ParamKind.PTR, "float32")]
    args: list[Any] = [Buf(ws)]

    def ptr(name: str, buf: str, dtype: str) -> None:
        params.append(KernelParam(name, ParamKind.PTR, dtype))
        args.append(Buf(buf))

    for g, b in enumerate(site.biases):
        if b is not None:
            ptr(f"b{g}_ptr", b, site.dtype)
    for buf, load in ep.loads.items():
        ptr(f"{load.param}_ptr", buf, load.dtype)
    if pro.norm is not None:
        norm = _reduce_row_norm(norm_site, held, n, width, count, ptr)
    else:
        norm = _reduce_layer_norm(norm_site, held, n, count, ptr)
    early += norm.early
    loads += norm.loads
    warps = REDUCE_NORM_WARPS or cfg.num_warps
    per_thread = (s + len(ep.loads) + norm.rows) * width * count // (32 * warps)
    body = loads
    if per_thread <= REDUCE_NORM_HELD_MAX:
        body.append("tl.debug_barrier()  # the loads above stay ahead of the first sum (render_reduce_norm)")
    body.append("# per chunk: the slabs added in a fixed order (the same bits on every run), the epilogue")
    for c in range(count):
        body += [
            f"rn = rn{c}",
            f"mask_n = rn < {n}",
            f"mask = mask{c}",
            f"acc0 = {' + '.join(f'ws{c}_{ks}' for ks in range(s))}",
        ]
        body += _epilogue_lines(site, ep, store=False, loaded=str(c), bias=str(c))
        body += [  # the norm's row inputs among the outputs: kept, rounded as the store would
            f"p{held[buf]}_{c} = tl.where(mask, {val}.to({TL_TYPE[STORAGE[dt]]}).to(tl.float32), 0.0)"
            for buf, val, dt in ep.stores
            if buf in held
        ]
    body += norm.body
    ptr("a_ptr", a_out, norm_site.dtype)
    params.append(KernelParam("M", ParamKind(index), ""))
    args.append(Sym(ix.size_text(ix.parse_size(site.m))))
    outputs = _prologue_outputs(norm_site) + [a_out]
    name = f"gemm_{_tag(site)}_{cfg.name}_reduce_norm"
    return _rendered(
        site,
        replace(cfg, block_m=1, block_n=width, dot=False, num_warps=warps),
        name,
        "split-K reduce + epilogue + the next GEMM's row norm",
        body,
        params,
        signature_of(params, index),
        args,
        outputs,
        (_grid_rows(site.m, 1),),
        (),
        early,
        first_ok=False,
    )


def _reduce_row_norm(
    norm_site: Site, held: dict[str, int], n: int, width: int, count: int, ptr: _Ptr
) -> _NormParts:
    """``render_reduce_norm``'s row norm (RMSNorm, lowered from the norm kernel) over the whole
    row, the row inputs ``held`` in registers (``p<i>_<chunk>``), the others loaded with the
    slabs, its vectors (weights: ``gemm_prologue`` takes only those) before the wait."""
    norm = norm_site.prologue.norm
    loads_held = {f"x{i}_@": f"p{i}_@" for i in held.values()}  # its loads of those inputs
    # its other loads (a row input's or a vector's: indices only), made ahead with the slabs
    ahead = [(v, e) for v, e, st in norm.row_ops if e.startswith("tl.load(") and v not in loads_held]
    vectors = {f"v{i}_@" for i in range(len(norm.vectors))}
    norm_view = replace(
        norm_site,
        k=n,
        prologue=replace(
            norm_site.prologue,
            norm=replace(
                norm,
                row_ops=tuple(
                    (v, loads_held.get(v, e), st) for v, e, st in norm.row_ops if (v, e) not in ahead
                ),
            ),
        ),
    )
    indices, early, loads = [], [], []
    for c in range(count):
        indices += _chunk_indices(str(c), f"rn{c}", n, n % width != 0)
        for v, e in ahead:
            (early if v in vectors else loads).append(f"{v.replace('@', str(c))} = {e.replace('@', str(c))}")
    steps = [f"rn{c}" for c in range(count)]
    body = ["# the next GEMM's row norm over the whole row"]
    body += _norm_stats(norm_view, "True", steps, n % width != 0, indices=False)
    dt = TL_TYPE[STORAGE[norm_site.dtype]]
    for c in range(count):
        body += [
            f"{var.replace('@', str(c))} = {expr.replace('@', str(c))}"
            for var, expr, st in norm.row_ops
            if st
        ]
        body.append(
            f"tl.store(a_ptr + rm[:, None] * {n} + rk{c}[None, :], {norm.out.replace('@', str(c))}.to({dt}), "
            f"mask=kmask{c})"
        )
    body += _sum_out_stores(norm_view, "True", {str(c): f"rk{c}" for c in range(count)}, 1)
    for i, (buf, dtype) in enumerate(norm.inputs):
        if buf not in held:
            ptr(f"x{i}_ptr", buf, dtype)
    for i, (buf, dtype) in enumerate(norm.vectors):
        ptr(f"v{i}_ptr", buf, dtype)
    if norm.sum_out is not None:
        ptr("sum_ptr", norm_site.prologue.sum_out, norm.sum_out[2])
    return _NormParts(indices + early, loads, body, len(ahead))


def _reduce_layer_norm(norm_site: Site, held: dict[str, int], n: int, count: int, ptr: _Ptr) -> _NormParts:
    """``render_reduce_norm``'s LayerNorm over the whole row: ``x [+ y]`` (the one ``held`` in
    registers, ``p<i>_<chunk>``; the other loaded with the slabs), rounded as the add rounds, as
    ``_prologue_rows`` has it; the sum stored where later steps read it; mean and 1/std
    (``_layer_norm_stats``); then A normalized, scaled and shifted (the scale and shift loaded
    before the wait: weights), rounded as the LayerNorm's output is (``_prologue_a``)."""
    pro = norm_site.prologue
    dt = TL_TYPE[STORAGE[norm_site.dtype]]
    inputs = [(name, buf) for name, buf in (("x", pro.x), ("y", pro.y)) if buf is not None]
    vectors = [(name, buf) for name, buf in (("lnw", pro.weight), ("lnb", pro.bias)) if buf is not None]
    early, loads, body = [], [], ["# the next GEMM's LayerNorm over the whole row"]
    for c in range(count):
        at = f"rm[:, None] * {n} + rn{c}[None, :]"
        early += [
            f"{name}_{c} = tl.load({name}_ptr + rn{c}, mask=rn{c} < {n}, other=0.0).to(tl.float32)[None, :]"
            for name, _ in vectors
        ]
        loads += [
            f"{name}_{c} = tl.load({name}_ptr + {at}, mask=mask{c}, other=0.0).to(tl.float32)"
            for name, buf in inputs
            if buf not in held
        ]
        terms = [f"p{held[buf]}_{c}" if buf in held else f"{name}_{c}" for name, buf in inputs]
        body.append(f"xs{c} = {' + '.join(terms)}")
        if len(terms) == 2 and norm_site.dtype in ROUND:
            body.append(f"xs{c} = xs{c}.to({ROUND[norm_site.dtype]}).to(tl.float32)")
        if pro.sum_out is not None:
            body.append(f"tl.store(sum_ptr + {at}, xs{c}.to({dt}), mask=mask{c})")
    body += _layer_norm_stats([f"mask{c}" for c in range(count)], n, pro.eps)
    for c in range(count):
        body.append(f"a = dev{c} * rstd[:, None]")
        body += [f"a = a {'*' if name == 'lnw' else '+'} {name}_{c}" for name, _ in vectors]
        body.append(f"tl.store(a_ptr + rm[:, None] * {n} + rn{c}[None, :], a.to({dt}), mask=mask{c})")
    for name, buf in inputs:
        if buf not in held:
            ptr(f"{name}_ptr", buf, norm_site.dtype)
    for name, buf in vectors:
        ptr(f"{name}_ptr", buf, norm_site.dtype)
    if pro.sum_out is not None:
        ptr("sum_ptr", pro.sum_out, norm_site.dtype)
    return _NormParts(early, loads, body, len(vectors) + sum(buf not in held for _, buf in inputs))
