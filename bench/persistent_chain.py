"""A decode step's GEMVs as one persistent kernel against one kernel per GEMV: what a megakernel
would gain on the weight stream alone (issue 31, lever 4), measured before building one.

Both run the same dependent chain, as a decode step does: every layer's q/k/v, o, gate/up and
down GEMVs (each reading the output of the one before as its input: the attention output, the
norms and SiLU·mul are left out, so the chain is the weight stream and its dependencies), then
the LM head, every layer its own weights, bfloat16, in one CUDA graph.

- ``kernels``: one launch per GEMV (the default table's dot-free form: two rows of W per block,
  K in steps of 1024), plainly and under programmatic dependent launch (each block loads its W
  rows before it waits for the kernel before), as ``bench/gemv_sweep.py --chain`` times them;
- ``persistent``: one launch of a grid that stays resident (``--blocks-per-sm`` per SM), each
  block taking row tiles of a GEMV in turn, all blocks meeting at a grid-wide barrier (an atomic
  counter) between GEMVs; with ``prefetch``, each block loads its first W tile of the next GEMV
  before it waits at the barrier, so the weight stream does not stop there.

- ``l2pf_*`` (``--prefetch``, or ``--quick`` for these alone): one launch per GEMV under
  dependent launch with a stand-in decode attention kernel between q/k/v and o (32 blocks, one
  per query head, over a 160-slot cache; its cache loaded before it waits, as the real one does),
  and the next GEMV's weights prefetched into L2 while a kernel runs, so HBM stays busy across
  the kernels' boundaries: Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2.global``, one
  instruction per thread for its slice; ``_pfl`` variants: ``prefetch.global.L2`` per 128-byte
  line) issued by the first blocks of a kernel before they wait. The plan names which kernels
  prefetch: ``a`` every GEMV the next GEMV's W, ``b`` the attention kernel o's W, ``c`` gate/up
  down's W, ``ab`` both (q/k/v then prefetches nothing), ``s`` only the small GEMVs' W (o's by
  the attention kernel, the next q/k/v's by down); a prefetch of more than ``--pf-cap-mb``
  takes that W's first bytes (the rows the first blocks read). ``_ef``: the GEMVs' W loads marked
  ``evict_first`` (streamed bytes leave L2 before prefetched ones); ``_el``: the prefetch under an
  ``evict_last`` L2 policy.

The outputs of every variant are compared (the same fp32 sums in the same order: bitwise, or
within bf16 rounding). A barrier that does not complete (blocks not all resident) gives up after
a bounded number of polls and the run reports it instead of hanging.

    python3 bench/persistent_chain.py --json out/persistent.json
    python3 bench/persistent_chain.py --quick --json out/l2-prefetch.json  # the prefetch rows, ~1 min
    python3 bench/persistent_chain.py --ahead --json out/l2-ahead.json  # gate/up's W in the attention's window
    python3 bench/persistent_chain.py --compile-only  # the prefetch kernels for sm_90, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from aot.verify import timing

# (N, K) of Llama-3.2-1B's decode GEMVs per layer, gate/up stacked; the LM head last.
LLAMA_1B = {
    "layers": 16,
    "sites": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "head": (128256, 2048),
}


def llama_1b_site_weights(layers: int, device, dtype) -> tuple[dict, dict]:
    """(shape, weights) of the chain benches (``tma_gemv``, ``swap_rows``): per site (``q`` q/k/v,
    ``o``, ``g`` gate/up, ``d`` down, ``h`` the LM head) its (N, K) and its weights, one per layer
    (one for the head), random and scaled by 1/sqrt(K), each its own (cold) memory."""
    (nq, h), (no, _), (ng, _), (nd, kd) = LLAMA_1B["sites"]
    shape = {"q": (nq, h), "o": (no, h), "g": (ng, h), "d": (nd, kd), "h": LLAMA_1B["head"]}
    w = {
        s: [torch.randn(*shape[s], device=device, dtype=dtype) / shape[s][1] ** 0.5 for _ in range(layers)]
        for s in "qogd"
    }
    w["h"] = [torch.randn(*shape["h"], device=device, dtype=dtype) / h**0.5]
    return shape, w


def llama_1b_site_chains(layers: int):
    """(name, [(site, layer)...]) of the chain benches: the whole step (every layer's q/k/v, o,
    gate/up, down, then the LM head), and each site's GEMMs alone (the head 4 times)."""
    sites = "qogd"
    yield "chain", [(s, i) for i in range(layers) for s in sites] + [("h", 0)]
    for s in sites:
        yield s, [(s, i) for i in range(layers)]
    yield "h", [("h", 0)] * 4


MAX_POLLS = tl.constexpr(1 << 18)  # polls of the barrier before a block gives up (reported, never a hang)


@triton.jit
def _gemv_rows(w_ptr, a_ptr, o_ptr, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr):
    """One launch per GEMV: R rows of W per block, every K step's tile loaded before the wait."""
    rn = tl.program_id(0) * R + tl.arange(0, R)
    mask_n = rn < N
    part = tl.zeros((R, BK), dtype=tl.float32)
    for i in tl.static_range(0, K, BK):
        rk = i + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None], other=0.0)
        if GDC and i == 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(a_ptr + rk)
        part += w.to(tl.float32) * a.to(tl.float32)[None, :]
    tl.store(o_ptr + rn, tl.sum(part, axis=1).to(o_ptr.dtype.element_ty), mask=mask_n)


# L2 prefetch (Hopper, PTX 8.0): a thread's slice of the next kernel's weights, issued where its
# size is positive. ``$0`` is a dummy result (inline asm must return a value).
PF_BULK = tl.constexpr(
    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)
PF_BULK_LAST = tl.constexpr(
    "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0;"
    " @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }"
)
PF_LINE = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }")
PF_LINE_LAST = tl.constexpr(
    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }"
)
LINE = tl.constexpr(128)


@triton.jit
def _asm(asm: tl.constexpr, ptrs, sizes):
    tl.inline_asm_elementwise(asm, "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch(pf_ptr, pf_bytes, pf_chunk, pf_blocks, NT: tl.constexpr, MODE: tl.constexpr):
    """Blocks ``pid < pf_blocks`` prefetch bytes [pid * NT * chunk, (pid + 1) * NT * chunk) of
    ``pf_ptr``'s first ``pf_bytes`` into L2, ``pf_chunk`` per thread (a multiple of 128).
    MODE 0: nothing; 1: one bulk prefetch per thread; 2: the same under an evict_last policy;
    3: ``prefetch.global.L2`` per line; 4: per line, evict_last."""
    _l2_prefetch_as(tl.program_id(0), pf_ptr, pf_bytes, pf_chunk, pf_blocks, NT, MODE)


@triton.jit
def _l2_prefetch_as(pid, pf_ptr, pf_bytes, pf_chunk, pf_blocks, NT: tl.constexpr, MODE: tl.constexpr):
    """``_l2_prefetch`` by the block that stands ``pid``-th among the prefetching blocks."""
    if MODE != 0:
        if pid < pf_blocks:
            base = pf_ptr.to(tl.pointer_type(tl.int8))
            off = (pid * NT + tl.arange(0, NT)) * pf_chunk
            size = tl.minimum(pf_bytes - off, pf_chunk)
            if MODE == 1:
                _asm(PF_BULK, base + off, size)
            elif MODE == 2:
                _asm(PF_BULK_LAST, base + off, size)
            else:
                for j in range(0, pf_chunk, LINE):
                    if MODE == 3:
                        _asm(PF_LINE, base + off + j, size - j)
                    else:
                        _asm(PF_LINE_LAST, base + off + j, size - j)


@triton.jit
def _gemv_pf(w_ptr, a_ptr, o_ptr, N, pf_ptr, pf_bytes, pf_chunk, pf_blocks, K: tl.constexpr, R: tl.constexpr,
             BK: tl.constexpr, NT: tl.constexpr, PF: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """``_gemv_rows`` under dependent launch that first prefetches its slice of the next GEMV's
    W (``_l2_prefetch``), every W tile loaded under the L2 policy ``EVICT`` ("" or "evict_first")."""
    _l2_prefetch(pf_ptr, pf_bytes, pf_chunk, pf_blocks, NT, PF)
    rn = tl.program_id(0) * R + tl.arange(0, R)
    mask_n = rn < N
    part = tl.zeros((R, BK), dtype=tl.float32)
    for i in tl.static_range(0, K, BK):
        rk = i + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None], other=0.0,
                    eviction_policy=EVICT)  # fmt: skip
        if i == 0:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(a_ptr + rk)
        part += w.to(tl.float32) * a.to(tl.float32)[None, :]
    tl.store(o_ptr + rn, tl.sum(part, axis=1).to(o_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _attn_standin(qkv_ptr, k_ptr, v_ptr, o_ptr, S, pf_ptr, pf_bytes, pf_chunk, pf_blocks, HD: tl.constexpr,
                  GROUP: tl.constexpr, BS: tl.constexpr, NT: tl.constexpr, PF: tl.constexpr,
                  SIDE: tl.constexpr = False, HEADS: tl.constexpr = 32):  # fmt: skip
    """A decode attention kernel's shape in the chain: one block per query head over its KV head's
    ``S`` cached keys and values (loaded before the wait, as the real kernel reads a cache no
    kernel of the step writes), softmax in fp32, the head's output row; the q/k/v GEMV's first
    outputs are the queries. Prefetches its slice of a later GEMV's W first; with ``SIDE``, the
    grid's blocks past the ``HEADS`` heads' prefetch instead, and the heads' blocks do not."""
    h = tl.program_id(0)
    if SIDE:
        if h >= HEADS:  # after the q/k/v GEMV, in the attention's window, not during its stream
            tl.extra.cuda.gdc_wait()
            _l2_prefetch_as(h - HEADS, pf_ptr, pf_bytes, pf_chunk, pf_blocks, NT, PF)
        else:
            _attn_head(qkv_ptr, k_ptr, v_ptr, o_ptr, S, h, HD, GROUP, BS)
    else:
        _l2_prefetch(pf_ptr, pf_bytes, pf_chunk, pf_blocks, NT, PF)
        _attn_head(qkv_ptr, k_ptr, v_ptr, o_ptr, S, h, HD, GROUP, BS)


@triton.jit
def _attn_head(qkv_ptr, k_ptr, v_ptr, o_ptr, S, h, HD: tl.constexpr, GROUP: tl.constexpr, BS: tl.constexpr):
    """Query head ``h``'s attention over its KV head's cache (``_attn_standin``'s body)."""
    rs = tl.arange(0, BS)
    rd = tl.arange(0, HD)
    at = (h // GROUP) * S * HD + rs[:, None] * HD + rd[None, :]
    mask = (rs < S)[:, None]
    kt = tl.load(k_ptr + at, mask=mask, other=0.0)
    vt = tl.load(v_ptr + at, mask=mask, other=0.0)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(qkv_ptr + h * HD + rd).to(tl.float32)
    s = tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * (1.0 / tl.sqrt(HD * 1.0))
    s = tl.where(rs < S, s, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=0))
    p = p / tl.sum(p, axis=0)
    tl.store(o_ptr + h * HD + rd, tl.sum(p[:, None] * vt.to(tl.float32), axis=0).to(o_ptr.dtype.element_ty))


@triton.jit
def _tile(w_ptr, a_ptr, o_ptr, t, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, w0):
    """Row tile ``t`` of a GEMV; ``w0``: its first K step's W tile, loaded already."""
    rn = t * R + tl.arange(0, R)
    mask_n = rn < N
    # A was written by other blocks in this launch: read through L2 (.cg), never a stale L1 line
    part = w0.to(tl.float32) * tl.load(a_ptr + tl.arange(0, BK), cache_modifier=".cg").to(tl.float32)[None, :]
    for i in tl.static_range(BK, K, BK):
        rk = i + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask_n[:, None], other=0.0)
        part += w.to(tl.float32) * tl.load(a_ptr + rk, cache_modifier=".cg").to(tl.float32)[None, :]
    tl.store(o_ptr + rn, tl.sum(part, axis=1).to(o_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _first(w_ptr, t, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    rn = t * R + tl.arange(0, R)
    rk = tl.arange(0, BK)
    return tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rn < N)[:, None], other=0.0)


@triton.jit
def _phase(w_ptr, a_ptr, o_ptr, N, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, G, w0,
           PREFETCH: tl.constexpr):  # fmt: skip
    """This block's row tiles of one GEMV (tiles pid, pid + G, ...); ``w0``: the first one's first
    W tile, loaded before the barrier (``PREFETCH``; else loaded here, after it)."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(N, R)
    if not PREFETCH:
        w0 = _first(w_ptr, pid, N, K, R, BK)
    if pid < tiles:
        _tile(w_ptr, a_ptr, o_ptr, pid, N, K, R, BK, w0)
    for t in range(pid + G, tiles, G):
        _tile(w_ptr, a_ptr, o_ptr, t, N, K, R, BK, _first(w_ptr, t, N, K, R, BK))


@triton.jit
def _barrier(bar_ptr, target, fail_ptr):
    """Every block of the grid has stored its tiles of this GEMV (``target``: blocks x barriers
    so far): arrive after this block's stores, then poll until all have arrived."""
    tl.debug_barrier()  # every thread's stores before the arrival
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < MAX_POLLS):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if polls >= MAX_POLLS:
        tl.atomic_max(fail_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _chain(x_ptr, wq_ptr, wo_ptr, wg_ptr, wd_ptr, wh_ptr, q_ptr, o_ptr, g_ptr, d_ptr, out_ptr, bar_ptr, fail_ptr,
           LAYERS: tl.constexpr, NQ: tl.constexpr, NO: tl.constexpr, NG: tl.constexpr, ND: tl.constexpr,
           NH: tl.constexpr, H: tl.constexpr, KD: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
           PREFETCH: tl.constexpr):  # fmt: skip
    """The whole chain in one grid: per layer q/k/v (A: the layer's input), o (A: q/k/v's first H
    outputs), gate/up (A: o's), down (A: gate/up's first KD), then the LM head (A: the last
    down's); a grid barrier after each GEMV."""
    G = tl.num_programs(0)
    pid = tl.program_id(0)
    a = x_ptr
    n = 0
    for layer in range(LAYERS):
        wq = wq_ptr + layer.to(tl.int64) * NQ * H
        wo = wo_ptr + layer.to(tl.int64) * NO * H
        wg = wg_ptr + layer.to(tl.int64) * NG * H
        wd = wd_ptr + layer.to(tl.int64) * ND * KD
        w0 = _first(wq, pid, NQ, H, R, BK)
        if layer > 0:
            n += 1
            _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wq, a, q_ptr, NQ, H, R, BK, G, w0, PREFETCH)
        w0 = _first(wo, pid, NO, H, R, BK)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wo, q_ptr, o_ptr, NO, H, R, BK, G, w0, PREFETCH)
        w0 = _first(wg, pid, NG, H, R, BK)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wg, o_ptr, g_ptr, NG, H, R, BK, G, w0, PREFETCH)
        w0 = _first(wd, pid, ND, KD, R, BK)
        n += 1
        _barrier(bar_ptr, n * G, fail_ptr)
        _phase(wd, g_ptr, d_ptr, ND, KD, R, BK, G, w0, PREFETCH)
        a = d_ptr
    w0 = _first(wh_ptr, pid, NH, H, R, BK)
    n += 1
    _barrier(bar_ptr, n * G, fail_ptr)
    _phase(wh_ptr, d_ptr, out_ptr, NH, H, R, BK, G, w0, PREFETCH)


# The stand-in decode attention of Llama-3.2-1B: query heads, KV heads, head dim, cache slots (a
# 32-token prompt and 128 new tokens, the decode bench's workload).
ATTN = {"heads": 32, "kv_heads": 8, "head_dim": 64, "slots": 160}
PF_MODES = {"bulk": 1, "bulk_el": 2, "line": 3, "line_el": 4}
# kernel -> the weight it prefetches in plan ``a``/``b``/``c``/``ab`` (see the module doc)
PF_PLANS = {
    "none": (),
    "a": ("q", "o", "g", "d"),
    "b": ("attn",),
    "c": ("g",),
    "ab": ("attn", "o", "g", "d"),
    "s": ("attn", "d"),
}


@dataclass(frozen=True)
class Prefetch:
    """One chain of GEMVs under dependent launch with the stand-in attention: which kernels
    prefetch the next GEMV's W (``plan``), how (``mode``: a ``PF_MODES`` key), by how many of a
    kernel's first blocks (0: all), at most ``cap_mb`` of it; the GEMVs' W loads' L2 policy."""

    plan: str = "none"
    mode: str = "bulk"
    evict: str = ""
    blocks: int = 128
    cap_mb: int = 16
    # the attention's prefetch: the W of the GEMV right after it (1: o) or the one after that
    # (2: gate/up, whose W no kernel is loading while the attention runs; o loads its own before
    # its wait); ``side``: by that many blocks of their own beside the heads' (0: the heads')
    ahead: int = 1
    side: int = 0

    @property
    def name(self) -> str:
        if self.plan == "none":
            return "attn_pdl" + ("_ef" if self.evict else "")
        name = f"l2pf_{self.plan}{'' if self.ahead == 1 else self.ahead}_{self.mode}" + (
            "_ef" if self.evict else ""
        )
        if self.side:
            name += f"_side{self.side}"
        if self.blocks != 128:
            name += f"_blocks{self.blocks or 'all'}"
        return name + (f"_cap{self.cap_mb}" if self.cap_mb != 16 else "")


def prefetch_variants(quick: bool) -> list[Prefetch]:
    ef = "evict_first"
    out = [
        Prefetch(),
        Prefetch(evict=ef),
        Prefetch("a"),
        Prefetch("a", evict=ef),
        Prefetch("a", "bulk_el", ef),
        Prefetch("a", "line", ef),
        Prefetch("b"),
        Prefetch("b", evict=ef),
        Prefetch("c", evict=ef),
        Prefetch("ab", evict=ef),
        Prefetch("ab", "bulk_el", ef),
        Prefetch("s", evict=ef),
        Prefetch("ab", evict=ef, cap_mb=4),
    ]
    if not quick:
        out += [
            Prefetch("a", "line_el", ef),
            Prefetch("ab", "line", ef),
            Prefetch("b", evict=ef, blocks=0),
            Prefetch("a", evict=ef, blocks=32),
            Prefetch("a", evict=ef, blocks=0),
            Prefetch("ab", evict=ef, cap_mb=8),
            Prefetch("ab", evict=ef, cap_mb=32),
            Prefetch("ab", "bulk_el", ef, cap_mb=32),
        ]
    return out


def ahead_variants() -> list[Prefetch]:
    """The attention kernel's window, where HBM idles but for o's early loads, streaming the W of
    gate/up (the GEMV after o) into L2: by the heads' blocks or by blocks of their own, a cap of
    8-32 MiB of its 64 MiB; beside the chain without a prefetch and the attention prefetching o's."""
    ef = "evict_first"
    return [
        Prefetch(),
        Prefetch(evict=ef),
        Prefetch("b", evict=ef),
        Prefetch("b", evict=ef, side=64),
        *(Prefetch("b", evict=ef, ahead=2, cap_mb=c) for c in (8, 16, 24)),
        *(Prefetch("b", evict=ef, ahead=2, side=64, cap_mb=c) for c in (8, 16, 24, 32)),
        Prefetch("b", ahead=2, side=64, cap_mb=16),
        Prefetch("b", "bulk_el", ef, ahead=2, side=64, cap_mb=16),
        Prefetch("b", evict=ef, ahead=2, side=128, cap_mb=24),
    ]


def pf_args(target, cap: int, blocks: int, nt: int, dummy) -> tuple:
    """(pointer, bytes, bytes per thread, blocks) of a prefetch of ``target``'s first ``cap``
    bytes by ``blocks`` blocks of ``nt`` threads; nothing where ``target`` is None."""
    if target is None:
        return dummy, 0, LINE.value, 0
    nbytes = min(target.numel() * target.element_size(), cap)
    chunk = -(-nbytes // (blocks * nt * LINE.value)) * LINE.value
    return target, nbytes, chunk, blocks


GEMV_WARPS, ATTN_WARPS, ROWS, BLOCK_K = 2, 8, 2, 1024


def prefetch_chain(v: Prefetch, w: dict, x, bufs: dict, cache: tuple, layers: int):
    """A callable launching ``v``'s chain once: per layer q/k/v, the stand-in attention (A of o:
    its output), o, gate/up, down; then the LM head, which prefetches nothing."""
    (nq, h), (no, _), (ng, _), (nd, kd) = LLAMA_1B["sites"]
    nh = LLAMA_1B["head"][0]
    kc, vc = cache
    per = ATTN["kv_heads"] * ATTN["slots"] * ATTN["head_dim"]
    mode, plan, cap = PF_MODES[v.mode], PF_PLANS[v.plan], v.cap_mb << 20
    gemv_nt, attn_nt = 32 * GEMV_WARPS, 32 * ATTN_WARPS
    dummy = bufs["out"]
    launches = []

    def gemv(key, wt, a, out, n, k, nxt):
        grid = triton.cdiv(n, ROWS)
        pf = pf_args(nxt if key in plan else None, cap, min(grid, v.blocks or grid), gemv_nt, dummy)
        launches.append(
            lambda: _gemv_pf[(grid,)](
                wt,
                a,
                out,
                n,
                *pf,
                k,
                ROWS,
                BLOCK_K,
                gemv_nt,
                mode if pf[1] else 0,
                v.evict,
                num_warps=GEMV_WARPS,
                num_stages=1,
                launch_pdl=True,
            )
        )

    def attn(layer, nxt):
        heads = ATTN["heads"]
        grid = heads + v.side if "attn" in plan else heads
        blocks = v.side or min(heads, v.blocks or heads)
        pf = pf_args(nxt if "attn" in plan else None, cap, blocks, attn_nt, dummy)
        kl, vl = kc[layer * per : (layer + 1) * per], vc[layer * per : (layer + 1) * per]
        launches.append(
            lambda: _attn_standin[(grid,)](
                bufs["q"],
                kl,
                vl,
                bufs["att"],
                ATTN["slots"],
                *pf,
                ATTN["head_dim"],
                ATTN["heads"] // ATTN["kv_heads"],
                triton.next_power_of_2(ATTN["slots"]),
                attn_nt,
                mode if pf[1] else 0,
                bool(v.side) and pf[1] > 0,
                heads,
                num_warps=ATTN_WARPS,
                num_stages=1,
                launch_pdl=True,
            )
        )

    def layer_w(key, rows, layer):
        return w[key][layer * rows : (layer + 1) * rows] if layer < layers else w["h"]

    a = x
    for layer in range(layers):
        wo, wg, wd = layer_w("o", no, layer), layer_w("g", ng, layer), layer_w("d", nd, layer)
        gemv("q", layer_w("q", nq, layer), a, bufs["q"], nq, h, wo)
        attn(layer, wo if v.ahead == 1 else wg)
        gemv("o", wo, bufs["att"], bufs["o"], no, h, wg)
        gemv("g", wg, bufs["o"], bufs["g"], ng, h, wd)
        gemv("d", wd, bufs["g"], bufs["d"], nd, kd, layer_w("q", nq, layer + 1))
        a = bufs["d"]
    gemv("h", w["h"], bufs["d"], bufs["out"], nh, h, None)

    def run():
        for launch in launches:
            launch()

    return run


def attention_alone_us(bufs: dict, cache: tuple, layers: int, dev, repeats: int) -> float:
    """µs of one stand-in attention kernel: every layer's, back to back in one graph, plainly."""
    per = ATTN["kv_heads"] * ATTN["slots"] * ATTN["head_dim"]
    dummy = bufs["out"]

    def run():
        for layer in range(layers):
            _attn_standin[(ATTN["heads"],)](
                bufs["q"], cache[0][layer * per :], cache[1][layer * per :], bufs["att"], ATTN["slots"],
                dummy, 0, LINE.value, 0, ATTN["head_dim"], ATTN["heads"] // ATTN["kv_heads"],
                triton.next_power_of_2(ATTN["slots"]), 32 * ATTN_WARPS, 0, num_warps=ATTN_WARPS, num_stages=1,
            )  # fmt: skip

    return timing.graph_us(run, dev, 1, repeats) / layers


def compile_only(arch: int) -> int:
    """Compile every prefetch kernel form the bench launches for ``sm_<arch>`` (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = "*bf16"
    jobs = []
    for mode in sorted(set(PF_MODES.values()) | {0}):
        for evict in ("", "evict_first"):
            for k in (2048, 8192):
                sig = {"w_ptr": ptr, "a_ptr": ptr, "o_ptr": ptr, "N": "i32", "pf_ptr": ptr, "pf_bytes": "i32",
                       "pf_chunk": "i32", "pf_blocks": "i32"}  # fmt: skip
                consts = {"K": k, "R": ROWS, "BK": BLOCK_K, "NT": 32 * GEMV_WARPS, "PF": mode, "EVICT": evict}
                jobs.append((_gemv_pf, sig, consts, GEMV_WARPS))
        sig = {"qkv_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "o_ptr": ptr, "S": "i32", "pf_ptr": ptr,
               "pf_bytes": "i32", "pf_chunk": "i32", "pf_blocks": "i32"}  # fmt: skip
        consts = {"HD": ATTN["head_dim"], "GROUP": 4, "BS": 256, "NT": 32 * ATTN_WARPS, "PF": mode}
        consts.update(SIDE=False, HEADS=ATTN["heads"])
        jobs.append((_attn_standin, sig, consts, ATTN_WARPS))
        if mode:  # the prefetch by blocks of their own beside the heads'
            jobs.append((_attn_standin, sig, {**consts, "SIDE": True}, ATTN_WARPS))
    failed = 0
    for fn, sig, consts, warps in jobs:
        full = {**sig, **{k: "constexpr" for k in consts}}
        # pointers 16-byte aligned, as the launches' (torch's allocations) are: vectorized loads
        aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
        src = ASTSource(fn, signature=full, constexprs=consts, attrs=aligned)
        label = f"{fn.__name__} {consts}"
        try:
            compiled = triton.compile(
                src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": 1}
            )
        except Exception as e:
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            continue
        ptx = compiled.asm["ptx"]
        found = {
            "bulk": ptx.count("cp.async.bulk.prefetch.L2"),
            "line": ptx.count("prefetch.global.L2"),
            "evict_first": ptx.count("L2::evict_first"),
            "gdc_wait": ptx.count("griddepcontrol.wait"),
        }
        want_bulk, want_line = consts["PF"] in (1, 2), consts["PF"] in (3, 4)
        ok = (found["bulk"] > 0) == want_bulk and (found["line"] > 0) == want_line and found["gdc_wait"] > 0
        ok = ok and (found["evict_first"] > 0) == (consts.get("EVICT") == "evict_first")
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: {found}, {len(compiled.asm['cubin'])} cubin bytes")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks-per-sm", type=int, action="append", help="persistent grid sizes (default 2, 4)")
    p.add_argument("--layers", type=int, default=LLAMA_1B["layers"])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--prefetch", action="store_true", help="also the L2 prefetch chains (every variant)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the plain chains and the main L2 prefetch variants only (no persistent)",
    )
    p.add_argument(
        "--ahead",
        action="store_true",
        help="the plain chains and the attention's prefetch of gate/up's W alone (ahead_variants)",
    )
    p.add_argument("--repeats", type=int, default=20, help="graph replays per variant (median)")
    p.add_argument(
        "--compile-only",
        type=int,
        metavar="ARCH",
        help="compile the prefetch kernels for sm_ARCH (no GPU) and exit",
    )
    args = p.parse_args()
    if args.compile_only:
        return compile_only(args.compile_only)
    if not torch.cuda.is_available():
        print("persistent_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    (nq, h), (no, _), (ng, _), (nd, kd) = LLAMA_1B["sites"]
    nh = LLAMA_1B["head"][0]
    layers = args.layers
    w = {
        "q": torch.randn(layers * nq, h, device=dev, dtype=dt) / h**0.5,
        "o": torch.randn(layers * no, h, device=dev, dtype=dt) / h**0.5,
        "g": torch.randn(layers * ng, h, device=dev, dtype=dt) / h**0.5,
        "d": torch.randn(layers * nd, kd, device=dev, dtype=dt) / kd**0.5,
        "h": torch.randn(nh, h, device=dev, dtype=dt) / h**0.5,
    }
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    x = torch.randn(h, device=dev, dtype=dt)
    bufs = {
        k: torch.empty(n, device=dev, dtype=dt)
        for k, n in (("q", nq), ("o", no), ("g", ng), ("d", nd), ("out", nh))
    }
    bufs["att"] = torch.empty(ATTN["heads"] * ATTN["head_dim"], device=dev, dtype=dt)
    per = ATTN["kv_heads"] * ATTN["slots"] * ATTN["head_dim"]
    cache = tuple(torch.randn(layers * per, device=dev, dtype=dt) for _ in range(2))
    bar = torch.zeros(1, device=dev, dtype=torch.int32)
    fail = torch.zeros(1, device=dev, dtype=torch.int32)
    r, bk = 2, 1024

    def per_gemv(pdl: bool):
        kw = {"num_warps": 2, "num_stages": 1, **({"launch_pdl": True} if pdl else {})}

        def one(wt, a, out, n, k):
            _gemv_rows[(triton.cdiv(n, r),)](wt, a, out, n, k, r, bk, pdl, **kw)

        def run():
            a = x
            for layer in range(layers):
                one(w["q"][layer * nq : (layer + 1) * nq], a, bufs["q"], nq, h)
                one(w["o"][layer * no : (layer + 1) * no], bufs["q"], bufs["o"], no, h)
                one(w["g"][layer * ng : (layer + 1) * ng], bufs["o"], bufs["g"], ng, h)
                one(w["d"][layer * nd : (layer + 1) * nd], bufs["g"], bufs["d"], nd, kd)
                a = bufs["d"]
            one(w["h"], bufs["d"], bufs["out"], nh, h)

        return run

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def persistent(blocks_per_sm: int, warps: int, prefetch: bool):
        def run():
            bar.zero_()
            _chain[(sms * blocks_per_sm,)](
                x, w["q"], w["o"], w["g"], w["d"], w["h"], bufs["q"], bufs["o"], bufs["g"], bufs["d"], bufs["out"],
                bar, fail, layers, nq, no, ng, nd, nh, h, kd, r, bk, prefetch, num_warps=warps, num_stages=1,
            )  # fmt: skip

        return run

    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 0)
    result = {
        "device": torch.cuda.get_device_name(),
        "l2_bytes": l2,
        "attention_standin": ATTN,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": layers,
        "weight_bytes": nbytes,
        "rows": [],
    }
    want = {}
    # (name, the chain it computes: outputs compare within one, fields of the row, run)
    variants = [("kernels", "gemv", {}, per_gemv(False)), ("kernels_pdl", "gemv", {}, per_gemv(True))]
    if not (args.quick or args.ahead):
        for b in args.blocks_per_sm or (2, 4):
            for warps in (2, 4):
                for prefetch in (True, False):
                    name = f"persistent_{b}x{warps}w" + ("" if prefetch else "_no_prefetch")
                    variants.append((name, "gemv", {}, persistent(b, warps, prefetch)))
    if args.quick or args.prefetch or args.ahead:
        for v in ahead_variants() if args.ahead else prefetch_variants(args.quick):
            fields = {
                "plan": v.plan,
                "mode": v.mode,
                "evict": v.evict,
                "pf_blocks": v.blocks,
                "cap_mb": v.cap_mb,
                "ahead": v.ahead,
                "side": v.side,
            }
            variants.append((v.name, "attn", fields, prefetch_chain(v, w, x, bufs, cache, layers)))
    attn_bytes = 2 * cache[0].numel() * cache[0].element_size()
    for name, chain, fields, run in variants:
        row = {"variant": name, **fields}
        try:
            fail.zero_()
            run()
            torch.cuda.synchronize()
            if fail.item():
                row["error"] = "a barrier gave up: the grid's blocks were not all resident"
            else:
                out = bufs["out"].float().clone()
                want.setdefault(chain, out)
                row["max_abs_diff"] = float((out - want[chain]).abs().max())
                us = timing.graph_us(run, dev, 1, args.repeats)
                moved = nbytes + (attn_bytes if chain == "attn" else 0)
                row.update(us=us, tb_per_s=moved / us / 1e6)
        except Exception as e:  # one variant failing (a compile error) must not lose the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    if args.quick or args.prefetch or args.ahead:
        result["attention_standin_us"] = attention_alone_us(bufs, cache, layers, dev, args.repeats)
        print(json.dumps({"attention_standin_us": result["attention_standin_us"]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
