"""Decode attention kernels: the Triton source of a decode attention site's forms, the one-kernel
form (one program per row and KV head) and the split-KV form (partials over ranges of the cache,
then a combine kernel), with the cache write, rotary embedding and masks each site folds in.
``aot.codegen.decode_attention`` says what each form does, chooses one per site and folds the
steps; this module writes the kernels.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import sympy

from aot.codegen import index as ix
from aot.codegen.cache_writes import INDEX_PUT
from aot.codegen.decode_sites import SDPA, DecodeSite, NewRows
from aot.codegen.gemm_prologue import RowNorm
from aot.codegen.kernel_source import (
    GDC_LAUNCH,
    kernel_module,
    launch_after,
    on_off,
    online_softmax_lines,
    setting,
    signature_of,
)
from aot.codegen.render import Rendered
from aot.codegen.triton_types import STORAGE, TL_TYPE
from aot.dtypes import ITEMSIZE
from aot.schema import Buf, KernelParam, ParamKind, Sym, TensorSpec

HEURISTIC = "decode-attention-v1"
MAX_BLOCK_N = 256  # cache slots per step of the one-kernel form's loop
LOG2E = 1.4426950408889634
WIDE_TILE = 128 * 64  # key tile (slots x head dim) from which a program gets 8 warps
SMALL_TILE = 64 * 64  # a key tile up to this gets 2 warps; one between them 4
# 2, 4, 8 or 16: every decode attention program's warps, for measuring. 4 instead of the rule's 8
# (Llama-3.2-1B's 160-slot cache, one 256 x 64 key tile a program) took its first 8 layers at
# batch 1 from 0.452 to 0.479 ms a token on an H200 (2026-12-04); 16 took them to 0.4605 against
# 0.4512 (paired, 12 of 12 rounds slower; bench/results/decode/paired-llama-3.2-1b-8layers-b1-
# attention-16-warps-h200-2026-12-04d.json). At GPT-2's split form (a 512-slot cache in 8 ranges
# of one 64 x 64 tile each) 2 warps instead of 4 took its whole decode from 0.2077 to 0.2015 ms a
# token at batch 1 (12 of 12 rounds faster, the same tokens) and 0.3335 to 0.3319 at batch 8
# (9 of 12), 8 warps to 0.2274 and 0.3808 (H100, 2026-12-07, both bundles in one process;
# bench/results/decode/paired-gpt2-b1-b8-attention-{2,8}-warps-h100-2026-12-07b.json). A likely
# reading, not profiled: at one query a KV head the program's few products leave its warps waiting
# at the barriers between its phases, which fewer warps cross sooner. The 0.58B Llama's split form
# (4 query heads a KV head, the same tile): 0.4316 against 0.4387 with 4 warps at batch 1 (12 of 12
# rounds faster, the same tokens), 0.5898 against 0.5890 at batch 8 (even; H100, 2026-12-07,
# paired-llama-b1-b8-attention-4-warps-h100-2026-12-07c.json). ``tests/gpu/test_decode_attention_gpu.py``
# passed with every form at 2.
WARPS_ENV = "AOTPACK_DECODE_WARPS"


def _warps(tile: int) -> int:
    """A program's warps: ``WARPS_ENV`` where set, else by its key tile (``WIDE_TILE``,
    ``SMALL_TILE``)."""
    given = setting(WARPS_ENV, None, ("2", "4", "8", "16"))
    if given is None:
        return 8 if tile >= WIDE_TILE else 2 if tile <= SMALL_TILE else 4
    return int(given)


# The one-kernel form's programs, one per row and query head, without tensor cores ("on"), or
# one per row and KV head, its query heads a tile of the tensor cores' products ("off"): the
# vector form keeps a block's keys and values in registers as loaded (both [BLOCK_D, BLOCK_N]),
# the scores and the weighted values sums of products over the head dim and over the slots, so
# that no shared-memory staging of the cache waits behind the dependent-launch wait, as the tile
# form's does (bench/results/profiles/sass-decode-attention-llama-3.2-1b-b1-variants-sm90-
# 2026-12-04d.txt); each program reads its KV head's cache again (G times in all, from L2 after
# the first). VECTOR_FORM, or VECTOR_ENV where set. Off: measured on an H200 (Llama-3.2-1B's first 8
# layers, a 160-slot cache, bfloat16, bench/decode_paired.py, 12 rounds; bench/results/decode/
# paired-llama-3.2-1b-8layers-*-attention-vector-*-h200-2026-12-04e.json), vector / tile ms a
# token: batch 1 0.4434 / 0.4458 on 8 warps (12 of 12 rounds faster) and 0.4421 / 0.4452 on 4
# warps (12 of 12), batch 8 on 4 warps 0.5766 / 0.5317 (8.4% slower, 12 of 12). Compiled for sm_90
# the vector form still has 15 barriers after the wait, as the tile form (the scores' layout
# converted for the mask's row and back, three reductions across warps): at batch 1 the kernel
# boundaries, not the cache's staging, are what the attention costs.
VECTOR_FORM = "off"
VECTOR_ENV = "AOTPACK_DECODE_VECTOR"


def vector_form() -> bool:
    """Whether the one-kernel form runs as the vector form (VECTOR_FORM, or VECTOR_ENV where set)."""
    return on_off(VECTOR_ENV, VECTOR_FORM)


# The vector form's weighted values (``online_softmax_lines``' ``weighted``): its one head's scores
# a [1, BLOCK_N] row, the values [BLOCK_D, BLOCK_N] as loaded, each weight rounded to the values'
# dtype before its product, as the tile form's dot takes it.
VECTOR_WEIGHTED = "tl.sum(v.to(tl.float32) * p.to(v.dtype).to(tl.float32), 1)"


NUM_STAGES = 2  # the next block's keys and values load while this one's softmax runs
SPLIT_BLOCK_N = 128  # cache slots per loop step of the split form's partial kernel, at most
MIN_SPLIT_BLOCK_N = 16  # a block halves (down to this) until each split has one
# slots x head dim (padded) of a block at most: two stages of 16-bit keys and values in 128 KiB of
# shared memory (a head dim of 256 takes blocks of 64 slots)
SPLIT_MAX_TILE = 128 * 128
COMBINE_WARPS = 4


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _norm_lines(
    norm: RowNorm, tag: str, raw: str, vectors: list[str], at: str, stats: bool
) -> tuple[list[str], str]:
    """Kernel lines computing a norm of each head (``Rotary.norm``: a row norm over one head's
    elements) of ``raw``, a ``[rows, BLOCK_D]`` tile of heads as loaded, whose elements are the
    head's ``at`` (a ``[BLOCK_D]`` index); the norm's vectors read at ``at`` from the pointers
    ``vectors``. Returns the lines and the variable holding the result (fp32, rounded as the norm
    rounds each op). ``stats``: compute each row's statistics from ``raw`` (named by ``tag``); else
    use those computed before under the same ``tag`` (a rotary partner's elements: its head's)."""
    part = tag if stats else tag + "p"
    stat = re.compile(r"\bs(_sum|_mean|\d+)\b")

    def named(expr: str) -> str:
        return stat.sub(lambda m: f"{tag}_s{m.group(1)}", expr.replace("@", part))

    def row(var: str, expr: str) -> str:
        if var.startswith("x0_"):  # the one row input: the tile as loaded
            return f"({raw}).to(tl.float32)"
        if var.startswith("v") and var[1 : var.index("_")].isdigit():  # a vector, at the head's elements
            i = int(var[1 : var.index("_")])
            return f"tl.load({vectors[i]} + {at}, mask={at} < HEAD_DIM, other=0.0).to(tl.float32)[None, :]"
        return named(expr)

    lines = [f"{named(v)} = {row(v, e)}" for v, e, post in norm.row_ops if not post]
    if stats:
        lines.append(
            f"{tag}_s_sum = tl.sum(tl.where(({at} < HEAD_DIM)[None, :], {named(norm.reduced)}, 0.0), axis=1)"
        )
        lines += [f"{named(v)} = {named(e)}" for v, e in norm.stat_ops]
    lines += [f"{named(v)} = {row(v, e)}" for v, e, post in norm.row_ops if post]
    return lines, named(norm.out)


def _head_norm(
    norm: RowNorm, prefix: str, vectors: list[str], tl_dtype: str, what: str
) -> tuple[list[str], Callable[[str], tuple[list[str], str]]]:
    """``_norm_lines`` for one head, a ``[BLOCK_D]`` vector (the new key ``kn``, or the vector
    form's query ``q``: ``prefix`` "k" or "q"), as a tile of one row: the lines that norm it in
    place (rounded to ``tl_dtype``), and the rotary partner's (``_rotation_lines``' ``partner_of``)."""
    tag, var = f"{prefix}n", "kn" if prefix == "k" else "q"
    lines, out = _norm_lines(norm, tag, f"{var}[None, :]", vectors, "rd", True)
    lines = [f"# {what} normed (its norm's statistics over the head), then rotated", *lines]
    lines.append(f"{var} = tl.reshape({out}, (BLOCK_D,)).to({tl_dtype})")

    def partner_of(load: str) -> tuple[list[str], str]:
        lines, out = _norm_lines(norm, tag, f"({load})[None, :]", vectors, f"{prefix}_partner", False)
        return lines, f"tl.reshape({out}, (BLOCK_D,))"

    return lines, partner_of


def _rotation_lines(
    prefix: str,
    x: str,
    partner_load: str,
    lanes: str,
    tables: tuple[str, str, str],
    tl_dtype: str,
    half_tables: bool = False,
    partner_of: Callable[[str], tuple[list[str], str]] | None = None,
) -> list[str]:
    """Kernel lines that rotate ``x`` (loaded un-rotated) as the library computes rotary embedding:
    ``x * cos + cat(-x2, x1) * sin`` over the first ``{PREFIX}_ROT`` elements of each head, each
    product and the sum rounded to the operands' dtype (``tl_dtype``), as the library rounds them
    (on an H200 some rotated keys still differed from the library's bits by a rounding: the GPU
    test holds them to the dtype's tolerance). ``partner_load``: the load of element
    ``{prefix}_partner`` of each head, where ``{prefix}_turn``; ``lanes``: the head dim's broadcast
    (``[None, :]`` in a tile of query heads); ``half_tables``: cos and sin hold ``{PREFIX}_ROT / 2``
    elements, each for both halves (GPT-OSS's); ``partner_of``: the lines and the expression that
    give the partner's value from its load (its head's norm, ``_norm_lines``), where it is not
    the value loaded."""
    rot = f"{prefix.upper()}_ROT"
    cos_ptr, sin_ptr, batch = tables
    half = tl_dtype != "tl.float32"
    at = f"(rd % ({rot} // 2))" if half_tables else "rd"

    def rounded(e: str) -> str:  # the library's rounding of each op's result
        return f"({e}).to({tl_dtype}).to(tl.float32)" if half else f"({e})"

    partner, other = ([], partner_load) if partner_of is None else partner_of(partner_load)
    return [
        f"{prefix}_turn = rd < {rot}  # the rotated elements of each head; the rest as loaded",
        f"{prefix}_partner = tl.where(rd < {rot} // 2, rd + {rot} // 2, rd - {rot} // 2)",
        f"{prefix}_cos = tl.load({cos_ptr} + b * {batch} + {at}, mask={prefix}_turn, other=0.0).to(tl.float32)",
        f"{prefix}_sin = tl.load({sin_ptr} + b * {batch} + {at}, mask={prefix}_turn, other=0.0).to(tl.float32)",
        f"{prefix}_sin = tl.where(rd < {rot} // 2, -{prefix}_sin, {prefix}_sin)  # cat(-x2, x1) * sin: the sign on sin, exactly",
        *partner,
        f"{prefix}_other = {other}.to(tl.float32)",
        f"{prefix}_turned = "
        + rounded(
            rounded(f"{x}.to(tl.float32) * {prefix}_cos{lanes}")
            + " + "
            + rounded(f"{prefix}_other * {prefix}_sin{lanes}")
        ),
        f"{x} = tl.where({prefix}_turn{lanes}, {prefix}_turned, {x}.to(tl.float32)).to({tl_dtype})",
    ]


# Where the decode attention lets the kernel after it (the o projection) start before its own
# wait (``render_decode_attention(launch_first=True)``): at one row. Measured on an H200
# (2026-12-02, paired, Llama-3.2-1B's first 8 layers): with the one-row GEMVs launching first too,
# 2.3% faster a token at batch 1 where the GEMVs alone gained 1.3%; at batch 8 the o projection's
# tensor-core blocks, resident early, cost 0.8%.
LAUNCH_FIRST_ROWS = "B == 1"
# The split form in one kernel lets the kernel after start once its partial is counted (below);
# at one row, with ``launch_first`` and ``COMBINED_FIRST``, before its wait as the one-kernel form.
COMBINED_FIRST = True


@dataclass(frozen=True)
class Ahead:
    """A later kernel's weight that the one-kernel form's own programs stream into L2 while the
    attention runs (``decode_attention.ahead_weight``): ``PROGRAMS`` programs past the grid's
    ``B * KV_HEADS`` wait for the kernel before, then each thread issues one bulk prefetch
    (``cp.async.bulk.prefetch.L2``) of its ``chunk`` of the weight's first ``nbytes``, and they
    end. The attention's programs do not touch it. A hint only: nothing reads the prefetched
    lines but that kernel, which reads them from L2 where they still are, from HBM where not."""

    weight: str
    dtype: str
    nbytes: int  # a multiple of 128, at most the weight's size
    programs: int = 128  # at most; fewer where each thread would take less than AHEAD_CHUNK bytes

    def chunk(self, threads: int) -> int:
        """Bytes a thread prefetches: a multiple of 128 (the bulk prefetch's 16-byte grain)."""
        return -(-self.nbytes // (self.programs * threads * 128)) * 128


AHEAD_CHUNK = 512  # bytes a side program's thread prefetches at least (16 MiB: 128 programs of 256)
# One thread's bulk prefetch of its chunk, where the chunk's size is positive (Hopper, PTX 8.0):
# ``$0`` is a dummy result (inline asm returns a value)
BULK_PREFETCH = (
    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


def _ahead_lines(ahead: Ahead) -> list[str]:
    """The side programs' lines, first in the kernel: under ``GDC`` (sm_90+ cubins; in Triton's
    interpreter and elsewhere they only end)."""
    return [
        "if tl.program_id(0) >= B * KV_HEADS:  # a side program: a later kernel's weight into L2",
        "    if GDC:  # after the kernel before: in this kernel's window, not during its stream",
        "        tl.extra.cuda.gdc_wait()",
        "        at = ((tl.program_id(0) - B * KV_HEADS) * PF_THREADS + tl.arange(0, PF_THREADS)) * PF_CHUNK",
        "        tl.inline_asm_elementwise(",
        f'            "{BULK_PREFETCH}",',
        '            "=r,l,r",',
        "            [pf_ptr.to(tl.pointer_type(tl.int8)) + at, tl.minimum(PF_BYTES - at, PF_CHUNK)],",
        "            dtype=tl.int32,",
        "            is_pure=False,",
        "            pack=1,",
        "        )",
        "    return",
    ]


def render_decode_attention(
    site: DecodeSite, launch_first: bool = False, vector: bool | None = None, ahead: Ahead | None = None
) -> Rendered:
    """The kernel of one site: grid (B * KV,), one program per row and KV head; or, ``vector``
    (``vector_form()`` where None), grid (B * KV, G), one program per row and query head, without
    tensor cores. ``launch_first``: at ``LAUNCH_FIRST_ROWS`` it lets the kernel after start before
    its own wait (``kernel_source.launch_first_where``; only where the step after it does not touch
    the program's state). ``ahead``: ``Ahead.programs`` more programs, streaming a later kernel's
    weight into L2 (the tile form only)."""
    first = LAUNCH_FIRST_ROWS if launch_first else False
    vector = vector_form() if vector is None else vector
    return _render_attention(site, 1, "", launch_first=first, vector=vector, ahead=None if vector else ahead)


def render_split_decode_attention(
    site: DecodeSite, splits: int
) -> tuple[Rendered, Rendered, dict[str, TensorSpec]]:
    """The split-KV form of one site in two kernels (``splits`` >= 2, at most its blocks of
    ``MIN_SPLIT_BLOCK_N`` slots): (the partial kernel, grid (B * KV, splits); the combine kernel,
    grid (B * KV,); the fp32 workspace between them, ``{name: spec}``, for the memory planner)."""
    ws, spec = _workspace(site, splits)
    return _render_attention(site, splits, ws), _render_combine(site, splits, ws), {ws: spec}


def render_split_combined_decode_attention(
    site: DecodeSite, splits: int, max_rows: int, launch_first: bool = False
) -> tuple[Rendered, dict[str, TensorSpec], tuple[str, TensorSpec]]:
    """The split-KV form of one site in one kernel: the partial kernel's programs (grid (B * KV,
    splits)), each counting its arrival on its row's and KV head's counter once its partial is
    stored; the last of them combines the partials as the combine kernel does, in the same fixed
    order (the same bits whichever arrives last), and zeroes the counter again. (the kernel; its
    fp32 workspace ``{name: spec}``; the counters' (name, int32 spec) for ``Program.scratch``,
    ``max_rows`` * KV of them: one per program of the grid's first dim at the largest batch.)
    ``launch_first``: as ``render_decode_attention``'s, where ``COMBINED_FIRST``."""
    ws, spec = _workspace(site, splits)
    counts = f"{site.out}_splitkv_arrivals"
    first = LAUNCH_FIRST_ROWS if launch_first and COMBINED_FIRST else False
    return (
        _render_attention(site, splits, ws, counts, launch_first=first),
        {ws: spec},
        (counts, TensorSpec("int32", (str(max_rows * site.kv_heads),))),
    )


def _workspace(site: DecodeSite, splits: int) -> tuple[str, TensorSpec]:
    """The split form's fp32 workspace: ws[b, kh, split, g, :], the split's un-normalized acc (D
    values), then its running max m and sum l."""
    blocks = -(-site.context // _split_block_n(site, splits))
    assert 2 <= splits <= blocks, (splits, blocks)
    groups = site.heads // site.kv_heads
    shape = (site.batch, str(site.kv_heads), str(splits), str(groups), str(site.head_dim + 2))
    return f"{site.out}_splitkv_partials", TensorSpec("float32", shape)


def _combine_lines(tl_dtype: str, mask_d: str, load: str = "") -> list[str]:
    """Program ``pid``'s combine of its ``SPLITS`` partials in ws (its query heads ``h``, ``rg``
    and ``valid_g`` and the lanes ``rd`` given), written to the output: rescaled to their common
    max and summed in a fixed order (the same bits on every run, no atomics). A split whose slots
    were all masked holds m at the finite floor and l = 0: its weight exp2(m - max) is 0 beside
    any other split's. ``load``: the loads' extra arguments (a cache modifier). Names of their own,
    so that the one-kernel split form can run them after its partial's."""
    return [
        "rs = tl.arange(0, BLOCK_S)",
        "both = (rs < SPLITS)[:, None] & valid_g[None, :]",
        "parts = ((pid * SPLITS + rs[:, None]) * GROUPS + rg[None, :]) * (HEAD_DIM + 2)  # ws[b, kh, split, g]: acc, m, l",
        f"m_s = tl.load(ws_ptr + parts + HEAD_DIM, mask=both, other=-1.0e30{load})  # [BLOCK_S, BLOCK_G]",
        f"l_s = tl.load(ws_ptr + parts + HEAD_DIM + 1, mask=both, other=0.0{load})",
        "m_all = tl.max(m_s, 0)",
        "l_all = tl.sum(l_s * tl.exp2(m_s - m_all[None, :]), 0)  # an all-masked split: l 0, weight 0",
        "acc_all = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)",
        "for one in range(SPLITS):  # a fixed order: the same bits on every run",
        "    part_one = ((pid * SPLITS + one) * GROUPS + rg) * (HEAD_DIM + 2)",
        f"    m_one = tl.load(ws_ptr + part_one + HEAD_DIM, mask=valid_g, other=-1.0e30{load})",
        f"    acc_one = tl.load(ws_ptr + part_one[:, None] + rd[None, :], mask=valid_g[:, None]{mask_d}, other=0.0{load})",
        "    acc_all += acc_one * tl.exp2(m_one - m_all)[:, None]",
        "acc_all = acc_all / l_all[:, None]",
        f"tl.store(out_ptr + (b * HEADS + h[:, None]) * HEAD_DIM + rd[None, :], acc_all.to({tl_dtype}), mask=valid_g[:, None]{mask_d})",
    ]


def _block_n(site: DecodeSite) -> int:
    """The one-kernel form's block: the cache's slots (a power of two, at least 16) up to
    ``MAX_BLOCK_N``, halved while its keys take more than ``SPLIT_MAX_TILE`` 16-bit elements where
    the loop runs (``NUM_STAGES`` blocks of keys and values in shared memory), or twice that where
    the cache is one block (loaded once). Before, every cache of over 128 slots took blocks of
    256, which did not fit an H200's 227 KiB at a head dim of 256 (264 KiB at 160 slots: Gemma 2
    and 3) nor of 128 past 256 slots (260 KiB: Llama-3-8B's, Mistral's): their SDPA stayed."""
    bn, bd = min(MAX_BLOCK_N, max(16, _pow2(site.context))), max(16, _pow2(site.head_dim))
    tile = SPLIT_MAX_TILE * 2 // ITEMSIZE[site.dtype]  # float32 keys: half the slots
    while bn > MIN_SPLIT_BLOCK_N and bn * bd > (2 * tile if site.context <= bn else tile):
        bn //= 2
    return bn


def _split_block_n(site: DecodeSite, splits: int) -> int:
    """The split form's block: ``SPLIT_BLOCK_N`` slots, halved while the cache has fewer blocks
    than ``splits`` or the block's keys take more bytes than ``SPLIT_MAX_TILE`` 16-bit elements
    (to ``MIN_SPLIT_BLOCK_N``)."""
    bn, bd = SPLIT_BLOCK_N, max(16, _pow2(site.head_dim))
    tile = SPLIT_MAX_TILE * 2 // ITEMSIZE[site.dtype]  # float32 keys: half the slots
    while bn > MIN_SPLIT_BLOCK_N and (-(-site.context // bn) < splits or bn * bd > tile):
        bn //= 2
    return bn


def row_sources(site: DecodeSite) -> tuple[NewRows, ...]:
    """Where the kernel of ``site`` reads its queries, and its new keys and values where it
    appends them (``rows`` of their rotary embedding where it rotates them)."""
    q = (
        site.q_rotary.rows
        if site.q_rotary
        else NewRows(site.q, site.q_batch_stride, site.q_column, site.q_head_stride)
    )
    a = site.append
    if a is None:
        return (q,)
    k = a.k_rotary.rows if a.k_rotary else a.k_new
    return (q, k, a.v_new)


@dataclass(frozen=True)
class Slices:
    """Where the queries and the new keys and values are the K slices of the projection that made
    them, not yet summed: its split-K partials ``ws`` (fp32 ``[slices, 1, M, width]``, ``M`` the
    batch), which the kernel sums in slice order and rounds to the site's dtype, as the
    projection's reduce kernel would (``aot.codegen.qkv_in_attention``)."""

    ws: str
    slices: int
    width: int


def render_decode_attention_tail(site: DecodeSite, max_block_n: int = 0) -> Rendered:
    """``render_decode_attention``'s kernel whose q and new keys and values are loaded from L2
    (``.cg``): where the programs of the kernel it becomes the tail of stored them
    (``aot.codegen.attention_tail``); its blocks of slots at most ``max_block_n`` (0: as the
    kernel's)."""
    return _render_attention(site, 1, "", rows_load=", cache_modifier='.cg'", max_block_n=max_block_n)


def render_decode_attention_summing(site: DecodeSite, slices: Slices, launch_first: bool = False) -> Rendered:
    """``render_decode_attention``'s kernel reading q, k and v as ``slices`` (their projection's
    K slices, summed here)."""
    first = LAUNCH_FIRST_ROWS if launch_first else False
    return _render_attention(site, 1, "", launch_first=first, slices=slices)


def _render_attention(
    site: DecodeSite,
    splits: int,
    ws: str,
    counts: str = "",
    launch_first: bool | str = False,
    slices: Slices | None = None,
    vector: bool = False,
    rows_load: str = "",
    max_block_n: int = 0,
    ahead: Ahead | None = None,
) -> Rendered:
    """The one-kernel form (``splits`` 1) or the split form's partial kernel (``ws`` its
    workspace), which also combines where ``counts`` names its arrival counters (the split form
    in one kernel). ``slices``: q, k and v read as their projection's K slices (one-kernel form).
    ``vector``: the one-kernel form's programs one per query head, dot-free (``VECTOR_FORM``).
    ``rows_load``: more arguments of the loads of q and the new keys and values (``",
    cache_modifier='.cg'"`` where other programs of the same kernel stored them:
    ``aot.codegen.attention_tail``); ``max_block_n``: the one-kernel form's blocks of slots at most
    so many (0: ``_block_n``'s), its keys and values then loaded block by block in the loop."""
    split = splits > 1
    assert slices is None or not split
    assert not (vector and (split or slices))
    assert ahead is None or not (split or vector)
    combined = bool(counts)
    assert split or not combined
    d, groups = site.head_dim, site.heads // site.kv_heads
    bd, bg = max(16, _pow2(d)), max(16, _pow2(groups))
    bn = _split_block_n(site, splits) if split else _block_n(site)
    bn = min(bn, max_block_n) if max_block_n and not split else bn
    blocks = -(-site.context // bn)
    num_warps = _warps(bn * bd)
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    precision = ", input_precision='ieee'" if site.dtype == "float32" else ""
    a = site.append
    qr, kr = site.q_rotary, a.k_rotary if a else None
    # the cos and sin tables' pointers: the queries' and the keys' the same where they are
    shared_tables = (
        qr is not None
        and kr is not None
        and (qr.cos, qr.sin, qr.batch_stride) == (kr.cos, kr.sin, kr.batch_stride)
    )
    qr_tables = ("qcos_ptr", "qsin_ptr", "Q_ROT_BATCH")
    kr_tables = qr_tables if shared_tables else ("kcos_ptr", "ksin_ptr", "K_ROT_BATCH")
    normed = (qr is not None and qr.norm is not None) or (kr is not None and kr.norm is not None)
    name = (
        f"decode_attention{'_append' if a else ''}{'_normed' if normed else ''}{'_rope' if qr or kr else ''}"
    )
    name += f"_g{groups}_d{d}"
    name += ("_split_combined" if combined else "_split") if split else ""
    name += "_capped" if site.softcap is not None else ""
    name += "_sinks" if site.sinks is not None else ""
    name += "_biased" if site.bias is not None else ""
    name += f"_sums{slices.slices}" if slices else ""
    name += "_vector" if vector else ""
    name += "_ahead" if ahead else ""
    # a query head's tile and its broadcasts: [BLOCK_G, BLOCK_D] (the tile form) or [BLOCK_D] (the
    # vector form's one head); the cache's values as loaded: [BLOCK_N, BLOCK_D], or as the keys,
    # [BLOCK_D, BLOCK_N], in the vector form (so that the scores' layout weighs them as it is)
    heads_ = "" if vector else "[:, None]"
    lanes_ = "" if vector else "[None, :]"
    rows = "1" if vector else "BLOCK_G"  # the scores' rows: the running max's and sum's length
    # elements between the heads of the rows the queries and new keys are read from
    q_head = "Q_HEAD" if (qr.head_stride if qr else site.q_head_stride) else "HEAD_DIM"
    k_head = "K_HEAD" if kr and kr.head_stride else "HEAD_DIM"
    if a and not kr and a.k_new.head_stride:
        k_head = "KN_HEAD"
    v_head = "VN_HEAD" if a and a.v_new.head_stride else "HEAD_DIM"

    def new_rows(ptr: str, at: str, rest: str) -> str:
        """The load of the new rows (q, k, v) at ``at``: as stored, or their K slices summed."""
        if slices is None:
            return f"tl.load({ptr} + {at}{rest}{rows_load})"
        terms = (f"tl.load(rows_ws_ptr + {i} * rows_slice + {at}{rest})" for i in range(slices.slices))
        return f"(0.0 + {' + '.join(terms)}).to({tl_dtype})"

    mask_d = "" if bd == d else f" & (rd < HEAD_DIM){lanes_}"
    mask_dk = "" if bd == d else " & (rd < HEAD_DIM)[:, None]"
    head_mask = "" if bd == d else ", mask=rd < HEAD_DIM, other=0.0"
    # Where the cache is one block of slots and this kernel appends the step's key and value, the
    # cache's keys and values are loaded before the wait for the kernel before (``kernel_module``'s
    # early lines): no kernel of the step writes the slots they read but this one, at ``pos``
    # (taken from registers below), and the steps before finished before the kernel before began
    # (each kernel waits for the one before it). Under dependent launch the cache's bytes then
    # arrive while the q/k/v projection still runs. Where a step before writes the cache (no
    # append here: a cache-write kernel or copy), its loads wait: loaded early they would race
    # that write and read the slot's old key and value.
    # The split form: each program's slots are one block where there are as many splits as
    # blocks, and the same rule holds for them (the program holding pos stores it; no other
    # program of this kernel reads that slot).
    one_block = blocks == splits if split else site.context <= bn
    loads_early = one_block and a is not None
    early = [
        "pid = tl.program_id(0).to(tl.int64)",
        "b = pid // KV_HEADS",
        "kh = pid % KV_HEADS",
        "rd = tl.arange(0, BLOCK_D)",
        "cache = (b * KV_HEADS + kh) * CONTEXT * HEAD_DIM",
    ]
    if split:
        early += [
            "split = tl.program_id(1)",
            "lo = split * BLOCKS // SPLITS * BLOCK_N  # this program's slots: whole blocks, lo to hi",
            "hi = (split + 1) * BLOCKS // SPLITS * BLOCK_N",
        ]
    loads = [
        f"k = tl.load(k_ptr + cache + rn[None, :] * HEAD_DIM + rd[:, None], mask=valid_n[None, :]{mask_dk}, other=0.0)",
        f"v = tl.load(v_ptr + cache + rn[None, :] * HEAD_DIM + rd[:, None], mask=valid_n[None, :]{mask_dk}, other=0.0)"
        if vector
        else f"v = tl.load(v_ptr + cache + rn[:, None] * HEAD_DIM + rd[None, :], mask=valid_n[:, None]{mask_d}, other=0.0)",
    ]
    first_slot = "lo + " if split else ""
    if loads_early:
        early += [f"rn = {first_slot}tl.arange(0, BLOCK_N)", "valid_n = rn < CONTEXT", *loads]
    # a norm of each head before the rotation (``Rotary.norm``): of the loaded tile, and of each
    # element's rotary partner with its head's statistics (the key: a tile of one row)
    q_norm, q_partner_of, k_norm, k_partner_of = [], None, [], None
    qn_ptrs = [f"qnv{i}_ptr" for i in range(len(qr.norm.vectors))] if qr and qr.norm else []
    kn_ptrs = [f"knv{i}_ptr" for i in range(len(kr.norm.vectors))] if kr and kr.norm else []
    if qn_ptrs and vector:  # one head: a tile of one row, as the new key's below
        q_norm, q_partner_of = _head_norm(qr.norm, "q", qn_ptrs, tl_dtype, "the query head")
    elif qn_ptrs:
        lines, out = _norm_lines(qr.norm, "qn", "q", qn_ptrs, "rd", True)
        q_norm = ["# each query head normed (its norm's statistics over the head), then rotated", *lines]
        q_norm.append(f"q = {out}.to({tl_dtype})")

        def q_partner_of(load: str) -> tuple[list[str], str]:
            return _norm_lines(qr.norm, "qn", load, qn_ptrs, "q_partner", False)

    if kn_ptrs:
        k_norm, k_partner_of = _head_norm(kr.norm, "k", kn_ptrs, tl_dtype, "the new key")

    body = [
        "rg = tl.program_id(1)  # this program's query head, kh * GROUPS + rg"
        if vector
        else "rg = tl.arange(0, BLOCK_G)  # the query heads kh * GROUPS + rg sharing this KV head",
        "valid_g = rd >= 0  # (the grid's second dim is GROUPS) a mask of the head's shape"
        if vector
        else "valid_g = rg < GROUPS",
        "h = kh * GROUPS + rg",
        *(
            ["rows_slice = B * ROWS_WIDTH  # one K slice's partial sums: [B, ROWS_WIDTH] fp32"]
            if slices
            else []
        ),
        "q = "
        + new_rows(
            "q_ptr",
            f"b * Q_BATCH + Q_COLUMN + h{heads_} * {q_head} + rd{lanes_}",
            f", mask=valid_g{heads_}{mask_d}, other=0.0",
        ),
        *q_norm,
        *(
            _rotation_lines(
                "q",
                "q",
                new_rows(
                    "q_ptr",
                    f"b * Q_BATCH + Q_COLUMN + h{heads_} * {q_head} + q_partner{lanes_}",
                    f", mask=valid_g{heads_} & q_turn{lanes_}, other=0.0",
                ),
                lanes_,
                qr_tables,
                tl_dtype,
                qr.half_tables,
                q_partner_of,
            )
            if qr
            else ()
        ),
        f"m_i = tl.full(({rows},), -1.0e30, dtype=tl.float32)  # finite: an all-masked block adds 0",
        f"l_i = tl.zeros(({rows},), dtype=tl.float32)",
        f"acc = tl.zeros({'(BLOCK_D,)' if vector else '(BLOCK_G, BLOCK_D)'}, dtype=tl.float32)",
    ]
    if site.sinks is not None:  # the head's sink: a slot of no value whose weight joins the denominator
        body += [
            "sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E"
            if vector
            else "sink = tl.load(sinks_ptr + h, mask=valid_g, other=0.0).to(tl.float32) * LOG2E",
            f"first = {'rg < GROUPS' if vector else 'valid_g'}{' & (split == 0)' if split else ''}  # one program of the head counts it",
            "m_i = tl.where(first, sink, m_i)",
            "l_i = tl.where(first, 1.0, l_i)  # exp2(sink - m_i)",
        ]
    if a:  # this step's key and value into slot pos; the loop takes them from registers there
        body += [
            "pos = tl.load(pos_ptr).to(tl.int64)",
            "pos = tl.where(pos < 0, pos + CONTEXT, pos)  # as index_put_ counts a negative slot",
            "kn = " + new_rows("kn_ptr", f"b * KN_BATCH + KN_COLUMN + kh * {k_head} + rd", head_mask),
            *k_norm,
            *(
                _rotation_lines(
                    "k",
                    "kn",
                    new_rows(
                        "kn_ptr",
                        f"b * KN_BATCH + KN_COLUMN + kh * {k_head} + k_partner",
                        ", mask=k_turn, other=0.0",
                    ),
                    "",
                    kr_tables,
                    tl_dtype,
                    kr.half_tables,
                    k_partner_of,
                )
                if kr
                else ()
            ),
            "vn = " + new_rows("vn_ptr", f"b * VN_BATCH + VN_COLUMN + kh * {v_head} + rd", head_mask),
            "slot = rd * 0 + pos  # the position per lane: a mask of the block's shape",
            (
                "put = (rd < HEAD_DIM) & (slot >= lo) & (slot < hi) & (slot < CONTEXT)  # one program stores: the one whose slots hold pos"
                if split
                else "put = (rd < HEAD_DIM) & (slot >= 0) & (slot < CONTEXT)  # the loader checks pos; never out of the cache"
            ),
            *(
                ["put = put & (rd * 0 + rg == 0)  # one program of the KV head's query heads stores"]
                if vector
                else []
            ),
            "tl.store(k_ptr + cache + pos * HEAD_DIM + rd, kn, mask=put)",
            "tl.store(v_ptr + cache + pos * HEAD_DIM + rd, vn, mask=put)",
        ]
    # one block of slots: the online softmax's step, once (over the keys and values loaded early
    # where they could be)
    if loads_early:
        block = []
    elif one_block:
        block = [f"rn = {first_slot}tl.arange(0, BLOCK_N)", "valid_n = rn < CONTEXT", *loads]
    else:
        block = ["rn = start + tl.arange(0, BLOCK_N)", "valid_n = rn < CONTEXT", *loads]
    if a:
        block += [
            "k = tl.where((rn == pos)[None, :], kn[:, None], k)",
            "v = tl.where((rn == pos)[None, :], vn[:, None], v)"
            if vector
            else "v = tl.where((rn == pos)[:, None], vn[None, :], v)",
        ]
    # the vector form's q k^T: the products exact in fp32 (as the tensor cores' on 16-bit
    # operands), summed over the head dim
    qk = (
        "tl.sum(q.to(tl.float32)[:, None] * k.to(tl.float32), 0, keep_dims=True)"
        if vector
        else f"tl.dot(q, k{precision})"
    )
    if site.softcap is None:
        block.append(f"s = {qk} * SCALE_LOG2E  # scores in log2 units")
    else:  # c * tanh(s / c), tanh(x) = 2 / (1 + e^(-2x)) - 1 (the limits exact: e^(-2x) 0 or inf)
        block += [
            f"s = {qk} * SCALE",
            "s = SOFTCAP * (2.0 / (1.0 + tl.exp2(s * (-2.0 * LOG2E / SOFTCAP))) - 1.0)  # capped",
            "s = s * LOG2E  # scores in log2 units",
        ]
    if site.bias is not None:  # each head's bias row (ALiBi), added to the scaled scores
        at = f"bias_ptr + BIAS_OFFSET + b * BIAS_BATCH + h{heads_} * BIAS_HEAD + rn{lanes_}"
        valid = "valid_n" if vector else "valid_g[:, None] & valid_n[None, :]"
        loaded = f"tl.load({at}, mask={valid}, other=0.0).to(tl.float32)"
        block.append(f"s = s + {loaded}{'[None, :]' if vector else ''} * LOG2E")
    bool_mask = site.mask is not None and site.mask_dtype == "bool"
    if bool_mask:
        block.append("keep = valid_n & (tl.load(mask_ptr + b * MASK_BATCH + rn, mask=valid_n, other=0) != 0)")
    else:
        block.append("keep = valid_n")
        if site.mask is not None:
            block.append(
                "s = s + tl.load(mask_ptr + b * MASK_BATCH + rn, mask=valid_n, other=0.0).to(tl.float32)[None, :] * LOG2E"
            )
    block += [
        "s = tl.where(keep[None, :], s, float('-inf'))",
        *online_softmax_lines(precision, weighted=VECTOR_WEIGHTED if vector else None),
    ]
    if one_block:
        body += block
    else:
        bounds = "lo, hi" if split else "0, CONTEXT"
        body += [f"for start in range({bounds}, BLOCK_N):", *("    " + ln for ln in block)]
    if split:  # the partial: m, l and the un-normalized acc, to this program's place in ws
        body += [
            "part = ((pid * SPLITS + split) * GROUPS + rg) * (HEAD_DIM + 2)  # ws[b, kh, split, g]: acc, m, l",
            f"tl.store(ws_ptr + part[:, None] + rd[None, :], acc, mask=valid_g[:, None]{mask_d})",
            "tl.store(ws_ptr + part + HEAD_DIM, m_i, mask=valid_g)",
            "tl.store(ws_ptr + part + HEAD_DIM + 1, l_i, mask=valid_g)",
        ]
        if combined:  # the last program of its row and KV head to store its partial combines them
            body += [
                "tl.debug_barrier()  # every thread's stores before the arrival (which releases them)",
                "arrived = tl.atomic_add(count_ptr + pid, 1, sem='acq_rel', scope='gpu')",
                *(launch_after(launch_first) if isinstance(launch_first, str) else GDC_LAUNCH),
                "if arrived == SPLITS - 1:  # the others' partials are stored: combine, then zero the counter",
                *(
                    "    " + ln
                    for ln in (
                        *_combine_lines(tl_dtype, mask_d, ", cache_modifier='.cg'"),
                        "tl.store(count_ptr + pid, 0)",
                    )
                ),
            ]
    else:
        body += [
            f"acc = acc / l_i{heads_}",
            f"tl.store(out_ptr + (b * HEADS + h{heads_}) * HEAD_DIM + rd{lanes_}, acc.to({tl_dtype}), mask=valid_g{heads_}{mask_d})",
        ]
    params = [
        KernelParam("rows_ws_ptr", ParamKind.PTR, "float32")
        if slices
        else KernelParam("q_ptr", ParamKind.PTR, site.dtype),
        KernelParam("k_ptr", ParamKind.PTR, site.dtype),
        KernelParam("v_ptr", ParamKind.PTR, site.dtype),
        *(
            [
                *(
                    ()
                    if slices
                    else (
                        KernelParam("kn_ptr", ParamKind.PTR, site.dtype),
                        KernelParam("vn_ptr", ParamKind.PTR, site.dtype),
                    )
                ),
                KernelParam("pos_ptr", ParamKind.PTR, a.pos_dtype),
            ]
            if a
            else []
        ),
        *(
            [
                KernelParam("qcos_ptr", ParamKind.PTR, site.dtype),
                KernelParam("qsin_ptr", ParamKind.PTR, site.dtype),
            ]
            if qr
            else []
        ),
        *(
            [
                KernelParam("kcos_ptr", ParamKind.PTR, site.dtype),
                KernelParam("ksin_ptr", ParamKind.PTR, site.dtype),
            ]
            if kr and not shared_tables
            else []
        ),
        *(
            KernelParam(n, ParamKind.PTR, dt)
            for n, (_, dt) in zip(qn_ptrs, qr.norm.vectors if qn_ptrs else ())
        ),
        *(
            KernelParam(n, ParamKind.PTR, dt)
            for n, (_, dt) in zip(kn_ptrs, kr.norm.vectors if kn_ptrs else ())
        ),
        *(
            [KernelParam("mask_ptr", ParamKind.PTR, site.mask_dtype or site.dtype)]
            if site.mask is not None
            else []
        ),
        *([KernelParam("sinks_ptr", ParamKind.PTR, site.dtype)] if site.sinks is not None else []),
        *([KernelParam("bias_ptr", ParamKind.PTR, site.bias.dtype)] if site.bias is not None else []),
        *([KernelParam("ws_ptr", ParamKind.PTR, "float32")] if split else []),
        *([KernelParam("out_ptr", ParamKind.PTR, site.dtype)] if combined or not split else []),
        *([KernelParam("count_ptr", ParamKind.PTR, "int32")] if combined else []),
        *([KernelParam("pf_ptr", ParamKind.PTR, ahead.dtype)] if ahead else []),
        KernelParam("B", ParamKind("i32"), ""),
    ]
    batch = ix.size_text(ix.parse_size(site.batch))
    sources = row_sources(site)
    q_at, k_new = sources[0], sources[1] if a else None
    args = (
        Buf(slices.ws if slices else q_at.base),
        *(
            (
                Buf(a.k_state),
                Buf(a.v_state),
                *(() if slices else (Buf(k_new.base), Buf(a.v_new.base))),
                Buf(a.pos),
            )
            if a
            else (Buf(site.k), Buf(site.v))
        ),
        *((Buf(qr.cos), Buf(qr.sin)) if qr else ()),
        *((Buf(kr.cos), Buf(kr.sin)) if kr and not shared_tables else ()),
        *(Buf(v) for v, _ in (qr.norm.vectors if qn_ptrs else ())),
        *(Buf(v) for v, _ in (kr.norm.vectors if kn_ptrs else ())),
        *([Buf(site.mask)] if site.mask is not None else []),
        *([Buf(site.sinks)] if site.sinks is not None else []),
        *([Buf(site.bias.base)] if site.bias is not None else []),
        *((Buf(ws),) if split else ()),
        *((Buf(site.out),) if combined or not split else ()),
        *((Buf(counts),) if combined else ()),
        *((Buf(ahead.weight),) if ahead else ()),
        Sym(batch),
    )
    signature = signature_of(params, "i32")
    consts = {
        "BLOCK_G": bg,
        "BLOCK_N": bn,
        "BLOCK_D": bd,
        "GROUPS": groups,
        "HEADS": site.heads,
        "KV_HEADS": site.kv_heads,
        "HEAD_DIM": d,
        "CONTEXT": site.context,
        "Q_BATCH": q_at.batch_stride,
        "Q_COLUMN": q_at.column,
        "MASK_BATCH": site.mask_batch_stride,
        "SCALE_LOG2E": repr(site.scale * LOG2E),
        "LOG2E": repr(LOG2E),
    }
    if site.softcap is not None:
        consts.update(SCALE=repr(site.scale), SOFTCAP=repr(site.softcap))
    if site.bias is not None:
        bias = site.bias
        consts.update(BIAS_OFFSET=bias.offset, BIAS_BATCH=bias.batch_stride, BIAS_HEAD=bias.head_stride)
    if slices:
        consts.update(ROWS_WIDTH=slices.width)
    if ahead:
        threads = 32 * num_warps
        # programs enough for AHEAD_CHUNK bytes a thread, at most ``Ahead.programs``
        ahead = replace(
            ahead, programs=max(1, min(ahead.programs, -(-ahead.nbytes // (threads * AHEAD_CHUNK))))
        )
        consts.update(PF_THREADS=threads, PF_CHUNK=ahead.chunk(threads), PF_BYTES=ahead.nbytes)
        early[:0] = _ahead_lines(ahead)
    if split:
        consts.update(SPLITS=splits, BLOCKS=blocks)
    if combined:
        consts.update(BLOCK_S=_pow2(splits))
    if a:
        consts.update(
            KN_BATCH=k_new.batch_stride,
            KN_COLUMN=k_new.column,
            VN_BATCH=a.v_new.batch_stride,
            VN_COLUMN=a.v_new.column,
        )
        if not kr and a.k_new.head_stride:
            consts.update(KN_HEAD=a.k_new.head_stride)
        if a.v_new.head_stride:
            consts.update(VN_HEAD=a.v_new.head_stride)
    if qr:
        consts.update(Q_ROT=qr.dim, Q_ROT_BATCH=qr.batch_stride)
        if qr.head_stride:
            consts.update(Q_HEAD=qr.head_stride)
    elif site.q_head_stride:
        consts.update(Q_HEAD=site.q_head_stride)
    if kr:
        consts.update(K_ROT=kr.dim)
        if kr.head_stride:
            consts.update(K_HEAD=kr.head_stride)
        if not shared_tables:
            consts.update(K_ROT_BATCH=kr.batch_stride)
    grid = (
        ix.size_text(ix.parse_size(site.batch) * site.kv_heads + (ahead.programs if ahead else 0)),
        *((str(splits),) if split else ()),
        *((str(groups),) if vector else ()),
    )
    mask_doc = ""
    if site.mask is not None:
        mask_doc = f"mask: {'bool (True: attend)' if bool_mask else 'additive'} [B or 1, C] rows; "
    scores = f"q k^T * {site.scale!r}"
    if site.softcap is not None:
        scores = f"{site.softcap!r} * tanh({scores} / {site.softcap!r})"
    if site.bias is not None:
        scores = f"{scores} + bias[b, h]"
    if site.sinks is not None:
        scores = f"[{scores}, sinks[h]] (the sink's weight dropped after)"
    doc = [
        f"Decode attention: softmax({scores} + mask) v for one query per row, online, fp32 accumulation.",
        "",
        f"q: [B, {site.heads}, 1, {d}] (row b at b * {site.q_batch_stride} + {site.q_column}); k, v: the cache,",
        f"[B, {site.kv_heads}, {site.context}, {d}] row-major, {groups} query heads per KV head; "
        + mask_doc
        + f"B = {batch}, {site.dtype}.",
        f"grid: ({', '.join(grid)},)",
    ]
    if ahead:
        doc[-1:-1] = [
            f"The {ahead.programs} programs past B * {site.kv_heads} stream the first {ahead.nbytes} bytes of {ahead.weight}, a later",
            "kernel's weight, into L2 once the kernel before has ended (sm_90+), and end: they touch nothing else.",
        ]
    if vector:
        doc[-1:-1] = [
            "One program per row and query head (grid's second dim), without tensor cores: its KV head's keys and",
            "values as loaded ([D, slots] each), the scores and the output sums of fp32 products.",
        ]
    if split:
        doc[0] = (
            f"Decode attention, split-KV partials: softmax({scores} + mask) v over one of {splits} "
            "ranges of the cache per program, online, fp32."
        )
        doc[-1:-1] = [
            f"Program (b * {site.kv_heads} + kh, split) walks blocks split * {blocks} // {splits} up to the next "
            f"split's of {bn} slots and writes its running max m, sum l and un-normalized acc to the workspace",
            f"ws ([B, {site.kv_heads}, {splits}, {groups}, {d} + 2] fp32: acc, m, l); the combine kernel normalizes.",
        ]
        if combined:
            doc[0] = doc[0].replace("split-KV partials", "split-KV in one kernel")
            doc[-2] = (
                f"ws ([B, {site.kv_heads}, {splits}, {groups}, {d} + 2] fp32: acc, m, l), then counts its arrival on "
                "count[pid]; the last to arrive rescales the partials to their common max, sums them in split order "
                "and writes [B, H, 1, D], then zeroes count[pid]."
            )
    if slices:
        doc[-1:-1] = [
            f"q{', k and v' if a else ''} are read as their projection's {slices.slices} K slices (fp32 [{slices.slices}, B, "
            f"{slices.width}] at ws), summed in slice order and rounded to {site.dtype} as its reduce kernel would.",
        ]
    if a:
        doc[-1:-1] = [
            f"First writes this step's keys and values (rows at b * {a.k_new.batch_stride} + {a.k_new.column} and "
            f"b * {a.v_new.batch_stride} + {a.v_new.column}) into slot pos of the cache, in place.",
        ]
        apart = [
            f"{what} {r.head_stride}" for what, r in (("keys", a.k_new), ("values", a.v_new)) if r.head_stride
        ]
        if apart:
            doc[-1:-1] = [f"The new rows' heads are further apart than D: {', '.join(apart)} elements."]
    for what, r in (("queries", qr), ("new keys", kr)):
        if r is not None:
            doc[-1:-1] = [
                f"The {what} are {'normed (each head over its mean square, as the model norms it) and ' if r.norm else ''}"
                f"rotated here (rotary embedding over the first {r.dim} elements of each head: "
                f"x * cos + cat(-x2, x1) * sin, each product and the sum rounded to {site.dtype}), read un-rotated "
                f"at b * {r.rows.batch_stride} + {r.rows.column}, cos and sin at b * {r.batch_stride}.",
            ]
    # the one-kernel split form lets the kernel after start once its partial is counted, not at
    # its start: launched earlier, the kernel after (Llama's o projection at 8 rows, under
    # dependent launch) slowed the step by 15% on an H200; at one row (``COMBINED_FIRST``), with
    # every program resident at once, before its wait took 4% off GPT-2's step
    source = kernel_module(
        doc, consts, name, signature, body, early, launch_dependents=not combined, launch_first=launch_first
    )
    elem = ITEMSIZE[site.dtype]
    rows = ix.parse_size(site.batch)
    traffic = rows * (2 * site.kv_heads * site.context * d + 2 * site.heads * d + site.context) * elem
    if split:  # the fp32 partials: written and read back where this kernel combines them, else
        partials = rows * site.heads * (d + 2) * splits * 4  # written instead of the output
        traffic += 2 * partials if combined else partials - rows * site.heads * d * elem
    if a:
        traffic += rows * 4 * site.kv_heads * d * elem  # the new keys and values, read and written
    if slices:  # q, k and v read as fp32 slices
        traffic += rows * (site.heads + (2 * site.kv_heads if a else 0)) * d * (4 * slices.slices - elem)
    for r in (qr, kr):
        if r is not None:
            traffic += rows * 2 * r.dim * elem  # cos and sin
    config = {
        "kind": ("decode_attention_split_combined" if combined else "decode_attention_split")
        if split
        else "decode_attention",
        **({"vector": True} if vector else {}),
        **({"SPLITS": splits} if split else {}),
        "BLOCK_G": bg,
        "BLOCK_N": bn,
        "BLOCK_D": bd,
        "heuristic": HEURISTIC,
        "num_warps": num_warps,
        "num_stages": NUM_STAGES,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=args,
        outputs=(
            ws if split and not combined else site.out,
            *((a.k_result, a.v_result) if a else ()),
            *((ws,) if combined else ()),
        ),
        grid=grid,
        num_warps=num_warps,
        num_stages=NUM_STAGES,
        config=config,
        ops=(*((INDEX_PUT,) if a else ()), SDPA),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )


def _render_combine(site: DecodeSite, splits: int, ws: str) -> Rendered:
    """The split form's second kernel: grid (B * KV,), each program combining its row's and KV
    head's ``splits`` partials (``_combine_lines``) into the output, where the one-kernel form
    writes it."""
    d, groups = site.head_dim, site.heads // site.kv_heads
    bd, bg, bs = max(16, _pow2(d)), max(16, _pow2(groups)), _pow2(splits)
    tl_dtype = TL_TYPE[STORAGE[site.dtype]]
    mask_d = "" if bd == d else " & (rd < HEAD_DIM)[None, :]"
    name = f"decode_attention_combine_g{groups}_d{d}"
    body = [
        "pid = tl.program_id(0).to(tl.int64)",
        "b = pid // KV_HEADS",
        "kh = pid % KV_HEADS",
        "rd = tl.arange(0, BLOCK_D)",
        "rg = tl.arange(0, BLOCK_G)",
        "valid_g = rg < GROUPS",
        "h = kh * GROUPS + rg",
        *_combine_lines(tl_dtype, mask_d),
    ]
    params = [
        KernelParam("ws_ptr", ParamKind.PTR, "float32"),
        KernelParam("out_ptr", ParamKind.PTR, site.dtype),
        KernelParam("B", ParamKind("i32"), ""),
    ]
    batch = ix.size_text(ix.parse_size(site.batch))
    signature = signature_of(params, "i32")
    consts = {
        "BLOCK_G": bg,
        "BLOCK_D": bd,
        "BLOCK_S": bs,
        "GROUPS": groups,
        "HEADS": site.heads,
        "KV_HEADS": site.kv_heads,
        "HEAD_DIM": d,
        "SPLITS": splits,
    }
    grid = (ix.size_text(ix.parse_size(site.batch) * site.kv_heads),)
    doc = [
        f"Decode attention, split-KV combine: the {splits} partials of each row and KV head (m, l, acc in ws,",
        f"[B, {site.kv_heads}, {splits}, {groups}, {d} + 2] fp32) rescaled to their common max and summed in order,",
        f"acc / l to [B, {site.heads}, 1, {d}] {site.dtype}. B = {batch}.",
        f"grid: ({', '.join(grid)},)",
    ]
    source = kernel_module(doc, consts, name, signature, body)
    rows = ix.parse_size(site.batch)
    traffic = rows * site.heads * ((d + 2) * splits * 4 + d * ITEMSIZE[site.dtype])
    config = {
        "kind": "decode_attention_combine",
        "SPLITS": splits,
        "BLOCK_G": bg,
        "BLOCK_D": bd,
        "BLOCK_S": bs,
        "heuristic": HEURISTIC,
        "num_warps": COMBINE_WARPS,
        "num_stages": 1,
    }
    return Rendered(
        name=name,
        source=source,
        signature=signature,
        params=tuple(params),
        args=(Buf(ws), Buf(site.out), Sym(batch)),
        outputs=(site.out,),
        grid=grid,
        num_warps=COMBINE_WARPS,
        num_stages=1,
        config=config,
        ops=(*((INDEX_PUT,) if site.append else ()), SDPA),
        bytes_moved=ix.size_text(sympy.expand(traffic)),
    )
