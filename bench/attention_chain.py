"""What the one-kernel decode attention costs inside a decode step's chain, and forms of it,
measured before the codegen changes (issue 31): Llama-3.2-1B's attention half-layers (q/k/v GEMV,
decode attention over a 160-slot cache, o GEMV), 16 layers, each its own weights and cache, in one
CUDA graph under programmatic dependent launch, bfloat16.

Attention forms (each appends the step's key and value at slot ``POS``, rotates the queries and
the new key, one program per KV head and its 4 query heads):

- ``none``: no attention (the o GEMV reads the q/k/v GEMV's output): the chain's floor;
- ``built``: the kernel the build writes today (``decode_attention_append_rope_g4_d64``: the
  cache's keys and values loaded before the wait, the new key and value merged into those tiles
  in registers, scores and the weighted sum on tensor cores, 8 warps);
- ``built_w4``: the same with 4 warps;
- ``apart``: the cached tiles left as loaded (slot ``POS`` masked out), the new key's score and
  value added beside the tensor-core products;
- ``vec``: no tensor cores: each query head's scores and weighted sum as products summed across
  the tile (4 warps), the new key apart;
- ``tail_<body>_r<rows>w<warps>``: the q/k/v GEMV with the attention in its tail (the last block of
  a KV head runs that head's attention);
- ``attn_o_<body>_r<R>w<warps>``: the attention and the o projection in one kernel (a layer's
  attention half in two launches, not three): a grid of (KV head, chunk of ``R`` output rows);
  each program loads its ``R`` rows of W_o's columns for that head's 4 query heads, and the cache
  tiles, before the wait, computes the head's attention (``built``'s or ``vec``'s; every chunk of
  a head again, from L2), its share of those rows of o in fp32, and the last of the 8 heads'
  programs to arrive at the chunk's counter sums the 8 shares in head order (deterministic) into
  o. Only chunk 0 appends to the cache.

µs per chain (median of graph replays); outputs compared with ``built``'s.

    python3 bench/attention_chain.py --json out.json
    TRITON_INTERPRET=1 python3 bench/attention_chain.py --check   # the forms against torch on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HEADS, KV_HEADS, HEAD_DIM, CONTEXT, HIDDEN = 32, 8, 64, 160, 2048
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
POS = 100
SCALE_LOG2E = HEAD_DIM**-0.5 * 1.4426950408889634
FORMS = (
    "none",
    "built",
    "built_w4",
    "apart",
    "vec",
    "tail_built_r2w2",
    "tail_built_r4w4",
    "tail_built_r8w8",
    "tail_built_r8w4",
    "tail_built_r4w8",
    "tail_built_r16w8",
    "tail_vec_r4w4",
    "attn_o_built_r128w8",
    "attn_o_built_r64w4",
    "attn_o_built_r64w8",
    "attn_o_vec_r128w8",
    "attn_o_vec_r64w4",
)


@triton.jit
def _gemv(w_ptr, a_ptr, o_ptr, K: tl.constexpr, GDC: tl.constexpr):
    """The default table's one-row form at K 2048: two rows of W per block."""
    _gemv_rows(w_ptr, a_ptr, o_ptr, tl.program_id(0) * 2 + tl.arange(0, 2), K, GDC)


@triton.jit
def _gemv_rows(w_ptr, a_ptr, o_ptr, rn, K: tl.constexpr, GDC: tl.constexpr):
    """Rows ``rn`` of W times a, stored at o[rn]: both K steps of 1024 loaded before the wait for
    the kernel before (K 2048)."""
    rk = tl.arange(0, 1024)
    w0 = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
    w1 = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + 1024 + rk[None, :])
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    part = w0.to(tl.float32) * tl.load(a_ptr + rk).to(tl.float32)[None, :]
    part += w1.to(tl.float32) * tl.load(a_ptr + 1024 + rk).to(tl.float32)[None, :]
    tl.store(o_ptr + rn, tl.sum(part, axis=1).to(o_ptr.dtype.element_ty))


@triton.jit
def _rotate(x, other, cos, sin):
    """x * cos + cat(-x2, x1) * sin, each product and the sum rounded to bfloat16 (as the model)."""
    return ((x * cos).to(tl.bfloat16).to(tl.float32) + (other * sin).to(tl.bfloat16).to(tl.float32)).to(
        tl.bfloat16
    )


@triton.jit
def _attention(qkv_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, mask_ptr, out_ptr, FORM: tl.constexpr,
               GDC: tl.constexpr, GROUPS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
               BN: tl.constexpr, SCALE: tl.constexpr):  # fmt: skip
    """One program per KV head: its cache tiles loaded before the wait, then ``_attend``."""
    kh = tl.program_id(0)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BN)
    cache = kh * C * D
    k = tl.load(k_ptr + cache + rn[None, :] * D + rd[:, None], mask=(rn < C)[None, :], other=0.0)  # [D, BN]
    v = tl.load(v_ptr + cache + rn[:, None] * D + rd[None, :], mask=(rn < C)[:, None], other=0.0)  # [BN, D]
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _attend(kh, k, v, qkv_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, mask_ptr, out_ptr, FORM, GROUPS, KV, D, C,
            BN, SCALE, "")  # fmt: skip


@triton.jit
def _qkv_tail(w_ptr, a_ptr, qkv_ptr, count_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, mask_ptr, out_ptr,
              FORM: tl.constexpr, GDC: tl.constexpr, ROWS: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr,
              KV: tl.constexpr, D: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, SCALE: tl.constexpr):  # fmt: skip
    """The q/k/v GEMV with the attention in its tail: blocks in program order take KV head 0's
    query rows, its key rows, its value rows, then head 1's...; each block counts itself in on
    its head's counter once its rows are stored, and the last of a head's blocks runs that head's
    attention (``_attend``), reading the others' rows from L2, and zeroes the counter."""
    pid = tl.program_id(0)
    qb: tl.constexpr = GROUPS * D // ROWS
    kb: tl.constexpr = D // ROWS
    per: tl.constexpr = qb + 2 * kb
    kh = pid // per
    j = pid % per
    row0 = tl.where(j < qb, kh * GROUPS * D + j * ROWS,
                    tl.where(j < qb + kb, GROUPS * KV * D + kh * D + (j - qb) * ROWS,
                             GROUPS * KV * D + KV * D + kh * D + (j - qb - kb) * ROWS))  # fmt: skip
    _gemv_rows(w_ptr, a_ptr, qkv_ptr, row0 + tl.arange(0, ROWS), K, GDC)
    tl.debug_barrier()  # every thread's stores before the arrival (which releases them)
    arrived = tl.atomic_add(count_ptr + kh, 1, sem="acq_rel", scope="gpu")
    if arrived == per - 1:
        rd = tl.arange(0, D)
        rs = tl.arange(0, BN)
        cache = kh * C * D
        k = tl.load(k_ptr + cache + rs[None, :] * D + rd[:, None], mask=(rs < C)[None, :], other=0.0)
        v = tl.load(v_ptr + cache + rs[:, None] * D + rd[None, :], mask=(rs < C)[:, None], other=0.0)
        _attend(kh, k, v, qkv_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, mask_ptr, out_ptr, FORM, GROUPS, KV,
                D, C, BN, SCALE, ".cg")  # fmt: skip
        tl.store(count_ptr + kh, 0)


@triton.jit
def _new_rows(kh, qkv_ptr, pos_ptr, cos_ptr, sin_ptr, GROUPS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
              CM: tl.constexpr):  # fmt: skip
    """KV head ``kh``'s step rows from the q/k/v output: its query heads [16, D] (rows past GROUPS
    0), rotated; the new key, rotated, and value [D]; the step's slot. ``CM``: the loads' cache
    modifier."""
    BG: tl.constexpr = 16
    rd = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = tl.where(rd < half, rd + half, rd - half)
    cos = tl.load(cos_ptr + rd).to(tl.float32)
    sin = tl.load(sin_ptr + rd).to(tl.float32)
    sin = tl.where(rd < half, -sin, sin)
    rg = tl.arange(0, BG)
    valid_g = rg < GROUPS
    h = kh * GROUPS + rg
    q = tl.load(qkv_ptr + h[:, None] * D + rd[None, :], mask=valid_g[:, None], other=0.0, cache_modifier=CM)
    q_o = tl.load(
        qkv_ptr + h[:, None] * D + partner[None, :], mask=valid_g[:, None], other=0.0, cache_modifier=CM
    )
    q = _rotate(q.to(tl.float32), q_o.to(tl.float32), cos[None, :], sin[None, :])  # [BG, D] bf16
    kn_at = qkv_ptr + (GROUPS * KV + kh) * D
    kn = tl.load(kn_at + rd, cache_modifier=CM).to(tl.float32)
    kn = _rotate(kn, tl.load(kn_at + partner, cache_modifier=CM).to(tl.float32), cos, sin)
    vn = tl.load(qkv_ptr + (GROUPS * KV + KV + kh) * D + rd, cache_modifier=CM)
    return q, kn, vn, tl.load(pos_ptr).to(tl.int64)


@triton.jit
def _vec_head(g, q, kf, vf, kn, vn, bias, bias_new, keep, SCALE: tl.constexpr):
    """Query head ``g`` of ``q`` [16, D] over the cache tiles ``kf`` [D, BN] and ``vf`` [BN, D]
    (fp32; ``keep``: the slots to take) and the new key and value beside them, without tensor
    cores: [D] fp32."""
    rg = tl.arange(0, 16)
    qg = tl.sum(tl.where((rg == g)[:, None], q.to(tl.float32), 0.0), 0)  # [D]
    s = tl.sum(kf * qg[:, None], 0) * SCALE + bias  # [BN]
    s = tl.where(keep, s, float("-inf"))
    s_new = tl.sum(qg * kn.to(tl.float32), 0) * SCALE + bias_new
    m = tl.maximum(tl.max(s, 0), s_new)
    p = tl.exp2(s - m).to(tl.bfloat16).to(tl.float32)
    p_new = tl.exp2(s_new - m)
    o = tl.sum(p[:, None] * vf, 0) + p_new.to(tl.bfloat16).to(tl.float32) * vn.to(tl.float32)
    return o / (tl.sum(tl.exp2(s - m), 0) + p_new)


@triton.jit
def _merged_heads(q, k, v, kn, vn, pos, bias, valid_n, SCALE: tl.constexpr):
    """The query heads ``q`` [16, D] over the cache tiles ``k`` [D, BN] and ``v`` [BN, D] with the
    new key and value merged into them at slot ``pos``, on tensor cores: [16, D] fp32."""
    rn = tl.arange(0, k.shape[1])
    k = tl.where((rn == pos)[None, :], kn[:, None], k)
    v = tl.where((rn == pos)[:, None], vn[None, :], v)
    s = tl.dot(q, k) * SCALE + bias[None, :]
    s = tl.where(valid_n[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - m[:, None])
    return tl.dot(p.to(tl.bfloat16), v) / tl.sum(p, 1)[:, None]


@triton.jit
def _attend(kh, k, v, qkv_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, mask_ptr, out_ptr, FORM: tl.constexpr,
            GROUPS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, C: tl.constexpr, BN: tl.constexpr,
            SCALE: tl.constexpr, CM: tl.constexpr):  # fmt: skip
    """KV head ``kh``'s attention over its cache tiles ``k`` [D, BN] and ``v`` [BN, D]: the new key
    and value (rotated key) stored at ``pos`` and taken into account. FORM 1: built (tensor
    cores, the new row merged into the tiles); 2: apart (tensor cores, the new row beside them);
    3: vec (no tensor cores, the new row beside). ``CM``: the q/k/v loads' cache modifier."""
    rd = tl.arange(0, D)
    rn = tl.arange(0, BN)
    valid_n = rn < C
    cache = kh * C * D
    rg = tl.arange(0, 16)
    valid_g = rg < GROUPS
    h = kh * GROUPS + rg
    q, kn, vn, pos = _new_rows(kh, qkv_ptr, pos_ptr, cos_ptr, sin_ptr, GROUPS, KV, D, CM)
    tl.store(k_ptr + cache + pos * D + rd, kn)
    tl.store(v_ptr + cache + pos * D + rd, vn)
    bias = tl.load(mask_ptr + rn, mask=valid_n, other=0.0).to(tl.float32) * 1.4426950408889634
    if FORM == 1:
        acc = _merged_heads(q, k, v, kn, vn, pos, bias, valid_n, SCALE)
        tl.store(out_ptr + h[:, None] * D + rd[None, :], acc.to(tl.bfloat16), mask=valid_g[:, None])
    elif FORM == 2:
        keep = valid_n & (rn != pos)
        s = tl.dot(q, k) * SCALE + bias[None, :]
        s = tl.where(keep[None, :], s, float("-inf"))
        bias_new = tl.load(mask_ptr + pos).to(tl.float32) * 1.4426950408889634
        s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * SCALE + bias_new  # [BG]
        m = tl.maximum(tl.max(s, 1), s_new)
        p = tl.exp2(s - m[:, None])
        p_new = tl.exp2(s_new - m).to(tl.bfloat16).to(tl.float32)
        acc = tl.dot(p.to(tl.bfloat16), v) + p_new[:, None] * vn.to(tl.float32)[None, :]
        acc = acc / (tl.sum(p, 1) + tl.exp2(s_new - m))[:, None]
        tl.store(out_ptr + h[:, None] * D + rd[None, :], acc.to(tl.bfloat16), mask=valid_g[:, None])
    else:
        keep = valid_n & (rn != pos)
        bias_new = tl.load(mask_ptr + pos).to(tl.float32) * 1.4426950408889634
        kf = k.to(tl.float32)
        vf = v.to(tl.float32)
        for g in tl.static_range(GROUPS):
            o = _vec_head(g, q, kf, vf, kn, vn, bias, bias_new, keep, SCALE)
            tl.store(out_ptr + (kh * GROUPS + g) * D + rd, o.to(tl.bfloat16))


@triton.jit
def _attn_o(qkv_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, mask_ptr, wo_ptr, ws_ptr, cnt_ptr, x_ptr,
            BODY: tl.constexpr, GDC: tl.constexpr, GROUPS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
            C: tl.constexpr, BN: tl.constexpr, SCALE: tl.constexpr, R: tl.constexpr,
            HID: tl.constexpr):  # fmt: skip
    """KV head ``program_id(0)``'s attention and its share of o's rows [c * R, (c + 1) * R), c =
    ``program_id(1)``: W_o's rows for the head's 4 query heads' columns and the cache tiles loaded
    before the wait; the share to ws[head, rows] in fp32; the last head's program at the chunk's
    counter sums the KV shares in head order into ``x`` and zeroes the counter. BODY 1: the
    attention on tensor cores (``built``), 3: without (``vec``). GROUPS must be 4."""
    kh = tl.program_id(0)
    c = tl.program_id(1)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BN)
    rr = c * R + tl.arange(0, R)
    col = wo_ptr + rr[:, None].to(tl.int64) * HID + kh * GROUPS * D + rd[None, :]
    w0 = tl.load(col)
    w1 = tl.load(col + D)
    w2 = tl.load(col + 2 * D)
    w3 = tl.load(col + 3 * D)
    valid_n = rn < C
    cache = kh * C * D
    k = tl.load(k_ptr + cache + rn[None, :] * D + rd[:, None], mask=valid_n[None, :], other=0.0)  # [D, BN]
    v = tl.load(v_ptr + cache + rn[:, None] * D + rd[None, :], mask=valid_n[:, None], other=0.0)  # [BN, D]
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rg = tl.arange(0, 16)
    q, kn, vn, pos = _new_rows(kh, qkv_ptr, pos_ptr, cos_ptr, sin_ptr, GROUPS, KV, D, "")
    if c == 0:  # one chunk appends the step's key and value
        tl.store(k_ptr + cache + pos * D + rd, kn)
        tl.store(v_ptr + cache + pos * D + rd, vn)
    bias = tl.load(mask_ptr + rn, mask=valid_n, other=0.0).to(tl.float32) * 1.4426950408889634
    if BODY == 1:
        att = _merged_heads(q, k, v, kn, vn, pos, bias, valid_n, SCALE)
    else:
        keep = valid_n & (rn != pos)
        bias_new = tl.load(mask_ptr + pos).to(tl.float32) * 1.4426950408889634
        kf = k.to(tl.float32)
        vf = v.to(tl.float32)
    share = tl.zeros((R,), dtype=tl.float32)
    for g in tl.static_range(GROUPS):  # query head g's output (rounded as the model's) times its W_o columns
        if BODY == 1:
            o = tl.sum(tl.where((rg == g)[:, None], att, 0.0), 0)
        else:
            o = _vec_head(g, q, kf, vf, kn, vn, bias, bias_new, keep, SCALE)
        w = w0 if g == 0 else w1 if g == 1 else w2 if g == 2 else w3
        share += tl.sum(w.to(tl.float32) * o.to(tl.bfloat16).to(tl.float32)[None, :], 1)
    tl.store(ws_ptr + kh * HID + rr, share)
    tl.debug_barrier()  # every thread's share stored before the arrival (which releases them)
    arrived = tl.atomic_add(cnt_ptr + c, 1, sem="acq_rel", scope="gpu")
    if arrived == KV - 1:
        total = tl.zeros((R,), dtype=tl.float32)
        for j in tl.static_range(KV):
            total += tl.load(ws_ptr + j * HID + rr, cache_modifier=".cg")
        tl.store(x_ptr + rr, total.to(x_ptr.dtype.element_ty))
        tl.store(cnt_ptr + c, 0)


def _shape(form: str) -> tuple[str, int, int]:
    """(body, rows, warps) of a ``..._<body>_r<rows>w<warps>`` form name."""
    body, tail = form.split("_")[-2:]
    rows, warps = tail.removeprefix("r").split("w")
    return body, int(rows), int(warps)


def launch_attn_o(form: str, qkv, k, v, pos, cos, sin, mask, wo, ws, count, x, pdl: bool) -> None:
    """An ``attn_o_<body>_r<R>w<warps>`` form: the attention and the o projection in one kernel."""
    body, rows, warps = _shape(form)
    gdc = pdl and not INTERPRET
    kw = {"launch_pdl": True} if gdc else {}
    _attn_o[(KV_HEADS, HIDDEN // rows)](
        qkv, k, v, pos, cos, sin, mask, wo, ws, count, x, {"built": 1, "vec": 3}[body], gdc,
        HEADS // KV_HEADS, KV_HEADS, HEAD_DIM, CONTEXT, 256, SCALE_LOG2E, rows, HIDDEN, num_warps=warps, **kw,
    )  # fmt: skip


def launch_tail(form: str, w, a, qkv, count, k, v, pos, cos, sin, mask, out, pdl: bool) -> None:
    """A ``tail_<body>_r<ROWS>w<warps>`` form: the q/k/v GEMV with the attention in its tail."""
    body, rows, warps = _shape(form)
    gdc = pdl and not INTERPRET
    kw = {"launch_pdl": True} if gdc else {}
    _qkv_tail[(QKV // rows,)](
        w, a, qkv, count, k, v, pos, cos, sin, mask, out, {"built": 1, "vec": 3}[body], gdc, rows, HIDDEN,
        HEADS // KV_HEADS, KV_HEADS, HEAD_DIM, CONTEXT, 256, SCALE_LOG2E, num_warps=warps, **kw,
    )  # fmt: skip


def launch_attention(form: str, qkv, k, v, pos, cos, sin, mask, out, pdl: bool) -> None:
    code = {"built": 1, "built_w4": 1, "apart": 2, "vec": 3}[form]
    warps = 8 if form == "built" else 4
    gdc = pdl and not INTERPRET
    kw = {"launch_pdl": True} if gdc else {}
    _attention[(KV_HEADS,)](
        qkv, k, v, pos, cos, sin, mask, out, code, gdc, HEADS // KV_HEADS, KV_HEADS, HEAD_DIM, CONTEXT,
        256, SCALE_LOG2E, num_warps=warps, **kw,
    )  # fmt: skip


def reference(qkv, k, v, cos, sin, mask) -> torch.Tensor:
    """torch: the same rotation and roundings, SDPA over the cache with the new row at POS."""

    def rot(x):
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        other = torch.cat((-x2, x1), -1)
        return (x * cos.float()).bfloat16().float() + (other * sin.float()).bfloat16().float()

    q = rot(qkv[: HEADS * HEAD_DIM].float().view(HEADS, HEAD_DIM)).bfloat16().float()
    kn = rot(
        qkv[HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].float().view(KV_HEADS, HEAD_DIM)
    ).bfloat16()
    vn = qkv[(HEADS + KV_HEADS) * HEAD_DIM :].view(KV_HEADS, HEAD_DIM)
    k, v = k.clone(), v.clone()
    k[:, POS], v[:, POS] = kn, vn
    kk = k.float().repeat_interleave(HEADS // KV_HEADS, 0)
    vv = v.float().repeat_interleave(HEADS // KV_HEADS, 0)
    s = (q[:, None, :] @ kk.transpose(1, 2))[:, 0] * HEAD_DIM**-0.5 + mask.float()[None, :]
    return (torch.softmax(s, -1)[:, None, :] @ vv)[:, 0].reshape(-1)


def inputs(dev, layers: int = 1):
    torch.manual_seed(0)
    qkv = torch.randn(QKV, device=dev).bfloat16()
    k = [torch.randn(KV_HEADS, CONTEXT, HEAD_DIM, device=dev).bfloat16() for _ in range(layers)]
    v = [torch.randn(KV_HEADS, CONTEXT, HEAD_DIM, device=dev).bfloat16() for _ in range(layers)]
    angle = torch.arange(HEAD_DIM // 2, device=dev).float() * 0.1 + 0.3
    cos = torch.cat((angle.cos(), angle.cos())).bfloat16()
    sin = torch.cat((angle.sin(), angle.sin())).bfloat16()
    mask = torch.zeros(CONTEXT, device=dev).bfloat16()
    mask[POS + 1 :] = float("-inf")
    pos = torch.tensor([POS], device=dev)
    return qkv, k, v, cos, sin, mask, pos


def check() -> int:
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    qkv, k, v, cos, sin, mask, pos = inputs(dev)
    want = reference(qkv.cpu(), k[0].cpu(), v[0].cpu(), cos.cpu(), sin.cpu(), mask.cpu())
    bad = 0
    w = (torch.randn(QKV, HIDDEN, device=dev) / HIDDEN**0.5).bfloat16()
    a = torch.randn(HIDDEN, device=dev).bfloat16()
    count = torch.zeros(KV_HEADS, device=dev, dtype=torch.int32)
    for form in FORMS[1:]:
        kk, vv = k[0].clone(), v[0].clone()
        out = torch.empty(HEADS * HEAD_DIM, device=dev).bfloat16()
        if INTERPRET and ("built" in form.split("_") or form == "apart"):  # the tensor-core forms
            print(f"{form:<10} skipped: the interpreter's bfloat16 dot is not the GPU's (checked there)")
            continue
        if form.startswith("attn_o"):
            wo = (torch.randn(HIDDEN, HEADS * HEAD_DIM, device=dev) / HIDDEN**0.5).bfloat16()
            ws = torch.empty(KV_HEADS * HIDDEN, device=dev)
            chunks = torch.zeros(HIDDEN, device=dev, dtype=torch.int32)
            x = torch.empty(HIDDEN, device=dev).bfloat16()
            launch_attn_o(form, qkv, kk, vv, pos, cos, sin, mask, wo, ws, chunks, x, False)
            ref = wo.float().cpu() @ want.bfloat16().float()
            err = max(float((x.float().cpu() - ref).abs().max() / ref.abs().max()), float(chunks.abs().max()))
        elif form.startswith("tail"):
            got = torch.zeros_like(qkv)
            launch_tail(form, w, a, got, count, kk, vv, pos, cos, sin, mask, out, False)
            gemv = float((got.float() - w.float() @ a.float()).abs().max())
            ref = reference(got.cpu(), k[0].cpu(), v[0].cpu(), cos.cpu(), sin.cpu(), mask.cpu())
            err = max(float((out.float().cpu() - ref).abs().max()), gemv / 4, float(count.abs().max()))
        else:
            launch_attention(form, qkv, kk, vv, pos, cos, sin, mask, out, False)
            err = float((out.float().cpu() - want).abs().max())
        wrote = bool((kk[:, POS].cpu().float() != k[0][:, POS].cpu().float()).any())
        ok = err < 2e-2 and wrote
        bad += not ok
        print(f"{form:<10} max abs error {err:.2e}, cache written {wrote}: {'ok' if ok else 'WRONG'}")
    return int(bad > 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    if args.check:
        return check()
    if not torch.cuda.is_available():
        print("attention_chain: needs a CUDA GPU (or --check under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from bench.common import chain_row

    dev = torch.device("cuda")
    layers = args.layers
    qkv, k, v, cos, sin, mask, pos = inputs(dev, layers)
    wq = [torch.randn(QKV, HIDDEN, device=dev).bfloat16() / HIDDEN**0.5 for _ in range(layers)]
    wo = [torch.randn(HIDDEN, HIDDEN, device=dev).bfloat16() / HIDDEN**0.5 for _ in range(layers)]
    x0 = torch.randn(HIDDEN, device=dev).bfloat16()
    x, att = torch.empty_like(x0), torch.empty(HEADS * HEAD_DIM, device=dev).bfloat16()
    count = torch.zeros(KV_HEADS, device=dev, dtype=torch.int32)
    ws = torch.empty(KV_HEADS * HIDDEN, device=dev)
    chunks = torch.zeros(HIDDEN, device=dev, dtype=torch.int32)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": layers, "rows": []}  # fmt: skip
    want: dict[str, torch.Tensor] = {}
    for form in FORMS:
        for pdl in (True, False):

            def run(form=form, pdl=pdl):
                kw = {"launch_pdl": True} if pdl else {}
                a = x0
                for i in range(layers):
                    if form.startswith("tail"):  # the q/k/v GEMV is the tail form's own
                        launch_tail(form, wq[i], a, qkv, count, k[i], v[i], pos, cos, sin, mask, att, pdl)
                        _gemv[(HIDDEN // 2,)](wo[i], att, x, HIDDEN, pdl, num_warps=2, **kw)
                        a = x
                        continue
                    _gemv[(QKV // 2,)](wq[i], a, qkv, HIDDEN, pdl, num_warps=2, **kw)
                    if form.startswith("attn_o"):
                        launch_attn_o(form, qkv, k[i], v[i], pos, cos, sin, mask, wo[i], ws, chunks, x, pdl)
                    elif form == "none":
                        _gemv[(HIDDEN // 2,)](wo[i], qkv, x, HIDDEN, pdl, num_warps=2, **kw)
                    else:
                        launch_attention(form, qkv, k[i], v[i], pos, cos, sin, mask, att, pdl)
                        _gemv[(HIDDEN // 2,)](wo[i], att, x, HIDDEN, pdl, num_warps=2, **kw)
                    a = x

            def diff():
                got = x.float().clone()
                ref = want.setdefault("out", got)  # the first form's output: the others' reference
                return float((got - ref).abs().max() / ref.abs().max())

            row = chain_row(
                {"form": form, "pdl": pdl},
                run,
                args.repeats,
                None if form == "none" else diff,
                lambda us: {"us_per_layer": round(us / layers, 3)},
            )
            result["rows"].append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
