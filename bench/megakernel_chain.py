"""A decode step's weight stream as one persistent kernel whose weights arrive by TMA and keep
arriving across the grid barriers between GEMVs (issue 31, lever 4), measured before the codegen
plans one: Llama-3.2-1B's 64 layer GEMVs and the LM head, each reading the one before's output,
bfloat16, in one CUDA graph, against the default table's one kernel per GEMV under dependent
launch (``tma_gemv.py``'s ``vec`` chain, the same weights and input).

The build would pack the weights for the kernel that reads them; here the bench does: every
GEMV's rows are cut in tiles of ``R`` rows, dealt to the ``P`` blocks in turn (tile ``t`` to block
``t % P``), and each tile in ``BK``-wide chunks; block ``b``'s chunks lie one after another in one
packed array, in the order it consumes them (GEMV by GEMV, tile by tile, K step by K step). So a
block's weight stream is one linear run of TMA boxes of ``R x BK``, which it keeps ``S`` deep in
shared memory (an mbarrier per stage): a chunk's stage is refilled with the chunk ``S`` ahead as
soon as it is read, whichever GEMV that chunk belongs to. The stream therefore does not stop at a
GEMV's end: while a block waits at the grid barrier (an atomic counter: every block counts itself
in once its rows of the GEMV are stored), the next GEMV's first chunks are already arriving.
After the barrier a block stages the GEMV's input row in shared memory (one read from L2).

Two forms: ``_chain``, where every warp both consumes the ring and refills it (a CTA-wide barrier
per chunk, or per two chunks: ``PAIR``), and ``_chain_ws``, warp-specialized: one warp loads the
ring (TMA, gated by "empty" mbarriers) and the kernel's warps consume it, handing each stage back
with an arrive, never waiting for each other.

Measured on an H200 (torch 2.11, triton 3.6; ``bench/results/megakernel-chain-*-h200-2026-11-30.json``):
correct (the chain's output within bf16 rounding of the per-kernel chain's), but not faster: the
warp-specialized form 659-676 µs against 652-662 for one kernel per GEMV in the same commands, the
one-role form 687-832. Deeper rings past 12-16 stages, more consuming warps and pairs of chunks
did not help: the consumers take about as long per chunk as the stream brings it, so the backlog
a grid barrier leaves is never made up.

Written in Gluon (Triton's explicit-layout dialect: TMA, mbarriers and shared memory by hand);
GPU only (Triton's interpreter does not run Gluon).

    python3 bench/megakernel_chain.py --json out.json
    python3 bench/megakernel_chain.py --configs 14 --ws 1,10 --json out.json  # the fastest forms
    python3 bench/megakernel_chain.py --compile-only 90   # every configuration for sm_90, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.persistent_chain import LLAMA_1B  # noqa: E402

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: main() says so
    gluon = None

if gluon is not None:
    MAX_POLLS = gl.constexpr(1 << 20)  # polls of the grid barrier before a block gives up (reported)
    # names across Triton releases: the TMA load and the CTA barrier were renamed
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _sync = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _input_after_barrier(bar_ptr, act_in, a_smem, g, K: gl.constexpr, P: gl.constexpr,
                             KMAX: gl.constexpr, AL: gl.constexpr):  # fmt: skip
        """Wait until every block has counted itself in for GEMV g-1 (a bounded wait: a grid whose
        blocks are not all resident gives up and flags it), then stage GEMV g's input row (K of
        ``act_in``, from L2) in ``a_smem``."""
        if g > 0:
            seen = gl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            polls = 0
            while (seen < P * g) & (polls < MAX_POLLS):
                seen = gl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
                polls += 1
            if polls >= MAX_POLLS:
                gl.atomic_xchg(bar_ptr + 1, 1)
        at = gl.arange(0, KMAX, layout=AL)
        a_all = gl.load(act_in + at, mask=at < K, other=0.0, cache_modifier=".cg")
        _sync()  # every thread done with the last GEMV's input
        a_smem.store(a_all)
        _sync()

    @gluon.jit
    def _count_in(bar_ptr):
        """This block's rows of the GEMV are stored: count it in at the grid barrier."""
        _sync()  # every thread's stores before the arrival (which releases them)
        gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")

    @gluon.jit
    def _stage(desc, smem, bars, a_smem, bar_ptr, act_in, act_out, b, j, n, g, base,
               N: gl.constexpr, K: gl.constexpr, P: gl.constexpr, R: gl.constexpr, BK: gl.constexpr,
               S: gl.constexpr, KMAX: gl.constexpr, WL: gl.constexpr, AL: gl.constexpr,
               FENCE: gl.constexpr, PAIR: gl.constexpr):  # fmt: skip
        """GEMV ``g`` (N x K) for block ``b``: wait for GEMV g-1 everywhere, stage its output (this
        GEMV's input) in shared memory, take this block's tiles chunk by chunk from the ring (the
        chunk counter ``j`` of ``n``), refilling each stage S chunks ahead; store, count in.
        ``PAIR``: two chunks per step, their stages refilled after one CTA barrier (half the
        barriers). Returns the chunk counter after the GEMV."""
        _input_after_barrier(bar_ptr, act_in, a_smem, g, K, P, KMAX, AL)
        rows = gl.arange(0, R, layout=gl.SliceLayout(1, WL))
        for t in range(b, N // R, P):
            acc = gl.zeros([R, BK], gl.float32, WL)
            if PAIR:
                for s in gl.static_range(0, K // BK, 2):
                    st0 = j % S
                    st1 = (j + 1) % S
                    mbarrier.wait(bars.index(st0), (j // S) & 1)
                    mbarrier.wait(bars.index(st1), ((j + 1) // S) & 1)
                    w0 = smem.index(st0).load(WL)
                    w1 = smem.index(st1).load(WL)
                    _sync()  # every thread has read both stages: refill them S chunks ahead
                    if FENCE:
                        fence_async_shared()
                    mbarrier.expect(bars.index(st0), R * BK * 2, pred=j + S < n)
                    _tma_load(desc, [(base + j + S) * R, 0], bars.index(st0), smem.index(st0), pred=j + S < n)
                    mbarrier.expect(bars.index(st1), R * BK * 2, pred=j + 1 + S < n)
                    _tma_load(
                        desc,
                        [(base + j + 1 + S) * R, 0],
                        bars.index(st1),
                        smem.index(st1),
                        pred=j + 1 + S < n,
                    )
                    a0 = a_smem.slice(s * BK, BK).load(gl.SliceLayout(0, WL))
                    a1 = a_smem.slice((s + 1) * BK, BK).load(gl.SliceLayout(0, WL))
                    acc += w0.to(gl.float32) * gl.expand_dims(a0.to(gl.float32), 0)
                    acc += w1.to(gl.float32) * gl.expand_dims(a1.to(gl.float32), 0)
                    j += 2
            else:
                for s in gl.static_range(K // BK):
                    st = j % S
                    mbarrier.wait(bars.index(st), (j // S) & 1)
                    w = smem.index(st).load(WL)
                    _sync()  # every thread has read the stage: refill it with the chunk S ahead
                    if FENCE:  # the generic proxy's reads ordered before the async proxy's write
                        fence_async_shared()
                    ahead = j + S
                    mbarrier.expect(bars.index(st), R * BK * 2, pred=ahead < n)
                    _tma_load(desc, [(base + ahead) * R, 0], bars.index(st), smem.index(st), pred=ahead < n)
                    a = a_smem.slice(s * BK, BK).load(gl.SliceLayout(0, WL))
                    acc += w.to(gl.float32) * gl.expand_dims(a.to(gl.float32), 0)
                    j += 1
            gl.store(act_out + t * R + rows, gl.sum(acc, axis=1).to(gl.bfloat16))
        _count_in(bar_ptr)
        return j

    @gluon.jit
    def _chain(desc, act_ptr, bar_ptr, MAXJ, LAYERS,
               NQ: gl.constexpr, NO: gl.constexpr, NG: gl.constexpr, ND: gl.constexpr, NH: gl.constexpr,
               KH: gl.constexpr, KD: gl.constexpr, ACT: gl.constexpr, P: gl.constexpr, R: gl.constexpr,
               BK: gl.constexpr, S: gl.constexpr, FENCE: gl.constexpr, PAIR: gl.constexpr,
               num_warps: gl.constexpr):  # fmt: skip
        """The whole chain: LAYERS x (q/k/v, o, gate/up, down), then the LM head; activations
        ping-pong between act[0] (the first input, copied there) and act[1] (ACT elements each);
        the head's output in act[1]."""
        WL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        AL: gl.constexpr = gl.BlockedLayout([8], [32], [num_warps], [0])
        KMAX: gl.constexpr = KD
        b = gl.program_id(0)
        smem = gl.allocate_shared_memory(gl.bfloat16, [S, R, BK], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [KMAX], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(S):
            mbarrier.init(bars.index(i), count=1)
        per_layer = ((NQ // R - b + P - 1) // P + (NO // R - b + P - 1) // P + (NG // R - b + P - 1) // P) * (
            KH // BK
        ) + ((ND // R - b + P - 1) // P) * (KD // BK)
        n = LAYERS * per_layer + ((NH // R - b + P - 1) // P) * (KH // BK)
        base = b * MAXJ
        for i in gl.static_range(S):  # the ring's first S chunks
            mbarrier.expect(bars.index(i), R * BK * 2, pred=i < n)
            _tma_load(desc, [(base + i) * R, 0], bars.index(i), smem.index(i), pred=i < n)
        j = 0
        for layer in range(LAYERS):
            g = layer * 4
            j = _stage(desc, smem, bars, a_smem, bar_ptr, act_ptr, act_ptr + ACT, b, j, n, g, base,
                       NQ, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
            j = _stage(desc, smem, bars, a_smem, bar_ptr, act_ptr + ACT, act_ptr, b, j, n, g + 1, base,
                       NO, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
            j = _stage(desc, smem, bars, a_smem, bar_ptr, act_ptr, act_ptr + ACT, b, j, n, g + 2, base,
                       NG, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
            j = _stage(desc, smem, bars, a_smem, bar_ptr, act_ptr + ACT, act_ptr, b, j, n, g + 3, base,
                       ND, KD, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
        j = _stage(desc, smem, bars, a_smem, bar_ptr, act_ptr, act_ptr + ACT, b, j, n, LAYERS * 4, base,
                   NH, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
        for i in gl.static_range(S):
            mbarrier.invalidate(bars.index(i))


if gluon is not None:
    import inspect

    # gl.warp_specialize's signature changed across Triton releases: a list of (function, args)
    # pairs now, the default partition's args and function then the workers' before
    NEW_WS = gl.constexpr(
        next(iter(inspect.signature(gl.warp_specialize).parameters)) == "functions_and_args"
    )

    @gluon.jit
    def _ws_stage(ready, empty, smem, a_smem, bar_ptr, act_in, act_out, b, j, g,
                  N: gl.constexpr, K: gl.constexpr, P: gl.constexpr, R: gl.constexpr, BK: gl.constexpr,
                  S: gl.constexpr, KMAX: gl.constexpr, WL: gl.constexpr, AL: gl.constexpr,
                  FENCE: gl.constexpr, PAIR: gl.constexpr):  # fmt: skip
        """``_stage`` for the consuming warps of the warp-specialized form: each chunk's stage is
        handed back to the loading warp (an arrive on its "empty" mbarrier) once read, no CTA-wide
        barrier per chunk."""
        _input_after_barrier(bar_ptr, act_in, a_smem, g, K, P, KMAX, AL)
        rows = gl.arange(0, R, layout=gl.SliceLayout(1, WL))
        for t in range(b, N // R, P):
            acc = gl.zeros([R, BK], gl.float32, WL)
            if PAIR:  # two chunks per wait and hand-back
                for s in gl.static_range(0, K // BK, 2):
                    st0 = j % S
                    st1 = (j + 1) % S
                    mbarrier.wait(ready.index(st0), (j // S) & 1)
                    mbarrier.wait(ready.index(st1), ((j + 1) // S) & 1)
                    w0 = smem.index(st0).load(WL)
                    w1 = smem.index(st1).load(WL)
                    if FENCE:
                        fence_async_shared()
                    mbarrier.arrive(empty.index(st0), count=1)
                    mbarrier.arrive(empty.index(st1), count=1)
                    a0 = a_smem.slice(s * BK, BK).load(gl.SliceLayout(0, WL))
                    a1 = a_smem.slice((s + 1) * BK, BK).load(gl.SliceLayout(0, WL))
                    acc += w0.to(gl.float32) * gl.expand_dims(a0.to(gl.float32), 0)
                    acc += w1.to(gl.float32) * gl.expand_dims(a1.to(gl.float32), 0)
                    j += 2
            else:
                for s in gl.static_range(K // BK):
                    st = j % S
                    mbarrier.wait(ready.index(st), (j // S) & 1)
                    w = smem.index(st).load(WL)
                    if FENCE:  # the generic proxy's reads ordered before the loader's TMA write
                        fence_async_shared()
                    mbarrier.arrive(empty.index(st), count=1)
                    a = a_smem.slice(s * BK, BK).load(gl.SliceLayout(0, WL))
                    acc += w.to(gl.float32) * gl.expand_dims(a.to(gl.float32), 0)
                    j += 1
            gl.store(act_out + t * R + rows, gl.sum(acc, axis=1).to(gl.bfloat16))
        _count_in(bar_ptr)
        return j

    @gluon.jit
    def _ws_compute(ready, empty, smem, a_smem, bar_ptr, act_ptr, b, LAYERS,
                    NQ: gl.constexpr, NO: gl.constexpr, NG: gl.constexpr, ND: gl.constexpr, NH: gl.constexpr,
                    KH: gl.constexpr, KD: gl.constexpr, ACT: gl.constexpr, P: gl.constexpr, R: gl.constexpr,
                    BK: gl.constexpr, S: gl.constexpr, NW: gl.constexpr, FENCE: gl.constexpr,
                    PAIR: gl.constexpr):  # fmt: skip
        """The default partition (NW warps): every GEMV of the chain, as ``_chain`` runs them."""
        WL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
        AL: gl.constexpr = gl.BlockedLayout([8], [32], [NW], [0])
        KMAX: gl.constexpr = KD
        j = 0
        for layer in range(LAYERS):
            g = layer * 4
            j = _ws_stage(ready, empty, smem, a_smem, bar_ptr, act_ptr, act_ptr + ACT, b, j, g,
                          NQ, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
            j = _ws_stage(ready, empty, smem, a_smem, bar_ptr, act_ptr + ACT, act_ptr, b, j, g + 1,
                          NO, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
            j = _ws_stage(ready, empty, smem, a_smem, bar_ptr, act_ptr, act_ptr + ACT, b, j, g + 2,
                          NG, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
            j = _ws_stage(ready, empty, smem, a_smem, bar_ptr, act_ptr + ACT, act_ptr, b, j, g + 3,
                          ND, KD, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip
        _ws_stage(ready, empty, smem, a_smem, bar_ptr, act_ptr, act_ptr + ACT, b, j, LAYERS * 4,
                  NH, KH, P, R, BK, S, KMAX, WL, AL, FENCE, PAIR)  # fmt: skip

    @gluon.jit
    def _ws_load(desc, ready, empty, smem, base, n, R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr):
        """The loading warp: the block's n chunks in order, each into its stage once the consuming
        warps have handed that stage back."""
        for j in range(n):
            st = j % S
            mbarrier.wait(empty.index(st), ((j // S) & 1) ^ 1)
            mbarrier.expect(ready.index(st), R * BK * 2)
            _tma_load(desc, [(base + j) * R, 0], ready.index(st), smem.index(st))

    @gluon.jit
    def _chain_ws(desc, act_ptr, bar_ptr, MAXJ, LAYERS,
                  NQ: gl.constexpr, NO: gl.constexpr, NG: gl.constexpr, ND: gl.constexpr, NH: gl.constexpr,
                  KH: gl.constexpr, KD: gl.constexpr, ACT: gl.constexpr, P: gl.constexpr, R: gl.constexpr,
                  BK: gl.constexpr, S: gl.constexpr, FENCE: gl.constexpr, PAIR: gl.constexpr,
                  num_warps: gl.constexpr):  # fmt: skip
        """``_chain`` with its warps specialized: one warp loads the ring (TMA), the kernel's
        ``num_warps`` consume it."""
        b = gl.program_id(0)
        smem = gl.allocate_shared_memory(gl.bfloat16, [S, R, BK], desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [KD], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        per_layer = ((NQ // R - b + P - 1) // P + (NO // R - b + P - 1) // P + (NG // R - b + P - 1) // P) * (
            KH // BK
        ) + ((ND // R - b + P - 1) // P) * (KD // BK)
        n = LAYERS * per_layer + ((NH // R - b + P - 1) // P) * (KH // BK)
        base = b * MAXJ
        if NEW_WS:  # the argument tuples written in the call: a tuple bound to a name loses its constants
            gl.warp_specialize(
                [
                    (_ws_compute, (ready, empty, smem, a_smem, bar_ptr, act_ptr, b, LAYERS, NQ, NO, NG, ND, NH, KH,
                                   KD, ACT, P, R, BK, S, num_warps, FENCE, PAIR)),
                    (_ws_load, (desc, ready, empty, smem, base, n, R, BK, S)),
                ],
                [1],
                [24],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                (ready, empty, smem, a_smem, bar_ptr, act_ptr, b, LAYERS, NQ, NO, NG, ND, NH, KH, KD, ACT, P, R, BK,
                 S, num_warps, FENCE, PAIR),
                _ws_compute,
                (desc, ready, empty, smem, base, n, R, BK, S),
                [_ws_load],
                [1],
                [24],
            )  # fmt: skip
        for i in gl.static_range(S):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


# the warp-specialized form: (rows R, columns BK, stages S, consuming warps, blocks per SM, maxnreg,
# the proxy fence before a stage's hand-back, two chunks per wait and hand-back)
WS_CONFIGS = (
    (16, 256, 8, 8, 1, 128, True, False),
    (16, 256, 12, 8, 1, 128, True, False),
    (16, 256, 8, 16, 1, 96, True, False),
    (16, 256, 6, 4, 2, 128, True, False),
    (32, 256, 6, 8, 1, 128, True, False),
    (16, 256, 16, 8, 1, 128, True, False),
    (16, 256, 20, 8, 1, 128, True, False),
    (16, 256, 24, 8, 1, 128, True, False),
    (16, 256, 20, 4, 1, 128, True, False),
    (32, 256, 10, 8, 1, 128, True, False),
    (16, 256, 16, 8, 1, 128, False, False),
    (16, 256, 16, 8, 1, 128, True, True),
    (16, 256, 16, 8, 1, 128, False, True),
    (16, 256, 24, 8, 1, 128, False, True),
)


# (rows R, columns BK, stages S, warps, blocks per SM, the proxy fence before a stage's refill,
# two chunks per CTA barrier)
CONFIGS = (
    (16, 256, 8, 4, 1, True, False),
    (16, 256, 4, 4, 2, True, False),
    (16, 256, 4, 4, 2, False, False),
    (16, 256, 5, 8, 2, False, False),
    (32, 256, 6, 8, 1, False, False),
    (32, 256, 4, 4, 2, False, False),
    (32, 256, 4, 8, 2, False, False),
    (64, 256, 3, 8, 1, False, False),
    (64, 256, 4, 8, 1, False, False),
    (64, 256, 2, 8, 2, False, False),
    (16, 256, 8, 16, 1, False, False),
    (32, 256, 5, 16, 1, False, False),
    (16, 256, 5, 16, 2, False, False),
    (16, 256, 8, 16, 1, False, True),
    (16, 256, 6, 8, 2, False, True),
    (16, 256, 4, 8, 2, False, True),
)


def chain_shapes(layers: int) -> list[tuple[int, int]]:
    (nq, h), (no, _), (ng, _), (nd, kd) = LLAMA_1B["sites"]
    return [s for _ in range(layers) for s in ((nq, h), (no, h), (ng, h), (nd, kd))] + [LLAMA_1B["head"]]


def pack(weights: list[torch.Tensor], p: int, r: int, bk: int) -> tuple[torch.Tensor, int]:
    """The chunks of every weight in the order block b consumes them, block b's at [b * maxj, ...):
    ([p * maxj, r, bk], maxj)."""
    counts = torch.zeros(p, dtype=torch.int64)
    spans = []
    for w in weights:
        tiles, sk = w.shape[0] // r, w.shape[1] // bk
        per = torch.tensor([len(range(b, tiles, p)) * sk for b in range(p)])
        spans.append(counts.clone())
        counts += per
    maxj = int(counts.max())
    out = torch.empty(p * maxj, r, bk, dtype=weights[0].dtype, device=weights[0].device)
    for w, start in zip(weights, spans):
        tiles, sk = w.shape[0] // r, w.shape[1] // bk
        t = torch.arange(tiles)
        blk, local = t % p, t // p
        dest = (blk * maxj + start[blk] + local * sk)[:, None] + torch.arange(sk)[None, :]  # [tiles, sk]
        out[dest.reshape(-1).to(out.device)] = w.view(tiles, r, sk, bk).permute(0, 2, 1, 3).reshape(-1, r, bk)
    return out, maxj


def forms(configs: tuple, ws: tuple) -> list[tuple]:
    """(kernel, name, R, BK, stages, warps, blocks per SM, FENCE, PAIR, launch options) of each
    configuration of the one-role form (``configs``) and the warp-specialized one (``ws``)."""

    def tail(fence: bool, pair: bool) -> str:
        return ("" if fence else "_nofence") + ("_pairs" if pair else "")

    return [
        (_chain, f"mega_{r}x{bk}_s{st}_w{w}_{ps}" + tail(f, pr), r, bk, st, w, ps, f, pr, {})
        for r, bk, st, w, ps, f, pr in configs
    ] + [
        (
            _chain_ws,
            f"mega_ws_{r}x{bk}_s{st}_w{w}_{ps}_r{reg}" + tail(f, pr),
            r,
            bk,
            st,
            w,
            ps,
            f,
            pr,
            {"maxnreg": reg},
        )
        for r, bk, st, w, ps, reg, f, pr in ws
    ]


def compile_only(arch: int, configs: tuple = CONFIGS, ws: tuple = WS_CONFIGS) -> int:
    """Compile ``_chain`` at ``configs`` and ``_chain_ws`` at ``ws`` for sm_ARCH (no GPU): the PTX
    holds the TMA loads, the mbarrier waits and the grid barrier's atomics. Prints one
    ``ok``/``FAIL`` line each."""
    if gluon is None:
        print("FAIL: this Triton has no Gluon")
        return 1
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    (nq, h), (no, _), (ng, _), (nd, kd) = LLAMA_1B["sites"]
    nh = LLAMA_1B["head"][0]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    failed = 0
    for fn, name, r, bk, stages, warps, per_sm, fence, pair, options in forms(configs, ws):
        signature = {"desc": f"tensordesc<bf16[{r}, {bk}],{layout!r}>", "act_ptr": "*bf16", "bar_ptr": "*i32",
                     "MAXJ": "i32", "LAYERS": "i32"}  # fmt: skip
        consts = dict(NQ=nq, NO=no, NG=ng, ND=nd, NH=nh, KH=h, KD=kd, ACT=nh, P=132 * per_sm, R=r, BK=bk, S=stages,
                      FENCE=fence, PAIR=pair, num_warps=warps)  # fmt: skip
        names = list(signature) + list(consts)
        signature.update(dict.fromkeys(consts, "constexpr"))
        try:
            src = GluonASTSource(fn, signature, {(names.index(k),): v for k, v in consts.items()})
            target = GPUTarget("cuda", arch, 32)
            ptx = triton.compile(src, target=target, options={"num_warps": warps, **options}).asm["ptx"]
            missing = [w for w in ("cp.async.bulk.tensor", "mbarrier.try_wait", "atom.") if w not in ptx]
            print(f"{'FAIL' if missing else 'ok'} {name}" + (f": no {missing}" if missing else ""))
            failed += bool(missing)
        except Exception as e:
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
            failed += 1
    return int(failed > 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    p.add_argument("--layers", type=int, default=LLAMA_1B["layers"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="the first configuration only, no per-GEMV chain")
    p.add_argument("--configs", help="indices into the configurations, comma-separated (default: all)")
    p.add_argument(
        "--ws", help="indices into the warp-specialized configurations (default: all; 'none': none)"
    )
    p.add_argument(
        "--compile-only",
        type=int,
        metavar="ARCH",
        help="compile every configuration for sm_ARCH (no GPU) and exit",
    )
    args = p.parse_args()
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")] if args.configs else list(CONFIGS)
    ws = (
        []
        if args.ws == "none"
        else [WS_CONFIGS[int(i)] for i in args.ws.split(",")]
        if args.ws
        else list(WS_CONFIGS)
    )
    if args.compile_only:
        return compile_only(args.compile_only, tuple(chosen), tuple(ws))
    if not torch.cuda.is_available() or gluon is None:
        print("megakernel_chain: needs a CUDA GPU of sm_90+ and a Triton with Gluon", file=sys.stderr)
        return 2
    from bench.common import chain_row
    from bench.tma_gemv import Gemv

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    layers = args.layers
    shapes = chain_shapes(layers)
    weights = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for n, k in shapes]
    nbytes = sum(w.numel() * 2 for w in weights)
    x = torch.randn(max(k for _, k in shapes), device=dev, dtype=dt)
    act_n = max(n for n, _ in shapes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": layers, "weight_bytes": nbytes, "sms": sms, "rows": []}  # fmt: skip

    # the reference: each GEMV in fp32 from the bf16 input, rounded to bf16, as the kernels do
    a = x
    for w in weights:
        a = (w.float() @ a[: w.shape[1]].float()).to(dt)
    want = a.float()

    vec = Gemv("vec")
    bufs = [torch.empty(act_n, device=dev, dtype=dt) for _ in range(2)]

    def run_vec():
        for j, w in enumerate(weights):
            vec(w, None, x if j == 0 else bufs[(j + 1) % 2], bufs[j % 2], w.shape[0], w.shape[1], True)

    rows = []

    def record(row: dict, run, out) -> None:
        def diff():
            if bar[1].item():
                raise RuntimeError("a grid barrier gave up: the grid's blocks were not all resident")
            got = out().float()
            return float((got - want).abs().max() / want.abs().max())

        rows.append(
            chain_row(row, run, args.repeats, diff, lambda us: {"tb_per_s": round(nbytes / us / 1e6, 3)})
        )
        if args.json:  # after every row: a run cut off keeps what it measured
            Path(args.json).write_text(json.dumps({**result, "rows": rows}, indent=1))

    act = torch.empty(2 * act_n, device=dev, dtype=dt)
    bar = torch.zeros(2, device=dev, dtype=torch.int32)  # the barrier's count; 1 where a block gave up
    if not args.quick:
        record({"form": "vec_pdl"}, run_vec, lambda: bufs[(len(weights) + 1) % 2][: shapes[-1][0]])
    (nq, h), (no, _), (ng, _), (nd, kd) = LLAMA_1B["sites"]
    nh = LLAMA_1B["head"][0]
    packed_for, packed, maxj = None, None, 0
    for fn, name, r, bk, stages, warps, per_sm, fence, pair, options in forms(
        tuple(chosen[:1] if args.quick else chosen), () if args.quick else tuple(ws)
    ):
        grid = sms * per_sm
        try:
            if packed_for != (grid, r, bk):
                packed = None
                torch.cuda.empty_cache()
                packed, maxj = pack(weights, grid, r, bk)
                packed_for = (grid, r, bk)
            layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
            flat = packed.view(-1, bk)
            desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [r, bk], layout)
            launch = (desc, act, bar, maxj, layers, nq, no, ng, nd, nh, h, kd, act_n, grid, r, bk, stages,
                      fence, pair)  # fmt: skip

            def run(fn=fn, grid=grid, launch=launch, warps=warps, options=options):
                bar.zero_()
                act[: x.numel()].copy_(x)
                fn[(grid,)](*launch, num_warps=warps, **options)

            record(
                {"form": name, "blocks": grid, "chunks_per_block": maxj}, run, lambda: act[act_n : act_n + nh]
            )
        except Exception as e:  # packing or a descriptor failing: the row says so, the others run
            row = {"form": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
    result["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
